#include "ckpt/gguf.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <optional>

#include "ckpt/checkpoint.h"
#include "ckpt/peft.h"  // a LoRA checkpoint merged on the way
#include "ckpt/quantize.h"
#include "ckpt/tensor_file.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/progress.h"
#include "kernels/cpu/rope.h"  // rope_inv_freq: the llama3 scaling tuna computes, as llama.cpp's factors
#include "model/config.h"
#include "model/layout.h"

namespace tuna {

namespace fs = std::filesystem;

namespace {

// GGUF's value types (the file's numbers).
enum : uint32_t {
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
};

constexpr uint32_t kGgufVersion = 3;

template <typename T>
void put(std::string& out, T value) {
  static_assert(std::is_trivially_copyable_v<T>);
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // little-endian, as every machine tuna runs on
  out.append(bytes, sizeof(T));
}

void put_string(std::string& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  out += s;
}

uint64_t padded(uint64_t n) { return (n + GgufWriter::kAlignment - 1) / GgufWriter::kAlignment * GgufWriter::kAlignment; }


}  // namespace

const char* ggml_type_name(GgmlType type) {
  switch (type) {
    case GgmlType::f32: return "F32";
    case GgmlType::f16: return "F16";
    case GgmlType::q4_0: return "Q4_0";
    case GgmlType::q8_0: return "Q8_0";
    case GgmlType::bf16: return "BF16";
  }
  return "?";
}

uint64_t ggml_nbytes(GgmlType type, int64_t n) {
  switch (type) {
    case GgmlType::f32: return uint64_t(n) * 4;
    case GgmlType::f16:
    case GgmlType::bf16: return uint64_t(n) * 2;
    case GgmlType::q8_0: return uint64_t(n / kQuantBlock) * quant_block_bytes(BlockQuant::q8_0);
    case GgmlType::q4_0: return uint64_t(n / kQuantBlock) * quant_block_bytes(BlockQuant::q4_0);
  }
  return 0;
}

void GgufWriter::key(const std::string& key, uint32_t value_type) {
  put_string(kv_, key);
  put<uint32_t>(kv_, value_type);
  n_kv_++;
}

void GgufWriter::add_string(const std::string& k, const std::string& value) { key(k, kString), put_string(kv_, value); }
void GgufWriter::add_u32(const std::string& k, uint32_t value) { key(k, kU32), put<uint32_t>(kv_, value); }
void GgufWriter::add_f32(const std::string& k, float value) { key(k, kF32), put<float>(kv_, value); }
void GgufWriter::add_bool(const std::string& k, bool value) { key(k, kBool), put<uint8_t>(kv_, value ? 1 : 0); }

void GgufWriter::add_strings(const std::string& k, const std::vector<std::string>& values) {
  key(k, kArray);
  put<uint32_t>(kv_, kString);
  put<uint64_t>(kv_, values.size());
  for (const std::string& s : values) put_string(kv_, s);
}

void GgufWriter::add_f32s(const std::string& k, const std::vector<float>& values) {
  key(k, kArray);
  put<uint32_t>(kv_, kF32);
  put<uint64_t>(kv_, values.size());
  for (float v : values) put<float>(kv_, v);
}

void GgufWriter::add_i32s(const std::string& k, const std::vector<int32_t>& values) {
  key(k, kArray);
  put<uint32_t>(kv_, kI32);
  put<uint64_t>(kv_, values.size());
  for (int32_t v : values) put<int32_t>(kv_, v);
}

void GgufWriter::add_tensor(const std::string& name, const std::vector<int64_t>& ne, GgmlType type) {
  TUNA_CHECK(!ne.empty() && ne.size() <= 4, "tensor ", name, ": ", ne.size(), " dimensions");
  int64_t n = 1;
  for (int64_t d : ne) n *= d;
  TUNA_CHECK((type != GgmlType::q8_0 && type != GgmlType::q4_0) || ne[0] % kQuantBlock == 0, "tensor ", name,
             ": rows of ", ne[0], " are not whole blocks");
  tensors_.push_back({name, ne, type, ggml_nbytes(type, n)});
}

uint64_t GgufWriter::write(const fs::path& path, const std::function<void(const Append&)>& produce,
                           ProgressLine* progress) const {
  std::string header = "GGUF";
  put<uint32_t>(header, kGgufVersion);
  put<uint64_t>(header, tensors_.size());
  put<uint64_t>(header, n_kv_);
  header += kv_;
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    put_string(header, t.name);
    put<uint32_t>(header, static_cast<uint32_t>(t.ne.size()));
    for (int64_t d : t.ne) put<uint64_t>(header, static_cast<uint64_t>(d));
    put<uint32_t>(header, static_cast<uint32_t>(t.type));
    put<uint64_t>(header, offset);
    offset = padded(offset + t.bytes);
  }
  header.resize(padded(header.size()), '\0');

  std::vector<TensorFileEntry> entries;
  for (const Tensor& t : tensors_) entries.push_back({t.name, t.bytes});
  return write_tensor_file(path, header, entries, kAlignment, produce, progress).bytes;
}

GgufWeights parse_gguf_weights(const std::string& name) {
  for (GgufWeights w : {GgufWeights::f32, GgufWeights::f16, GgufWeights::bf16, GgufWeights::q8_0, GgufWeights::q4_0})
    if (name == gguf_weights_name(w)) return w;
  fail("option --type: expected bf16, f16, f32, q8_0 or q4_0, found '", name,
       "' (k-quants such as q4_k_m are not written by tuna: run llama.cpp's llama-quantize on a bf16 export)");
}

const char* gguf_weights_name(GgufWeights w) {
  switch (w) {
    case GgufWeights::f32: return "f32";
    case GgufWeights::f16: return "f16";
    case GgufWeights::bf16: return "bf16";
    case GgufWeights::q8_0: return "q8_0";
    case GgufWeights::q4_0: return "q4_0";
  }
  return "?";
}

void permute_rope_rows(const float* in, float* out, int64_t rows, int64_t cols, int64_t head_dim) {
  TUNA_CHECK(head_dim > 0 && head_dim % 2 == 0 && rows % head_dim == 0, rows, " rows, head_dim ", head_dim);
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < rows / head_dim; ++h)
    for (int64_t i = 0; i < half; ++i)
      for (int64_t j = 0; j < 2; ++j)
        std::memcpy(out + (h * head_dim + 2 * i + j) * cols, in + (h * head_dim + j * half + i) * cols,
                    sizeof(float) * size_t(cols));
}

namespace {

// llama.cpp's file type (general.file_type): what most of the weights are.
uint32_t file_type(GgufWeights w) {
  switch (w) {
    case GgufWeights::f32: return 0;
    case GgufWeights::f16: return 1;
    case GgufWeights::q4_0: return 2;
    case GgufWeights::q8_0: return 7;
    case GgufWeights::bf16: return 32;
  }
  return 0;
}

// One tensor of the export: where its values come from, what it is called and how it is stored.
struct Planned {
  const ParamTensor* param = nullptr;  // null: rope_freqs (values below)
  std::string name;
  GgmlType type;
  int64_t rope_head_dim = 0;  // > 0: attn_q / attn_k, rows permuted per head of this size
  std::vector<float> values;  // rope_freqs
};

std::string gguf_name(const std::string& hf, int layer) {
  static const std::pair<const char*, const char*> kLayer[] = {
      {"input_layernorm.weight", "attn_norm.weight"},          {"self_attn.q_proj.weight", "attn_q.weight"},
      {"self_attn.k_proj.weight", "attn_k.weight"},            {"self_attn.v_proj.weight", "attn_v.weight"},
      {"self_attn.o_proj.weight", "attn_output.weight"},       {"post_attention_layernorm.weight", "ffn_norm.weight"},
      {"mlp.gate_proj.weight", "ffn_gate.weight"},             {"mlp.up_proj.weight", "ffn_up.weight"},
      {"mlp.down_proj.weight", "ffn_down.weight"},
  };
  if (hf == "model.embed_tokens.weight") return "token_embd.weight";
  if (hf == "model.norm.weight") return "output_norm.weight";
  if (hf == "lm_head.weight") return "output.weight";
  const std::string prefix = str("model.layers.", layer, ".");
  if (layer >= 0 && hf.rfind(prefix, 0) == 0)
    for (const auto& [from, to] : kLayer)
      if (hf.substr(prefix.size()) == from) return str("blk.", layer, ".", to);
  fail("GGUF export: no llama.cpp name for tensor '", hf, "'");
}

GgmlType tensor_type(GgufWeights w, const ParamTensor& t, bool is_head, std::vector<std::string>* fell_back) {
  if (t.shape.size() == 1 || w == GgufWeights::f32) return GgmlType::f32;  // norms stay f32, as llama.cpp's
  if (w == GgufWeights::f16) return GgmlType::f16;
  if (w == GgufWeights::bf16) return GgmlType::bf16;
  if (t.shape.back() % kQuantBlock != 0) {
    fell_back->push_back(t.name);
    return GgmlType::f16;
  }
  if (w == GgufWeights::q4_0 && !is_head) return GgmlType::q4_0;
  return GgmlType::q8_0;
}

void add_vocabulary(GgufWriter& w, const GgufVocabulary& v) {
  w.add_string("tokenizer.ggml.model", v.model);
  if (v.model == "llama") w.add_bool("tokenizer.ggml.add_space_prefix", v.add_space_prefix);
  if (!v.pre.empty()) w.add_string("tokenizer.ggml.pre", v.pre);
  w.add_strings("tokenizer.ggml.tokens", v.tokens);
  if (!v.scores.empty()) w.add_f32s("tokenizer.ggml.scores", v.scores);
  w.add_i32s("tokenizer.ggml.token_type", v.types);
  if (!v.merges.empty()) w.add_strings("tokenizer.ggml.merges", v.merges);
  if (v.bos >= 0) w.add_u32("tokenizer.ggml.bos_token_id", uint32_t(v.bos));
  if (v.eos >= 0) w.add_u32("tokenizer.ggml.eos_token_id", uint32_t(v.eos));
  if (v.unk >= 0) w.add_u32("tokenizer.ggml.unknown_token_id", uint32_t(v.unk));
  if (v.pad >= 0) w.add_u32("tokenizer.ggml.padding_token_id", uint32_t(v.pad));
  w.add_bool("tokenizer.ggml.add_bos_token", v.add_bos);
  w.add_bool("tokenizer.ggml.add_eos_token", v.add_eos);
  if (!v.chat_template.empty()) w.add_string("tokenizer.chat_template", v.chat_template);
}

// rope_scaling as llama.cpp reads it (gguf's rope.scaling.* keys, which llama.cpp's converter writes from
// config.json): llama3 goes as the rope_freqs tensor (export_gguf), linear and yarn as keys. llama.cpp's yarn
// interpolates over the same correction range from original_context_length, beta_fast and beta_slow, and scales
// cos and sin by 0.1 ln(factor) + 1 itself; it has no dynamic NTK. What it would compute differently is refused.
void add_rope_scaling(GgufWriter& w, const LlamaConfig& config) {
  const cpu::RopeScaling& s = config.rope_scaling;
  if (s.type == "default" || s.type == "llama3") return;
  if (s.type == "dynamic")
    fail("tuna-to-gguf: the model's rope scaling is 'dynamic' (NTK-aware), which llama.cpp does not implement: its "
         "GGUF would rotate positions differently from what was trained; export to Hugging Face instead");
  w.add_string("llama.rope.scaling.type", s.type);
  w.add_f32("llama.rope.scaling.factor", float(s.factor));
  if (s.type != "yarn") return;
  if (s.attention_factor > 0.0 && std::abs(s.attention_factor - (0.1 * std::log(s.factor) + 1.0)) > 1e-6)
    fail("tuna-to-gguf: the model's yarn attention_factor ", s.attention_factor, " is not llama.cpp's (0.1 ln(factor) ",
         "+ 1 = ", 0.1 * std::log(s.factor) + 1.0, "), which its GGUF would run with");
  w.add_u32("llama.rope.scaling.original_context_length", uint32_t(s.original_max_position_embeddings));
  w.add_f32("llama.rope.scaling.yarn_beta_fast", float(s.beta_fast));
  w.add_f32("llama.rope.scaling.yarn_beta_slow", float(s.beta_slow));
}

// The file's general.* keys and the llama architecture's hyperparameters, as llama.cpp's converter writes them.
void add_model_keys(GgufWriter& w, const fs::path& ckpt_dir, const LlamaConfig& config, GgufWeights weights) {
  w.add_string("general.architecture", "llama");
  fs::path named = fs::absolute(ckpt_dir).lexically_normal();
  if (named.filename().empty()) named = named.parent_path();
  w.add_string("general.name", named.filename().string());
  w.add_u32("general.file_type", file_type(weights));
  w.add_u32("general.quantization_version", 2);  // ggml's current block layouts (GGML_QNT_VERSION)
  w.add_u32("general.alignment", GgufWriter::kAlignment);
  // The context the model was trained for: with yarn, max_position_embeddings x factor (max_position_embeddings is
  // yarn's original context, written below as rope.scaling.original_context_length).
  w.add_u32("llama.context_length", uint32_t(config.max_context()));
  w.add_u32("llama.embedding_length", uint32_t(config.hidden_size));
  w.add_u32("llama.feed_forward_length", uint32_t(config.intermediate_size));
  w.add_u32("llama.block_count", uint32_t(config.num_hidden_layers));
  w.add_u32("llama.attention.head_count", uint32_t(config.num_attention_heads));
  w.add_u32("llama.attention.head_count_kv", uint32_t(config.num_key_value_heads));
  // Always written: llama.cpp would otherwise take hidden_size / heads, which a config's head_dim may differ from.
  w.add_u32("llama.attention.key_length", uint32_t(config.head_dim));
  w.add_u32("llama.attention.value_length", uint32_t(config.head_dim));
  w.add_u32("llama.rope.dimension_count", uint32_t(config.head_dim));
  w.add_f32("llama.rope.freq_base", float(config.rope_theta));
  add_rope_scaling(w, config);
  w.add_f32("llama.attention.layer_norm_rms_epsilon", float(config.rms_norm_eps));
  w.add_u32("llama.vocab_size", uint32_t(config.vocab_size));
}

}  // namespace

GgufReport export_gguf(const fs::path& ckpt_dir, const fs::path& out, GgufWeights weights, const GgufVocabulary& vocab,
                       std::FILE* progress, bool overwrite, const fs::path& base_override) {
  std::error_code ec;
  if (fs::is_directory(out, ec)) fail(out.string(), ": is a directory; the GGUF export is one file (e.g. model.gguf)");
  if (fs::exists(out, ec) && !overwrite)
    fail(out.string(), ": already exists: --overwrite to replace it, or choose another output file");
  // What ships must be what training wrote: every file against the checkpoint's manifest first.
  if (const std::string problem = verify_checkpoint(ckpt_dir); !problem.empty())
    fail(ckpt_dir.string(), ": fails verification, nothing exported: ", problem);
  // A LoRA checkpoint exports its base with the adapters merged on the way (ckpt/peft.h).
  const bool lora = is_lora_directory(ckpt_dir);
  if (!lora && !base_override.empty())
    fail("option 'base': ", ckpt_dir.string(), " is not a LoRA checkpoint (no ", kAdapterConfigFile, ")");
  const fs::path model_dir =
      lora ? open_lora_checkpoint(ckpt_dir, base_override, LoraManifest::ChecksumsVerifiedByCaller).base : ckpt_dir;
  const fs::path config_path = model_dir / "config.json";
  const LlamaConfig config = LlamaConfig::from_json(read_config_json(model_dir), config_path.string());
  const ParamLayout layout(config);

  // What llama.cpp's llama architecture cannot hold, named before anything is written.
  if (static_cast<int64_t>(vocab.tokens.size()) != config.vocab_size)
    fail(ckpt_dir.string(), ": the tokenizer's vocabulary (", vocab.tokens.size(), " tokens) does not match config.json's "
         "vocab_size (", config.vocab_size, "): llama.cpp needs one token per embedding row");
  for (int64_t v : {config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads,
                    config.num_key_value_heads, config.head_dim, config.vocab_size, config.max_context()})
    if (v > int64_t(UINT32_MAX)) fail(config_path.string(), ": a dimension of ", v, " does not fit GGUF's 32-bit fields");

  GgufWriter w;
  add_model_keys(w, ckpt_dir, config, weights);
  add_vocabulary(w, vocab);

  GgufReport report;
  std::vector<Planned> plan;
  if (config.rope_scaling.type == "llama3") {
    // llama.cpp rotates by theta^(-2i/d) / factor_i: the factors are tuna's unscaled frequencies over its scaled
    // ones, so that both compute the same angles.
    const int64_t half = config.head_dim / 2;
    std::vector<double> plain(half), scaled(half);
    rope_inv_freq(plain.data(), config.head_dim, config.rope_theta, cpu::RopeScaling{});
    rope_inv_freq(scaled.data(), config.head_dim, config.rope_theta, config.rope_scaling);
    Planned p{nullptr, "rope_freqs.weight", GgmlType::f32, 0, std::vector<float>(half)};
    for (int64_t i = 0; i < half; ++i) p.values[i] = float(plain[i] / scaled[i]);
    plan.push_back(std::move(p));
  }
  const ParamTensor* head = layout.find(config.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
  TUNA_CHECK(head != nullptr, "no output head in the layout");
  for (const ParamTensor& t : layout.tensors()) {
    Planned p{&t, gguf_name(t.name, t.layer), tensor_type(weights, t, &t == head, &report.fell_back), 0, {}};
    if (t.name.ends_with("self_attn.q_proj.weight") || t.name.ends_with("self_attn.k_proj.weight"))
      p.rope_head_dim = config.head_dim;
    plan.push_back(std::move(p));
  }
  for (const Planned& p : plan) {
    std::vector<int64_t> ne;
    if (p.param)
      ne.assign(p.param->shape.rbegin(), p.param->shape.rend());
    else
      ne = {static_cast<int64_t>(p.values.size())};
    w.add_tensor(p.name, ne, p.type);
    report.tensors++;
    report.parameters += p.param ? p.param->numel : 0;
  }

  std::optional<WeightReader> plain;
  std::optional<MergedWeightReader> merged;
  if (lora) merged.emplace(model_dir, ckpt_dir, layout);
  else plain.emplace(ckpt_dir, layout);
  const auto read = [&](const Segment& piece, float* out) { lora ? merged->read(piece, out) : plain->read(piece, out); };
  uint64_t total = 0;
  for (const Planned& p : plan) total += ggml_nbytes(p.type, p.param ? p.param->numel : int64_t(p.values.size()));
  ProgressLine line(str("convert: writing ", out.string(), " (", gguf_weights_name(weights), ")"), double(total),
                    ProgressLine::Unit::Bytes, progress);
  // Rows of a tensor go through three bounded buffers (fp32 as read, fp32 permuted, the stored bytes): at most
  // kRun values, rounded to whole heads for attn_q/attn_k.
  constexpr int64_t kRun = int64_t(16) << 20;
  std::vector<float> read_buf, permuted;
  std::vector<std::byte> stored;
  report.bytes_written = w.write(
      out,
      [&](const GgufWriter::Append& append) {
        for (const Planned& p : plan) {
          if (!p.param) {
            append(p.values.data(), p.values.size() * sizeof(float));
            continue;
          }
          const ParamTensor& t = *p.param;
          const int64_t cols = t.shape.size() == 1 ? t.numel : t.shape[1];
          const int64_t rows = t.numel / cols;
          int64_t run_rows = std::max<int64_t>(1, kRun / cols);
          if (p.rope_head_dim) run_rows = std::max<int64_t>(1, run_rows / p.rope_head_dim) * p.rope_head_dim;
          for (int64_t r0 = 0; r0 < rows; r0 += run_rows) {
            const int64_t nr = std::min(run_rows, rows - r0), n = nr * cols;
            if (int64_t(read_buf.size()) < n) read_buf.resize(n);
            read(Segment{t.offset + r0 * cols, n}, read_buf.data());
            const float* values = read_buf.data();
            if (p.rope_head_dim) {
              if (int64_t(permuted.size()) < n) permuted.resize(n);
              permute_rope_rows(read_buf.data(), permuted.data(), nr, cols, p.rope_head_dim);
              values = permuted.data();
            }
            const uint64_t bytes = ggml_nbytes(p.type, n);
            if (p.type == GgmlType::f32) {
              append(values, bytes);
              continue;
            }
            if (stored.size() < bytes) stored.resize(bytes);
            switch (p.type) {
              case GgmlType::f16:
                for (int64_t i = 0; i < n; ++i)
                  if (!(std::fabs(values[i]) < 65520.0f))  // what rounds to 65504 or less
                    fail(ckpt_dir.string(), ": tensor '", t.name, "' holds ", values[i], " at element ",
                         (r0 * cols) + i, ", beyond f16's range (65504): llama.cpp cannot hold it as f16; export "
                         "with --type bf16");
                convert_from_f32(values, DType::F16, stored.data(), n);
                break;
              case GgmlType::bf16: convert_from_f32(values, DType::BF16, stored.data(), n); break;
              case GgmlType::q8_0: quantize_blocks(BlockQuant::q8_0, values, n, stored.data()); break;
              case GgmlType::q4_0: quantize_blocks(BlockQuant::q4_0, values, n, stored.data()); break;
              case GgmlType::f32: break;
            }
            append(stored.data(), bytes);
          }
        }
      },
      &line);
  line.finish();
  report.host_staging_bytes = int64_t((read_buf.capacity() + permuted.capacity()) * sizeof(float) + stored.capacity());
  return report;
}

}  // namespace tuna
