// build/convert — Hugging Face <-> tuna checkpoints, and GGUF for llama.cpp.
//
//   build/convert hf-to-tuna HF_DIR OUT_DIR [--dtype keep|float32|bfloat16|float16] [--overwrite]
//   build/convert tuna-to-hf CKPT_DIR OUT_DIR [--dtype auto|float32|bfloat16|float16] [--max-shard-bytes N] [--overwrite]
//   build/convert tuna-to-gguf CKPT_DIR OUT.gguf [--type bf16|f16|f32|q8_0|q4_0] [--overwrite]
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
#include "model/config.h"

int main(int argc, char** argv) {
  return tuna::guarded_main([&] {
    std::string dtype, type = "bf16";
    int64_t max_shard_bytes = int64_t(5) << 30;
    bool overwrite = false;
    tuna::Options options("build/convert hf-to-tuna|tuna-to-hf|tuna-to-gguf SRC OUT",
                          "hf-to-tuna: a Hugging Face LLaMA directory (config.json + safetensors) -> a tuna checkpoint.\n"
                          "tuna-to-hf: a tuna checkpoint -> a directory transformers loads (AutoModelForCausalLM).\n"
                          "tuna-to-gguf: a tuna checkpoint or Hugging Face directory -> one GGUF file that llama.cpp "
                          "(and Ollama, LM Studio) loads, tokenizer included.");
    options.add("dtype", &dtype,
                "weights dtype; hf-to-tuna: keep (default) | float32 | bfloat16 | float16; tuna-to-hf: auto (config.json's "
                "torch_dtype, default) | float32 | bfloat16 | float16",
                {"keep", "auto", "float32", "bfloat16", "float16"});
    options.add("max_shard_bytes", &max_shard_bytes, "tuna-to-hf: start a new model-0000N-of-0000M.safetensors past this size",
                tuna::Bounds::closed(1, 1e15));
    options.add("type", &type,
                "tuna-to-gguf: the weights' type: bf16 (default) | f16 | f32 | q8_0 | q4_0 (norms stay f32; under q4_0 "
                "the output head is q8_0)");
    options.add("overwrite", &overwrite, "replace a model directory (or GGUF file) already at OUT (default: refuse)");
    std::vector<std::string> args = options.parse(argc, argv);
    if (args.size() != 3) tuna::fail("expected: hf-to-tuna|tuna-to-hf|tuna-to-gguf SRC OUT (see --help)");
    if (args[0] == "tuna-to-gguf") {
      const tuna::GgufWeights weights = tuna::parse_gguf_weights(type);
      args[1] = tuna::resolve_checkpoint(args[1]).string();
      // llama.cpp encodes prompts itself: the GGUF must carry the very tokenizer the model was trained with.
      if (!tuna::has_tokenizer(args[1]))
        tuna::fail(args[1], ": has no tokenizer file (tokenizer.model or tokenizer.json): a GGUF carries its tokenizer, "
                   "and llama.cpp cannot run a model without one; copy the model's tokenizer files into it");
      const tuna::Tokenizer tokenizer(args[1]);
      const tuna::LlamaConfig config = tuna::LlamaConfig::load(args[1]);
      const tuna::GgufVocabulary vocab = tuna::gguf_vocabulary(tokenizer, config.vocab_size);
      const tuna::GgufReport g = tuna::export_gguf(args[1], args[2], weights, vocab, stderr, overwrite);
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
    } else {
      tuna::fail("unknown direction '", args[0], "': expected hf-to-tuna, tuna-to-hf or tuna-to-gguf");
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
    // The tokenizer travelled with the weights: say which one, or why it will not serve build/prepare.
    if (!tuna::has_tokenizer(args[2])) {
      std::printf("note: %s has no tokenizer file; give build/prepare and build/train one with --tokenizer\n",
                  args[1].c_str());
    } else {
      try {
        std::printf("tokenizer %s\n", tuna::Tokenizer(args[2]).describe().c_str());
      } catch (const tuna::Error& e) {
        std::printf("warning: the tokenizer files were copied, but tuna cannot read them: %s\n", e.what());
      }
    }
    if (args[0] == "tuna-to-hf") {
      std::string warning;
      for (const std::string& name : tuna::complete_hf_tokenizer_files(args[2], tuna::read_config_json(args[2]), &warning))
        std::printf("wrote %s/%s (for transformers)\n", args[2].c_str(), name.c_str());
      if (!warning.empty()) std::printf("warning: %s\n", warning.c_str());
    }
    return 0;
  });
}
