// GGUF export: a tuna checkpoint (or a Hugging Face directory) as one file that llama.cpp, and what is built
// on it (Ollama, LM Studio), loads and runs.
//
// The file (GGUF version 3, little-endian): "GGUF", version, tensor and key counts; the metadata keys (typed
// values, strings and arrays); one record per tensor (name, dimensions innermost first, ggml type, offset
// into the data section); then the data section, every tensor starting on a 32-byte boundary
// (general.alignment). Offsets are known from the shapes alone, so the header goes out first and the tensors
// follow one at a time, each read from the checkpoint a bounded run of rows at a time: no tensor, let alone
// the model, is ever whole in memory.
//
// What llama.cpp's `llama` architecture expects of a LLaMA (its convert_hf_to_gguf.py writes the same):
//   - names token_embd, blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up,
//     ffn_down}, output_norm, output (absent when the embeddings are tied: llama.cpp then reads token_embd);
//   - attn_q and attn_k rows permuted within each head from Hugging Face's rotate-half pairs (i, i + d/2) to
//     the interleaved pairs (2i, 2i + 1) llama.cpp rotates (permute_rope_rows);
//   - LLaMA 3 RoPE scaling as the tensor rope_freqs: per frequency, the factor llama.cpp divides it by;
//   - norms (1-D) in f32 whatever the type; a matrix whose rows are not whole blocks of 32 goes f16 under
//     q8_0/q4_0 (as llama.cpp's converter does); under q4_0 the output head (token_embd when tied) goes q8_0:
//     its error lands on the logits directly (llama.cpp's own quantizer keeps it at 6 bits or more too).
// The writer goes to OUT.tmp, fsyncs and renames: a failed export (a full disk) leaves nothing under OUT.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "data/tokenizer.h"  // GgufVocabulary (a plain struct: ckpt/ calls nothing of data/)

namespace tuna {

class ProgressLine;  // core/progress.h

// ggml's tensor types that tuna writes (the numbers are the file's).
enum class GgmlType : uint32_t { f32 = 0, f16 = 1, q4_0 = 2, q8_0 = 8, bf16 = 30 };
const char* ggml_type_name(GgmlType type);  // "F32", "F16", "Q4_0", "Q8_0", "BF16"
// Bytes of `n` values (n a multiple of the type's block for q8_0/q4_0).
uint64_t ggml_nbytes(GgmlType type, int64_t n);

// A GGUF file: metadata and tensor records first (add_*), then write() streams the tensors' bytes.
class GgufWriter {
 public:
  static constexpr uint32_t kAlignment = 32;

  void add_string(const std::string& key, const std::string& value);
  void add_u32(const std::string& key, uint32_t value);
  void add_f32(const std::string& key, float value);
  void add_bool(const std::string& key, bool value);
  void add_strings(const std::string& key, const std::vector<std::string>& values);
  void add_f32s(const std::string& key, const std::vector<float>& values);
  void add_i32s(const std::string& key, const std::vector<int32_t>& values);
  // ne: dimensions innermost first (a Hugging Face [out, in] matrix is ne = {in, out}).
  void add_tensor(const std::string& name, const std::vector<int64_t>& ne, GgmlType type);

  using Append = std::function<void(const void* data, uint64_t bytes)>;
  // Writes path + ".tmp", calls produce(append), which must append every tensor's bytes in the order added
  // (the padding between tensors is the writer's), then fsyncs and renames to path. Any failure (a full
  // disk, produce throwing) removes the temporary file and leaves path as it was. Returns the file's size.
  uint64_t write(const std::filesystem::path& path, const std::function<void(const Append&)>& produce,
                 ProgressLine* progress = nullptr) const;

 private:
  struct Tensor {
    std::string name;
    std::vector<int64_t> ne;
    GgmlType type;
    uint64_t bytes;
  };
  std::string kv_;  // the encoded key-value records
  uint64_t n_kv_ = 0;
  std::vector<Tensor> tensors_;
  void key(const std::string& key, uint32_t value_type);
};

// The weights' type of an export: f32, f16, bf16, q8_0 or q4_0.
enum class GgufWeights : uint8_t { f32, f16, bf16, q8_0, q4_0 };
// Fails naming the option and listing the types for anything else.
GgufWeights parse_gguf_weights(const std::string& name);
const char* gguf_weights_name(GgufWeights weights);

// Within each head of `rows` rows of `cols` values, row j * head_dim / 2 + i goes to row 2i + j (j = 0, 1):
// Hugging Face's rotate-half layout of q_proj/k_proj to llama.cpp's interleaved one. rows: whole heads.
void permute_rope_rows(const float* in, float* out, int64_t rows, int64_t cols, int64_t head_dim);

struct GgufReport {
  int64_t tensors = 0;
  int64_t parameters = 0;
  uint64_t bytes_written = 0;
  int64_t host_staging_bytes = 0;        // the buffers the weights went through (bounded by a run of rows)
  std::vector<std::string> fell_back;    // matrices written f16 because their rows are not whole blocks
};

// Exports the model of ckpt_dir (a tuna checkpoint, single file or rank files, or a Hugging Face directory;
// verified against its manifest when it has one) to out. vocab: the model's tokenizer as GGUF metadata
// (data/tokenizer.h: gguf_vocabulary). An existing out is replaced only with overwrite. Fails naming what
// llama.cpp cannot represent (a weight beyond f16's range under f16, a tokenizer larger than the model).
// A LoRA checkpoint (ckpt/peft.h) exports its base with the adapters merged; base_override: --base.
GgufReport export_gguf(const std::filesystem::path& ckpt_dir, const std::filesystem::path& out, GgufWeights weights,
                       const GgufVocabulary& vocab, std::FILE* progress = nullptr, bool overwrite = false,
                       const std::filesystem::path& base_override = {});

}  // namespace tuna
