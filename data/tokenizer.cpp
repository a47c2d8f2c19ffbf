// Tokenizer: the format of a file recognized by content, a model directory's tokenizer found, BOS/EOS from
// the model's config, the vocabulary fingerprint; and CachedEncoder's per-thread segment cache.
#include "data/tokenizer.h"

#include <xxhash.h>

#include <atomic>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"
#include "data/tokenizer_impl.h"

namespace tuna {

namespace fs = std::filesystem;

const char* format_name(TokenizerFormat format) {
  switch (format) {
    case TokenizerFormat::sentencepiece: return "sentencepiece";
    case TokenizerFormat::hf_bpe: return "Hugging Face BPE";
    case TokenizerFormat::tiktoken: return "tiktoken BPE";
  }
  return "?";
}

namespace {

// Names a model directory's tokenizer files take (checkpoints, exports), and the model config files that
// travel with them.
const char* const kTokenizerModel = "tokenizer.model";
const char* const kTokenizerJson = "tokenizer.json";

enum class Sniffed { json, tiktoken, other };

// The format a file's first bytes suggest: JSON starts with '{'; a tiktoken file's first line is
// "base64 rank"; anything else may be a sentencepiece model (a protobuf).
Sniffed sniff(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("tokenizer ", path, ": cannot open");
  std::string head(4096, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(in.gcount()));
  if (head.starts_with("\xEF\xBB\xBF")) head.erase(0, 3);
  const size_t first = head.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && head[first] == '{') return Sniffed::json;
  const size_t end = head.find('\n');
  const std::string line = head.substr(0, end == std::string::npos ? head.size() : end);
  const size_t space = line.find(' ');
  if (space != std::string::npos && space > 0 &&
      line.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=") == space &&
      line.find_first_not_of("0123456789\r", space + 1) == std::string::npos && space + 1 < line.size())
    return Sniffed::tiktoken;
  return Sniffed::other;
}

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// The tokenizer file of a model directory (see Tokenizer::load).
std::string find_in_directory(const fs::path& dir) {
  const fs::path model = dir / kTokenizerModel, json = dir / kTokenizerJson, original = dir / "original" / kTokenizerModel;
  // What transformers' AutoTokenizer reads: the fast tokenizer.json, even beside a sentencepiece tokenizer.model.
  if (is_file(json)) return json.string();
  if (is_file(model)) return model.string();
  if (is_file(original)) return original.string();
  fail("tokenizer ", dir.string(), ": the directory holds no tokenizer (looked for tokenizer.model, tokenizer.json, "
       "original/tokenizer.model)");
}

// A file or a directory, resolved to the tokenizer file.
std::string resolve(const std::string& path) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec || !fs::exists(status)) fail("tokenizer ", path, ": no such file or directory");
  if (fs::is_directory(status)) return find_in_directory(path);
  if (!fs::is_regular_file(status)) fail("tokenizer ", path, ": not a regular file");
  return path;
}

std::unique_ptr<TokenizerImpl> load_file(const std::string& path) {
  switch (sniff(path)) {
    case Sniffed::json: return load_tokenizer_json(path);
    case Sniffed::tiktoken: return load_tiktoken(path);
    case Sniffed::other: break;
  }
  try {
    return load_sentencepiece(path);
  } catch (const Error& e) {
    fail("tokenizer ", path, ": not a tokenizer in any format tuna reads: not a Hugging Face tokenizer.json (it does "
         "not start with '{'), not tiktoken BPE ranks (its first line is not 'base64 rank'), and not a sentencepiece "
         "model (", e.what(), ")");
  }
}

// BOS and EOS as the model's config names them (see Tokenizer::load).
void ids_from_model_config(const std::string& path, const TokenizerImpl& impl, int32_t* bos, int32_t* eos) {
  *bos = impl.default_bos();
  *eos = impl.default_eos();
  bool bos_set = false, eos_set = false;
  const std::string tokenizer_config = model_config_file(path, "tokenizer_config.json");
  if (!tokenizer_config.empty()) {
    const nlohmann::json c = read_json_file(tokenizer_config, tokenizer_config);  // core/json.h: bounded
    auto token = [&](const char* key, int32_t* id, bool* set) {
      if (!c.is_object() || !c.contains(key)) return;
      const nlohmann::json& v = c[key];
      if (v.is_null()) {
        *id = -1, *set = true;
        return;
      }
      std::string name;
      if (v.is_string()) name = v.get<std::string>();
      else if (v.is_object() && v.contains("content") && v["content"].is_string()) name = v["content"].get<std::string>();
      else fail(tokenizer_config, ": field '", key, "': expected a token (a string), found ", v.dump());
      *id = impl.token_id(name);
      if (*id < 0) fail(tokenizer_config, ": field '", key, "': '", name, "' is not a token of ", path);
      *set = true;
    };
    token("bos_token", bos, &bos_set);
    token("eos_token", eos, &eos_set);
  }
  const std::string config = model_config_file(path, "config.json");
  if ((!bos_set || !eos_set) && !config.empty()) {
    const nlohmann::json c = read_json_file(config, config);
    auto id_of = [&](const char* key, int32_t* id, bool set) {
      if (set || !c.is_object() || !c.contains(key) || c[key].is_null()) return;
      const nlohmann::json& v = c[key].is_array() && !c[key].empty() ? c[key][0] : c[key];
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= impl.vocab_size())
        fail(config, ": field '", key, "': expected a token id below ", impl.vocab_size(), ", found ", c[key].dump());
      *id = static_cast<int32_t>(v.get<int64_t>());
    };
    id_of("bos_token_id", bos, bos_set);
    id_of("eos_token_id", eos, eos_set);
  }
}

uint64_t vocabulary_fingerprint(const TokenizerImpl& impl) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  for (int32_t id = 0; id < impl.vocab_size(); ++id) {
    const uint8_t kind = static_cast<uint8_t>(impl.kind(id));
    const std::string text = impl.token_text(id);
    const uint32_t size = static_cast<uint32_t>(text.size());
    XXH3_64bits_update(state, &kind, 1);
    XXH3_64bits_update(state, &size, sizeof size);
    XXH3_64bits_update(state, text.data(), text.size());
  }
  const uint64_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return h;
}

}  // namespace

std::string model_config_file(const std::string& tokenizer_path, const char* name) {
  const fs::path dir = fs::path(tokenizer_path).parent_path();
  if (is_file(dir / name)) return (dir / name).string();
  if (dir.filename() == "original" && is_file(dir.parent_path() / name)) return (dir.parent_path() / name).string();
  return {};
}

Tokenizer::Tokenizer() = default;
Tokenizer::Tokenizer(const std::string& path) { load(path); }
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

void Tokenizer::load(const std::string& path) {
  const std::string file = resolve(path);
  std::unique_ptr<TokenizerImpl> impl = load_file(file);
  if (impl->vocab_size() <= 0) fail("tokenizer ", file, ": the vocabulary is empty");
  int32_t bos, eos;
  ids_from_model_config(file, *impl, &bos, &eos);
  fingerprint_ = vocabulary_fingerprint(*impl);
  impl_ = std::move(impl);
  bos_ = bos, eos_ = eos;
}

const std::string& Tokenizer::path() const {
  TUNA_CHECK(impl_, "tokenizer not loaded");
  return impl_->path();
}
TokenizerFormat Tokenizer::format() const {
  TUNA_CHECK(impl_, "tokenizer not loaded");
  return impl_->format();
}
std::string Tokenizer::describe() const {
  return str(path(), " (", format_name(format()), ", ", vocab_size(), " tokens)");
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, SpecialTokens specials) const {
  TUNA_CHECK(impl_, "encode on a tokenizer that is not loaded");
  std::vector<int32_t> ids;
  impl_->encode(text, specials, &ids);
  return ids;
}

std::vector<int32_t> Tokenizer::encode_continuation(std::string_view text) const {
  TUNA_CHECK(impl_, "encode on a tokenizer that is not loaded");
  std::vector<int32_t> ids;
  impl_->encode_continuation(text, &ids);
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  TUNA_CHECK(impl_, "decode on a tokenizer that is not loaded");
  const int32_t vocab = vocab_size();
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      fail("tokenizer ", path(), ": cannot decode id ", ids[i], " at position ", i,
           ": outside the vocabulary [0, ", vocab, ")");
  return impl_->decode(ids);
}

int32_t Tokenizer::vocab_size() const {
  TUNA_CHECK(impl_, "tokenizer not loaded");
  return impl_->vocab_size();
}
int32_t Tokenizer::bos_id() const {
  TUNA_CHECK(impl_, "tokenizer not loaded");
  return bos_;
}
int32_t Tokenizer::eos_id() const {
  TUNA_CHECK(impl_, "tokenizer not loaded");
  return eos_;
}
int32_t Tokenizer::unk_id() const {
  TUNA_CHECK(impl_, "tokenizer not loaded");
  return impl_->unk_id();
}
int32_t Tokenizer::pad_id() const {
  TUNA_CHECK(impl_, "tokenizer not loaded");
  return impl_->pad_id();
}
int32_t Tokenizer::token_id(std::string_view text) const {
  TUNA_CHECK(impl_, "tokenizer not loaded");
  return impl_->token_id(text);
}
std::string Tokenizer::piece(int32_t id) const {
  TUNA_CHECK(impl_, "tokenizer not loaded");
  if (id < 0 || id >= vocab_size())
    fail("tokenizer ", path(), ": id ", id, " is outside the vocabulary [0, ", vocab_size(), ")");
  return impl_->token_text(id);
}
uint64_t Tokenizer::fingerprint() const {
  TUNA_CHECK(impl_, "tokenizer not loaded");
  return fingerprint_;
}

// ---------------------------------------------------------------------------------------------------
// The files of a tokenizer

bool has_tokenizer(const fs::path& dir) {
  return is_file(dir / kTokenizerModel) || is_file(dir / kTokenizerJson) || is_file(dir / "original" / kTokenizerModel);
}

std::vector<TokenizerFile> tokenizer_files(const std::string& path, bool allow_none, Tokenizer* loaded) {
  std::error_code ec;
  if (allow_none && fs::is_directory(path, ec) && !has_tokenizer(path)) return {};
  Tokenizer local;
  Tokenizer& tokenizer = loaded ? *loaded : local;
  tokenizer.load(path);  // exists and parses, or fails here
  const std::string& file = tokenizer.path();
  const std::string name = tokenizer.format() == TokenizerFormat::hf_bpe ? kTokenizerJson : kTokenizerModel;
  std::vector<TokenizerFile> files = {{file, name}};
  auto add = [&](const fs::path& source, const std::string& as) {
    for (const TokenizerFile& f : files)
      if (f.name == as) return;
    files.push_back({source, as});
  };
  if (fs::is_directory(path, ec)) {
    for (const char* carried : kTokenizerFileNames)
      if (is_file(fs::path(path) / carried)) add(fs::path(path) / carried, carried);
  }
  for (const char* config : {"tokenizer_config.json", "special_tokens_map.json"}) {
    const std::string found = model_config_file(file, config);
    if (!found.empty()) add(found, config);
  }
  return files;
}

std::string check_tokenizer_fits(const Tokenizer& tokenizer, int64_t model_vocab_size, const std::string& model) {
  const int64_t ids = tokenizer.vocab_size();
  if (ids <= model_vocab_size) return "";
  std::vector<int32_t> refused, allowed;
  for (int64_t id = model_vocab_size; id < ids; id++) {
    const bool special = tokenizer.impl().kind(static_cast<int32_t>(id)) == TokenKind::special;
    const bool framing = id == tokenizer.bos_id() || id == tokenizer.eos_id();
    (special && !framing ? allowed : refused).push_back(static_cast<int32_t>(id));
  }
  const auto name = [&](const std::vector<int32_t>& list) {
    std::string out;
    for (size_t i = 0; i < list.size() && i < 4; i++)
      out += str(i ? ", " : "", list[i], " ", tokenizer.piece(list[i]));
    return out + (list.size() > 4 ? str(", ... (", list.size(), " in all)") : std::string());
  };
  if (!refused.empty())
    fail("tokenizer ", tokenizer.path(), ": ", ids, " ids, more than the model's vocab_size ", model_vocab_size, " (",
         model, "); ids ", name(refused),
         " would appear in encoded text but have no embedding. Use the model's own tokenizer (another model's?), or "
         "remove those tokens from the tokenizer's added_tokens");
  return str("tokenizer ", tokenizer.path(), ": ", allowed.size(), " special token(s) at or above the model's vocab_size ",
             model_vocab_size, " (", model, "): ", name(allowed),
             ". They have no embedding: documents encode them as plain text, and a prompt that names one is refused");
}

int64_t model_vocab_beside(const std::string& tokenizer_path, std::string* config_path) {
  std::error_code ec;
  const std::string config = fs::is_directory(tokenizer_path, ec)
                                 ? (is_file(fs::path(tokenizer_path) / "config.json") ? (fs::path(tokenizer_path) / "config.json").string() : "")
                                 : model_config_file(tokenizer_path, "config.json");
  if (config.empty()) return 0;
  const nlohmann::json j = read_json_file(config, "model config");
  if (!j.is_object() || !j.contains("vocab_size")) return 0;  // not a model's config: nothing to compare with
  if (config_path) *config_path = config;
  return json_int(j, "vocab_size", config, 1, int64_t{1} << 26);
}

void check_ids_fit(const Tokenizer& tokenizer, std::span<const int32_t> ids, int64_t model_vocab_size,
                   const std::string& what) {
  for (int32_t id : ids)
    if (id < 0 || id >= model_vocab_size)
      fail(what, ": token ", id, " (", tokenizer.piece(id), ") is at or above the model's vocab_size ", model_vocab_size,
           ": the model has no embedding for it");
}

ModelTokenizer model_tokenizer(const std::string& named, const std::string& model_dir, int64_t model_vocab_size) {
  ModelTokenizer m;
  Tokenizer tokenizer;
  std::error_code ec;
  if (!named.empty()) {
    m.files = tokenizer_files(named, /*allow_none=*/false, &tokenizer);
  } else if (!model_dir.empty() && fs::is_directory(model_dir, ec) && has_tokenizer(model_dir)) {
    try {
      m.files = tokenizer_files(model_dir, /*allow_none=*/false, &tokenizer);
    } catch (const Error& e) {
      // A tokenizer tuna cannot read still travels with the model; shards are then not checked against it.
      for (const char* name : kTokenizerFileNames)
        if (is_file(fs::path(model_dir) / name)) m.files.push_back({fs::path(model_dir) / name, name});
      m.description = str(model_dir, " (not read)");
      m.note = str("the tokenizer of ", model_dir, " is carried into checkpoints but not read, so shards are not "
                   "checked against it: ", e.what());
      return m;
    }
  } else {
    m.description = "none (checkpoints carry no tokenizer)";
    return m;
  }
  m.note = check_tokenizer_fits(tokenizer, model_vocab_size, "the model's config.json");
  m.fingerprint = tokenizer.fingerprint();
  m.description = tokenizer.describe();
  return m;
}

void copy_tokenizer_files(const std::vector<TokenizerFile>& files, const fs::path& dir) {
  for (const TokenizerFile& f : files) {
    std::error_code ec;
    fs::copy_file(f.source, dir / f.name, fs::copy_options::overwrite_existing, ec);
    if (ec) fail(f.source.string(), ": cannot copy to ", (dir / f.name).string(), ": ", ec.message());
  }
}

// ---------------------------------------------------------------------------------------------------
// CachedEncoder

namespace {

std::atomic<uint64_t> next_encoder_id{1};
constexpr size_t kMaxCachedSegmentBytes = 64;  // longer segments (URLs, rules of dashes) skip the cache

// Segment -> ids, open addressing over one arena of keys and one of ids: a lookup is a hash, a probe and a
// memcmp, and nothing is allocated per segment.
class SegmentCache {
 public:
  void reset(uint64_t owner) {
    owner_ = owner;
    clear();
  }
  uint64_t owner() const { return owner_; }
  size_t size() const { return entries_.size(); }
  void clear() {
    slots_.assign(4096, 0);
    entries_.clear();
    keys_.clear();
    ids_.clear();
  }
  // The ids of key, or null.
  const int32_t* find(std::string_view key, uint64_t hash, uint32_t* count) const {
    const size_t mask = slots_.size() - 1;
    for (size_t i = hash & mask;; i = (i + 1) & mask) {
      const uint32_t slot = slots_[i];
      if (slot == 0) return nullptr;
      const Entry& e = entries_[slot - 1];
      if (e.hash == hash && e.key_size == key.size() && std::memcmp(keys_.data() + e.key_at, key.data(), key.size()) == 0) {
        *count = e.ids_size;
        return ids_.data() + e.ids_at;
      }
    }
  }
  void insert(std::string_view key, uint64_t hash, const int32_t* ids, size_t count) {
    if ((entries_.size() + 1) * 2 > slots_.size()) grow();
    entries_.push_back({hash, static_cast<uint32_t>(keys_.size()), static_cast<uint32_t>(key.size()),
                        static_cast<uint32_t>(ids_.size()), static_cast<uint32_t>(count)});
    keys_.append(key);
    ids_.insert(ids_.end(), ids, ids + count);
    place(static_cast<uint32_t>(entries_.size()));
  }

 private:
  struct Entry {
    uint64_t hash;
    uint32_t key_at, key_size, ids_at, ids_size;
  };
  void place(uint32_t slot) {
    const size_t mask = slots_.size() - 1;
    size_t i = entries_[slot - 1].hash & mask;
    while (slots_[i] != 0) i = (i + 1) & mask;
    slots_[i] = slot;
  }
  void grow() {
    slots_.assign(slots_.size() * 2, 0);
    for (uint32_t s = 1; s <= entries_.size(); ++s) place(s);
  }
  uint64_t owner_ = 0;
  std::vector<uint32_t> slots_ = std::vector<uint32_t>(4096, 0);
  std::vector<Entry> entries_;
  std::string keys_;
  std::vector<int32_t> ids_;
};

}  // namespace

CachedEncoder::CachedEncoder(const Tokenizer& tokenizer, size_t max_words_per_thread)
    : tokenizer_(&tokenizer), max_words_(std::max<size_t>(1, max_words_per_thread)), id_(next_encoder_id++) {
  for (char c : tokenizer.impl().missing_bytes()) dropped_[static_cast<uint8_t>(c)] = drops_ = true;
}

bool CachedEncoder::exact() const { return tokenizer_->impl().segments_exact(); }
const char* CachedEncoder::segment_encoder() const { return tokenizer_->impl().segment_encoder(); }

void CachedEncoder::encode(std::string_view text, std::vector<int32_t>* out, SpecialTokens specials,
                           uint64_t* dropped_bytes) const {
  const TokenizerImpl& impl = tokenizer_->impl();
  if (!impl.segments_exact()) {
    impl.encode(text, specials, out);
    return;
  }
  thread_local SegmentCache cache;
  if (cache.owner() != id_) cache.reset(id_);
  const bool count = dropped_bytes && drops_;
  impl.segment(
      text, specials,
      [&](std::string_view segment) {
        if (count)  // segments are the bytes the model sees (after normalization and pre-tokenization)
          for (char c : segment) *dropped_bytes += dropped_[static_cast<uint8_t>(c)];
        if (segment.size() > kMaxCachedSegmentBytes) {
          impl.encode_segment(segment, out);
          return;
        }
        const uint64_t hash = XXH3_64bits(segment.data(), segment.size());
        uint32_t count;
        if (const int32_t* ids = cache.find(segment, hash, &count)) {
          out->insert(out->end(), ids, ids + count);
          return;
        }
        const size_t before = out->size();
        impl.encode_segment(segment, out);
        if (cache.size() >= max_words_) cache.clear();  // bounded: start over rather than grow
        cache.insert(segment, hash, out->data() + before, out->size() - before);
      },
      [&](int32_t id) { out->push_back(id); });
}

std::vector<int32_t> CachedEncoder::encode_by_words(std::string_view text) const {
  const TokenizerImpl& impl = tokenizer_->impl();
  std::vector<int32_t> out;
  if (!impl.segments_exact()) {
    impl.encode(text, SpecialTokens::as_text, &out);
    return out;
  }
  impl.segment(
      text, SpecialTokens::as_text, [&](std::string_view segment) { impl.encode_segment(segment, &out); },
      [&](int32_t id) { out.push_back(id); });
  return out;
}

}  // namespace tuna
