// build/fuzz_readers (make fuzz): every reader of untrusted bytes (checkpoints, configs, shards, TOML, tokenizer
// files, prepare's corpus inputs), fed mutated inputs under AddressSanitizer and UBSan. Deterministic: a seed and
// a case number name every input, so a failure reproduces exactly (--reader R --case K --dump FILE writes the input
// that failed; FUZZ_VERBOSE=1 prints every clean error).
//
// For each reader: the regression corpus first (tests/fuzz/corpus/<reader>/*: the inputs that crashed, hung or
// trained garbage before), then its valid seed inputs (which must be read without an error), then
// --cases mutations of them: bit flips, byte overwrites with boundary values, truncations, insertions,
// deletions and duplicated chunks; for text formats also numbers replaced by 1e400, -1, 2^63, NaN..., deep
// nesting, repeated keys and removed fields. The expected outcome of every case is a clean error (a
// tuna::Error) or a valid result. Anything else fails the run: another exception type (printed with the case),
// a sanitizer report or a signal (the process dies with it; -fno-sanitize-recover), or a hang (a case that runs
// longer than --case_seconds ends the run naming it).
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <typeinfo>
#include <vector>
#include <zlib.h>
#include <zstd.h>

#include "core/error.h"
#include "core/json.h"
#include "core/options.h"
#include "data/byte_bpe.h"
#include "data/chat_template.h"
#include "data/loader.h"
#include "data/mc_tasks.h"  // build/eval --tasks records
#include "data/prepare.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "ckpt/checkpoint.h"
#include "ckpt/peft.h"     // open_lora_checkpoint: the rule of every LoRA reader
#include "ckpt/run_dir.h"  // RunLock
#include "model/lora.h"
#include "model/config.h"
#include "model/layout.h"
#include "ckpt/safetensors.h"
#include "engine/gen_eval.h"  // encode_gen_requests

namespace fs = std::filesystem;
using nlohmann::json;
using namespace tuna;

namespace {

// ---- deterministic randomness -----------------------------------------------------------------------------

struct Rng {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  uint64_t below(uint64_t n) { return n ? next() % n : 0; }
};

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// ---- mutations ----------------------------------------------------------------------------------------------

const char* const kNumbers[] = {"1e400",  "-1e400", "-1", "0", "1", "9223372036854775807", "9223372036854775808",
                                "-9223372036854775808", "18446744073709551616", "4294967296", "2147483648",
                                "1e-400", "0.5", "-0", "1e308", "65536", "NaN", "inf", "\"7\"", "null", "true",
                                "[]", "{}", "2.5e9"};

std::string mutate_bytes(std::string s, Rng& rng) {
  const int kind = static_cast<int>(rng.below(7));
  const size_t n = s.size();
  switch (kind) {
    case 0:  // flip a few bits
      for (int i = 0, k = 1 + rng.below(8); i < k && n; i++) s[rng.below(n)] ^= static_cast<char>(1 << rng.below(8));
      break;
    case 1: {  // boundary bytes
      static const unsigned char values[] = {0x00, 0xff, 0x7f, 0x80, 0x01, 0xfe};
      for (int i = 0, k = 1 + rng.below(4); i < k && n; i++) s[rng.below(n)] = static_cast<char>(values[rng.below(6)]);
      break;
    }
    case 2:  // truncate
      s.resize(rng.below(n + 1));
      break;
    case 3: {  // insert random bytes
      std::string extra(1 + rng.below(64), '\0');
      for (char& c : extra) c = static_cast<char>(rng.next());
      s.insert(rng.below(n + 1), extra);
      break;
    }
    case 4: {  // delete a range
      const size_t at = rng.below(n + 1);
      s.erase(at, rng.below(std::min<size_t>(n - at, 256) + 1));
      break;
    }
    case 5: {  // duplicate a chunk
      const size_t at = rng.below(n + 1), len = rng.below(std::min<size_t>(n - at, 256) + 1);
      s.insert(rng.below(n + 1), s.substr(at, len));
      break;
    }
    default: {  // an 8-byte little-endian field (a length, a count, an offset) set to a boundary value
      if (n < 8) break;
      static const uint64_t values[] = {0, 1, ~uint64_t{0}, uint64_t{1} << 63, uint64_t{1} << 32, 0x7fffffff, 4096};
      const uint64_t v = values[rng.below(7)];
      const size_t at = rng.below(std::min<size_t>(n - 7, 64)) & ~size_t{3};  // mostly the headers
      std::memcpy(&s[at], &v, 8);
      break;
    }
  }
  return s;
}

// Positions of the numbers in JSON or TOML text (outside strings).
std::vector<std::pair<size_t, size_t>> number_spans(const std::string& s) {
  std::vector<std::pair<size_t, size_t>> spans;
  bool in_string = false;
  for (size_t i = 0; i < s.size(); i++) {
    if (s[i] == '"' && (i == 0 || s[i - 1] != '\\')) in_string = !in_string;
    if (in_string || !(std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '-')) continue;
    size_t j = i;
    while (j < s.size() && std::strchr("0123456789+-.eE", s[j])) j++;
    spans.emplace_back(i, j - i);
    i = j;
  }
  return spans;
}

std::string mutate_text(std::string s, Rng& rng) {
  const int kind = static_cast<int>(rng.below(8));
  switch (kind) {
    case 0: case 1: {  // a number becomes a boundary value or another type
      auto spans = number_spans(s);
      if (spans.empty()) break;
      const auto [at, len] = spans[rng.below(spans.size())];
      s.replace(at, len, kNumbers[rng.below(std::size(kNumbers))]);
      break;
    }
    case 2: {  // deep nesting where a value starts
      const size_t at = s.find(':', rng.below(s.size() + 1));
      if (at == std::string::npos) break;
      const size_t depth = 1 + rng.below(200000);
      s.insert(at + 1, std::string(depth, '[') + "1" + std::string(depth, ']'));
      break;
    }
    case 3: {  // repeat a line (a key twice)
      const size_t begin = s.rfind('\n', rng.below(s.size() + 1));
      const size_t from = begin == std::string::npos ? 0 : begin + 1, end = s.find('\n', from);
      if (end == std::string::npos) break;
      s.insert(from, s.substr(from, end - from + 1));
      break;
    }
    case 4: {  // drop a line (a field goes missing)
      const size_t begin = s.rfind('\n', rng.below(s.size() + 1));
      const size_t from = begin == std::string::npos ? 0 : begin + 1, end = s.find('\n', from);
      s.erase(from, end == std::string::npos ? std::string::npos : end - from + 1);
      break;
    }
    case 5: {  // a string value becomes a number
      const size_t open = s.find(": \"", rng.below(s.size() + 1));
      if (open == std::string::npos) break;
      const size_t close = s.find('"', open + 3);
      if (close == std::string::npos) break;
      s.replace(open + 2, close - open - 1, kNumbers[rng.below(std::size(kNumbers))]);
      break;
    }
    default:
      return mutate_bytes(std::move(s), rng);
  }
  return s;
}

// ---- fixtures -----------------------------------------------------------------------------------------------

// A LLaMA small enough that a checkpoint of it is a few kilobytes.
const char* kTinyConfig = R"({
  "model_type": "llama",
  "hidden_size": 16,
  "intermediate_size": 24,
  "num_hidden_layers": 1,
  "num_attention_heads": 2,
  "num_key_value_heads": 1,
  "head_dim": 8,
  "vocab_size": 32,
  "max_position_embeddings": 64,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 32},
  "tie_word_embeddings": false,
  "bos_token_id": 1,
  "eos_token_id": [2, 3],
  "torch_dtype": "float32"
})";

std::string safetensors_seed(const fs::path& dir) {
  std::vector<float> f32(12);
  for (size_t i = 0; i < f32.size(); i++) f32[i] = 0.25f * static_cast<float>(i) - 1.0f;
  const std::vector<uint16_t> bf16 = {0x3f80, 0xbf80, 0x4000, 0x0000, 0x3e00}, f16 = {0x3c00, 0xbc00, 0x4000, 0x0001};
  const std::vector<int64_t> i64 = {1, -2, 3};
  SafetensorsWriter w;
  w.add_metadata("format", "pt");
  w.add("w", DType::F32, {4, 3}, f32.data());
  w.add("b", DType::BF16, {5}, bf16.data());
  w.add("h", DType::F16, {2, 2}, f16.data());
  w.add("ids", DType::I64, {3}, i64.data());
  w.add("empty", DType::U8, {0}, nullptr);
  w.write(dir / "seed.safetensors");
  return read_bytes(dir / "seed.safetensors");
}

void read_every_tensor(const SafetensorsFile& f) {
  for (const TensorInfo& t : f.tensors()) {
    if (is_floating(t.dtype)) {
      std::vector<float> out(static_cast<size_t>(t.numel));
      f.read_f32(t.name, t.shape, out.data());
    } else if (t.dtype == DType::I32 || t.dtype == DType::I64) {
      std::vector<int32_t> out(static_cast<size_t>(t.numel));
      f.read_i32(t.name, t.shape, out.data());
    }
  }
}

// A training checkpoint of the tiny model written by 2 data-parallel ranks, and one written by 1.
struct CheckpointFixture {
  LlamaConfig config;
  ParamLayout layout;
  fs::path sharded, single;
  std::vector<Segment> whole;
  explicit CheckpointFixture(const fs::path& root)
      : config(LlamaConfig::from_json(json::parse(kTinyConfig), "tiny config")), layout(config) {
    whole = {Segment{0, layout.total()}};
    std::vector<float> p(layout.total()), m(layout.total()), v(layout.total());
    for (int64_t i = 0; i < layout.total(); i++) p[i] = 0.01f * static_cast<float>(i % 89), m[i] = 1e-3f, v[i] = 1e-6f;
    json config_json = config.to_json();
    const json state = {{"data_cursor", {{"epoch", 0}, {"position", 0}, {"seed", 1}, {"seq_len", 8}, {"dp_size", 1},
                                         {"total_windows", 3}}}};
    prepare_sharded_checkpoint(root / "sharded", 6);
    // Two ranks, each a half of the flat layout (a split inside a tensor, as ZeRO makes them).
    const std::vector<std::vector<Segment>> halves = {{Segment{0, layout.total() / 2}},
                                                      {Segment{layout.total() / 2, layout.total() - layout.total() / 2}}};
    for (int r = 0; r < 2; r++) {
      const std::vector<Segment>& segs = halves[r];
      std::vector<float> sp, sm, sv;
      for (const Segment& s : segs)
        for (int64_t i = s.begin; i < s.begin + s.size; i++) sp.push_back(p[i]), sm.push_back(m[i]), sv.push_back(v[i]);
      write_checkpoint_shard(checkpoint_tmp_dir(root / "sharded", 6), r, layout,
                             ShardState{&segs, shard_buffers_export(segs, sp.data(), sm.data(), sv.data()), 6});
    }
    sharded = finish_sharded_checkpoint(root / "sharded", 6, CheckpointContents{&config_json, nullptr, {}, state, {}}, 0);
    single = save_checkpoint(root / "single", 6, layout,
                             CheckpointContents{&config_json, p.data(), {m.data(), v.data(), 6}, state, {}}, 0);
  }
};

void copy_dir(const fs::path& from, const fs::path& to) {
  fs::remove_all(to);
  fs::create_directories(to.parent_path());
  fs::copy(from, to, fs::copy_options::recursive);
}


// ---- tokenizers -------------------------------------------------------------------------------------------------

// A zstd file's content (the committed tokenizer fixtures).
std::string read_zstd(const fs::path& p) {
  const std::string packed = read_bytes(p);
  ZSTD_DCtx* ctx = ZSTD_createDCtx();
  ZSTD_DCtx_setParameter(ctx, ZSTD_d_windowLogMax, 27);
  std::string out, buffer(1 << 20, '\0');
  ZSTD_inBuffer in{packed.data(), packed.size(), 0};
  while (in.pos < in.size) {
    ZSTD_outBuffer o{buffer.data(), buffer.size(), 0};
    const size_t rc = ZSTD_decompressStream(ctx, &o, &in);
    if (ZSTD_isError(rc)) {
      ZSTD_freeDCtx(ctx);
      throw std::runtime_error(p.string() + ": " + ZSTD_getErrorName(rc));
    }
    out.append(buffer.data(), o.pos);
  }
  ZSTD_freeDCtx(ctx);
  return out;
}

// A byte-level BPE tokenizer.json small enough to mutate a few hundred times a second: the 256 byte tokens, the
// merges that build a few words, Llama 3's special tokens of its chat format and an added one. Two shapes: Llama 3's (a Split regex then
// ByteLevel without its regex, merges as "a b" strings, a TemplateProcessing BOS) and GPT-2's (ByteLevel with
// its regex and add_prefix_space, merges as pairs, ignore_merges).
std::string tiny_tokenizer_json(bool llama3_shape) {
  json vocab = json::object(), merges = json::array();
  int32_t next = 0;
  for (int b = 0; b < 256; b++) vocab[byte_level_encode(std::string(1, static_cast<char>(b)))] = next++;
  for (const char* word : {"hello", " world", "the", " the", "ing", "123", "\n\n"}) {
    std::string left(word, 1);
    for (const char* c = word + 1; *c; ++c) {  // merges grow each word from its left end
      const std::string right(c, 1), l = byte_level_encode(left), r = byte_level_encode(right);
      if (!vocab.contains(byte_level_encode(left + right))) {
        vocab[byte_level_encode(left + right)] = next++;
        merges.push_back(llama3_shape ? json(l + " " + r) : json::array({l, r}));
      }
      left += right;
    }
  }
  const json added = json::array({{{"id", next}, {"content", "<|begin_of_text|>"}, {"special", true}},
                                  {{"id", next + 1}, {"content", "<|eot_id|>"}, {"special", true}},
                                  {{"id", next + 2}, {"content", "<extra>"}, {"special", false}},
                                  {{"id", next + 3}, {"content", "<|start_header_id|>"}, {"special", true}},
                                  {{"id", next + 4}, {"content", "<|end_header_id|>"}, {"special", true}}});
  json pre = llama3_shape
                 ? json{{"type", "Sequence"},
                        {"pretokenizers", {{{"type", "Split"}, {"pattern", {{"Regex", kLlama3Pattern}}},
                                            {"behavior", "Isolated"}, {"invert", false}},
                                           {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}
                 : json{{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  json t = {{"version", "1.0"}, {"added_tokens", added}, {"normalizer", nullptr}, {"pre_tokenizer", pre},
            {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"ignore_merges", !llama3_shape},
                       {"byte_fallback", false}, {"vocab", vocab}, {"merges", merges}}}};
  if (llama3_shape)
    t["post_processor"] = {{"type", "TemplateProcessing"},
                           {"single", {{{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}},
                                       {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}}};
  return t.dump(1);
}

// A tiktoken file of the 256 byte tokens and a few merged ones (not Llama 3's: refused after the parse).
std::string tiny_tiktoken() {
  static const char* digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  auto base64 = [](const std::string& bytes) {
    std::string out;
    for (size_t i = 0; i < bytes.size(); i += 3) {
      uint32_t v = 0;
      const size_t n = std::min<size_t>(3, bytes.size() - i);
      for (size_t k = 0; k < 3; k++) v = v << 8 | (k < n ? static_cast<uint8_t>(bytes[i + k]) : 0);
      for (size_t k = 0; k < 4; k++) out += k <= n ? digits[(v >> (18 - 6 * k)) & 63] : '=';
    }
    return out;
  };
  std::string out;
  int rank = 0;
  for (int b = 0; b < 256; b++) out += base64(std::string(1, static_cast<char>(b))) + " " + std::to_string(rank++) + "\n";
  for (const char* t : {"he", "hel", "hell", "hello", " w", " wo", "in", "ing"}) out += base64(t) + " " + std::to_string(rank++) + "\n";
  return out;
}

// Mutations that keep a tokenizer.json parseable and aim at its meaning: ids duplicated, huge or missing,
// merges of unknown tokens, malformed merges, added tokens on vocabulary ids, pre-tokenizer regexes that match
// empty strings or do not compile, a BOS that names no token. Half the time, the text mutations instead.
std::string mutate_tokenizer_json(std::string s, Rng& rng) {
  json t;
  try {
    t = json::parse(s);
  } catch (const json::exception&) {
    return mutate_text(std::move(s), rng);
  }
  if (rng.below(2) || !t.is_object() || !t.contains("model") || !t["model"].is_object() ||
      !t["model"].contains("vocab") || !t["model"]["vocab"].is_object() || t["model"]["vocab"].empty() ||
      !t["model"].contains("merges") || !t["model"]["merges"].is_array() || !t.contains("added_tokens") ||
      !t["added_tokens"].is_array())
    return mutate_text(std::move(s), rng);
  json& vocab = t["model"]["vocab"];
  json& merges = t["model"]["merges"];
  json& added = t["added_tokens"];
  auto any_key = [&]() {
    auto it = vocab.begin();
    std::advance(it, rng.below(vocab.size()));
    return it.key();
  };
  const int64_t ids[] = {-1, 0, 255, 256, 300, 65535 + 300, 65537 + 300, (int64_t{1} << 30) - 1, int64_t{1} << 31};
  auto any_id = [&]() -> json { return rng.below(2) ? json(vocab[any_key()]) : json(ids[rng.below(std::size(ids))]); };
  const char* const regexes[] = {"(", "", "(?=)", "a*", "\\K", "(?<=a)\\Kb", "(a|b)*c", "[\\s\\S]", "\\p{L}+|\\p{N}",
                                 "(?i)", ".", "\\X", "(?:(?:a*)*)*b", "\\b"};
  const char* const strings[] = {"", "a", "a b", "a b c", " ", "<|eot_id|>", "\xC4\xA0", "\xC4\xA0t", "<|begin_of_text|>",
                                 "hello", "\xC3\xBF\xC3\xBF", "\xE2\x96\x81"};
  switch (rng.below(12)) {
    case 0: vocab[any_key()] = any_id(); break;
    case 1: vocab.erase(any_key()); break;
    case 2: vocab[strings[rng.below(std::size(strings))]] = any_id(); break;
    case 3: merges.push_back(rng.below(2) ? json(any_key() + " " + any_key()) : json::array({any_key(), any_key()})); break;
    case 4:
      if (!merges.empty()) {
        const json bad[] = {"a", "a b c", "", json::array({"a"}), json::array({1, 2}), json::array(), nullptr};
        merges[rng.below(merges.size())] = bad[rng.below(std::size(bad))];
      }
      break;
    case 5: std::reverse(merges.begin(), merges.end()); break;
    case 6:
      if (!added.empty()) {
        json& a = added[rng.below(added.size())];
        if (rng.below(2)) a["id"] = any_id();
        else a["content"] = rng.below(2) ? json(strings[rng.below(std::size(strings))]) : json(any_key());
      }
      break;
    case 7:
      added.push_back({{"id", any_id()}, {"content", strings[rng.below(std::size(strings))]}, {"special", rng.below(2) == 0},
                       {"lstrip", rng.below(4) == 0}});
      break;
    case 8: {
      json& pre = t["pre_tokenizer"];
      const json split = {{"type", "Split"}, {"pattern", {{"Regex", regexes[rng.below(std::size(regexes))]}}},
                          {"behavior", "Isolated"}, {"invert", false}};
      const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", rng.below(2) == 0}, {"use_regex", rng.below(2) == 0}};
      pre = rng.below(2) ? json{{"type", "Sequence"}, {"pretokenizers", {split, byte_level}}}
                         : json{{"type", "Sequence"}, {"pretokenizers", {byte_level, split, byte_level}}};
      break;
    }
    case 9:
      t["post_processor"] = {{"type", "TemplateProcessing"},
                             {"single", {{{"SpecialToken", {{"id", strings[rng.below(std::size(strings))]}}}}}}};
      break;
    case 10: t["model"]["ignore_merges"] = !t["model"].value("ignore_merges", false); break;
    default: {  // two tokens trade ids (a valid vocabulary, other ids)
      const std::string a = any_key(), b = any_key();
      std::swap(vocab[a], vocab[b]);
      break;
    }
  }
  return t.dump(1);
}

// Mutations of a sentencepiece model that keep it a well-formed protobuf and aim at its meaning: a piece's
// type, score or text (empty, another piece's, invalid UTF-8), pieces dropped, repeated or swapped, the
// trainer spec's model type, byte fallback and special ids, the normalizer's flags and name. (ModelProto: 1
// pieces {1 text, 2 score, 3 type}, 2 trainer_spec {3 model_type, 35 byte_fallback, 40-43 unk/bos/eos/pad
// ids}, 3 normalizer_spec {1 name, 3 add_dummy_prefix, 4 remove_extra_whitespaces, 5 escape_whitespaces}; a
// scalar field written twice takes its last value.) Half the time, the byte mutations instead.
struct ProtoField {
  uint64_t tag;          // number << 3 | wire type
  std::string payload;   // length-delimited: the bytes; varint: the value's encoding; fixed: the bytes
};

void put_varint(uint64_t v, std::string* out) {
  for (; v >= 0x80; v >>= 7) out->push_back(static_cast<char>((v & 0x7f) | 0x80));
  out->push_back(static_cast<char>(v));
}

bool split_proto(const std::string& s, std::vector<ProtoField>* fields) {
  size_t at = 0;
  auto varint = [&](uint64_t* v) {
    *v = 0;
    for (int shift = 0; at < s.size() && shift < 64; shift += 7) {
      const uint8_t b = static_cast<uint8_t>(s[at++]);
      *v |= uint64_t{b & 0x7fu} << shift;
      if (b < 0x80) return true;
    }
    return false;
  };
  while (at < s.size()) {
    ProtoField f;
    uint64_t length = 0;
    if (!varint(&f.tag)) return false;
    const size_t value = at;
    switch (f.tag & 7) {
      case 0:
        if (!varint(&length)) return false;
        f.payload = s.substr(value, at - value);
        break;
      case 1:
      case 5:
      case 2:
        length = (f.tag & 7) == 1 ? 8 : 4;
        if ((f.tag & 7) == 2 && !varint(&length)) return false;
        if (length > s.size() - at) return false;
        f.payload = s.substr(at, length);
        at += length;
        break;
      default:
        return false;
    }
    fields->push_back(std::move(f));
  }
  return true;
}

std::string join_proto(const std::vector<ProtoField>& fields) {
  std::string out;
  for (const ProtoField& f : fields) {
    put_varint(f.tag, &out);
    if ((f.tag & 7) == 2) put_varint(f.payload.size(), &out);
    out += f.payload;
  }
  return out;
}

ProtoField varint_field(uint32_t number, uint64_t value) {
  ProtoField f{uint64_t{number} << 3, ""};
  put_varint(value, &f.payload);
  return f;
}

std::string mutate_sentencepiece(std::string s, Rng& rng) {
  std::vector<ProtoField> top;
  if (rng.below(2) || !split_proto(s, &top)) return mutate_bytes(std::move(s), rng);
  std::vector<size_t> pieces;
  ProtoField* trainer = nullptr;
  ProtoField* normalizer = nullptr;
  for (size_t i = 0; i < top.size(); i++) {
    if (top[i].tag == (1 << 3 | 2)) pieces.push_back(i);
    if (top[i].tag == (2 << 3 | 2)) trainer = &top[i];
    if (top[i].tag == (3 << 3 | 2)) normalizer = &top[i];
  }
  if (pieces.empty() || !trainer || !normalizer) return mutate_bytes(std::move(s), rng);
  auto append = [](ProtoField* message, const ProtoField& f) { message->payload += join_proto({f}); };
  ProtoField& piece = top[pieces[rng.below(pieces.size())]];
  const uint64_t ids[] = {~uint64_t{0}, 0, 1, 2, 3, 5, 258, 1000000, uint64_t{1} << 31};
  switch (rng.below(9)) {
    case 0: append(&piece, varint_field(3, rng.below(8))); break;  // type (1 normal ... 6 byte; 0, 7 unknown)
    case 1: {  // score: NaN, inf, a huge or negative one
      const float scores[] = {std::nanf(""), INFINITY, -INFINITY, 1e30f, -1e30f, 0.0f};
      const float score = scores[rng.below(std::size(scores))];
      ProtoField f{2 << 3 | 5, std::string(4, '\0')};
      std::memcpy(f.payload.data(), &score, 4);
      append(&piece, f);
      break;
    }
    case 2: {  // text: empty, another piece's, invalid UTF-8, a space run, a byte piece's name
      const std::string texts[] = {"", "\xE2\x96\x81\xE2\x96\x81", "\xFF\xFE", "<0x41>", "\n", "a\nb", "<unk>", "<s>"};
      std::string text = texts[rng.below(std::size(texts))];
      if (rng.below(2)) {
        std::vector<ProtoField> other;
        if (split_proto(top[pieces[rng.below(pieces.size())]].payload, &other) && !other.empty()) text = other[0].payload;
      }
      append(&piece, ProtoField{1 << 3 | 2, text});
      break;
    }
    case 3: top.erase(top.begin() + static_cast<long>(pieces[rng.below(pieces.size())])); break;
    case 4: {
      const ProtoField copy = piece;
      top.insert(top.begin() + static_cast<long>(pieces[rng.below(pieces.size())]), copy);
      break;
    }
    case 5: std::swap(top[pieces[rng.below(pieces.size())]], top[pieces[rng.below(pieces.size())]]); break;
    case 6: append(trainer, varint_field(3, rng.below(6))); break;  // model_type
    case 7: append(trainer, rng.below(3) ? varint_field(40 + static_cast<uint32_t>(rng.below(4)), ids[rng.below(std::size(ids))])
                                         : varint_field(35, rng.below(2)));
            break;
    default:
      if (rng.below(3)) {
        append(normalizer, varint_field(3 + static_cast<uint32_t>(rng.below(3)), rng.below(2)));
      } else {
        const char* names[] = {"identity", "nfkc", "nmt_nfkc", "bogus", ""};
        append(normalizer, ProtoField{1 << 3 | 2, names[rng.below(std::size(names))]});
      }
      break;
  }
  return join_proto(top);
}

// Whether decode(encode(text)) must give the text back: tiktoken, and a tokenizer.json whose pipeline is GPT-2's
// byte-level one untouched (no normalizer, a ByteLevel decoder alone, every byte in the vocabulary). Any other
// pipeline decodes as the library does, which need not be the text (no decoder joins tokens with spaces, a
// normalizer changes the text, a missing byte is dropped); the fixtures hold those to the library.
bool decodes_back(const Tokenizer& t) {
  if (t.format() == TokenizerFormat::tiktoken) return true;
  const ByteBpeModel* m = t.impl().bpe_model();
  if (m == nullptr || !m->normalizers.empty() || !t.impl().missing_bytes().empty()) return false;
  if (m->decoders.size() != 1 || m->decoders[0].kind != DecoderStep::Kind::byte_level) return false;
  return std::any_of(m->pre_tokenizers.begin(), m->pre_tokenizers.end(),
                     [](const PreTokenizerStep& p) { return p.kind == PreTokenizerStep::Kind::byte_level; });
}

// What a caller does with a tokenizer once loaded: every id's text (the fingerprint already read them), encode
// with special tokens as text and parsed, the word cache, decode. Where the pipeline is byte-level end to end
// (decodes_back) decoding must give the text back (a space before it with add_prefix_space): a loaded vocabulary
// that cannot is not a valid result.
void use_tokenizer(const Tokenizer& t) {
  const std::string text = "hello world, the thing 123456 <|eot_id|> <extra>\n\n  tabs\tand caf\xC3\xA9 \xF0\x9F\x98\x80!";
  for (int32_t id : {t.bos_id(), t.eos_id(), t.unk_id(), t.pad_id()})
    if (id >= 0) (void)t.piece(id);
  (void)t.describe();
  for (SpecialTokens specials : {SpecialTokens::as_text, SpecialTokens::parse}) {
    const std::vector<int32_t> ids = t.encode(text, specials);
    const std::string back = t.decode(ids);
    auto without_spaces = [](std::string s) { return std::erase(s, ' '), s; };  // add_prefix_space adds some
    if (decodes_back(t) && without_spaces(back) != without_spaces(text))
      throw std::logic_error("decode(encode(text)) gave '" + back + "'");
    std::vector<int32_t> cached;
    CachedEncoder(t).encode(text, &cached, specials);
    if (t.impl().segments_exact() && cached != ids) throw std::logic_error("the word cache encodes differently");
  }
  (void)t.encode_continuation("continued text");
  // Against a model smaller than the tokenizer: refused, or a warning and refused ids at encode time.
  for (int64_t limit : {int64_t{1}, int64_t{t.vocab_size()} / 2, int64_t{t.vocab_size()} - 1}) {
    try {
      (void)check_tokenizer_fits(t, std::max<int64_t>(1, limit), "fuzz config.json");
      try {
        check_ids_fit(t, t.encode(text, SpecialTokens::parse), std::max<int64_t>(1, limit), "fuzz prompt");
      } catch (const Error&) {
      }
    } catch (const Error&) {
    }
  }
}

// ---- prepare's corpus inputs --------------------------------------------------------------------------------------

std::string gzip(const std::string& bytes) {
  z_stream z{};
  if (deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK) throw std::runtime_error("deflateInit2");
  std::string out(deflateBound(&z, bytes.size()), '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data()));
  z.avail_in = static_cast<uInt>(bytes.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  if (deflate(&z, Z_FINISH) != Z_STREAM_END) throw std::runtime_error("deflate");
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

std::string zstd(const std::string& bytes) {
  std::string out(ZSTD_compressBound(bytes.size()), '\0');
  const size_t n = ZSTD_compress(out.data(), out.size(), bytes.data(), bytes.size(), 3);
  if (ZSTD_isError(n)) throw std::runtime_error(ZSTD_getErrorName(n));
  out.resize(n);
  return out;
}

// JSONL records as a corpus has them: documents to keep, an exact duplicate, a near-empty one, unicode, other
// fields, a record without the text field, a line that is not JSON, a blank line, no final newline.
std::string corpus_jsonl() {
  std::string out;
  for (int i = 0; i < 6; i++)
    out += json{{"id", i}, {"text", "Document " + std::to_string(i) + ": Licensed under the Apache License, Version 2.0; "
                                    "you may not use this file except in compliance with the License.\nSee the NOTICE "
                                    "file distributed with this work for additional information. caf\xC3\xA9 \xE6\x97\xA5"},
                 {"meta", {{"source", "fuzz"}, {"score", 0.5}}}}.dump() + "\n";
  out += json{{"text", "Document 1: Licensed under the Apache License, Version 2.0; you may not use this file except in "
                       "compliance with the License.\nSee the NOTICE file distributed with this work for additional "
                       "information. caf\xC3\xA9 \xE6\x97\xA5"}}.dump() + "\n";
  out += "{\"text\": \" \"}\n{\"content\": \"no text field\"}\nnot json at all\n\n";
  out += json{{"text", "The last record, without a final newline: THE SOFTWARE IS PROVIDED \"AS IS\", WITHOUT "
                       "WARRANTY OF ANY KIND."}}.dump();
  return out;
}

// SFT records: conversations (system, user, assistant turns; a tool turn; an unknown role; no assistant turn)
// and prompt/response pairs.
std::string sft_jsonl() {
  auto turn = [](const char* role, const std::string& content) { return json{{"role", role}, {"content", content}}; };
  std::string out;
  for (int i = 0; i < 4; i++)
    out += json{{"messages", {turn("system", "You answer questions about licenses."),
                              turn("user", "Which license is document " + std::to_string(i) + " under?"),
                              turn("assistant", "  The Apache License, Version 2.0.\n\nSee the NOTICE file. caf\u00e9 "),
                              turn("user", "And may I redistribute it?"), turn("assistant", "Yes, with the notice.")}}}
               .dump() + "\n";
  out += json{{"messages", {turn("user", "Run it."), turn("ipython", "{\"ok\": true}"), turn("assistant", "Done.")}}}.dump() + "\n";
  out += json{{"messages", {turn("narrator", "Once upon a time"), turn("assistant", "...")}}}.dump() + "\n";
  out += json{{"messages", {turn("user", "No answer follows.")}}}.dump() + "\n";
  out += json{{"prompt", "What does the warranty cover?"}, {"response", "Nothing: THE SOFTWARE IS PROVIDED \"AS IS\"."}}.dump() + "\n";
  return out;
}

// Runs build/prepare's pipeline on one input file with the tiny tokenizer and reads back what it wrote: every
// document accounted for (prepare checks that itself), every shard readable with ids inside the vocabulary.
void prepare_one(const fs::path& input, const fs::path& tokenizer, const fs::path& out, bool sft) {
  PrepareOptions o;
  o.sft = sft;  // conversations rendered through Llama 3's chat format (the tokenizer has its special tokens)
  o.inputs = {input.string()};
  o.tokenizer_path = tokenizer.string();
  o.eos = "<|eot_id|>";  // the tiny tokenizer's file names no EOS, so prepare asks for one (--eos)
  o.out_dir = out.string();
  o.threads = 1;
  o.batch_records = 4;
  o.shard_tokens = 256;
  o.overwrite = true;
  o.quiet = true;
  o.val_fraction = 0.2;
  o.dedup_memory_bytes = 1 << 20;
  const PrepareReport r = prepare_corpus(o);
  uint64_t outcomes = 0;
  for (const Tally& t : r.outcome) outcomes += t.count;
  if (outcomes != r.documents_read) throw std::logic_error("prepare lost track of a document");
  for (const PrepareReport::Split* split : {&r.train, &r.val})
    for (const std::string& shard : split->shards) {
      ShardReader reader(shard);
      for (uint64_t d = 0; d < reader.document_count(); d++) (void)reader.document(d);
    }
}

// ---- readers --------------------------------------------------------------------------------------------------

struct Reader {
  std::string name;
  bool text;                                  // mutate as text (JSON, TOML) or as bytes
  std::vector<std::string> seeds;             // valid inputs
  std::function<void(const std::string&)> read;  // places the bytes where the reader reads them, and reads
  bool seeds_load = true;  // false: the seeds are refused past the parse (a tiktoken file not Llama 3's)
  int case_divisor = 1;    // runs --cases / case_divisor mutations (a reader that takes a fifth of a second a case)
  std::string (*mutate)(std::string, Rng&) = nullptr;  // a reader's own mutations, instead of text's or bytes'
};

std::vector<Reader> make_readers(const fs::path& work) {
  std::vector<Reader> readers;
  auto fixture = std::make_shared<CheckpointFixture>(work / "fixture");
  const fs::path case_dir = work / "case";

  readers.push_back({"safetensors", false, {safetensors_seed(work), read_bytes("tests/fixtures/llama32_tiny/model.safetensors")},
                     [case_dir](const std::string& bytes) {
                       write_bytes(case_dir / "x.safetensors", bytes);
                       read_every_tensor(SafetensorsFile(case_dir / "x.safetensors"));
                     }});

  {  // model.safetensors.index.json over two valid shards
    SafetensorsWriter a, b;
    const float one = 1, two = 2;
    a.add("x", DType::F32, {1}, &one);
    b.add("y", DType::F32, {1}, &two);
    fs::create_directories(work / "index");
    a.write(work / "index" / "model-00001-of-00002.safetensors");
    b.write(work / "index" / "model-00002-of-00002.safetensors");
    const std::string seed = json{{"metadata", {{"total_size", 8}}},
                                  {"weight_map", {{"x", "model-00001-of-00002.safetensors"},
                                                  {"y", "model-00002-of-00002.safetensors"}}}}.dump(2);
    readers.push_back({"hf_index", true, {seed}, [work](const std::string& bytes) {
                         write_bytes(work / "index" / "model.safetensors.index.json", bytes);
                         HfCheckpointDir dir(work / "index");
                         dir.verify();
                         for (const std::string& name : dir.tensor_names()) {
                           float out = 0;
                           dir.read_f32(name, {1}, &out);
                         }
                       }});
  }

  readers.push_back({"config", true, {kTinyConfig, read_bytes("tests/fixtures/llama2_tiny/config.json")},
                     [case_dir](const std::string& bytes) {
                       write_bytes(case_dir / "config.json", bytes);
                       const LlamaConfig c = LlamaConfig::load(case_dir.string());
                       const ParamLayout layout(c);
                       (void)model_flops_per_token(c, 16);
                     }});

  readers.push_back({"state", true, {read_bytes(fixture->single / "state.json")},
                     [case_dir](const std::string& bytes) {
                       const fs::path dir = case_dir / "step_00000006";
                       fs::create_directories(dir);
                       write_bytes(dir / "state.json", bytes);
                       const TrainingState s = read_training_state(dir);
                       check_optimizer_steps(s, 6, dir);
                       const LoaderCursor cursor = s.data_cursor.get<LoaderCursor>();
                       (void)cursor;
                       // Against the step, and resharded (products checked for overflow).
                       (void)resume_data_cursor(s, 1, dir);
                       (void)resume_data_cursor(s, 3, dir);
                     }});

  {  // the pieces metadata of rank 1 of a sharded checkpoint, as text, wrapped back into its rank file
    SafetensorsFile rank1(fixture->sharded / "rank_00001.safetensors");
    const std::string seed = json::parse(rank1.metadata().at("pieces")).dump(1);
    readers.push_back({"pieces", true, {seed}, [fixture, case_dir](const std::string& bytes) {
                         const fs::path dir = case_dir / "pieces" / "step_00000006";
                         copy_dir(fixture->sharded, dir);
                         {
                           SafetensorsFile src(fixture->sharded / "rank_00001.safetensors");
                           SafetensorsWriter w;
                           w.add_metadata("steps_taken", "6");
                           w.add_metadata("pieces", bytes);
                           for (const TensorInfo& t : src.tensors()) w.add(t.name, t.dtype, t.shape, src.data(t));
                           try {
                             w.write(dir / "rank_00001.safetensors");
                           } catch (const Error&) {
                             return;  // bytes that no JSON string holds (invalid UTF-8): no such file can exist
                           }
                         }
                         std::vector<float> p, m, v;
                         load_checkpoint_shard(dir, fixture->layout, fixture->whole, p, m, v);
                         std::vector<float> weights(fixture->layout.total());
                         load_weights(dir, fixture->layout, weights.data());
                       }});
  }

  readers.push_back({"rank_file", false, {read_bytes(fixture->sharded / "rank_00000.safetensors")},
                     [fixture, case_dir](const std::string& bytes) {
                       const fs::path dir = case_dir / "rank" / "step_00000006";
                       copy_dir(fixture->sharded, dir);
                       write_bytes(dir / "rank_00000.safetensors", bytes);
                       const std::string problem = verify_checkpoint(dir);  // the resume would stop here
                       std::vector<float> p, m, v;
                       load_checkpoint_shard(dir, fixture->layout, fixture->whole, p, m, v);  // eval, --init would not
                       if (!problem.empty()) throw Error(problem);
                     }});

  readers.push_back({"manifest", true, {read_bytes(fixture->single / kManifestFile)},
                     [fixture, case_dir](const std::string& bytes) {
                       const fs::path dir = case_dir / "manifest" / "step_00000006";
                       copy_dir(fixture->single, dir);
                       write_bytes(dir / kManifestFile, bytes);
                       bool unverified = false;
                       (void)verify_checkpoint(dir, 1, 2, &unverified);
                       // What eval, sample, --init and prepare check of a model directory.
                       try {
                         (void)verify_model_directory(dir, ModelFiles::Tokenizer);
                       } catch (const Error&) {
                       }
                       (void)verify_model_directory(dir, ModelFiles::Weights, 1, 2);
                       const std::string problem = verify_checkpoint(dir, 0, 1, &unverified);
                       if (!problem.empty()) throw Error(problem);
                     }});

  {  // out_dir/run.lock as another run (alive, dead or damaged) left it: refused naming it, or taken over
    const LockHolder me = this_process_holder();
    // The seed is a lock another host left an hour ago (its heartbeat long stale): valid, and taken over.
    const std::string seed = json{{"format", "tuna run lock"}, {"host", "node-7"}, {"boot_id", me.boot_id},
                                  {"pid", 4242}, {"job", ""}, {"started", me.started - 3600},
                                  {"heartbeat", me.heartbeat - 3600}}
                                 .dump();
    readers.push_back({"run_lock", true, {seed}, [case_dir](const std::string& bytes) {
                         const fs::path out = case_dir / "locked_run";
                         fs::create_directories(out);
                         write_bytes(out / kRunLockFile, bytes);
                         RunLock lock(out, [](const std::string&) {}, RunLock::Timing{3600, 120, 0.01});
                       }});
    // run.lock as something that is not a regular file ("kind:argument"): a symbolic link (dangling, to /dev/zero,
    // to a lock), a FIFO, a directory. Each must be refused at once: none may block, read without end or be
    // followed. Mutations pick another kind.
    static const char* const kKinds[] = {"symlink:nowhere", "symlink:/dev/zero", "symlink:lock", "fifo:", "directory:",
                                         "symlink:/proc/self/fd/0", "symlink:.", "symlink:"};
    readers.push_back({"run_lock_kind", true, {"regular:"}, [case_dir, seed](const std::string& bytes) {
                         const fs::path out = case_dir / "kind_run", lock = out / kRunLockFile;
                         fs::remove_all(out);
                         fs::create_directories(out);
                         const size_t colon = bytes.find(':');
                         const std::string kind = bytes.substr(0, colon),
                                           arg = colon == std::string::npos ? "" : bytes.substr(colon + 1);
                         if (kind == "regular") {
                           write_bytes(lock, seed);
                         } else if (kind == "symlink") {
                           if (arg == "lock") write_bytes(out / "elsewhere.lock", seed);
                           std::error_code ec;
                           fs::create_symlink(arg == "lock" ? fs::path("elsewhere.lock") : fs::path(arg), lock, ec);
                           if (ec) return;  // a name no link can have
                         } else if (kind == "fifo") {
                           if (::mkfifo(lock.c_str(), 0644) != 0) throw std::runtime_error("mkfifo failed");
                         } else if (kind == "directory") {
                           fs::create_directories(lock / arg);
                         } else {
                           return;  // not a kind: nothing to place
                         }
                         RunLock held(out, [](const std::string&) {}, RunLock::Timing{3600, 120, 0.01});
                       },
                       true, 8, [](std::string, Rng& rng) { return std::string(kKinds[rng.below(std::size(kKinds))]); }});
  }

  {  // a tuna LoRA checkpoint (PEFT's files, base_model.json, state.json; no manifest, so that a mutation reaches the
     // parsers instead of the checksum) on the llama2 fixture base, through the one rule of every LoRA reader
     // (ckpt/peft.h open_lora_checkpoint) and the merged weights eval and sample compute with
    const fs::path base = "tests/fixtures/llama2_tiny";
    const LlamaConfig config = LlamaConfig::load(base.string());
    const LoraConfig lora = read_peft_adapter_config("tests/fixtures/lora_llama2_tiny");
    const LoraLayout layout = lora_layout(config, lora);
    std::vector<float> adapters(layout.params.total());
    adapter_weights_from_peft("tests/fixtures/lora_llama2_tiny")(layout.params, Segment{0, layout.params.total()},
                                                                 adapters.data());
    const json config_json = read_config_json(base);
    const LoraFiles files = lora_files(lora, base, BaseQuant::Nf4);
    CheckpointContents contents{&config_json, adapters.data(), {}, json{{"step", 0}}, {}};
    contents.lora = &files;
    const fs::path lora_ckpt = save_checkpoint(work / "lora", 0, layout.params, contents, 0);
    fs::remove(lora_ckpt / kManifestFile);
    const auto read_lora = [lora_ckpt, case_dir](const char* name, const std::string& bytes) {
      const fs::path dir = case_dir / "lora" / "step_00000000";
      copy_dir(lora_ckpt, dir);
      write_bytes(dir / name, bytes);
      const LoraCheckpoint c = open_lora_checkpoint(dir, {});
      const ParamLayout model(c.base_config);
      std::vector<float> w(static_cast<size_t>(model.total()));
      merged_lora_weights(c.base, dir)(model, Segment{0, model.total()}, w.data());
    };
    readers.push_back({"lora_adapter_config", true, {read_bytes(lora_ckpt / kAdapterConfigFile)},
                       [read_lora](const std::string& bytes) { read_lora(kAdapterConfigFile, bytes); }});
    readers.push_back({"lora_base_record", true, {read_bytes(lora_ckpt / kBaseModelFile)},
                       [read_lora](const std::string& bytes) { read_lora(kBaseModelFile, bytes); }});
    readers.push_back({"lora_adapter_file", false, {read_bytes(lora_ckpt / kAdapterWeightsFile)},
                       [read_lora](const std::string& bytes) { read_lora(kAdapterWeightsFile, bytes); }});
  }

  {  // a token shard with a loss mask, read whole by the training and the evaluation loader
    fs::create_directories(work / "shard");
    ShardWriter w((work / "shard" / "seed.bin").string(), 32, /*with_mask=*/true);
    for (int d = 0; d < 5; d++) {
      std::vector<int32_t> tokens(3 + 5 * d);
      std::vector<uint8_t> mask(tokens.size());
      for (size_t i = 0; i < tokens.size(); i++) tokens[i] = static_cast<int32_t>((d * 7 + i) % 32), mask[i] = i % 3 != 0;
      w.add_document(tokens, mask);
    }
    w.finish();
    readers.push_back({"shard", false, {read_bytes(work / "shard" / "seed.bin")}, [case_dir](const std::string& bytes) {
                         const std::string path = (case_dir / "x.bin").string();
                         write_bytes(path, bytes);
                         for (bool eval : {false, true}) {
                           LoaderOptions o;
                           o.seq_len = 4, o.micro_batch = 2, o.vocab_size = 32, o.seed = 5, o.eval = eval;
                           DataLoader loader({path}, o);
                           std::vector<int32_t> in(8), tg(8), pos(8);
                           for (int b = 0; b < 40 && loader.next(in.data(), tg.data(), pos.data()); b++) {
                           }
                           const ShardReader& s = loader.shard(0);
                           for (uint64_t d = 0; d < s.document_count(); d++) (void)s.document(d);
                         }
                       }});
  }

  {  // a run.toml against options declared like the trainer's
    const std::string seed =
        "model_config = \"config.json\"\ntrain_data = \"data/train-*.bin\"\nseq_len = 16\nmicro_batch = 2\n"
        "steps = 100\nlr = 3e-4\nweight_decay = 0.1\ngrad_clip = 1.0\nschedule = \"cosine\"\ndevice = \"cpu\"\n"
        "zero = 1\nresume = true\ncomm_timeout = 300.0\n";
    readers.push_back({"toml", true, {seed}, [case_dir](const std::string& bytes) {
                         write_bytes(case_dir / "run.toml", bytes);
                         std::string model_config, train_data, schedule = "cosine", device = "auto";
                         int64_t seq_len = 1, micro_batch = 1, steps = 1, zero = 0;
                         double lr = 1e-3, weight_decay = 0, grad_clip = 1, comm_timeout = 300;
                         bool resume = false;
                         Options o("fuzz", "options like build/train's");
                         o.add("model_config", &model_config, "");
                         o.add("train_data", &train_data, "");
                         o.add("seq_len", &seq_len, "", Bounds::closed(1, 1 << 22));
                         o.add("micro_batch", &micro_batch, "", Bounds::closed(1, 1 << 22));
                         o.add("steps", &steps, "", Bounds::closed(1, 1e12));
                         o.add("lr", &lr, "", Bounds::open_closed(0, 1));
                         o.add("weight_decay", &weight_decay, "", Bounds::closed(0, 1e3));
                         o.add("grad_clip", &grad_clip, "", Bounds::closed(0, 1e12));
                         o.add("schedule", &schedule, "", {"cosine", "linear", "constant", "wsd"});
                         o.add("device", &device, "", {"auto", "cpu", "cuda"});
                         o.add("zero", &zero, "", Bounds::closed(0, 3));
                         o.add("resume", &resume, "");
                         o.add("comm_timeout", &comm_timeout, "", Bounds::closed(0, 1e9));
                         o.load_toml((case_dir / "run.toml").string());
                         Options back("fuzz", "round trip");  // what a checkpoint saves reads back
                         back.add("seq_len", &seq_len, "", Bounds::closed(1, 1 << 22));
                         back.from_json(json{{"seq_len", seq_len}}, "round trip");
                       }});
  }

  readers.push_back({"checkpoint_names", false, {"step_00000006"}, [fixture, case_dir](const std::string& bytes) {
                       (void)checkpoint_step(fs::path("ckpt") / bytes);
                       const std::string name(bytes.begin(), std::find(bytes.begin(), bytes.end(), '\0'));
                       if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") return;
                       const fs::path root = case_dir / "names";
                       std::error_code ec;  // a name the file system refuses (too long) is not the reader's case
                       fs::remove_all(root, ec);
                       if (!fs::create_directories(root / name, ec) || ec) return;
                       write_bytes(root / name / "state.json", "{\"step\": 6}");
                       (void)list_checkpoints(root);
                       (void)latest_checkpoint(root);
                     }});

  {  // tokenizer files: a tokenizer.json, the model config files that name its BOS/EOS, a tiktoken file, a
     // sentencepiece model; each loaded, then used (use_tokenizer)
    const fs::path tok = work / "tokenizer";
    fs::create_directories(tok / "bpe");
    const std::string tokenizer_json = tiny_tokenizer_json(true);
    write_bytes(tok / "bpe" / "tokenizer.json", tokenizer_json);
    readers.push_back({"tokenizer_json", true, {tokenizer_json, tiny_tokenizer_json(false)}, [case_dir](const std::string& bytes) {
                         fs::create_directories(case_dir / "tokenizer_json");
                         write_bytes(case_dir / "tokenizer_json" / "tokenizer.json", bytes);
                         use_tokenizer(Tokenizer((case_dir / "tokenizer_json" / "tokenizer.json").string()));
                       }, true, 1, mutate_tokenizer_json});
    const std::string tokenizer_config =
        json{{"bos_token", "<|begin_of_text|>"}, {"eos_token", {{"content", "<|eot_id|>"}, {"special", true}}},
             {"clean_up_tokenization_spaces", true}, {"model_max_length", 131072},
             {"tokenizer_class", "PreTrainedTokenizerFast"},
             {"chat_template", {{{"name", "default"}, {"template", "{{ '<|start_header_id|>' + role + '<|end_header_id|>' }}"}},
                                {{"name", "tool_use"}, {"template", "{{ '[INST]' }}"}}}}}.dump(2);
    readers.push_back({"tokenizer_config", true, {tokenizer_config}, [tok](const std::string& bytes) {
                         write_bytes(tok / "bpe" / "tokenizer_config.json", bytes);
                         const Tokenizer t((tok / "bpe").string());
                         use_tokenizer(t);
                         (void)resolve_chat_format(t, "auto");  // its chat_template
                       }});
    // The seed: the tiny model's config.json with the vocabulary of the tokenizer beside it (a smaller one is refused).
    json model_config = json::parse(kTinyConfig);
    model_config["vocab_size"] = Tokenizer((tok / "bpe" / "tokenizer.json").string()).vocab_size();
    readers.push_back({"tokenizer_model_config", true, {model_config.dump(2)}, [tok](const std::string& bytes) {
                         fs::remove(tok / "bpe" / "tokenizer_config.json");
                         write_bytes(tok / "bpe" / "config.json", bytes);
                         const Tokenizer t((tok / "bpe" / "tokenizer.json").string());
                         use_tokenizer(t);
                         std::string config;  // the model's vocab_size, as prepare and convert read it
                         if (const int64_t v = model_vocab_beside((tok / "bpe").string(), &config); v > 0)
                           (void)check_tokenizer_fits(t, v, config);
                       }});
    readers.push_back({"tiktoken", false, {tiny_tiktoken()}, [case_dir](const std::string& bytes) {
                         fs::create_directories(case_dir / "tiktoken");
                         write_bytes(case_dir / "tiktoken" / "tokenizer.model", bytes);
                         use_tokenizer(Tokenizer((case_dir / "tiktoken" / "tokenizer.model").string()));
                       }, /*seeds_load=*/false});
    {  // Llama 3's real ranks (tiktoken files of other vocabularies are refused) and the tokenizer_config.json whose
       // added_tokens_decoder names their special tokens
      fs::create_directories(tok / "llama3" / "original");
      write_bytes(tok / "llama3" / "original" / "tokenizer.model",
                  read_zstd("tests/fixtures/tokenizers/llama3/original/tokenizer.model.zst"));
      readers.push_back({"tiktoken_config", true, {read_zstd("tests/fixtures/tokenizers/llama3/tokenizer_config.json.zst")},
                         [tok](const std::string& bytes) {
                           write_bytes(tok / "llama3" / "tokenizer_config.json", bytes);
                           use_tokenizer(Tokenizer((tok / "llama3" / "original" / "tokenizer.model").string()));
                         }, true, /*case_divisor=*/10});
    }
    readers.push_back({"sentencepiece", false, {read_bytes("tests/fixtures/tokenizers/spm/tokenizer.model")},
                       [case_dir](const std::string& bytes) {
                         fs::create_directories(case_dir / "sentencepiece");
                         write_bytes(case_dir / "sentencepiece" / "tokenizer.model", bytes);
                         use_tokenizer(Tokenizer((case_dir / "sentencepiece" / "tokenizer.model").string()));
                       }, true, 1, mutate_sentencepiece});
  }

  {  // build/eval --tasks records: multiple-choice and generative lines of the lm-eval fixture, read strictly (a bad
     // record an error naming its line) and with --skip_bad_records, then tokenized as build/eval does
    const std::string fixture = "tests/fixtures/mc_eval";
    std::string seed;
    for (const char* file : {"tasks/four.jsonl", "tasks/fill.jsonl", "gen/tasks/stop.jsonl"}) {
      std::ifstream in(fixture + "/" + file, std::ios::binary);
      std::string line;
      for (int i = 0; i < 3 && std::getline(in, line); i++) seed += line + "\n";
    }
    auto tokenizer = std::make_shared<Tokenizer>(fixture);
    readers.push_back({"task_records", true, {seed}, [case_dir, tokenizer](const std::string& bytes) {
                         fs::create_directories(case_dir / "tasks");
                         const std::string path = (case_dir / "tasks" / "records.jsonl").string();
                         write_bytes(path, bytes);
                         try {
                           (void)read_mc_tasks({path}, /*skip_bad=*/false);
                         } catch (const Error&) {
                         }
                         const McTasks tasks = read_mc_tasks({path}, /*skip_bad=*/true);
                         int64_t truncated = 0;
                         (void)encode_mc_requests(tasks, *tokenizer, /*special_tokens=*/true, 64, &truncated);
                         (void)encode_gen_requests(tasks, gen_tokenizer(*tokenizer, {}, true), 1 << 20);
                       }});
  }

  {  // prepare's corpus inputs: a .jsonl (text mutations: records, lines, fields), and the same records as
     // .jsonl.gz and .jsonl.zst (byte mutations of the compressed streams), through the whole pipeline
    const fs::path tokenizer = work / "tokenizer" / "prepare" / "tokenizer.json";
    fs::create_directories(tokenizer.parent_path());
    write_bytes(tokenizer, tiny_tokenizer_json(true));
    const std::string jsonl = corpus_jsonl();
    struct Input {
      const char* reader;
      const char* file;
      std::string seed;
      bool sft;
    };
    const Input inputs[] = {{"prepare_jsonl", "in.jsonl", jsonl, false}, {"prepare_gz", "in.jsonl.gz", gzip(jsonl), false},
                            {"prepare_zst", "in.jsonl.zst", zstd(jsonl), false}, {"prepare_sft", "in.jsonl", sft_jsonl(), true}};
    for (const auto& [reader, name, seed, sft] : inputs) {
      const std::string file = name;
      readers.push_back({reader, file == "in.jsonl", {seed}, [case_dir, tokenizer, file, sft](const std::string& bytes) {
                           fs::create_directories(case_dir / "prepare_in");
                           write_bytes(case_dir / "prepare_in" / file, bytes);
                           prepare_one(case_dir / "prepare_in" / file, tokenizer, case_dir / "prepare_out", sft);
                           fs::remove(case_dir / "prepare_in" / file);
                         }, true, /*case_divisor=*/3});  // a tenth of a second a case, mostly fsyncs
    }
  }
  return readers;
}

// ---- the run ----------------------------------------------------------------------------------------------------

const char* g_reader = "";
long g_case = -1;

extern "C" void on_alarm(int) {
  char msg[256];
  const int n = std::snprintf(msg, sizeof msg, "\nFAIL: reader %s case %ld hangs (ran past --case_seconds)\n", g_reader, g_case);
  if (n > 0) (void)!::write(2, msg, static_cast<size_t>(n));
  ::_exit(3);
}

struct Counts {
  int cases = 0, errors = 0, valid = 0, failures = 0;
};

// Runs one input: true unless it ended in anything but a tuna::Error or a valid result.
bool run_case(const Reader& r, const std::string& bytes, const std::string& label, Counts& counts, bool must_be_valid) {
  counts.cases++;
  try {
    r.read(bytes);
    counts.valid++;
    return true;
  } catch (const Error& e) {
    counts.errors++;
    if (std::getenv("FUZZ_VERBOSE")) std::fprintf(stderr, "%s %s: %s\n", r.name.c_str(), label.c_str(), e.what());
    if (!must_be_valid) return true;
    std::fprintf(stderr, "FAIL: reader %s %s: a valid seed was refused: %s\n", r.name.c_str(), label.c_str(), e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: reader %s %s: %s instead of a tuna::Error: %s\n", r.name.c_str(), label.c_str(),
                 typeid(e).name(), e.what());
  } catch (...) {
    std::fprintf(stderr, "FAIL: reader %s %s: a non-standard exception\n", r.name.c_str(), label.c_str());
  }
  counts.failures++;
  return false;
}

std::string mutated_input(const Reader& r, uint64_t seed, long k) {
  Rng rng{seed * 0x100000001b3ull ^ std::hash<std::string>{}(r.name) ^ static_cast<uint64_t>(k) * 0x9e3779b97f4a7c15ull};
  std::string bytes = r.seeds[rng.below(r.seeds.size())];
  for (int m = 0, rounds = 1 + static_cast<int>(rng.below(3)); m < rounds; m++)
    bytes = r.mutate ? r.mutate(std::move(bytes), rng)
            : r.text ? mutate_text(std::move(bytes), rng) : mutate_bytes(std::move(bytes), rng);
  return bytes;
}

}  // namespace

int main(int argc, char** argv) {
  long cases = 300, only_case = -1;
  uint64_t seed = 1;
  unsigned case_seconds = 30;
  std::string only, corpus = "tests/fuzz/corpus", dump, dump_seeds;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--cases") cases = std::stol(value);
    else if (flag == "--seed") seed = std::stoull(value);
    else if (flag == "--reader") only = value;
    else if (flag == "--case") only_case = std::stol(value);
    else if (flag == "--corpus") corpus = value;
    else if (flag == "--dump") dump = value;
    else if (flag == "--case_seconds") case_seconds = static_cast<unsigned>(std::stoul(value));
    else if (flag == "--dump_seeds") dump_seeds = value;
    else {
      std::fprintf(stderr, "usage: fuzz_readers [--cases N] [--seed S] [--reader R [--case K [--dump FILE]]] "
                           "[--corpus DIR] [--case_seconds T] [--dump_seeds DIR]\n");
      return 2;
    }
  }
  std::signal(SIGALRM, on_alarm);
  char tmpl[] = "/tmp/tuna_fuzz_XXXXXX";
  const fs::path work = ::mkdtemp(tmpl);
  fs::create_directories(work / "case");
  int failures = 0;
  try {
    for (const Reader& r : make_readers(work)) {
      if (!only.empty() && r.name != only) continue;
      g_reader = r.name.c_str();
      if (!dump_seeds.empty()) {  // the valid inputs, to start a regression case from
        fs::create_directories(fs::path(dump_seeds) / r.name);
        for (size_t i = 0; i < r.seeds.size(); i++) write_bytes(fs::path(dump_seeds) / r.name / ("seed_" + std::to_string(i)), r.seeds[i]);
        continue;
      }
      Counts counts;
      if (only_case < 0) {
        std::vector<fs::path> regressions;
        std::error_code ec;
        for (fs::directory_iterator it(fs::path(corpus) / r.name, ec), end; !ec && it != end; it.increment(ec))
          regressions.push_back(it->path());
        std::sort(regressions.begin(), regressions.end());
        for (const fs::path& p : regressions) {
          alarm(case_seconds);
          run_case(r, read_bytes(p), "corpus " + p.filename().string(), counts, false);
        }
        for (size_t s = 0; s < r.seeds.size(); s++) {
          alarm(case_seconds);
          run_case(r, r.seeds[s], "seed " + std::to_string(s), counts, r.seeds_load);
        }
      }
      const long reader_cases = std::max<long>(1, cases / r.case_divisor);
      for (long k = only_case < 0 ? 0 : only_case; k < (only_case < 0 ? reader_cases : only_case + 1); k++) {
        g_case = k;
        const std::string bytes = mutated_input(r, seed, k);
        if (!dump.empty()) write_bytes(dump, bytes);
        alarm(case_seconds);
        if (!run_case(r, bytes, "case " + std::to_string(k), counts, false))
          std::fprintf(stderr, "  reproduce: build/fuzz_readers --seed %llu --reader %s --case %ld --dump input.bin\n",
                       static_cast<unsigned long long>(seed), r.name.c_str(), k);
      }
      alarm(0);
      g_case = -1;
      std::printf("%-17s %5d cases: %5d clean errors, %5d valid, %d failures\n", r.name.c_str(), counts.cases,
                  counts.errors, counts.valid, counts.failures);
      std::fflush(stdout);
      failures += counts.failures;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: the harness itself: %s\n", e.what());
    failures++;
  }
  std::error_code ec;
  fs::remove_all(work, ec);
  std::printf("fuzz: %s (seed %llu, %ld mutated cases per reader)\n", failures ? "FAILED" : "passed",
              static_cast<unsigned long long>(seed), cases);
  return failures ? 1 : 0;
}
