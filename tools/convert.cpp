// build/convert — Hugging Face <-> tuna checkpoints, and GGUF for llama.cpp.
//
//   build/convert hf-to-tuna HF_DIR OUT_DIR [--dtype keep|float32|bfloat16|float16] [--overwrite]
//   build/convert tuna-to-hf CKPT_DIR OUT_DIR [--dtype auto|float32|bfloat16|float16] [--max-shard-bytes N] [--overwrite]
//   build/convert tuna-to-gguf CKPT_DIR OUT.gguf [--type bf16|f16|f32|q8_0|q4_0] [--base DIR] [--overwrite]
//   build/convert merge-lora LORA_CKPT OUT_DIR [--base DIR] [--dtype auto|bf16|fp32|float32|bfloat16|float16]
//                 [--max_shard_bytes N] [--overwrite]
//
//   build/convert peft-to-tuna ADAPTER_DIR OUT_DIR [--base DIR] [--overwrite]
//
// merge-lora writes base + (alpha / r) B A as a Hugging Face model (ckpt/peft.h), a bounded run at a time;
// tuna-to-gguf merges a LoRA checkpoint the same way. --base replaces the base path the checkpoint records (the
// checksum must still match).
//
// CKPT_DIR may be runs/X/ckpt/latest (or a Hugging Face directory, for tuna-to-gguf). OUT_DIR must be new or
// empty; a model directory there is replaced only with --overwrite; so is an existing OUT.gguf.
//
// Only safetensors are read; PyTorch pickle checkpoints (.bin/.pth) are refused with a way out.
#include <cstdio>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/options.h"
#include "data/tokenizer.h"  // the tokenizer the model carries; the files transformers needs beside it
#include "ckpt/checkpoint.h"  // read_config_json, resolve_checkpoint
#include "ckpt/gguf.h"        // export_gguf
#include "ckpt/hf_convert.h"
#include "ckpt/peft.h"        // merge_lora, open_model
#include "model/config.h"

int main(int argc, char** argv) {
  return tuna::guarded_main([&] {
    std::string dtype, type = "bf16", base;
    int64_t max_shard_bytes = int64_t(5) << 30;
    bool overwrite = false;
    tuna::Options options("build/convert hf-to-tuna|tuna-to-hf|tuna-to-gguf|merge-lora|peft-to-tuna SRC OUT",
                          "hf-to-tuna: a Hugging Face LLaMA directory (config.json + safetensors) -> a tuna checkpoint.\n"
                          "tuna-to-hf: a tuna checkpoint -> a directory transformers loads (AutoModelForCausalLM).\n"
                          "tuna-to-gguf: a tuna checkpoint or Hugging Face directory -> one GGUF file that llama.cpp "
                          "(and Ollama, LM Studio) loads, tokenizer included; a LoRA checkpoint is merged into its base.\n"
                          "merge-lora: a LoRA checkpoint (or PEFT adapter directory) merged into its base -> a directory "
                          "transformers loads.\n"
                          "peft-to-tuna: a PEFT adapter directory -> a LoRA checkpoint (step 0) naming its base.");
    options.add("dtype", &dtype,
                "weights dtype; hf-to-tuna: keep (default) | float32 | bfloat16 | float16; tuna-to-hf: auto (config.json's "
                "torch_dtype, default) | float32 | bfloat16 | float16; merge-lora: as tuna-to-hf (the base's torch_dtype), "
                "bf16 and fp32 too",
                {"keep", "auto", "float32", "bfloat16", "float16", "bf16", "fp32"});
    options.add("base", &base, "tuna-to-gguf, merge-lora: the LoRA checkpoint's base model, instead of the one it "
                "records (same checksum required)");
    options.add("max_shard_bytes", &max_shard_bytes, "tuna-to-hf: start a new model-0000N-of-0000M.safetensors past this size",
                tuna::Bounds::closed(1, 1e15));
    options.add("type", &type,
                "tuna-to-gguf: the weights' type: bf16 (default) | f16 | f32 | q8_0 | q4_0 (norms stay f32; under q4_0 "
                "the output head is q8_0)");
    options.add("overwrite", &overwrite, "replace a model directory (or GGUF file) already at OUT (default: refuse)");
    std::vector<std::string> args = options.parse(argc, argv);
    if (args.size() != 3) tuna::fail("expected: hf-to-tuna|tuna-to-hf|tuna-to-gguf|merge-lora|peft-to-tuna SRC OUT (see --help)");
    if (!base.empty() && args[0] != "tuna-to-gguf" && args[0] != "merge-lora" && args[0] != "peft-to-tuna")
      tuna::fail("option 'base' applies to tuna-to-gguf, merge-lora and peft-to-tuna (the base of adapters)");
    if ((dtype == "bf16" || dtype == "fp32") && args[0] != "merge-lora")
      tuna::fail("option 'dtype': '", dtype, "' is merge-lora's short name; write ", dtype == "bf16" ? "bfloat16" : "float32");
    if (dtype == "bf16") dtype = "bfloat16";
    if (dtype == "fp32") dtype = "float32";
    if (args[0] == "tuna-to-gguf") {
      const tuna::GgufWeights weights = tuna::parse_gguf_weights(type);
      args[1] = tuna::resolve_checkpoint(args[1]).string();
      // llama.cpp encodes prompts itself: the GGUF must carry the very tokenizer the model was trained with.
      if (!tuna::has_tokenizer(args[1]))
        tuna::fail(args[1], ": has no tokenizer file (tokenizer.model or tokenizer.json): a GGUF carries its tokenizer, "
                   "and llama.cpp cannot run a model without one; copy the model's tokenizer files into it");
      const tuna::Tokenizer tokenizer(args[1]);
      // A LoRA checkpoint's config.json is its base's (base_config.json, the same file: its checksum is recorded).
      const tuna::LlamaConfig config = tuna::LlamaConfig::load(
          tuna::is_lora_directory(args[1]) ? tuna::lora_base(args[1], base).string() : args[1]);
      const tuna::GgufVocabulary vocab = tuna::gguf_vocabulary(tokenizer, config.vocab_size);
      const tuna::GgufReport g = tuna::export_gguf(args[1], args[2], weights, vocab, stderr, overwrite, base);
      std::printf("%s -> %s: %lld tensors, %lld parameters, %s, %.1f MB, through %.1f MB of host buffers\n",
                  args[1].c_str(), args[2].c_str(), (long long)g.tensors, (long long)g.parameters,
                  tuna::gguf_weights_name(weights), g.bytes_written / 1e6, g.host_staging_bytes / 1e6);
      std::printf("tokenizer %s -> GGUF '%s'%s%s, %zu tokens, bos %d, eos %d\n", tokenizer.describe().c_str(),
                  vocab.model.c_str(), vocab.pre.empty() ? "" : " pre-tokenizer ", vocab.pre.c_str(),
                  vocab.tokens.size(), vocab.bos, vocab.eos);
      for (const std::string& name : g.fell_back)
        std::printf("note: %s is f16: its rows are not whole blocks of 32 values\n", name.c_str());
      return 0;
    }
    tuna::ConvertReport r;
    if (args[0] == "hf-to-tuna") {
      // The tokenizer against the model's config.json first: one with ids the model has no embedding for
      // would pass here and be refused only by build/train, after the corpus was prepared with it.
      // The files read, against the directory's manifest where it has one (ckpt/checkpoint.h: one rule).
      if (!tuna::verify_model_directory(args[1], tuna::ModelFiles::Weights))
        std::fprintf(stderr, "note: %s\n", tuna::unverified_note(args[1]).c_str());
      std::optional<tuna::Tokenizer> tokenizer;
      if (tuna::has_tokenizer(args[1])) {
        try {
          tokenizer.emplace(args[1]);
        } catch (const tuna::Error&) {  // one tuna cannot read: said after the conversion, as before
        }
      }
      std::string config;
      const int64_t model_vocab = tuna::model_vocab_beside(args[1], &config);
      if (tokenizer && model_vocab > 0)
        if (const std::string w = tuna::check_tokenizer_fits(*tokenizer, model_vocab, config); !w.empty())
          std::printf("warning: %s\n", w.c_str());
      r = tuna::import_hf(args[1], args[2], dtype.empty() ? "keep" : dtype, stderr, overwrite);
    } else if (args[0] == "tuna-to-hf") {
      args[1] = tuna::resolve_checkpoint(args[1]).string();
      r = tuna::export_hf(args[1], args[2], dtype.empty() ? "auto" : dtype, max_shard_bytes, stderr, overwrite);
    } else if (args[0] == "peft-to-tuna") {
      // The tokenizer the adapter came with, else its base's: the checkpoint carries one to sample with.
      const std::filesystem::path from =
          tuna::has_tokenizer(args[1]) ? std::filesystem::path(args[1]) : tuna::lora_base(args[1], base);
      tuna::import_peft(args[1], args[2], base, tuna::tokenizer_files(from.string(), /*allow_none=*/true), overwrite);
      std::printf("%s -> %s: a LoRA checkpoint at step 0 (%s)\n", args[1].c_str(), args[2].c_str(),
                  tuna::has_tokenizer(args[2]) ? "with its tokenizer" : "no tokenizer");
      return 0;
    } else if (args[0] == "merge-lora") {
      args[1] = tuna::resolve_checkpoint(args[1]).string();
      r = tuna::merge_lora(args[1], args[2], dtype.empty() ? "auto" : dtype, max_shard_bytes, base, stderr, overwrite);
    } else {
      tuna::fail("unknown direction '", args[0], "': expected hf-to-tuna, tuna-to-hf, tuna-to-gguf, merge-lora or "
                 "peft-to-tuna");
    }
    // Staging buffers are used only where a dtype is converted or tensors are gathered (none: straight copies).
    char staged[64] = "";
    if (r.host_staging_bytes >= 100000)
      std::snprintf(staged, sizeof staged, ", through %.1f MB of host buffers", r.host_staging_bytes / 1e6);
    else if (r.host_staging_bytes > 0)
      std::snprintf(staged, sizeof staged, ", through %.1f kB of host buffers", r.host_staging_bytes / 1e3);
    const std::string staging = staged;
    std::printf("%s -> %s: %lld tensors, %lld parameters, %s, %.1f MB in %lld file(s)%s\n", args[1].c_str(),
                args[2].c_str(), (long long)r.tensors, (long long)r.parameters, r.dtype.c_str(), r.bytes_written / 1e6,
                (long long)r.shards, staging.c_str());
    // The tokenizer travelled with the weights: say which one, or why it will not serve build/prepare. One tuna
    // cannot read was still copied as it is (transformers may read it): the conversion succeeded, and this is a
    // warning, not an error.
    bool tokenizer_read = true;
    if (!tuna::has_tokenizer(args[2])) {
      std::printf("note: %s has no tokenizer file; give build/prepare and build/train one with --tokenizer\n",
                  args[1].c_str());
    } else {
      try {
        std::printf("tokenizer %s\n", tuna::Tokenizer(args[2]).describe().c_str());
      } catch (...) {
        tokenizer_read = false;
        std::printf("warning: the tokenizer files were copied as they are, but tuna cannot read them, so it wrote "
                    "no generation_config.json, tokenizer_config.json or special_tokens_map.json beside them: %s\n",
                    tuna::describe_current_exception().c_str());
      }
    }
    if ((args[0] == "tuna-to-hf" || args[0] == "merge-lora") && tokenizer_read) {
      std::string warning;
      for (const std::string& name : tuna::complete_hf_tokenizer_files(args[2], tuna::read_config_json(args[2]), &warning))
        std::printf("wrote %s/%s (for transformers)\n", args[2].c_str(), name.c_str());
      if (!warning.empty()) std::printf("warning: %s\n", warning.c_str());
    }
    return 0;
  });
}
