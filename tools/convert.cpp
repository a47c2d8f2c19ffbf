// build/convert — Hugging Face <-> tuna checkpoints.
//
//   build/convert hf-to-tuna HF_DIR OUT_DIR [--dtype keep|float32|bfloat16|float16]
//   build/convert tuna-to-hf CKPT_DIR OUT_DIR [--dtype auto|float32|bfloat16|float16] [--max-shard-bytes N]
//
// Only safetensors are read; PyTorch pickle checkpoints (.bin/.pth) are refused with a way out.
#include <cstdio>

#include "core/error.h"
#include "core/options.h"
#include "model/hf_convert.h"

int main(int argc, char** argv) {
  try {
    std::string dtype;
    int64_t max_shard_bytes = int64_t(5) << 30;
    tuna::Options options("build/convert hf-to-tuna|tuna-to-hf SRC_DIR OUT_DIR",
                          "hf-to-tuna: a Hugging Face LLaMA directory (config.json + safetensors) -> a tuna checkpoint.\n"
                          "tuna-to-hf: a tuna checkpoint -> a directory transformers loads (AutoModelForCausalLM).");
    options.add("dtype", &dtype,
                "weights dtype; hf-to-tuna: keep (default) | float32 | bfloat16 | float16; tuna-to-hf: auto (config.json's "
                "torch_dtype, default) | float32 | bfloat16 | float16");
    options.add("max_shard_bytes", &max_shard_bytes, "tuna-to-hf: start a new model-0000N-of-0000M.safetensors past this size");
    std::vector<std::string> args = options.parse(argc, argv);
    if (args.size() != 3) tuna::fail("expected: hf-to-tuna|tuna-to-hf SRC_DIR OUT_DIR (see --help)");
    tuna::ConvertReport r;
    if (args[0] == "hf-to-tuna") r = tuna::import_hf(args[1], args[2], dtype.empty() ? "keep" : dtype, stderr);
    else if (args[0] == "tuna-to-hf") r = tuna::export_hf(args[1], args[2], dtype.empty() ? "auto" : dtype, max_shard_bytes, stderr);
    else tuna::fail("unknown direction '", args[0], "': expected hf-to-tuna or tuna-to-hf");
    std::printf("%s -> %s: %lld tensors, %lld parameters, %s, %.1f MB in %lld file(s), through %.1f MB of host buffers\n",
                args[1].c_str(), args[2].c_str(), (long long)r.tensors, (long long)r.parameters, r.dtype.c_str(),
                r.bytes_written / 1e6, (long long)r.shards, r.host_staging_bytes / 1e6);
    return 0;
  } catch (const tuna::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
