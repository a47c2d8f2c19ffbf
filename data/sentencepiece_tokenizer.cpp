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
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <filesystem>
#include <thread>
#include <unordered_map>

#include "core/error.h"
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

    cut_words_ = cut_newlines_ = true;
    for (int32_t id = 0; id < vocab_size(); ++id) {
      const std::string& piece = processor_->IdToPiece(id);
      size_t lead = 0;
      while (piece.compare(lead, kSpace.size(), kSpace) == 0) lead += kSpace.size();
      if (piece.find(kSpace, lead) != std::string::npos) cut_words_ = false;
      if (piece.find('\n') != std::string::npos && piece != "\n") cut_newlines_ = false;
    }
    if (!cut_words_ && !cut_newlines_) return;
    exact_ = true;
    for (const char* probe :
         {"Hello world", "a  b c", "x\ny z.\n\nNext para", " lead", "trail ", "two  ", "\nstarts with a newline",
          " \n \n ", "ends with newlines\n\n", "The  quick\tbrown fox, 1234.56 (b) \xC3\xBC" "ber stra\xC3\x9F" "e",
          "tab\t\tand\n\tindent", "  ", "\n"}) {
      std::vector<int32_t> whole, parts;
      encode(probe, SpecialTokens::as_text, &whole);
      segment(probe, SpecialTokens::as_text, [&](std::string_view s) { encode_segment(s, &parts); },
              [](int32_t) {});
      if (whole != parts) {
        exact_ = false;
        return;
      }
    }
  }

  std::string path_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> processor_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> no_prefix_;  // add_dummy_prefix off
  bool dummy_prefix_ = true;
  bool cut_words_ = false, cut_newlines_ = false;
  bool exact_ = false;
};

}  // namespace

std::unique_ptr<TokenizerImpl> load_sentencepiece(const std::string& path) {
  return std::make_unique<SentencePieceTokenizer>(path);
}

void train_tokenizer(const std::vector<std::string>& input_files, const std::string& model_prefix,
                     int vocab_size, const TokenizerTrainOptions& options) {
  if (input_files.empty()) fail("tokenizer training (", model_prefix, "): no input files");
  std::string inputs;
  for (const std::string& file : input_files) {
    if (!std::filesystem::is_regular_file(file))
      fail("tokenizer training (", model_prefix, "): input ", file, " is not a file");
    // sentencepiece takes its inputs as one comma-separated flag.
    if (file.find(',') != std::string::npos)
      fail("tokenizer training (", model_prefix, "): input file name ", file,
           " contains a comma, which sentencepiece cannot take");
    inputs += (inputs.empty() ? "" : ",") + file;
  }
  if (vocab_size < 1)
    fail("tokenizer training (", model_prefix, "): vocab_size must be positive, found ", vocab_size);
  if (options.model_type != "bpe" && options.model_type != "unigram")
    fail("tokenizer training (", model_prefix, "): model_type must be bpe or unigram, found ",
         options.model_type);
  const int threads =
      options.num_threads > 0 ? options.num_threads : std::max(1u, std::thread::hardware_concurrency());

  const std::unordered_map<std::string, std::string> args = {
      {"input", inputs},
      {"model_prefix", model_prefix},
      {"vocab_size", std::to_string(vocab_size)},
      {"model_type", options.model_type},
      {"character_coverage", std::to_string(options.character_coverage)},
      {"input_sentence_size", std::to_string(options.input_sentence_size)},
      {"shuffle_input_sentence", options.shuffle_input_sentence ? "true" : "false"},
      {"max_sentence_length", std::to_string(options.max_sentence_length)},
      {"num_threads", std::to_string(threads)},
      // LLaMA's choices: keep the text as it is (no NFKC, no whitespace folding), so decode(encode(x))
      // gives x back; any byte encodes through the 256 byte pieces.
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "true"},
      {"byte_fallback", "true"},
      {"split_digits", "true"},
      {"allow_whitespace_only_pieces", "true"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"minloglevel", options.quiet ? "2" : "0"},
  };
  sentencepiece::SetRandomGeneratorSeed(options.seed);
  const auto status = sentencepiece::SentencePieceTrainer::Train(args);
  if (!status.ok())
    fail("tokenizer training (", model_prefix, ", vocab_size ", vocab_size, "): ", status.ToString());
}

}  // namespace tuna
