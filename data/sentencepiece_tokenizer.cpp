// The sentencepiece format: the sentencepiece library encodes and decodes (it is the reference), and tuna
// cuts text into segments for the word cache (data/tokenizer_impl.h).
//
// Where text may be cut. Sentencepiece normalizes the text (LLaMA: identity, spaces become "▁", a dummy "▁"
// before the first word) and then merges symbols of the whole text; two runs of text encode independently
// when no piece of the model spans the point between them. So, checked on the model's pieces at load:
//   - before a space that follows a non-space, when no piece has "▁" after a character other than "▁";
//   - on both sides of a newline, when no piece holds "\n" next to another character.
// A segment that does not start the text must be encoded without the dummy prefix: tuna loads the model a
// second time with add_dummy_prefix turned off (an edit of the serialized model), and encodes the text as if
// a space stood before it ("word" at the start encodes as " word" does later). A model that normalizes (a
// character map such as spm_train's default nmt_nfkc, or remove_extra_whitespaces) has its whole document
// normalized first by tuna's copy of the normalizer, and the normalized text is cut the same way (its
// segments already carry their "▁"). A model whose cuts fail the probe strings checked at load, a unigram
// model that normalizes, or one without escaped whitespace encodes whole documents through the library.
#include <sentencepiece_processor.h>

#include <algorithm>
#include <array>
#include <bit>
#include <memory>
#include <cstring>
#include <filesystem>
#include <tuple>
#include <unordered_map>

#include "core/error.h"
#include "data/byte_bpe.h"  // TokenIndex
#include "data/clean.h"     // is_valid_utf8
#include "data/tokenizer.h"
#include "data/tokenizer_impl.h"

namespace tuna {

namespace {

// --- The few protobuf wire-format steps needed to turn off add_dummy_prefix in a serialized ModelProto
// (sentencepiece's headers do not ship the generated proto classes).

bool read_varint(std::string_view s, size_t* pos, uint64_t* value) {
  *value = 0;
  for (int shift = 0; shift < 64 && *pos < s.size(); shift += 7) {
    const uint8_t byte = static_cast<uint8_t>(s[(*pos)++]);
    *value |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if (!(byte & 0x80)) return true;
  }
  return false;
}

void write_varint(uint64_t value, std::string* out) {
  do {
    uint8_t byte = value & 0x7f;
    value >>= 7;
    out->push_back(static_cast<char>(byte | (value ? 0x80 : 0)));
  } while (value);
}

struct WireField {
  uint32_t number = 0;
  uint32_t wire_type = 0;
  size_t begin = 0, end = 0;          // the whole field, tag included
  std::string_view payload;           // length-delimited fields
  uint64_t varint = 0;                // varint fields
  uint32_t fixed32 = 0;               // 32-bit fields (a float's bits)
};

// The top-level fields of a message; false on malformed bytes.
bool parse_fields(std::string_view s, std::vector<WireField>* fields) {
  size_t pos = 0;
  while (pos < s.size()) {
    WireField f;
    f.begin = pos;
    uint64_t tag;
    if (!read_varint(s, &pos, &tag)) return false;
    f.number = static_cast<uint32_t>(tag >> 3);
    f.wire_type = static_cast<uint32_t>(tag & 7);
    switch (f.wire_type) {
      case 0:
        if (!read_varint(s, &pos, &f.varint)) return false;
        break;
      case 1:
        pos += 8;
        break;
      case 2: {
        uint64_t length;
        if (!read_varint(s, &pos, &length) || length > s.size() - pos) return false;
        f.payload = s.substr(pos, length);
        pos += length;
        break;
      }
      case 5:
        if (s.size() - pos < 4) return false;
        std::memcpy(&f.fixed32, s.data() + pos, 4);
        pos += 4;
        break;
      default:
        return false;
    }
    if (pos > s.size()) return false;
    f.end = pos;
    fields->push_back(f);
  }
  return true;
}

// ModelProto field 3 is the NormalizerSpec: 1 name, 2 precompiled_charsmap, 3 add_dummy_prefix (default
// true), 4 remove_extra_whitespaces (default true), 5 escape_whitespaces (default true).
struct NormalizerFacts {
  bool found = false;
  std::string name;
  bool charsmap = false, add_dummy_prefix = true, remove_extra_whitespaces = true, escape_whitespaces = true;
  std::string charsmap_bytes;  // the precompiled character map
};

// Reads the normalizer and writes the model with add_dummy_prefix = false into *no_prefix (a repeated
// scalar field's last value wins in protobuf, so appending the field overrides it). False when the bytes
// are not what was expected.
bool inspect_normalizer(std::string_view model, NormalizerFacts* facts, std::string* no_prefix) {
  std::vector<WireField> fields;
  if (!parse_fields(model, &fields)) return false;
  const WireField* spec = nullptr;
  for (const WireField& f : fields)
    if (f.number == 3) {
      if (spec || f.wire_type != 2) return false;
      spec = &f;
    }
  if (!spec) return false;
  std::vector<WireField> inner;
  if (!parse_fields(spec->payload, &inner)) return false;
  facts->found = true;
  for (const WireField& f : inner) {
    if (f.number == 1 && f.wire_type == 2) facts->name = std::string(f.payload);
    if (f.number == 2 && f.wire_type == 2) facts->charsmap = !f.payload.empty(), facts->charsmap_bytes = f.payload;
    if (f.number == 3 && f.wire_type == 0) facts->add_dummy_prefix = f.varint != 0;
    if (f.number == 4 && f.wire_type == 0) facts->remove_extra_whitespaces = f.varint != 0;
    if (f.number == 5 && f.wire_type == 0) facts->escape_whitespaces = f.varint != 0;
  }
  std::string payload(spec->payload);
  payload += std::string("\x18\x00", 2);  // field 3 (add_dummy_prefix), varint 0
  no_prefix->assign(model.substr(0, spec->begin));
  write_varint((3u << 3) | 2u, no_prefix);
  write_varint(payload.size(), no_prefix);
  *no_prefix += payload;
  no_prefix->append(model.substr(spec->end));
  return true;
}

const std::string kSpace = "\xE2\x96\x81";  // "▁", sentencepiece's space

// sentencepiece's BPE encoding (bpe_model.cc), for the segments of the word cache: a library call costs
// microseconds of bookkeeping per segment, this a fraction of one. The same algorithm, checked against the
// library at load (the probe strings) and by the tests (the library's ids on real text):
//   - text: spaces become "▁" (a normalized segment has none left; the segment carries no dummy prefix);
//   - symbols: user-defined pieces where they match (longest; they never merge), else one UTF-8 character;
//   - merge: the adjacent pair whose concatenation is a piece (normal, user-defined or unused) with the highest
//     score, leftmost on ties, until none is left;
//   - ids: a merged unused piece is split back into the pair it came from; a symbol that is no piece is
//     <unk>, or its bytes' <0xNN> pieces with byte fallback.
// Symbols are ids, and every possible merge is a pair of ids in a table made at load (each piece split at
// each character boundary into two halves that can be symbols), so a merge step is an integer hash probe,
// not a string hash. A character that is no piece but is the half of one gets an id of its own above the
// vocabulary. Short segments rescan an array for the best pair; long ones use a heap with stale entries.
// Made only for BPE models with valid UTF-8 segments; the rest goes to the library.
class SentencePieceBpe {
 public:
  // False (and nothing to use) when the model is not a BPE model tuna can encode this way.
  bool init(std::string_view model) {
    std::vector<WireField> fields;
    if (!parse_fields(model, &fields)) return false;
    bool bpe = false;
    for (const WireField& f : fields) {
      if (f.number == 1 && f.wire_type == 2) {
        std::vector<WireField> inner;
        if (!parse_fields(f.payload, &inner)) return false;
        Piece piece;
        for (const WireField& g : inner) {
          if (g.number == 1 && g.wire_type == 2) piece.text = std::string(g.payload);
          if (g.number == 2 && g.wire_type == 5) std::memcpy(&piece.score, &g.fixed32, 4);
          if (g.number == 3 && g.wire_type == 0) piece.type = static_cast<int>(g.varint);
        }
        pieces_.push_back(std::move(piece));
      }
      if (f.number == 2 && f.wire_type == 2) {
        std::vector<WireField> inner;
        if (!parse_fields(f.payload, &inner)) return false;
        for (const WireField& g : inner) {
          if (g.number == 3 && g.wire_type == 0) bpe = g.varint == 2;  // ModelType BPE
          if (g.number == 35 && g.wire_type == 0) byte_fallback_ = g.varint != 0;
          if (g.number == 24 && g.wire_type == 0 && g.varint != 0) return false;  // treat_whitespace_as_suffix
        }
      }
    }
    if (!bpe || pieces_.empty() || pieces_.size() >= (size_t{1} << 30)) return false;
    mergeable_.reserve(pieces_.size());
    for (int32_t id = 0; id < static_cast<int32_t>(pieces_.size()); ++id) {
      const Piece& p = pieces_[id];
      if (p.type == kNormal || p.type == kUserDefined || p.type == kUnused) mergeable_.insert(p.text, id);
      if (p.type == kUserDefined) user_defined_.push_back(id);
      if (p.type == kUnknown) unk_ = id;
    }
    std::sort(user_defined_.begin(), user_defined_.end(),
              [&](int32_t a, int32_t b) { return pieces_[a].text.size() > pieces_[b].text.size(); });
    if (byte_fallback_)
      for (int b = 0; b < 256; ++b) {
        char name[8];
        std::snprintf(name, sizeof name, "<0x%02X>", b);
        byte_[b] = -1;
        for (int32_t id = 0; id < static_cast<int32_t>(pieces_.size()) && byte_[b] < 0; ++id)
          if (pieces_[id].type == kByte && pieces_[id].text == name) byte_[b] = id;
        if (byte_[b] < 0) return false;
      }
    if (unk_ < 0) return false;
    build_pairs();
    return true;
  }

  bool has_user_defined() const { return !user_defined_.empty(); }

  void encode(std::string_view segment, std::vector<int32_t>* out) const {
    thread_local std::string spaced;
    std::string_view text = segment;
    if (segment.find(' ') != std::string_view::npos) {
      spaced.clear();
      for (char c : segment) {
        if (c == ' ')
          spaced.append(kSpace);
        else
          spaced.push_back(c);
      }
      text = spaced;
    }
    thread_local std::vector<Symbol> symbols;
    symbols.clear();
    for (size_t at = 0; at < text.size();) {
      size_t size = 0;
      bool frozen = false;
      for (int32_t id : user_defined_)
        if (text.compare(at, pieces_[id].text.size(), pieces_[id].text) == 0) {
          size = pieces_[id].text.size(), frozen = true;
          break;
        }
      const uint8_t lead = static_cast<uint8_t>(text[at]);
      if (!size) size = utf8_length(lead);
      size = std::min(size, text.size() - at);
      const int32_t id = frozen ? -1 : size == 1 ? ascii_[lead] : symbol_id(text.substr(at, size));
      symbols.push_back({static_cast<uint32_t>(at), static_cast<uint32_t>(size), id});
      at += size;
    }
    // (unused piece, size of its left half) of each merge into an unused piece, recorded when the pair is
    // considered, as sentencepiece does: the last one is how the piece splits back (its rev_merge).
    thread_local std::vector<std::pair<int32_t, uint32_t>> unused_merges;
    unused_merges.clear();
    if (symbols.size() <= kShortSymbols)
      merge_short(&symbols, &unused_merges);
    else
      merge_long(&symbols, &unused_merges);
    for (const Symbol& s : symbols)
      if (s.size) emit(text.substr(s.begin, s.size), s.id, unused_merges, out);
  }

 private:
  static constexpr int kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6;
  static constexpr size_t kShortSymbols = 48;  // longer segments merge through a heap (n log n)
  struct Piece {
    std::string text;
    float score = 0;
    int type = kNormal;
  };
  struct Symbol {
    uint32_t begin, size;  // size 0: merged into the symbol before it
    int32_t id;            // a piece, a half-only character (>= the vocabulary), or -1: never merges
  };
  struct Merge {
    float score = 0;
    int32_t piece = -1;  // -1: the pair does not merge
  };
  static size_t utf8_length(uint8_t c) { return c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1; }

  // The id a one-character symbol starts with.
  int32_t symbol_id(std::string_view c) const {
    const int32_t id = mergeable_.find(c);
    return id >= 0 ? id : half_chars_.find(c);
  }

  // Every pair of symbols that concatenates to a mergeable piece.
  void build_pairs() {
    std::vector<std::tuple<int32_t, int32_t, int32_t>> pairs;  // left, right, piece
    auto half_id = [&](std::string_view half) -> int32_t {
      const int32_t id = mergeable_.find(half);
      if (id >= 0) return id;
      if (utf8_length(static_cast<uint8_t>(half[0])) != half.size()) return -1;  // no symbol is this text
      const int32_t next = static_cast<int32_t>(pieces_.size() + half_char_text_.size());
      if (half_chars_.find(half) < 0) {
        half_char_text_.push_back(std::make_unique<std::string>(half));
        half_chars_.insert(*half_char_text_.back(), next);
      }
      return half_chars_.find(half);
    };
    for (int32_t id = 0; id < static_cast<int32_t>(pieces_.size()); ++id) {
      const Piece& p = pieces_[id];
      if (!(p.type == kNormal || p.type == kUserDefined || p.type == kUnused)) continue;
      for (size_t k = utf8_length(static_cast<uint8_t>(p.text[0])); k < p.text.size();
           k += utf8_length(static_cast<uint8_t>(p.text[k]))) {
        const int32_t left = half_id(std::string_view(p.text).substr(0, k));
        const int32_t right = left < 0 ? -1 : half_id(std::string_view(p.text).substr(k));
        if (right >= 0) pairs.emplace_back(left, right, id);
      }
    }
    size_t capacity = 16;
    while (capacity < pairs.size() * 2) capacity *= 2;
    slots_.assign(capacity, PairSlot{});
    mask_ = capacity - 1;
    shift_ = 64 - std::countr_zero(capacity);
    for (const auto& [left, right, piece] : pairs) {
      PairSlot& s = slot(key(left, right));
      s.key = key(left, right);
      s.piece = piece;
      s.score = pieces_[piece].score;
      any_unused_ |= pieces_[piece].type == kUnused;
    }
    for (int c = 0; c < 128; ++c) {
      const char ch = static_cast<char>(c);
      ascii_[c] = symbol_id(std::string_view(&ch, 1));
    }
  }

  struct PairSlot {  // the merge's score beside its piece: a lookup touches one cache line
    uint64_t key = ~uint64_t{0};
    int32_t piece = -1;
    float score = 0;
  };
  static uint64_t key(int32_t l, int32_t r) { return (uint64_t(uint32_t(l)) << 32) | uint32_t(r); }
  const PairSlot& slot(uint64_t k) const {
    // The product's top bits: every bit of both ids reaches them (low bits would hash the right id alone).
    size_t i = (k * 0x9E3779B97F4A7C15ull) >> shift_;
    while (slots_[i].key != ~uint64_t{0} && slots_[i].key != k) i = (i + 1) & mask_;
    return slots_[i];
  }
  PairSlot& slot(uint64_t k) { return const_cast<PairSlot&>(static_cast<const SentencePieceBpe*>(this)->slot(k)); }

  // The merge of two adjacent symbols, recording a merge into an unused piece.
  [[gnu::always_inline]] Merge pair(const Symbol& left, const Symbol& right,
                                    std::vector<std::pair<int32_t, uint32_t>>* unused) const {
    if (left.id < 0 || right.id < 0) return {};
    const PairSlot& s = slot(key(left.id, right.id));
    if (s.piece < 0) return {};
    if (any_unused_ && pieces_[s.piece].type == kUnused) unused->push_back({s.piece, left.size});
    return {s.score, s.piece};
  }

  // Array rescan: the merge of each symbol with the next; a merge removes the right symbol from the array
  // and recomputes the two pairs it touched.
  void merge_short(std::vector<Symbol>* symbols, std::vector<std::pair<int32_t, uint32_t>>* unused) const {
    std::vector<Symbol>& s = *symbols;
    size_t n = s.size();
    Merge merges[kShortSymbols];
    for (size_t i = 0; i + 1 < n; ++i) merges[i] = pair(s[i], s[i + 1], unused);
    while (n > 1) {
      size_t best = n;
      for (size_t i = 0; i + 1 < n; ++i)
        if (merges[i].piece >= 0 && (best == n || merges[i].score > merges[best].score)) best = i;
      if (best == n) break;
      s[best].size += s[best + 1].size;
      s[best].id = merges[best].piece;
      for (size_t i = best + 1; i + 1 < n; ++i) s[i] = s[i + 1];
      for (size_t i = best + 1; i + 2 < n; ++i) merges[i] = merges[i + 1];
      --n;
      if (best > 0) merges[best - 1] = pair(s[best - 1], s[best], unused);
      if (best + 1 < n) merges[best] = pair(s[best], s[best + 1], unused);
    }
    s.resize(n);
  }

  // Heap: a linked list of symbols and a max-heap of candidate merges by (score, leftmost); an entry is
  // stale when either symbol has changed since it was pushed (sentencepiece's size check).
  void merge_long(std::vector<Symbol>* symbols, std::vector<std::pair<int32_t, uint32_t>>* unused) const {
    std::vector<Symbol>& s = *symbols;
    const int32_t n = static_cast<int32_t>(s.size());
    thread_local std::vector<int32_t> prev, next;
    prev.resize(n), next.resize(n);
    for (int32_t i = 0; i < n; ++i) prev[i] = i - 1, next[i] = i + 1 < n ? i + 1 : -1;
    struct Candidate {
      float score;
      int32_t left, right, piece;
      uint32_t size;
    };
    auto lower = [](const Candidate& a, const Candidate& b) {
      return a.score < b.score || (a.score == b.score && a.left > b.left);
    };
    thread_local std::vector<Candidate> heap;
    heap.clear();
    auto push = [&](int32_t left, int32_t right) {
      if (left < 0 || right < 0) return;
      const Merge m = pair(s[left], s[right], unused);
      if (m.piece < 0) return;
      heap.push_back({m.score, left, right, m.piece, s[left].size + s[right].size});
      std::push_heap(heap.begin(), heap.end(), lower);
    };
    for (int32_t i = 0; i + 1 < n; ++i) push(i, i + 1);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), lower);
      const Candidate top = heap.back();
      heap.pop_back();
      Symbol &left = s[top.left], &right = s[top.right];
      if (left.size == 0 || right.size == 0 || left.size + right.size != top.size) continue;
      left.size += right.size;
      left.id = top.piece;
      right.size = 0;
      next[top.left] = next[top.right];
      if (next[top.right] >= 0) prev[next[top.right]] = top.left;
      push(prev[top.left], top.left);
      push(top.left, next[top.left]);
    }
  }

  // A final symbol's ids: its piece, an unused piece split back into the pair it was merged from, or
  // <unk> (its bytes' pieces with byte fallback).
  void emit(std::string_view symbol, int32_t id, const std::vector<std::pair<int32_t, uint32_t>>& unused_merges,
            std::vector<int32_t>* out) const {
    if (id < 0 || id >= static_cast<int32_t>(pieces_.size())) id = mergeable_.find(symbol);
    if (id >= 0 && any_unused_ && pieces_[id].type == kUnused) {
      for (auto it = unused_merges.rbegin(); it != unused_merges.rend(); ++it)
        if (it->first == id) {
          emit(symbol.substr(0, it->second), -1, unused_merges, out);
          emit(symbol.substr(it->second), -1, unused_merges, out);
          return;
        }
    }
    if (id >= 0) {
      out->push_back(id);
      return;
    }
    if (!byte_fallback_) {
      out->push_back(unk_);
      return;
    }
    for (char c : symbol) out->push_back(byte_[static_cast<uint8_t>(c)]);
  }

  std::vector<Piece> pieces_;
  TokenIndex mergeable_;  // views into pieces_
  TokenIndex half_chars_;  // characters that are no piece but half of one -> ids above the vocabulary
  std::vector<std::unique_ptr<std::string>> half_char_text_;
  std::vector<PairSlot> slots_;
  size_t mask_ = 0;
  int shift_ = 60;
  bool any_unused_ = false;  // some merge makes an unused piece
  std::array<int32_t, 128> ascii_{};
  std::vector<int32_t> user_defined_;
  int32_t unk_ = -1;
  bool byte_fallback_ = false;
  std::array<int32_t, 256> byte_{};
};

// sentencepiece's normalizer (normalizer.cc), so that a model with a normalization rule (nmt_nfkc, what
// spm_train uses by default) and remove_extra_whitespaces can be cut into cached segments too: the
// document is normalized once, then cut where the normalized text allows. The rule is the model's
// precompiled character map: a double-array trie (darts-clone's layout) from input prefixes to offsets of
// NUL-terminated replacements; at each position the longest rule applies, else one character is copied (an
// invalid UTF-8 byte becomes U+FFFD). Spaces become "▁"; remove_extra_whitespaces drops leading and
// trailing spaces and collapses runs; a dummy "▁" starts the text. Checked against the library at load
// (the probe strings) and by the tests (real text, NFKC-affected characters, invalid bytes).
class SentencePieceNormalizer {
 public:
  // False when the map is malformed.
  bool init(std::string_view charsmap, bool add_dummy_prefix, bool remove_extra_whitespaces) {
    add_dummy_prefix_ = add_dummy_prefix;
    remove_extra_whitespaces_ = remove_extra_whitespaces;
    plain_.fill(true);
    for (int b = 0; b < 128; ++b) single_[b] = std::string_view(&kAscii[b], 1);
    if (charsmap.empty()) return finish();
    uint32_t trie_bytes;
    if (charsmap.size() <= 4) return false;
    std::memcpy(&trie_bytes, charsmap.data(), 4);
    if (trie_bytes >= charsmap.size() - 4 || trie_bytes % 4 != 0 || trie_bytes == 0) return false;
    trie_.resize(trie_bytes / 4);
    std::memcpy(trie_.data(), charsmap.data() + 4, trie_bytes);
    replacements_.assign(charsmap.substr(4 + trie_bytes));
    // An ASCII byte followed by another ASCII byte (or the end) needs no trie walk when no rule starts with
    // it and an ASCII byte: its own rule applies (NFKC has rules for letters, such as "A" + a combining
    // accent, but none made of two ASCII bytes in nmt_nfkc), else it is copied.
    for (int b = 0; b < 128; ++b) {
      single_[b] = std::string_view(&kAscii[b], 1);
      const uint32_t node = offset(trie_[0]) ^ static_cast<uint32_t>(b);
      if (node >= trie_.size() || label(trie_[node]) != static_cast<uint32_t>(b)) continue;
      const uint32_t unit = trie_[node], children = node ^ offset(unit);
      bool ascii_child = false;
      for (uint32_t c = 0; c < 128 && !ascii_child; ++c)
        ascii_child = (children ^ c) < trie_.size() && label(trie_[children ^ c]) == c;
      if (ascii_child) {
        plain_[b] = false;
      } else if (has_leaf(unit)) {
        if (children >= trie_.size() || value(trie_[children]) >= replacements_.size()) return false;
        const char* s = replacements_.data() + value(trie_[children]);
        single_[b] = std::string_view(s, strnlen(s, replacements_.size() - value(trie_[children])));
      }
    }
    return finish();
  }

  void normalize(std::string_view in, std::string* out) const {
    out->clear();
    size_t at = 0;
    std::string_view piece;
    if (remove_extra_whitespaces_)
      while (at < in.size()) {
        const size_t used = prefix(in, at, &piece);
        if (piece != " ") break;
        at += used;
      }
    if (at == in.size()) return;
    if (add_dummy_prefix_) out->append(kSpace);
    bool prev_space = remove_extra_whitespaces_;
    while (at < in.size()) {
      // A run of ASCII bytes that map to themselves (not spaces) is copied whole.
      size_t end = at;
      while (end < in.size() && copied_[static_cast<uint8_t>(in[end])] &&
             (end + 1 == in.size() || static_cast<uint8_t>(in[end + 1]) < 0x80))
        ++end;
      if (end > at) {
        out->append(in.substr(at, end - at));
        prev_space = false;
        at = end;
        continue;
      }
      const size_t used = prefix(in, at, &piece);
      if (prev_space)
        while (!piece.empty() && piece[0] == ' ') piece.remove_prefix(1);
      if (!piece.empty()) {
        for (char c : piece) {
          if (c == ' ')
            out->append(kSpace);
          else
            out->push_back(c);
        }
        prev_space = piece.back() == ' ';
      }
      at += used;
      if (!remove_extra_whitespaces_) prev_space = false;
    }
    if (remove_extra_whitespaces_)
      while (out->size() >= kSpace.size() && out->compare(out->size() - kSpace.size(), kSpace.size(), kSpace) == 0)
        out->resize(out->size() - kSpace.size());
  }

 private:
  bool finish() {
    copied_.fill(false);
    for (int b = 0; b < 128; ++b) copied_[b] = b != ' ' && plain_[b] && single_[b] == std::string_view(&kAscii[b], 1);
    return true;
  }

  // darts-clone's unit: a label, an offset to the children, a leaf flag, a value.
  static uint32_t offset(uint32_t unit) { return (unit >> 10) << ((unit & (1u << 9)) >> 6); }
  static uint32_t label(uint32_t unit) { return unit & ((1u << 31) | 0xFF); }
  static bool has_leaf(uint32_t unit) { return (unit >> 8) & 1; }
  static uint32_t value(uint32_t unit) { return unit & ((1u << 31) - 1); }

  // The replacement of the longest rule at in[at], or one character as itself; returns the bytes used.
  size_t prefix(std::string_view in, size_t at, std::string_view* piece) const {
    const uint8_t lead = static_cast<uint8_t>(in[at]);
    if (lead < 0x80 && plain_[lead] && (at + 1 == in.size() || static_cast<uint8_t>(in[at + 1]) < 0x80)) {
      *piece = single_[lead];
      return 1;
    }
    size_t longest = 0;
    uint32_t longest_value = 0;
    if (!trie_.empty()) {
      uint32_t node = offset(trie_[0]);
      for (size_t i = at; i < in.size(); ++i) {
        const uint8_t c = static_cast<uint8_t>(in[i]);
        node ^= c;
        if (node >= trie_.size() || label(trie_[node]) != c) break;
        const uint32_t unit = trie_[node];
        node ^= offset(unit);
        if (has_leaf(unit)) {
          if (node >= trie_.size()) break;
          longest = i + 1 - at;
          longest_value = value(trie_[node]);
        }
      }
    }
    if (longest > 0 && longest_value < replacements_.size()) {
      const char* s = replacements_.data() + longest_value;
      *piece = std::string_view(s, strnlen(s, replacements_.size() - longest_value));
      return longest;
    }
    uint32_t cp;
    const size_t length = decode_utf8(in, at, &cp);
    if (length == 0) {
      *piece = "\xEF\xBF\xBD";  // U+FFFD for one invalid byte
      return 1;
    }
    *piece = in.substr(at, length);
    return length;
  }

  static constexpr std::array<char, 128> kAscii = [] {
    std::array<char, 128> a{};
    for (int b = 0; b < 128; ++b) a[b] = static_cast<char>(b);
    return a;
  }();
  std::vector<uint32_t> trie_;
  std::string replacements_;
  std::array<bool, 128> plain_{};             // no rule of two ASCII bytes starts with this byte
  std::array<std::string_view, 128> single_;  // then: the byte's own rule, or itself
  std::array<bool, 256> copied_{};            // then: the byte itself, not a space
  bool add_dummy_prefix_ = true, remove_extra_whitespaces_ = true;
};

class SentencePieceTokenizer final : public TokenizerImpl {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    auto processor = std::make_unique<sentencepiece::SentencePieceProcessor>();
    const auto status = processor->Load(path);
    if (!status.ok()) fail("tokenizer ", path, ": not a valid sentencepiece model: ", status.ToString());
    if (processor->GetPieceSize() <= 0) fail("tokenizer ", path, ": the model has no pieces");
    processor_ = std::move(processor);
    prepare_segments();
  }

  TokenizerFormat format() const override { return TokenizerFormat::sentencepiece; }
  const std::string& path() const override { return path_; }

  void encode(std::string_view text, SpecialTokens, std::vector<int32_t>* out) const override {
    library_encode(*processor_, text, out);
  }
  void encode_continuation(std::string_view text, std::vector<int32_t>* out) const override {
    if (no_prefix_) {
      library_encode(*no_prefix_, text, out);
      return;
    }
    if (!dummy_prefix_) {
      library_encode(*processor_, text, out);
      return;
    }
    fail("tokenizer ", path_, ": cannot encode text that continues a sequence (the model's dummy prefix cannot be "
         "turned off)");
  }

  bool segments_exact() const override { return exact_; }
  const char* segment_encoder() const override {
    return !exact_     ? "none (whole documents through sentencepiece)"
           : normalize_ ? "tuna's sentencepiece normalizer and BPE"
           : own_bpe_   ? "tuna's sentencepiece BPE"
                        : "sentencepiece, segment by segment";
  }

  void segment(std::string_view text, SpecialTokens, const std::function<void(std::string_view)>& on_text,
               const std::function<void(int32_t)>&) const override {
    TUNA_CHECK(exact_, "segment() on a sentencepiece model that failed the segment checks");
    if (text.empty()) return;
    if (normalize_) {
      segment_normalized(text, on_text);
      return;
    }
    // The segments of (dummy prefix ? " " : "") + text. The first one is copied with its virtual space.
    thread_local std::string first;
    const bool virtual_space = dummy_prefix_;
    const size_t n = text.size();
    auto at = [&](size_t i) -> char { return virtual_space ? (i == 0 ? ' ' : text[i - 1]) : text[i]; };
    const size_t total = n + (virtual_space ? 1 : 0);
    size_t start = 0;
    auto emit = [&](size_t end) {
      if (end <= start) return;
      if (virtual_space && start == 0) {
        first.assign(" ");
        first.append(text.substr(0, end - 1));
        on_text(first);
      } else {
        const size_t offset = virtual_space ? start - 1 : start;
        on_text(text.substr(offset, end - start));
      }
      start = end;
    };
    // A "▁" written in the text is a space to the model: no cut between it and a space.
    auto after_space_mark = [&](size_t i) {
      return i >= 3 && at(i - 1) == kSpace[2] && at(i - 2) == kSpace[1] && at(i - 3) == kSpace[0];
    };
    for (size_t i = 1; i < total; ++i) {
      const char c = at(i), prev = at(i - 1);
      const bool cut = (cut_words_ && c == ' ' && prev != ' ' && !after_space_mark(i)) ||
                       (cut_newlines_ && ((c == '\n') != (prev == '\n')));
      if (cut) emit(i);
    }
    emit(total);
  }

  void encode_segment(std::string_view segment, std::vector<int32_t>* out) const override {
    if (own_bpe_ && is_valid_utf8(segment))
      bpe_.encode(segment, out);
    else
      library_encode(no_prefix_ ? *no_prefix_ : *processor_, segment, out);
  }

  std::string decode(std::span<const int32_t> ids) const override {
    std::string text;
    const auto status = processor_->Decode(std::vector<int>(ids.begin(), ids.end()), &text);
    if (!status.ok()) fail("tokenizer ", path_, ": cannot decode: ", status.ToString());
    return text;
  }
  int32_t vocab_size() const override { return processor_->GetPieceSize(); }
  int32_t token_id(std::string_view text) const override {
    const int id = processor_->PieceToId(text);
    return id >= 0 && processor_->IdToPiece(id) == text ? id : -1;
  }
  TokenKind kind(int32_t id) const override {
    if (processor_->IsControl(id)) return TokenKind::special;
    if (processor_->IsUnknown(id)) return TokenKind::unknown;
    if (processor_->IsByte(id)) return TokenKind::byte;
    if (processor_->IsUnused(id)) return TokenKind::unused;
    return TokenKind::normal;
  }
  std::string token_text(int32_t id) const override { return processor_->IdToPiece(id); }
  int32_t default_bos() const override { return processor_->bos_id(); }
  int32_t default_eos() const override { return processor_->eos_id(); }
  int32_t unk_id() const override { return processor_->unk_id(); }
  int32_t pad_id() const override { return processor_->pad_id(); }
  float score(int32_t id) const override { return processor_->GetScore(id); }
  std::string llama_spm_difference(bool* dummy_prefix) const override {
    NormalizerFacts facts;
    std::string unused;
    const std::string model = processor_->serialized_model_proto();
    if (!inspect_normalizer(model, &facts, &unused)) return "its normalizer spec cannot be read";
    *dummy_prefix = facts.add_dummy_prefix;
    std::vector<WireField> fields;
    bool bpe = false;
    if (parse_fields(model, &fields))
      for (const WireField& f : fields) {
        std::vector<WireField> inner;
        if (f.number == 2 && f.wire_type == 2 && parse_fields(f.payload, &inner))
          for (const WireField& g : inner)
            if (g.number == 3 && g.wire_type == 0) bpe = g.varint == 2;  // TrainerSpec.model_type BPE
      }
    if (!bpe) return "it is not a BPE model (llama.cpp's llama tokenizer merges pieces by score, as BPE does)";
    if (facts.name != "identity" || facts.charsmap)
      return "it normalizes text ('" + facts.name + "'), which llama.cpp's llama tokenizer does not";
    if (facts.remove_extra_whitespaces) return "it removes extra whitespace, which llama.cpp's llama tokenizer keeps";
    if (!facts.escape_whitespaces) return "it does not write spaces as \u2581, which llama.cpp's llama tokenizer does";
    return "";
  }
  // The library has no accessor for a user-defined piece: the types come from the model proto itself (field
  // 1, pieces; in each, field 3, the type; absent means normal).
  std::vector<int> piece_types() const override {
    std::vector<WireField> fields;
    const std::string model = processor_->serialized_model_proto();
    if (!parse_fields(model, &fields)) fail("tokenizer ", path_, ": cannot read the model's pieces");
    std::vector<int> types;
    for (const WireField& f : fields) {
      if (f.number != 1 || f.wire_type != 2) continue;
      std::vector<WireField> inner;
      if (!parse_fields(f.payload, &inner)) fail("tokenizer ", path_, ": cannot read piece ", types.size());
      int type = 1;
      for (const WireField& g : inner)
        if (g.number == 3 && g.wire_type == 0) type = static_cast<int>(g.varint);
      types.push_back(type);
    }
    if (static_cast<int32_t>(types.size()) != vocab_size())
      fail("tokenizer ", path_, ": the model proto lists ", types.size(), " pieces, the library ", vocab_size());
    return types;
  }

 private:
  // The segments of the normalized text: before each "▁" that follows another character, and around
  // newlines, as the model allows (see prepare_segments).
  void segment_normalized(std::string_view text, const std::function<void(std::string_view)>& on_text) const {
    thread_local std::string normalized;
    normalizer_.normalize(text, &normalized);
    const std::string_view n = normalized;
    size_t start = 0, space_end = std::string_view::npos;  // where the last "▁" ended
    auto cut = [&](size_t i) {
      if (i > start) on_text(n.substr(start, i - start));
      start = i;
    };
    for (size_t i = 0; i < n.size(); ++i) {
      const char c = n[i];
      if (c == kSpace[0] && n.compare(i, kSpace.size(), kSpace) == 0) {
        if ((cut_words_ && space_end != i) || (cut_newlines_ && i > 0 && n[i - 1] == '\n')) cut(i);
        space_end = i + kSpace.size();
        i = space_end - 1;
      } else if (cut_newlines_ && i > 0 && (c == '\n') != (n[i - 1] == '\n')) {
        cut(i);
      }
    }
    cut(n.size());
  }

  void library_encode(const sentencepiece::SentencePieceProcessor& p, std::string_view text,
                      std::vector<int32_t>* out) const {
    thread_local std::vector<int> ids;
    ids.clear();
    const auto status = p.Encode(text, &ids);
    if (!status.ok()) fail("tokenizer ", path_, ": cannot encode text: ", status.ToString());
    out->insert(out->end(), ids.begin(), ids.end());
  }

  // Decides where segments may be cut (see the top of the file) and checks it on probe strings.
  void prepare_segments() {
    NormalizerFacts facts;
    std::string no_prefix_model;
    const std::string model = processor_->serialized_model_proto();
    if (!inspect_normalizer(model, &facts, &no_prefix_model)) return;
    dummy_prefix_ = facts.add_dummy_prefix;
    if (!facts.escape_whitespaces) return;
    auto no_prefix = std::make_unique<sentencepiece::SentencePieceProcessor>();
    if (!no_prefix->LoadFromSerializedProto(no_prefix_model).ok()) return;
    no_prefix_ = std::move(no_prefix);
    own_bpe_ = bpe_.init(model);
    // A normalizing model's segments are cut from the normalized text and encoded by tuna's BPE (the library
    // would normalize them again); user-defined pieces, which the library's normalizer keeps whole, are left
    // to the library.
    normalize_ = facts.charsmap || facts.remove_extra_whitespaces;
    if (normalize_ && (!own_bpe_ || bpe_.has_user_defined() ||
                       !normalizer_.init(facts.charsmap_bytes, facts.add_dummy_prefix, facts.remove_extra_whitespaces)))
      return;

    cut_words_ = cut_newlines_ = true;
    for (int32_t id = 0; id < vocab_size(); ++id) {
      const std::string& piece = processor_->IdToPiece(id);
      size_t lead = 0;
      while (piece.compare(lead, kSpace.size(), kSpace) == 0) lead += kSpace.size();
      if (piece.find(kSpace, lead) != std::string::npos) cut_words_ = false;
      if (piece.find('\n') != std::string::npos && piece != "\n") cut_newlines_ = false;
    }
    if (!cut_words_ && !cut_newlines_) return;
    // The probes: segments (through tuna's BPE, else through the library) against the library on the whole.
    exact_ = true;
    if (own_bpe_ && !segments_match_library()) own_bpe_ = false;
    if (normalize_ && !own_bpe_) {
      exact_ = false;
      return;
    }
    exact_ = segments_match_library();
  }

  bool segments_match_library() const {
    for (const char* probe :
         {"Hello world", "a  b c", "x\ny z.\n\nNext para", " lead", "trail ", "two  ", "\nstarts with a newline",
          " \n \n ", "ends with newlines\n\n", "The  quick\tbrown fox, 1234.56 (b) \xC3\xBC" "ber stra\xC3\x9F" "e",
          "tab\t\tand\n\tindent", "  ", "\n", "Licensed under the Apache License, Version 2.0 (the \"License\");",
          "THE SOFTWARE IS PROVIDED \"AS IS\", WITHOUT WARRANTY OF ANY KIND", "\xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x98\x80 caf\xC3\xA9",
          "Copyright (c) 1999-2024 Free Software Foundation, Inc. <https://fsf.org/>",
          // Characters normalization rules change (NFKC: ligatures, full-width, circled and super digits,
          // fractions, no-break and ideographic spaces, a combining accent), control characters, CRLF, a
          // literal "▁", and invalid UTF-8 bytes (U+FFFD).
          "\xEF\xAC\x81le \xEF\xBC\xA1\xEF\xBC\xA2 \xE2\x91\xA0 x\xC2\xB2 \xC2\xBD\xC2\xA0nbsp\xE3\x80\x80ideo e\xCC\x81t\xC3\xA9",
          "\tctrl\x01\x7F here\r\nCRLF \xE2\x96\x81lit\xE2\x96\x81 \xE2\x96\x81", "bad \xFF byte \xC3 cut \xE2\x82"}) {
      std::vector<int32_t> whole, parts;
      encode(probe, SpecialTokens::as_text, &whole);
      segment(probe, SpecialTokens::as_text, [&](std::string_view s) { encode_segment(s, &parts); },
              [](int32_t) {});
      if (whole != parts) return false;
    }
    return true;
  }

  std::string path_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> processor_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> no_prefix_;  // add_dummy_prefix off
  bool dummy_prefix_ = true;
  bool cut_words_ = false, cut_newlines_ = false;
  bool exact_ = false;
  SentencePieceBpe bpe_;
  bool own_bpe_ = false;
  SentencePieceNormalizer normalizer_;
  bool normalize_ = false;  // segments come from the normalized text (segment_normalized)  // segments encode with bpe_ (checked on the probes below), not the library
};

}  // namespace

std::unique_ptr<TokenizerImpl> load_sentencepiece(const std::string& path) {
  return std::make_unique<SentencePieceTokenizer>(path);
}

}  // namespace tuna
