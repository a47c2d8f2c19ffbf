// Byte-level BPE: see data/byte_bpe.h.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "data/byte_bpe.h"

#include <pcre2.h>
#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <bit>
#include <tuple>
#include <climits>
#include <cstring>
#include <queue>

#include "core/error.h"
#include "data/clean.h"  // is_valid_utf8
#include "data/tokenizer.h"
#include "data/bpe_text.h"  // Regex, Event, the split behaviours, the decoders
#include "data/unicode.h"

namespace tuna {

const char* const kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

void TokenIndex::reserve(size_t count) {
  size_t capacity = 16;
  while (capacity < count * 2) capacity *= 2;
  if (capacity <= slots_.size()) return;
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(capacity, Slot{});
  size_ = 0;
  for (const Slot& s : old)
    if (s.id >= 0) insert(std::string_view(s.data, s.length), s.id);
}

void TokenIndex::grow() { reserve(std::max<size_t>(16, slots_.size())); }

bool TokenIndex::insert(std::string_view text, int32_t id) {
  if ((size_ + 1) * 2 > slots_.size()) grow();
  const uint64_t hash = XXH3_64bits(text.data(), text.size());
  const size_t mask = slots_.size() - 1;
  for (size_t i = hash & mask;; i = (i + 1) & mask) {
    Slot& s = slots_[i];
    if (s.id < 0) {
      s = {hash, text.data(), static_cast<uint32_t>(text.size()), id};
      ++size_;
      return true;
    }
    if (s.hash == hash && s.length == text.size() && std::memcmp(s.data, text.data(), text.size()) == 0) return false;
  }
}

int32_t TokenIndex::find(std::string_view text) const {
  if (slots_.empty()) return -1;
  const uint64_t hash = XXH3_64bits(text.data(), text.size());
  const size_t mask = slots_.size() - 1;
  for (size_t i = hash & mask;; i = (i + 1) & mask) {
    const Slot& s = slots_[i];
    if (s.id < 0) return -1;
    if (s.hash == hash && s.length == text.size() && std::memcmp(s.data, text.data(), text.size()) == 0) return s.id;
  }
}

namespace {

using namespace bpe_text;  // Regex, Event, char_events, apply_behavior, replace_all, decode_step

// --- The byte-level alphabet.

struct ByteLevelAlphabet {
  static constexpr uint32_t kCodePoints = 256 + 68;  // the highest code point used is U+0143
  std::array<uint32_t, 256> code_point{};           // byte -> code point
  std::array<int16_t, kCodePoints> byte{};          // code point -> byte, -1 outside the alphabet
  ByteLevelAlphabet() {
    byte.fill(-1);
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      code_point[b] = printable ? b : next++;
      byte[code_point[b]] = static_cast<int16_t>(b);
    }
  }
};
const ByteLevelAlphabet& alphabet() {
  static const ByteLevelAlphabet a;
  return a;
}

// --- Merge ranks: (left, right) -> (rank, merged id), open addressing.

class PairTable {
 public:
  void build(const std::vector<ByteBpeModel::Merge>& merges) {
    size_t capacity = 16;
    while (capacity < merges.size() * 2) capacity *= 2;
    slots_.assign(capacity, Slot{});
    mask_ = capacity - 1;
    shift_ = 64 - std::countr_zero(capacity);
    for (const ByteBpeModel::Merge& m : merges) {
      Slot& s = find_slot(key(m.left, m.right));
      s.key = key(m.left, m.right);
      s.rank = m.rank;  // a pair listed twice takes its last rank, as Hugging Face's does
      s.merged = m.merged;
    }
  }
  // The rank of merging left and right (INT32_MAX: they do not merge) and the merged id.
  int32_t rank(int32_t left, int32_t right, int32_t* merged) const {
    const Slot& s = find_slot(key(left, right));
    *merged = s.merged;
    return s.key == kEmpty ? INT32_MAX : s.rank;
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  struct Slot {
    uint64_t key = kEmpty;
    int32_t rank = INT32_MAX;
    int32_t merged = -1;
  };
  static uint64_t key(int32_t l, int32_t r) { return (uint64_t(uint32_t(l)) << 32) | uint32_t(r); }
  const Slot& find_slot(uint64_t k) const {
    // The product's top bits: every bit of both ids reaches them (low bits would hash the right id alone).
    size_t i = (k * 0x9E3779B97F4A7C15ull) >> shift_;
    while (slots_[i].key != kEmpty && slots_[i].key != k) i = (i + 1) & mask_;
    return slots_[i];
  }
  Slot& find_slot(uint64_t k) { return const_cast<Slot&>(static_cast<const PairTable*>(this)->find_slot(k)); }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  int shift_ = 60;
};

// --- The tokenizer.

// Per-thread scratch of the pre-tokenizer, one per step (a step's pieces are views into its own buffers while the
// next steps run on them).
struct StepScratch {
  std::string text, mapped;
  std::vector<Event> events;
};

bool starts_with_word(std::string_view s) {
  if (s.empty()) return false;
  size_t i = 0;
  return unicode::is_word(unicode::next_code_point(s, &i));
}
bool ends_with_word(std::string_view s) {
  if (s.empty()) return false;
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) --i;
  return unicode::is_word(unicode::next_code_point(s, &i));
}
// Where the whitespace that ends s begins, and where the whitespace that starts s ends.
size_t trailing_space_start(std::string_view s) {
  size_t start = s.size();
  while (start > 0) {
    size_t i = start - 1;
    while (i > 0 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) --i;
    size_t j = i;
    if (!unicode::is_whitespace(unicode::next_code_point(s, &j))) break;
    start = i;
  }
  return start;
}
size_t leading_space_end(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    size_t j = i;
    if (!unicode::is_whitespace(unicode::next_code_point(s, &j))) break;
    i = j;
  }
  return i;
}

class ByteBpeTokenizer final : public TokenizerImpl {
 public:
  explicit ByteBpeTokenizer(ByteBpeModel model) : m_(std::move(model)) {
    const std::string& path = m_.path;
    const size_t n = m_.vocab.size();
    TUNA_CHECK(m_.in_vocab.size() == n, "vocab and in_vocab differ in size");
    kinds_.assign(n, TokenKind::unused);
    for (size_t id = 0; id < n; ++id)
      if (m_.in_vocab[id]) kinds_[id] = TokenKind::normal;
    // The model's own strings: what the char engine, ignore_merges and byte fallback look up.
    model_index_.reserve(n);
    for (size_t id = 0; id < n; ++id)
      if (m_.in_vocab[id] && !model_index_.insert(m_.vocab[id], static_cast<int32_t>(id)))
        fail("tokenizer ", path, ": tokens ", model_index_.find(m_.vocab[id]), " and ", id, " have the same text");

    // The byte engine: a ByteLevel pre-tokenizer, no subword decorations, the vocabulary's strings read as bytes.
    int byte_level_steps = 0;
    for (const PreTokenizerStep& p : m_.pre_tokenizers) byte_level_steps += p.kind == PreTokenizerStep::Kind::byte_level;
    byte_engine_ = byte_level_steps == 1 && m_.continuing_subword_prefix.empty() && m_.end_of_word_suffix.empty();
    if (byte_engine_) {
      bytes_.assign(n, std::string());
      decodable_.assign(n, false);
      byte_index_.reserve(n);
      for (size_t id = 0; id < n; ++id) {
        // A vocabulary entry outside the alphabet (a token with a space in it) is reached only as an added token.
        if (!m_.in_vocab[id] || !byte_level_decode(m_.vocab[id], &bytes_[id])) continue;
        decodable_[id] = true;
        byte_index_.insert(bytes_[id], static_cast<int32_t>(id));
      }
      for (int b = 0; b < 256; ++b) {
        const char c = static_cast<char>(b);
        byte_token_[b] = byte_index_.find(std::string_view(&c, 1));
        any_missing_byte_ |= byte_token_[b] < 0;
      }
    }
    for (int b = 0; b < 256; ++b) {
      char code[8];
      std::snprintf(code, sizeof code, "<0x%02X>", b);
      fallback_[b] = m_.byte_fallback ? model_index_.find(code) : -1;
    }
    // A byte without a token is dropped unless byte fallback or the unk token stands for it (initial_symbols).
    if (byte_engine_ && m_.unk < 0)
      for (int b = 0; b < 256; ++b) {
        if (byte_token_[b] >= 0) continue;
        const char c = static_cast<char>(b);
        bool fallback = m_.byte_fallback;
        for (char u : byte_level_encode(std::string_view(&c, 1))) fallback &= fallback_[static_cast<uint8_t>(u)] >= 0;
        if (!fallback) missing_bytes_.push_back(c);
      }

    // Added tokens: an id the vocabulary also holds keeps its vocabulary entry for merges; text and kind are the
    // added token's.
    added_text_.resize(n);
    for (AddedToken& a : m_.added) {
      if (a.content.empty()) fail("tokenizer ", path, ": added token ", a.id, " is empty");
      kinds_[a.id] = a.special ? TokenKind::special : TokenKind::added;
      named_.insert(a.content, a.id);
      // What decode sees: the normalized form of a normalized token (the library's simple_id_to_token).
      std::string decoded = a.normalized && !m_.normalizers.empty() ? normalize(a.content) : a.content;
      added_text_[a.id] = {true, decoded, a.content};
      Matcher& mt = a.normalized ? normalized_added_ : raw_added_;
      mt.tokens.push_back({a.normalized ? decoded : a.content, &a});
    }
    raw_added_.build();
    normalized_added_.build();

    pairs_.build(m_.merges);
    // The list is kept for a GGUF export, in rank order: tokenizer.json's as the file orders it; tiktoken's (every
    // split of a token into two tokens, at the token's rank) by rank, then left and right rank, the order Hugging
    // Face's conversion of a tiktoken file writes (Llama 3's tokenizer.json lists exactly that).
    if (m_.format == TokenizerFormat::hf_bpe)
      std::stable_sort(m_.merges.begin(), m_.merges.end(),
                       [](const ByteBpeModel::Merge& a, const ByteBpeModel::Merge& b) { return a.rank < b.rank; });
    else
      std::sort(m_.merges.begin(), m_.merges.end(), [](const ByteBpeModel::Merge& a, const ByteBpeModel::Merge& b) {
        return std::tie(a.rank, a.left, a.right) < std::tie(b.rank, b.left, b.right);
      });
    m_.merges.shrink_to_fit();

    // Regexes, compiled once.
    for (size_t k = 0; k < m_.normalizers.size(); ++k)
      normalizer_regex_.push_back(m_.normalizers[k].kind == NormalizerStep::Kind::replace
                                      ? std::make_unique<Regex>(m_.normalizers[k].pattern, path, "normalizer Replace")
                                      : nullptr);
    for (size_t k = 0; k < m_.pre_tokenizers.size(); ++k) {
      const PreTokenizerStep& p = m_.pre_tokenizers[k];
      std::unique_ptr<Regex> r;
      if (p.kind == PreTokenizerStep::Kind::split) r = std::make_unique<Regex>(p.pattern, path, "pre_tokenizer Split");
      if (p.kind == PreTokenizerStep::Kind::byte_level && p.use_regex)
        r = std::make_unique<Regex>(TextPattern{true, kGpt2Pattern}, path, "pre_tokenizer ByteLevel");
      pre_regex_.push_back(std::move(r));
    }
    for (const DecoderStep& d : m_.decoders)
      decoder_regex_.push_back(d.kind == DecoderStep::Kind::replace ? std::make_unique<Regex>(d.pattern, path, "decoder Replace")
                                                                      : nullptr);
    prepare_cuts();
  }

  TokenizerFormat format() const override { return m_.format; }
  const std::string& path() const override { return m_.path; }

  void encode(std::string_view text, SpecialTokens specials, std::vector<int32_t>* out) const override {
    segment(text, specials, [&](std::string_view s) { encode_segment(s, out); },
            [&](int32_t id) { out->push_back(id); });
  }

  bool segments_exact() const override { return true; }
  const char* segment_encoder() const override {
    return byte_engine_ ? "tuna's byte-level BPE" : "tuna's BPE over the model's strings";
  }

  void segment(std::string_view text, SpecialTokens specials, const std::function<void(std::string_view)>& on_text,
               const std::function<void(int32_t)>& on_token) const override {
    if (!is_valid_utf8(text)) fail("tokenizer ", m_.path, ": cannot encode text that is not valid UTF-8");
    const bool parse = specials == SpecialTokens::parse;
    // 1. Added tokens matched in the text as written; 2. the rest normalized, normalized added tokens matched in
    // it; 3. pre-tokenized.
    split_added(raw_added_, text, parse, on_token, [&](std::string_view piece, size_t offset) {
      if (m_.normalizers.empty()) {
        split_added(normalized_added_, piece, parse, on_token, [&](std::string_view part, size_t at) {
          pre_tokenize(part, offset == 0 && at == 0, on_text);
        });
        return;
      }
      const std::string normalized = normalize(piece);
      split_added(normalized_added_, normalized, parse, on_token, [&](std::string_view part, size_t at) {
        pre_tokenize(part, offset == 0 && at == 0, on_text);
      });
    });
  }

  void encode_segment(std::string_view piece, std::vector<int32_t>* out) const override {
    if (piece.empty()) return;
    if (m_.ignore_merges) {
      const int32_t id = byte_engine_ ? byte_index_.find(piece) : model_index_.find(piece);
      if (id >= 0) {
        out->push_back(id);
        return;
      }
    }
    if (byte_engine_ && !any_missing_byte_) {
      if (piece.size() == 1) {
        out->push_back(byte_token_[static_cast<uint8_t>(piece[0])]);
        return;
      }
      if (piece.size() <= kShortPiece) {
        int32_t ids[kShortPiece];
        for (size_t i = 0; i < piece.size(); ++i) ids[i] = byte_token_[static_cast<uint8_t>(piece[i])];
        merge_short(ids, piece.size(), out);
        return;
      }
    }
    thread_local std::vector<int32_t> symbols;
    symbols.clear();
    initial_symbols(piece, &symbols);
    if (symbols.size() <= kShortPiece) {
      int32_t ids[kShortPiece];
      std::copy(symbols.begin(), symbols.end(), ids);
      merge_short(ids, symbols.size(), out);
    } else {
      merge_long(symbols, out);
    }
  }

  std::string decode(std::span<const int32_t> ids) const override {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (int32_t id : ids) {
      if (added_text_[id].added) tokens.push_back(added_text_[id].decoded);
      else if (m_.in_vocab[id]) tokens.push_back(m_.vocab[id]);
    }
    if (!m_.has_decoder) {
      std::string joined;
      for (size_t i = 0; i < tokens.size(); ++i) joined += (i ? " " : "") + tokens[i];
      return joined;
    }
    for (size_t k = 0; k < m_.decoders.size(); ++k)
      tokens = decode_step(m_.decoders[k], decoder_regex_[k].get(), std::move(tokens));
    std::string text;
    for (const std::string& t : tokens) text += t;
    return text;
  }
  int32_t vocab_size() const override { return static_cast<int32_t>(m_.vocab.size()); }
  int32_t token_id(std::string_view text) const override {
    const int32_t named = named_.find(text);
    if (named >= 0) return named;
    return byte_engine_ ? byte_index_.find(text) : model_index_.find(text);
  }
  TokenKind kind(int32_t id) const override { return kinds_[id]; }
  std::string token_text(int32_t id) const override {
    if (added_text_[id].added) return added_text_[id].content;
    if (byte_engine_ && decodable_[id]) return bytes_[id];
    return m_.vocab[id];
  }
  int32_t default_bos() const override { return m_.bos; }
  int32_t default_eos() const override { return m_.eos; }
  int32_t unk_id() const override { return m_.unk; }
  std::vector<std::pair<int32_t, int32_t>> merge_list() const override {
    std::vector<std::pair<int32_t, int32_t>> list;
    list.reserve(m_.merges.size());
    for (const ByteBpeModel::Merge& m : m_.merges) list.emplace_back(m.left, m.right);
    return list;
  }
  std::string missing_bytes() const override { return missing_bytes_; }
  const ByteBpeModel* bpe_model() const override { return &m_; }

 private:
  static constexpr size_t kShortPiece = 48;  // longer pieces merge through a heap (n log n)

  struct Pattern {
    std::string text;  // what is matched: the content, or for a normalized token its normalized form
    const AddedToken* token;
  };
  // The added tokens of one kind (matched in the text as written, or in normalized text) in a byte trie: the
  // longest token at a position is found in as many steps as it has bytes, however many tokens there are (a model
  // with thousands of added tokens that share a first byte, "<extra_id_N>", costs what one with three does).
  struct Matcher {
    std::vector<Pattern> tokens;
    // Node 0 is the root; a node's children are edges[first, first + count), sorted by byte.
    struct Node {
      uint32_t first = 0, count = 0;
      int32_t token = -1;  // index into tokens of the token that ends here
    };
    struct Edge {
      uint8_t byte;
      uint32_t node;
    };
    std::vector<Node> nodes;
    std::vector<Edge> edges;
    std::array<int32_t, 256> root{};  // the root's child per first byte, -1: no token starts with it

    void build() {
      std::erase_if(tokens, [](const Pattern& p) { return p.text.empty(); });
      // Children as lists while building; two tokens with one text: the first listed is matched, as before.
      std::vector<std::vector<std::pair<uint8_t, uint32_t>>> children(1);
      std::vector<int32_t> ends(1, -1);
      for (size_t t = 0; t < tokens.size(); ++t) {
        uint32_t node = 0;
        for (char c : tokens[t].text) {
          const uint8_t b = static_cast<uint8_t>(c);
          auto& kids = children[node];
          auto it = std::find_if(kids.begin(), kids.end(), [&](const auto& e) { return e.first == b; });
          if (it != kids.end()) {
            node = it->second;
            continue;
          }
          const uint32_t child = static_cast<uint32_t>(children.size());
          kids.emplace_back(b, child);
          children.emplace_back();
          ends.push_back(-1);
          node = child;
        }
        if (ends[node] < 0) ends[node] = static_cast<int32_t>(t);
      }
      nodes.assign(children.size(), Node{});
      edges.clear();
      for (size_t n = 0; n < children.size(); ++n) {
        auto& kids = children[n];
        std::sort(kids.begin(), kids.end());
        nodes[n] = {static_cast<uint32_t>(edges.size()), static_cast<uint32_t>(kids.size()), ends[n]};
        for (const auto& [b, child] : kids) edges.push_back({b, child});
      }
      root.fill(-1);
      for (const auto& [b, child] : children[0]) root[b] = static_cast<int32_t>(child);
    }
    // The longest token that text[at...] starts with, or null.
    const Pattern* longest(std::string_view text, size_t at) const {
      int32_t node = root[static_cast<uint8_t>(text[at])];
      const Pattern* found = nullptr;
      for (size_t i = at + 1;; ++i) {
        if (nodes[node].token >= 0) found = &tokens[nodes[node].token];
        if (i == text.size() || nodes[node].count == 0) return found;
        const Edge* begin = edges.data() + nodes[node].first;
        const Edge* end = begin + nodes[node].count;
        const uint8_t b = static_cast<uint8_t>(text[i]);
        const Edge* e = std::lower_bound(begin, end, b, [](const Edge& x, uint8_t v) { return x.byte < v; });
        if (e == end || e->byte != b) return found;
        node = static_cast<int32_t>(e->node);
      }
    }
  };

  // The library's AddedVocabulary::find_matches over one stretch of text: on_text(piece, offset) for the text
  // between tokens, on_token(id) for each token.
  template <typename OnText>
  void split_added(const Matcher& mt, std::string_view text, bool parse, const std::function<void(int32_t)>& on_token,
                   OnText&& on_text) const {
    size_t start_offset = 0;
    if (!mt.tokens.empty()) {
      for (size_t i = 0; i < text.size();) {
        if (mt.root[static_cast<uint8_t>(text[i])] < 0) {
          ++i;
          continue;
        }
        const Pattern* found = mt.longest(text, i);
        if (!found) {
          ++i;
          continue;
        }
        size_t start = i, stop = i + found->text.size();
        i = stop;  // the search goes on after this match, whether it is kept or not
        const AddedToken& a = *found->token;
        if (a.special && !parse) continue;
        if (a.single_word) {
          const bool start_space = start == 0 || !ends_with_word(text.substr(0, start));
          const bool stop_space = stop == text.size() || !starts_with_word(text.substr(stop));
          if (!start_space || !stop_space) continue;
        }
        if (a.lstrip) start = std::max(trailing_space_start(text.substr(0, start)), start_offset);
        if (a.rstrip) stop += leading_space_end(text.substr(stop));
        if (start_offset < start) on_text(text.substr(start_offset, start - start_offset), start_offset);
        on_token(a.id);
        start_offset = stop;
      }
    }
    if (start_offset < text.size()) on_text(text.substr(start_offset), start_offset);
  }

  std::string normalize(std::string_view text) const {
    std::string s(text);
    for (size_t k = 0; k < m_.normalizers.size(); ++k) {
      const NormalizerStep& n = m_.normalizers[k];
      using K = NormalizerStep::Kind;
      switch (n.kind) {
        case K::nfc: s = unicode::normalize(s, unicode::NormalForm::nfc); break;
        case K::nfd: s = unicode::normalize(s, unicode::NormalForm::nfd); break;
        case K::nfkc: s = unicode::normalize(s, unicode::NormalForm::nfkc); break;
        case K::nfkd: s = unicode::normalize(s, unicode::NormalForm::nfkd); break;
        case K::lowercase: s = unicode::lowercase(s); break;
        case K::replace: s = replace_all(*normalizer_regex_[k], s, n.content); break;
        case K::prepend:
          if (!s.empty()) s = n.content + s;
          break;
        case K::strip: {
          const size_t begin = n.left ? leading_space_end(s) : 0;
          const size_t end = n.right ? std::max(begin, trailing_space_start(s)) : s.size();
          s = s.substr(begin, end - begin);
          break;
        }
        case K::strip_accents: {
          std::string kept;
          for (size_t i = 0; i < s.size();) {
            const size_t at = i;
            if (!unicode::is_combining_mark(unicode::next_code_point(s, &i))) kept.append(s, at, i - at);
          }
          s = std::move(kept);
          break;
        }
        case K::byte_level: s = byte_level_encode(s); break;
      }
    }
    return s;
  }

  void pre_tokenize(std::string_view text, bool first, const std::function<void(std::string_view)>& on_text) const {
    if (text.empty()) return;
    thread_local std::vector<StepScratch> scratch;
    if (scratch.size() < m_.pre_tokenizers.size() + 1) scratch.resize(m_.pre_tokenizers.size() + 1);
    run_step(0, text, first, false, scratch, on_text);
  }

  // Step k on one piece; `first`: the piece starts the text (Metaspace's prepend_scheme "first"); `mapped`: the
  // piece is in the byte-level alphabet (a ByteLevel step ran and another step followed it).
  void run_step(size_t k, std::string_view piece, bool first, bool mapped, std::vector<StepScratch>& scratch,
                const std::function<void(std::string_view)>& on_text) const {
    if (piece.empty()) return;
    if (k == m_.pre_tokenizers.size()) {
      if (byte_engine_ && mapped) {  // back to the bytes the byte engine works on
        std::string& bytes = scratch[k].text;
        byte_level_decode(piece, &bytes);
        on_text(bytes);
      } else {
        cut_piece(piece, on_text);
      }
      return;
    }
    const PreTokenizerStep& p = m_.pre_tokenizers[k];
    StepScratch& s = scratch[k];
    auto next = [&](std::string_view part, bool part_first) { run_step(k + 1, part, part_first, mapped, scratch, on_text); };
    auto pieces = [&](std::string_view text) {  // the kept events of s.events, each to the next step
      for (const Event& e : s.events)
        if (e.end > e.begin) next(text.substr(e.begin, e.end - e.begin), first && e.begin == 0);
    };
    using K = PreTokenizerStep::Kind;
    switch (p.kind) {
      case K::split:
        pre_regex_[k]->events(piece, &s.events);
        if (p.invert)
          for (Event& e : s.events) e.match = !e.match;
        apply_behavior(p.behavior, &s.events);
        pieces(piece);
        return;
      case K::digits:
        char_events(piece, unicode::is_numeric, &s.events);
        apply_behavior(p.individual_digits ? SplitBehavior::isolated : SplitBehavior::contiguous, &s.events);
        pieces(piece);
        return;
      case K::punctuation:
        char_events(piece, unicode::is_punctuation, &s.events);
        apply_behavior(p.behavior, &s.events);
        pieces(piece);
        return;
      case K::whitespace_split:
        char_events(piece, unicode::is_whitespace, &s.events);
        apply_behavior(SplitBehavior::removed, &s.events);
        pieces(piece);
        return;
      case K::whitespace: {
        // Invert(\w+|[^\w\s]+), Removed: runs of word characters and runs of other non-space characters.
        s.events.clear();
        size_t run = 0;
        int run_class = -1;  // 0 word, 1 other
        for (size_t i = 0; i < piece.size();) {
          const size_t at = i;
          const uint32_t cp = unicode::next_code_point(piece, &i);
          const int c = unicode::is_word(cp) ? 0 : unicode::is_whitespace(cp) ? -1 : 1;
          if (c != run_class) {
            if (run_class >= 0) s.events.push_back({run, at, false});
            run = at;
            run_class = c;
          }
        }
        if (run_class >= 0) s.events.push_back({run, piece.size(), false});
        pieces(piece);
        return;
      }
      case K::metaspace: {
        std::string& t = s.text;
        t.clear();
        for (char c : piece) {
          if (c == ' ') t += p.replacement;
          else t.push_back(c);
        }
        const bool starts = t.compare(0, p.replacement.size(), p.replacement) == 0;
        if (!starts && (p.prepend == PreTokenizerStep::Prepend::always ||
                        (p.prepend == PreTokenizerStep::Prepend::first && first)))
          t.insert(0, p.replacement);
        if (!p.split) {
          next(t, first);
          return;
        }
        s.events.clear();
        size_t last = 0;
        for (size_t at = t.find(p.replacement); at != std::string::npos; at = t.find(p.replacement, at + p.replacement.size())) {
          if (last < at) s.events.push_back({last, at, false});
          s.events.push_back({at, at + p.replacement.size(), true});
          last = at + p.replacement.size();
        }
        if (last < t.size()) s.events.push_back({last, t.size(), false});
        apply_behavior(SplitBehavior::merged_with_next, &s.events);
        pieces(t);
        return;
      }
      case K::byte_level: {
        std::string_view text = piece;
        if (p.add_prefix_space && piece[0] != ' ') {
          s.text.assign(" ").append(piece);
          text = s.text;
        }
        const bool last = k + 1 == m_.pre_tokenizers.size();
        auto emit = [&](std::string_view part, bool part_first) {
          if (byte_engine_ && last) {
            on_text(part);  // the byte engine's symbols are the bytes themselves
            return;
          }
          std::string& mapped_text = s.mapped;
          mapped_text = byte_level_encode(part);
          run_step(k + 1, mapped_text, part_first, true, scratch, on_text);
        };
        if (!p.use_regex) {
          emit(text, first);
          return;
        }
        // Isolated: every match and every stretch between matches is a piece.
        size_t prev = 0;
        pre_regex_[k]->matches(text, [&](size_t begin, size_t end) {
          if (prev < begin) emit(text.substr(prev, begin - prev), first && prev == 0);
          if (end > begin) emit(text.substr(begin, end - begin), first && begin == 0);
          prev = end;
        });
        if (prev < text.size()) emit(text.substr(prev), first && prev == 0);
        return;
      }
    }
  }

  // Cuts inside a piece, for the word cache. A pipeline that does not split words (Metaspace with split false, or a
  // Replace of " " by "▁" and no pre-tokenizer, the sentencepiece-style tokenizer.json of LLaMA-2-family models)
  // hands the model whole documents as one piece; but BPE merges only adjacent symbols into tokens of the
  // vocabulary, so two runs of a piece encode independently where no token of the vocabulary spans the point
  // between them (sentencepiece is cut the same way, data/sentencepiece_tokenizer.cpp). Checked on the vocabulary at
  // load, for the model's own strings:
  //   - before a word mark ("▁", the Metaspace replacement) that follows another character, when no token has the
  //     mark after a character other than the mark;
  //   - where a run of newlines starts and ends, when no token holds a newline beside another character.
  // fuse_unk would join an unknown character on each side of a cut into one unk token: then the character that
  // starts the right side (the mark, a newline) must be known. The byte engine's pieces come from regexes that
  // already split words, and are not cut.
  void prepare_cuts() {
    if (byte_engine_ || !m_.continuing_subword_prefix.empty() || !m_.end_of_word_suffix.empty()) return;
    for (const PreTokenizerStep& p : m_.pre_tokenizers)
      if (p.kind == PreTokenizerStep::Kind::metaspace) cut_mark_ = p.replacement;
    if (cut_mark_.empty() && m_.pre_tokenizers.empty())
      for (const NormalizerStep& n : m_.normalizers)
        if (n.kind == NormalizerStep::Kind::replace && !n.pattern.regex && n.pattern.text == " ") cut_mark_ = n.content;
    // One character (the library's Metaspace replacement is a char).
    size_t end = 0;
    if (!cut_mark_.empty()) unicode::next_code_point(cut_mark_, &end);
    bool words = !cut_mark_.empty() && end == cut_mark_.size(), newlines = true;
    for (size_t id = 0; id < m_.vocab.size() && (words || newlines); ++id) {
      if (!m_.in_vocab[id]) continue;
      const std::string& t = m_.vocab[id];
      if (words) {
        size_t lead = 0;
        while (t.compare(lead, cut_mark_.size(), cut_mark_) == 0) lead += cut_mark_.size();
        if (t.find(cut_mark_, lead) != std::string::npos) words = false;
      }
      if (newlines && t.find('\n') != std::string::npos && t.find_first_not_of('\n') != std::string::npos) newlines = false;
    }
    if (m_.fuse_unk && m_.unk >= 0) {
      auto known = [&](std::string_view ch) {
        if (model_index_.find(ch) >= 0) return true;
        if (!m_.byte_fallback) return false;
        for (char c : ch)
          if (fallback_[static_cast<uint8_t>(c)] < 0) return false;
        return true;
      };
      words = words && known(cut_mark_);
      newlines = newlines && known("\n");
    }
    if (!words && !newlines) return;
    // The rule above, checked: probes cut and whole give the same ids.
    std::vector<int32_t> whole, parts;
    for (const char* probe : {"Hello world", "a  b c", "x\ny z.\n\nNext para", " lead", "trail ", "\nstarts with a newline",
                              " \n \n ", "ends with newlines\n\n", "The  quick\tbrown fox, 1234.56 (b) \xC3\xBC" "ber",
                              "\xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x98\x80 caf\xC3\xA9 \xE2\x96\x81lit\xE2\x96\x81 \xE2\x96\x81",
                              "\tctrl\x01\x7F here\r\nCRLF  \x04\x05 \x06"}) {
      whole.clear();
      parts.clear();
      cut_words_ = cut_newlines_ = false;
      encode(probe, SpecialTokens{}, &whole);
      cut_words_ = words;
      cut_newlines_ = newlines;
      encode(probe, SpecialTokens{}, &parts);
      if (whole != parts) {
        cut_words_ = cut_newlines_ = false;
        return;
      }
    }
  }

  void cut_piece(std::string_view piece, const std::function<void(std::string_view)>& on_text) const {
    if (!cut_words_ && !cut_newlines_) {
      on_text(piece);
      return;
    }
    const std::string_view mark = cut_mark_;
    size_t start = 0;
    for (size_t i = 1; i < piece.size(); ++i) {
      const char c = piece[i], prev = piece[i - 1];
      const bool cut = (cut_newlines_ && (c == '\n') != (prev == '\n')) ||
                       (cut_words_ && c == mark[0] && piece.compare(i, mark.size(), mark) == 0 &&
                        !(i >= mark.size() && piece.compare(i - mark.size(), mark.size(), mark) == 0));
      if (!cut) continue;
      on_text(piece.substr(start, i - start));
      start = i;
    }
    on_text(piece.substr(start));
  }

  // The symbols a piece starts as (the library's BPE::merge_word): each character (each byte, for the byte
  // engine) is its token; an unknown one becomes the <0xNN> tokens of its bytes (byte_fallback), else the unk token
  // (consecutive ones fused with fuse_unk), else nothing.
  void initial_symbols(std::string_view piece, std::vector<int32_t>* symbols) const {
    int32_t pending_unk = -1;
    auto known = [&](int32_t id) {
      if (pending_unk >= 0) symbols->push_back(pending_unk), pending_unk = -1;
      symbols->push_back(id);
    };
    auto unknown = [&](std::string_view unit) {
      if (m_.byte_fallback) {
        bool all = true;
        for (char c : unit) all &= fallback_[static_cast<uint8_t>(c)] >= 0;
        if (all) {
          for (char c : unit) symbols->push_back(fallback_[static_cast<uint8_t>(c)]);
          return;
        }
      }
      if (m_.unk < 0) return;
      if (pending_unk >= 0 && !m_.fuse_unk) symbols->push_back(pending_unk);
      pending_unk = m_.unk;
    };
    if (byte_engine_) {
      for (char c : piece) {
        const int32_t id = byte_token_[static_cast<uint8_t>(c)];
        if (id >= 0) known(id);
        else unknown(byte_level_encode(std::string_view(&c, 1)));
      }
    } else {
      thread_local std::string unit;
      for (size_t i = 0; i < piece.size();) {
        const size_t at = i;
        unicode::next_code_point(piece, &i);
        const std::string_view ch = piece.substr(at, i - at);
        std::string_view key = ch;
        if ((at > 0 && !m_.continuing_subword_prefix.empty()) || (i == piece.size() && !m_.end_of_word_suffix.empty())) {
          unit.clear();
          if (at > 0) unit += m_.continuing_subword_prefix;
          unit += ch;
          if (i == piece.size()) unit += m_.end_of_word_suffix;
          key = unit;
        }
        const int32_t id = model_index_.find(key);
        if (id >= 0) known(id);
        else unknown(key);
      }
    }
    if (pending_unk >= 0) symbols->push_back(pending_unk);
  }

  // Short pieces: the ids and the rank of each adjacent pair in arrays; each merge rescans for the lowest
  // rank (leftmost on ties) and updates the two pairs it touched.
  void merge_short(int32_t* ids, size_t n, std::vector<int32_t>* out) const {
    int32_t ranks[kShortPiece], merged[kShortPiece];
    for (size_t i = 0; i + 1 < n; ++i) ranks[i] = pairs_.rank(ids[i], ids[i + 1], &merged[i]);
    size_t size = n;
    while (size > 1) {
      size_t best = 0;
      for (size_t i = 1; i + 1 < size; ++i)
        if (ranks[i] < ranks[best]) best = i;
      if (ranks[best] == INT32_MAX) break;
      ids[best] = merged[best];
      for (size_t i = best + 1; i + 1 < size; ++i) ids[i] = ids[i + 1];
      for (size_t i = best + 1; i + 2 < size; ++i) ranks[i] = ranks[i + 1], merged[i] = merged[i + 1];
      --size;
      if (best > 0) ranks[best - 1] = pairs_.rank(ids[best - 1], ids[best], &merged[best - 1]);
      if (best + 1 < size) ranks[best] = pairs_.rank(ids[best], ids[best + 1], &merged[best]);
    }
    out->insert(out->end(), ids, ids + size);
  }

  // Long pieces: a doubly linked list of symbols and a min-heap of candidate merges ordered by (rank,
  // position); an entry is stale when either symbol has changed since it was pushed. Pops in the same order
  // as merge_short's rescans.
  void merge_long(const std::vector<int32_t>& initial, std::vector<int32_t>* out) const {
    const int32_t n = static_cast<int32_t>(initial.size());
    if (n == 0) return;
    struct Symbol {
      int32_t id, prev, next;
      bool alive;
    };
    struct Candidate {
      int32_t rank, pos, left, right, merged;
      bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::vector<Symbol> sym(n);
    for (int32_t i = 0; i < n; ++i) sym[i] = {initial[i], i - 1, i + 1 < n ? i + 1 : -1, true};
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
    auto push = [&](int32_t pos) {
      const int32_t next = sym[pos].next;
      if (next < 0) return;
      int32_t merged;
      const int32_t rank = pairs_.rank(sym[pos].id, sym[next].id, &merged);
      if (rank != INT32_MAX) heap.push({rank, pos, sym[pos].id, sym[next].id, merged});
    };
    for (int32_t i = 0; i + 1 < n; ++i) push(i);
    while (!heap.empty()) {
      const Candidate c = heap.top();
      heap.pop();
      const int32_t next = sym[c.pos].next;
      if (!sym[c.pos].alive || next < 0 || sym[c.pos].id != c.left || sym[next].id != c.right) continue;
      sym[c.pos].id = c.merged;
      sym[next].alive = false;
      sym[c.pos].next = sym[next].next;
      if (sym[next].next >= 0) sym[sym[next].next].prev = c.pos;
      if (sym[c.pos].prev >= 0) push(sym[c.pos].prev);
      push(c.pos);
    }
    for (int32_t i = 0; i >= 0; i = sym[i].next) out->push_back(sym[i].id);
  }

  ByteBpeModel m_;
  std::vector<TokenKind> kinds_;
  TokenIndex model_index_;  // the model's string -> id of every vocabulary entry
  TokenIndex named_;        // added token content -> id
  struct Added {
    bool added = false;
    std::string decoded, content;  // what decode sees (the normalized form of a normalized token), the content
  };
  std::vector<Added> added_text_;
  bool byte_engine_ = false;
  std::vector<std::string> bytes_;  // byte engine: id -> bytes of a vocabulary entry
  std::vector<bool> decodable_;     // byte engine: the entry is in the byte-level alphabet
  TokenIndex byte_index_;           // byte engine: bytes -> id
  std::array<int32_t, 256> byte_token_{};
  std::string missing_bytes_;  // byte engine: bytes the model drops (no token, no fallback, no unk)
  bool any_missing_byte_ = false;
  std::array<int32_t, 256> fallback_{};  // <0xNN> ids (byte_fallback)
  PairTable pairs_;
  Matcher raw_added_, normalized_added_;
  std::string cut_mark_;                            // the word mark pieces are cut before (prepare_cuts)
  bool cut_words_ = false, cut_newlines_ = false;  // where pieces are cut
  std::vector<std::unique_ptr<Regex>> normalizer_regex_, pre_regex_, decoder_regex_;
};

}  // namespace

void check_token_id_space(int64_t ids, int64_t defined, const std::string& path, const char* field) {
  if (ids - defined > kMaxUnusedTokenIds)
    fail("tokenizer ", path, ": ", field, " define ", defined, " tokens but name ids up to ", ids - 1,
         ": more than ", kMaxUnusedTokenIds, " ids would have no token");
}

std::string describe_pipeline(const ByteBpeModel& m) {
  using N = NormalizerStep::Kind;
  using P = PreTokenizerStep::Kind;
  auto normalizer = [](N k) {
    switch (k) {
      case N::nfc: return "NFC";
      case N::nfd: return "NFD";
      case N::nfkc: return "NFKC";
      case N::nfkd: return "NFKD";
      case N::lowercase: return "Lowercase";
      case N::replace: return "Replace";
      case N::prepend: return "Prepend";
      case N::strip: return "Strip";
      case N::strip_accents: return "StripAccents";
      case N::byte_level: return "ByteLevel";
    }
    return "?";
  };
  auto pre = [](P k) {
    switch (k) {
      case P::split: return "Split";
      case P::byte_level: return "ByteLevel";
      case P::digits: return "Digits";
      case P::metaspace: return "Metaspace";
      case P::whitespace: return "Whitespace";
      case P::whitespace_split: return "WhitespaceSplit";
      case P::punctuation: return "Punctuation";
    }
    return "?";
  };
  std::string out = "normalizer ";
  for (size_t i = 0; i < m.normalizers.size(); ++i) out += str(i ? ", " : "", normalizer(m.normalizers[i].kind));
  if (m.normalizers.empty()) out += "none";
  out += "; pre_tokenizer ";
  for (size_t i = 0; i < m.pre_tokenizers.size(); ++i) out += str(i ? ", " : "", pre(m.pre_tokenizers[i].kind));
  if (m.pre_tokenizers.empty()) out += "none";
  if (m.byte_fallback) out += "; BPE with byte_fallback";
  return out;
}

std::unique_ptr<TokenizerImpl> make_byte_bpe(ByteBpeModel model) {
  return std::make_unique<ByteBpeTokenizer>(std::move(model));
}

std::string byte_level_encode(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) unicode::append_utf8(alphabet().code_point[static_cast<uint8_t>(c)], &out);
  return out;
}

bool byte_level_decode(std::string_view text, std::string* bytes) {
  bytes->clear();
  const auto& table = alphabet().byte;
  for (size_t i = 0; i < text.size();) {
    const uint8_t c = static_cast<uint8_t>(text[i]);
    uint32_t cp;
    size_t len;
    if (c < 0x80) cp = c, len = 1;
    else if ((c & 0xE0) == 0xC0) cp = c & 0x1F, len = 2;
    else if ((c & 0xF0) == 0xE0) cp = c & 0x0F, len = 3;
    else return false;  // every code point of the alphabet is below U+0800... U+0143 at most
    if (i + len > text.size()) return false;
    for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<uint8_t>(text[i + k]) & 0x3F);
    if (cp >= ByteLevelAlphabet::kCodePoints || table[cp] < 0) return false;
    bytes->push_back(static_cast<char>(table[cp]));
    i += len;
  }
  return true;
}

}  // namespace tuna
