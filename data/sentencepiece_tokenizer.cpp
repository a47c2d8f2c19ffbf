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
// a space stood before it ("word" at the start encodes as " word" does later). Normalizations that could
// act across a cut (anything but identity, or remove_extra_whitespaces) make the model encode whole
// documents instead; so does a model whose cuts fail the probe strings checked at load.
#include <sentencepiece_processor.h>

#include <algorithm>
#include <cstring>
#include <queue>
#include <filesystem>
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
    if (f.number == 2 && f.wire_type == 2) facts->charsmap = !f.payload.empty();
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
//   - text: spaces become "▁" (identity normalization; the segment carries no dummy prefix);
//   - symbols: user-defined pieces where they match (longest; they never merge), else one UTF-8 character;
//   - merge: the adjacent pair whose concatenation is a piece (normal, user-defined or unused) with the highest
//     score, leftmost on ties, until none is left;
//   - ids: a merged unused piece is split back into the pair it came from; a symbol that is no piece is
//     <unk>, or its bytes' <0xNN> pieces with byte fallback.
// Made only for BPE models with identity normalization and valid UTF-8 segments; the rest goes to the library.
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
    if (!bpe || pieces_.empty()) return false;
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
    return unk_ >= 0;
  }

  void encode(std::string_view segment, std::vector<int32_t>* out) const {
    thread_local std::string text;
    text.clear();
    for (char c : segment) {
      if (c == ' ')
        text.append(kSpace);
      else
        text.push_back(c);
    }
    struct Symbol {
      uint32_t begin, size;
      int32_t prev, next;
      bool frozen;
    };
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
      if (!size) size = utf8_length(static_cast<uint8_t>(text[at]));
      size = std::min(size, text.size() - at);
      const int32_t index = static_cast<int32_t>(symbols.size());
      symbols.push_back({static_cast<uint32_t>(at), static_cast<uint32_t>(size), index - 1, -1, frozen});
      if (index > 0) symbols[index - 1].next = index;
      at += size;
    }
    struct Pair {
      float score;
      int32_t left, right;
      uint32_t size;
    };
    // sentencepiece's agenda: the highest score first, the leftmost on ties.
    auto lower = [](const Pair& a, const Pair& b) { return a.score < b.score || (a.score == b.score && a.left > b.left); };
    thread_local std::vector<Pair> heap;
    heap.clear();
    // (unused piece, size of its left half) of each merge into an unused piece: the last one is how the
    // piece splits back (sentencepiece's rev_merge).
    thread_local std::vector<std::pair<int32_t, uint32_t>> unused_merges;
    unused_merges.clear();
    auto view = [&](const Symbol& s) { return std::string_view(text).substr(s.begin, s.size); };
    auto maybe_add = [&](int32_t left, int32_t right) {
      if (left < 0 || right < 0 || symbols[left].frozen || symbols[right].frozen) return;
      const uint32_t size = symbols[left].size + symbols[right].size;
      const int32_t id = mergeable_.find(std::string_view(text).substr(symbols[left].begin, size));
      if (id < 0) return;
      heap.push_back({pieces_[id].score, left, right, size});
      std::push_heap(heap.begin(), heap.end(), lower);
      if (pieces_[id].type == kUnused) unused_merges.push_back({id, symbols[left].size});
    };
    for (int32_t i = 1; i < static_cast<int32_t>(symbols.size()); ++i) maybe_add(i - 1, i);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), lower);
      const Pair top = heap.back();
      heap.pop_back();
      Symbol &left = symbols[top.left], &right = symbols[top.right];
      if (left.size == 0 || right.size == 0 || left.size + right.size != top.size) continue;
      left.size += right.size;
      left.next = right.next;
      if (right.next >= 0) symbols[right.next].prev = top.left;
      right.size = 0;
      maybe_add(left.prev, top.left);
      maybe_add(top.left, left.next);
    }
    for (int32_t i = 0; i >= 0 && !symbols.empty(); i = symbols[i].next) emit(view(symbols[i]), unused_merges, out);
  }

 private:
  static constexpr int kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6;
  struct Piece {
    std::string text;
    float score = 0;
    int type = kNormal;
  };
  static size_t utf8_length(uint8_t c) { return c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1; }

  // A final symbol's ids: its piece, an unused piece split back into the pair it was merged from, or
  // <unk> (its bytes' pieces with byte fallback).
  void emit(std::string_view symbol, const std::vector<std::pair<int32_t, uint32_t>>& unused_merges,
            std::vector<int32_t>* out) const {
    const int32_t id = mergeable_.find(symbol);
    if (id >= 0 && pieces_[id].type == kUnused) {
      for (auto it = unused_merges.rbegin(); it != unused_merges.rend(); ++it)
        if (it->first == id) {
          emit(symbol.substr(0, it->second), unused_merges, out);
          emit(symbol.substr(it->second), unused_merges, out);
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
  std::vector<int32_t> user_defined_;
  int32_t unk_ = -1;
  bool byte_fallback_ = false;
  std::array<int32_t, 256> byte_{};
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
    return !exact_ ? "none (whole documents through sentencepiece)"
                   : own_bpe_ ? "tuna's sentencepiece BPE" : "sentencepiece, segment by segment";
  }

  void segment(std::string_view text, SpecialTokens, const std::function<void(std::string_view)>& on_text,
               const std::function<void(int32_t)>&) const override {
    TUNA_CHECK(exact_, "segment() on a sentencepiece model that failed the segment checks");
    if (text.empty()) return;
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
    for (size_t i = 1; i < total; ++i) {
      const char c = at(i), prev = at(i - 1);
      const bool cut = (cut_words_ && c == ' ' && prev != ' ') ||
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
    if (facts.name != "identity" || facts.charsmap || facts.remove_extra_whitespaces || !facts.escape_whitespaces)
      return;
    auto no_prefix = std::make_unique<sentencepiece::SentencePieceProcessor>();
    if (!no_prefix->LoadFromSerializedProto(no_prefix_model).ok()) return;
    no_prefix_ = std::move(no_prefix);
    own_bpe_ = bpe_.init(model);

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
    exact_ = segments_match_library();
  }

  bool segments_match_library() const {
    for (const char* probe :
         {"Hello world", "a  b c", "x\ny z.\n\nNext para", " lead", "trail ", "two  ", "\nstarts with a newline",
          " \n \n ", "ends with newlines\n\n", "The  quick\tbrown fox, 1234.56 (b) \xC3\xBC" "ber stra\xC3\x9F" "e",
          "tab\t\tand\n\tindent", "  ", "\n", "Licensed under the Apache License, Version 2.0 (the \"License\");",
          "THE SOFTWARE IS PROVIDED \"AS IS\", WITHOUT WARRANTY OF ANY KIND", "\xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x98\x80 caf\xC3\xA9",
          "Copyright (c) 1999-2024 Free Software Foundation, Inc. <https://fsf.org/>"}) {
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
  bool own_bpe_ = false;  // segments encode with bpe_ (checked on the probes below), not the library
};

}  // namespace

std::unique_ptr<TokenizerImpl> load_sentencepiece(const std::string& path) {
  return std::make_unique<SentencePieceTokenizer>(path);
}

}  // namespace tuna
