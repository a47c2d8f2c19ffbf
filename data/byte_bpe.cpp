// Byte-level BPE: see data/byte_bpe.h.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "data/byte_bpe.h"

#include <pcre2.h>
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <tuple>
#include <climits>
#include <cstring>
#include <queue>

#include "core/error.h"
#include "data/clean.h"  // is_valid_utf8
#include "data/tokenizer.h"

namespace tuna {

const char* const kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

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

void append_utf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// --- The pre-tokenizer regex.

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof buffer);
  return reinterpret_cast<const char*>(buffer);
}

// Per-thread match state: the match data (only the whole match is read) and a JIT stack that grows to 8 MB,
// enough for \s+(?!\S) over megabytes of spaces.
struct MatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  MatchState() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~MatchState() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(data);
  }
};

class Regex {
 public:
  Regex(const std::string& pattern, const std::string& path) : path_(path) {
    int code;
    PCRE2_SIZE offset;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &code, &offset, nullptr);
    if (!code_)
      fail("tokenizer ", path, ": the pre-tokenizer regex does not compile at offset ", offset, " (",
           pcre2_message(code), "): ", pattern);
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Calls fn(piece) for every match and every run of text between matches, in order.
  template <typename Fn>
  void split(std::string_view text, Fn&& fn) const {
    thread_local MatchState state;
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t gap = 0, at = 0;
    while (at < text.size()) {
      const int rc = jit_ ? pcre2_jit_match(code_, subject, text.size(), at, 0, state.data, state.context)
                          : pcre2_match(code_, subject, text.size(), at, PCRE2_NO_UTF_CHECK, state.data, state.context);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0)
        fail("tokenizer ", path_, ": the pre-tokenizer regex failed at byte ", at, ": ", pcre2_message(rc));
      // Copied out: fn may split the piece with the next regex, which reuses this thread's match data.
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(state.data);
      const size_t begin = ov[0], end = ov[1];
      if (begin < at || end < begin || end > text.size())
        fail("tokenizer ", path_, ": the pre-tokenizer regex reported a match at bytes [", begin, ", ", end,
             ") from byte ", at, " (a \\K inside a lookaround?)");
      if (end == begin) {  // an empty match: step over one character, which joins the gap
        at = begin + 1;
        while (at < text.size() && (static_cast<uint8_t>(text[at]) & 0xC0) == 0x80) ++at;
        continue;
      }
      if (begin > gap) fn(text.substr(gap, begin - gap));
      fn(text.substr(begin, end - begin));
      gap = at = end;
    }
    if (gap < text.size()) fn(text.substr(gap));
  }

 private:
  std::string path_;
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
};

// --- Merge ranks: (left, right) -> (rank, merged id), open addressing.

class PairTable {
 public:
  void build(const std::vector<ByteBpeModel::Merge>& merges, const TokenIndex& ids,
             const std::vector<std::string>& tokens, const std::string& path) {
    size_t capacity = 16;
    while (capacity < merges.size() * 2) capacity *= 2;
    slots_.assign(capacity, Slot{});
    mask_ = capacity - 1;
    shift_ = 64 - std::countr_zero(capacity);
    std::string joined;
    for (const ByteBpeModel::Merge& m : merges) {
      joined.assign(tokens[m.left]).append(tokens[m.right]);
      const int32_t merged = ids.find(joined);
      if (merged < 0)
        fail("tokenizer ", path, ": the merge of tokens ", m.left, " and ", m.right,
             " makes a token that is not in the vocabulary");
      Slot& s = find_slot(key(m.left, m.right));
      s.key = key(m.left, m.right);
      s.rank = m.rank;  // a pair listed twice takes its last rank, as Hugging Face's does
      s.merged = merged;
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

class ByteBpeTokenizer final : public TokenizerImpl {
 public:
  explicit ByteBpeTokenizer(ByteBpeModel model) : m_(std::move(model)) {
    const std::string& path = m_.path;
    TUNA_CHECK(m_.tokens.size() == m_.kinds.size(), "tokens and kinds differ in size");
    normal_.reserve(m_.tokens.size());
    for (int32_t id = 0; id < static_cast<int32_t>(m_.tokens.size()); ++id) {
      const std::string& text = m_.tokens[id];
      switch (m_.kinds[id]) {
        case TokenKind::normal:
          if (!normal_.insert(text, id))
            fail("tokenizer ", path, ": tokens ", normal_.find(text), " and ", id, " have the same bytes");
          break;
        case TokenKind::special:
        case TokenKind::added:
          if (text.empty()) fail("tokenizer ", path, ": added token ", id, " is empty");
          added_.push_back({text, id, m_.kinds[id] == TokenKind::special});
          named_.insert(text, id);
          break;
        default:
          break;
      }
    }
    for (int b = 0; b < 256; ++b) {
      const char c = static_cast<char>(b);
      byte_token_[b] = normal_.find(std::string_view(&c, 1));
      if (byte_token_[b] < 0)
        fail("tokenizer ", path, ": not a byte-level vocabulary: byte 0x", "0123456789abcdef"[b >> 4],
             "0123456789abcdef"[b & 15], " has no token of its own");
    }
    pairs_.build(m_.merges, normal_, m_.tokens, path);
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
    // Longest first, so the first match at a position is the longest (Hugging Face matches leftmost-longest).
    std::sort(added_.begin(), added_.end(), [](const Added& a, const Added& b) {
      return a.text.size() != b.text.size() ? a.text.size() > b.text.size() : a.id < b.id;
    });
    for (const Added& a : added_) {
      (a.special ? starts_special_ : starts_added_)[static_cast<uint8_t>(a.text[0])] = true;
      any_added_ |= !a.special;
    }
    for (const std::string& pattern : m_.patterns) regexes_.push_back(std::make_unique<Regex>(pattern, path));
  }

  TokenizerFormat format() const override { return m_.format; }
  const std::string& path() const override { return m_.path; }

  void encode(std::string_view text, SpecialTokens specials, std::vector<int32_t>* out) const override {
    segment(text, specials, [&](std::string_view s) { encode_segment(s, out); },
            [&](int32_t id) { out->push_back(id); });
  }

  bool segments_exact() const override { return true; }
  const char* segment_encoder() const override { return "tuna's byte-level BPE"; }

  void segment(std::string_view text, SpecialTokens specials, const std::function<void(std::string_view)>& on_text,
               const std::function<void(int32_t)>& on_token) const override {
    if (!is_valid_utf8(text)) fail("tokenizer ", m_.path, ": cannot encode text that is not valid UTF-8");
    const bool parse = specials == SpecialTokens::parse;
    const bool scan = parse || any_added_;
    size_t run = 0;
    if (scan) {
      for (size_t i = 0; i < text.size(); ++i) {
        const uint8_t c = static_cast<uint8_t>(text[i]);
        if (!starts_added_[c] && !(parse && starts_special_[c])) continue;
        for (const Added& a : added_) {
          if ((a.special && !parse) || text.compare(i, a.text.size(), a.text) != 0) continue;
          pretokenize(text.substr(run, i - run), on_text);
          on_token(a.id);
          i += a.text.size() - 1;
          run = i + 1;
          break;
        }
      }
    }
    pretokenize(text.substr(run), on_text);
  }

  void encode_segment(std::string_view piece, std::vector<int32_t>* out) const override {
    if (piece.empty()) return;
    if (m_.ignore_merges || piece.size() == 1) {
      const int32_t id = normal_.find(piece);
      if (id >= 0) {
        out->push_back(id);
        return;
      }
    }
    if (piece.size() <= kShortPiece)
      merge_short(piece, out);
    else
      merge_long(piece, out);
  }

  std::string decode(std::span<const int32_t> ids) const override {
    std::string text;
    for (int32_t id : ids) text += m_.tokens[id];
    return text;
  }
  int32_t vocab_size() const override { return static_cast<int32_t>(m_.tokens.size()); }
  int32_t token_id(std::string_view text) const override {
    const int32_t named = named_.find(text);
    return named >= 0 ? named : normal_.find(text);
  }
  TokenKind kind(int32_t id) const override { return m_.kinds[id]; }
  std::string token_text(int32_t id) const override { return m_.tokens[id]; }
  int32_t default_bos() const override { return m_.bos; }
  int32_t default_eos() const override { return m_.eos; }
  std::vector<std::pair<int32_t, int32_t>> merge_list() const override {
    std::vector<std::pair<int32_t, int32_t>> list;
    list.reserve(m_.merges.size());
    for (const ByteBpeModel::Merge& m : m_.merges) list.emplace_back(m.left, m.right);
    return list;
  }
  std::vector<std::string> pretokenizer_patterns() const override { return m_.patterns; }
  bool adds_prefix_space() const override { return m_.add_prefix_space; }

 private:
  static constexpr size_t kShortPiece = 48;  // longer pieces merge through a heap (n log n)

  struct Added {
    std::string text;
    int32_t id;
    bool special;
  };

  void pretokenize(std::string_view text, const std::function<void(std::string_view)>& on_text) const {
    if (text.empty()) return;
    thread_local std::string prefixed;
    if (m_.add_prefix_space && text[0] != ' ') {
      prefixed.assign(" ");
      prefixed.append(text);
      text = prefixed;
    }
    split(text, 0, on_text);
  }
  void split(std::string_view text, size_t step, const std::function<void(std::string_view)>& on_text) const {
    if (step == regexes_.size()) {
      on_text(text);
      return;
    }
    regexes_[step]->split(text, [&](std::string_view piece) { split(piece, step + 1, on_text); });
  }

  // Short pieces: the ids and the rank of each adjacent pair in arrays; each merge rescans for the lowest
  // rank (leftmost on ties) and updates the two pairs it touched.
  void merge_short(std::string_view piece, std::vector<int32_t>* out) const {
    const size_t n = piece.size();
    int32_t ids[kShortPiece], ranks[kShortPiece], merged[kShortPiece];
    for (size_t i = 0; i < n; ++i) ids[i] = byte_token_[static_cast<uint8_t>(piece[i])];
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
  void merge_long(std::string_view piece, std::vector<int32_t>* out) const {
    const int32_t n = static_cast<int32_t>(piece.size());
    struct Symbol {
      int32_t id, prev, next;
      bool alive;
    };
    struct Candidate {
      int32_t rank, pos, left, right, merged;
      bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::vector<Symbol> sym(n);
    for (int32_t i = 0; i < n; ++i) sym[i] = {byte_token_[static_cast<uint8_t>(piece[i])], i - 1, i + 1 < n ? i + 1 : -1, true};
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
  TokenIndex normal_;  // bytes -> id of every normal token (views into m_.tokens)
  TokenIndex named_;   // text -> id of every special and added token
  std::array<int32_t, 256> byte_token_{};
  PairTable pairs_;
  std::vector<Added> added_;
  std::array<bool, 256> starts_special_{}, starts_added_{};
  bool any_added_ = false;
  std::vector<std::unique_ptr<Regex>> regexes_;
};

}  // namespace

void check_token_id_space(int64_t ids, int64_t defined, const std::string& path, const char* field) {
  if (ids - defined > kMaxUnusedTokenIds)
    fail("tokenizer ", path, ": ", field, " define ", defined, " tokens but name ids up to ", ids - 1,
         ": more than ", kMaxUnusedTokenIds, " ids would have no token");
}

std::unique_ptr<TokenizerImpl> make_byte_bpe(ByteBpeModel model) {
  return std::make_unique<ByteBpeTokenizer>(std::move(model));
}

std::string byte_level_encode(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) append_utf8(alphabet().code_point[static_cast<uint8_t>(c)], &out);
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
