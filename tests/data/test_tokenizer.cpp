// data/tokenizer: the three formats against their reference libraries' ids on real text (Debian copyright
// files; tests/fixtures/tokenizers), decoding round trips, the word cache, directories, BOS/EOS from the
// model's config, fingerprints, the files a checkpoint carries, and bad tokenizer files; plus sentencepiece
// training on demo text.
#include <gtest/gtest.h>

#include <memory>

#include "data/byte_bpe.h"
#include "data/tokenizer.h"
#include "data/tokenizer_impl.h"
#include "tests/data/data_test_util.h"
#include "tests/data/tokenizer_fixtures.h"

namespace tuna {
namespace {

using testing_data::expect_error;
using testing_data::TempDir;

// One tiny model for the whole suite: a few demo documents, 400 pieces (256 bytes + specials + merges).
class TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    const auto corpus = testing_data::demo_corpus();
    std::vector<std::string> inputs;
    for (const char* name :
         {"GPL-3/001.txt", "GPL-3/002.txt", "GPL-3/003.txt", "MPL-2.0/001.txt", "Apache-2.0/002.txt"})
      inputs.push_back((corpus / name).string());
    TokenizerTrainOptions options;
    options.num_threads = 2;
    train_tokenizer(inputs, dir_->file("tiny"), 400, options);
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string model() { return dir_->file("tiny.model"); }
  static TempDir* dir_;
};
TempDir* TokenizerTest::dir_ = nullptr;

TEST_F(TokenizerTest, TrainedModelHasLlamaSpecials) {
  EXPECT_TRUE(std::filesystem::exists(dir_->file("tiny.vocab")));
  Tokenizer tok(model());
  EXPECT_EQ(tok.vocab_size(), 400);
  EXPECT_EQ(tok.unk_id(), 0);
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_id(), 2);
  EXPECT_EQ(tok.pad_id(), -1);
  EXPECT_EQ(tok.piece(3), "<0x00>");  // byte pieces follow the specials
}

TEST_F(TokenizerTest, EncodeDecodeRoundTrip) {
  Tokenizer tok(model());
  for (const std::string& text :
       {std::string("The GNU General Public License is a free, copyleft license for software."),
        std::string("  Two spaces,\ttabs,\nnewlines\n\nand digits 2007 survive."),
        std::string(
            "Unseen characters fall back to bytes: \xc3\xa9t\xc3\xa9, \xe2\x82\xac 5, \xf0\x9f\x90\x9f.")}) {
    std::vector<int32_t> ids = tok.encode(text);
    ASSERT_FALSE(ids.empty());
    for (int32_t id : ids) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, tok.vocab_size());
      EXPECT_NE(id, tok.unk_id()) << "byte fallback: nothing is unknown";
    }
    EXPECT_EQ(tok.decode(ids), text);
  }
  EXPECT_TRUE(tok.encode("").empty());
  // Merges learned from the text: a common word takes fewer pieces than it has bytes.
  EXPECT_LT(tok.encode(" License").size(), 8u);
}

TEST_F(TokenizerTest, EncodeIsDeterministicAcrossLoads) {
  Tokenizer a(model()), b(model());
  const std::string text = "This License applies to any program or other work.";
  EXPECT_EQ(a.encode(text), b.encode(text));
}

TEST_F(TokenizerTest, DecodeRefusesIdsOutsideTheVocabulary) {
  Tokenizer tok(model());
  std::vector<int32_t> ids = {5, 400};
  expect_error([&] { tok.decode(ids); }, {model(), "id 400", "position 1", "[0, 400)"});
}

TEST(Tokenizer, MissingAndInvalidModels) {
  TempDir dir;
  expect_error([&] { Tokenizer t(dir.file("missing.model")); }, {dir.file("missing.model"), "no such file"});
  testing_data::write_file(dir.file("junk.model"), "this is not a protobuf, just text\n");
  // A file in none of the formats: the error names each format tried.
  expect_error([&] { Tokenizer t(dir.file("junk.model")); },
               {dir.file("junk.model"), "not a tokenizer in any format", "tokenizer.json", "tiktoken",
                "not a valid sentencepiece model"});
  expect_error([&] { Tokenizer t(dir.path().string()); },
               {dir.path().string(), "holds no tokenizer", "tokenizer.model", "tokenizer.json", "original/tokenizer.model"});
}

TEST(Tokenizer, TrainingErrors) {
  TempDir dir;
  expect_error([&] { train_tokenizer({}, dir.file("m"), 100); }, {"no input files"});
  expect_error([&] { train_tokenizer({dir.file("nope.txt")}, dir.file("m"), 100); },
               {"nope.txt", "not a file"});
  testing_data::write_file(dir.file("few.txt"), "a b c\nabc abc\n");
  // A vocabulary the text cannot support: sentencepiece's reason comes through.
  expect_error([&] { train_tokenizer({dir.file("few.txt")}, dir.file("m"), 5000); },
               {"tokenizer training", "vocab_size 5000", "Vocabulary size too high"});
}

// The cached word-by-word encoder gives Tokenizer::encode's ids on every demo document (raw and with
// doubled spaces, tabs, leading and trailing spaces), repeated so that the cache serves most words.
TEST_F(TokenizerTest, CachedEncoderIsExact) {
  Tokenizer tok(model());
  CachedEncoder encoder(tok);
  ASSERT_TRUE(encoder.exact()) << "a BPE model trained by train_tokenizer splits at word starts";
  EXPECT_STREQ(encoder.segment_encoder(), "tuna's sentencepiece BPE");
  std::vector<std::string> texts;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(testing_data::demo_corpus()))
    if (entry.is_regular_file()) texts.push_back(testing_data::read_file(entry.path().string()));
  texts.push_back("  two leading,  double  spaces\tand a tab  ");
  texts.push_back(" ");
  texts.push_back("\xC3\xBC" "ber \xE2\x82\xAC 12.50 caf\xC3\xA9 na\xC3\xAFve \xE6\x97\xA5\xE6\x9C\xAC");
  CachedEncoder tiny(tok, /*max_words_per_thread=*/3);  // starts over every few words
  for (int round = 0; round < 2; ++round)
    for (const std::string& text : texts) {
      std::vector<int32_t> cached, small;
      encoder.encode(text, &cached);
      ASSERT_EQ(cached, tok.encode(text)) << text.substr(0, 200);
      ASSERT_EQ(encoder.encode_by_words(text), tok.encode(text));
      tiny.encode(text, &small);
      ASSERT_EQ(small, cached);
    }
}

}  // namespace
}  // namespace tuna

namespace tuna {
namespace {

using testing_data::expect_error;
using testing_data::TempDir;
using testing_data::TokenizerFixtures;

// Every reference text and probe: the ids `key` holds, through Tokenizer::encode and through the cached
// encoder (twice, so that the second round comes from the cache), and decode gives the text back.
void expect_reference_ids(const Tokenizer& tok, const std::string& key, SpecialTokens specials) {
  const TokenizerFixtures& f = TokenizerFixtures::get();
  const auto expected = f.ids(key);
  ASSERT_EQ(expected.size(), f.texts().size());
  CachedEncoder cached(tok);
  ASSERT_TRUE(cached.exact());
  size_t tokens = 0;
  for (int round = 0; round < 2; ++round)
    for (size_t i = 0; i < f.texts().size(); ++i) {
      const std::string& text = f.texts()[i];
      if (round == 0) {
        ASSERT_EQ(tok.encode(text, specials), expected[i]) << key << " text " << i << ": " << text.substr(0, 120);
        EXPECT_EQ(tok.decode(expected[i]), text) << key << " text " << i;
        tokens += expected[i].size();
      }
      std::vector<int32_t> ids;
      cached.encode(text, &ids, specials);
      ASSERT_EQ(ids, expected[i]) << key << " (cached, round " << round << ") text " << i << ": " << text.substr(0, 120);
    }
  EXPECT_GT(tokens, 90'000u) << "the reference is real text, not a few probes";
}

TEST(TokenizerFormats, HuggingFaceJsonGivesTokenizersIds) {
  const Tokenizer& tok = TokenizerFixtures::get().llama3();
  EXPECT_EQ(tok.format(), TokenizerFormat::hf_bpe);
  EXPECT_EQ(tok.vocab_size(), 128257);  // 128000 + 256 special tokens + <|image|> (Llama 3.2's json)
  expect_reference_ids(tok, "llama3_text", SpecialTokens::as_text);
  expect_reference_ids(tok, "llama3_special", SpecialTokens::parse);
}

TEST(TokenizerFormats, TiktokenFileGivesTheSameIds) {
  const Tokenizer& tok = TokenizerFixtures::get().llama3_from_tiktoken();
  EXPECT_EQ(tok.format(), TokenizerFormat::tiktoken);
  expect_reference_ids(tok, "llama3_text", SpecialTokens::as_text);
  // Its special tokens come from the tokenizer_config.json above original/, as the json's do.
  expect_reference_ids(tok, "llama3_special", SpecialTokens::parse);
  EXPECT_EQ(tok.fingerprint(), TokenizerFixtures::get().llama3().fingerprint());
}

TEST(TokenizerFormats, SentencepieceGivesItsLibrarysIds) {
  const Tokenizer& tok = TokenizerFixtures::get().spm();
  EXPECT_EQ(tok.format(), TokenizerFormat::sentencepiece);
  EXPECT_STREQ(CachedEncoder(tok).segment_encoder(), "tuna's sentencepiece BPE");
  expect_reference_ids(tok, "spm", SpecialTokens::as_text);
}

TEST(TokenizerFormats, SpecialTokensAsTextOrParsed) {
  const Tokenizer& tok = TokenizerFixtures::get().llama3();
  const int32_t eot = tok.token_id("<|eot_id|>");
  EXPECT_EQ(eot, 128009);
  EXPECT_EQ(tok.encode("<|eot_id|>", SpecialTokens::parse), std::vector<int32_t>{eot});
  const std::vector<int32_t> as_text = tok.encode("<|eot_id|>");
  EXPECT_GT(as_text.size(), 1u);
  for (int32_t id : as_text) EXPECT_LT(id, 128000) << "a document cannot forge a control token";
  EXPECT_EQ(tok.decode(as_text), "<|eot_id|>");
}

TEST(TokenizerFormats, BosAndEosFromTheModelsConfig) {
  const TokenizerFixtures& f = TokenizerFixtures::get();
  for (const std::string& path : {f.llama3_dir(), f.llama3_json(), f.llama3_tiktoken()}) {
    const Tokenizer tok(path);
    EXPECT_EQ(tok.bos_id(), 128000) << path;  // tokenizer_config.json: <|begin_of_text|>
    EXPECT_EQ(tok.eos_id(), 128001) << path;  // <|end_of_text|>
  }
  // An instruct model's config names <|eot_id|> as EOS; a config.json's id list is read when
  // tokenizer_config.json names none.
  TempDir dir;
  std::filesystem::copy_file(f.llama3_json(), dir.file("tokenizer.json"));
  testing_data::write_file(dir.file("tokenizer_config.json"), R"({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})");
  EXPECT_EQ(Tokenizer(dir.path().string()).eos_id(), 128009);
  testing_data::write_file(dir.file("tokenizer_config.json"), R"({"tokenizer_class": "PreTrainedTokenizerFast"})");
  testing_data::write_file(dir.file("config.json"), R"({"bos_token_id": 128000, "eos_token_id": [128008, 128009]})");
  EXPECT_EQ(Tokenizer(dir.path().string()).eos_id(), 128008);
  testing_data::write_file(dir.file("tokenizer_config.json"), R"({"eos_token": "<|no_such_token|>"})");
  expect_error([&] { Tokenizer t(dir.path().string()); },
               {dir.file("tokenizer_config.json"), "eos_token", "<|no_such_token|>", "is not a token"});
  // Without any config: the json's post-processor names BOS; the tiktoken file has Llama 3's own.
  std::filesystem::remove(dir.file("tokenizer_config.json"));
  std::filesystem::remove(dir.file("config.json"));
  const Tokenizer bare(dir.file("tokenizer.json"));
  EXPECT_EQ(bare.bos_id(), 128000);
  EXPECT_EQ(bare.eos_id(), -1);
  std::filesystem::copy_file(f.llama3_tiktoken(), dir.file("llama3.tiktoken"));
  const Tokenizer tiktoken(dir.file("llama3.tiktoken"));
  EXPECT_EQ(tiktoken.bos_id(), 128000);
  EXPECT_EQ(tiktoken.eos_id(), 128001);
  EXPECT_EQ(tiktoken.vocab_size(), 128256);  // Meta's 256 special tokens, no <|image|>
  EXPECT_EQ(tiktoken.token_id("<|eot_id|>"), 128009);
  EXPECT_EQ(tiktoken.token_id("<|start_header_id|>"), 128006);
}

// A tokenizer against its model's vocab_size: unused special tokens above it (Llama 3.2's <|image|>) are a
// warning naming them, and refused at encode time when a prompt parses one; anything text could produce above
// it (a vocabulary token, BOS, EOS) is an error naming the ids and what to do.
TEST(TokenizerFormats, ATokenizerBiggerThanItsModel) {
  // Llama 3.2's tokenizer.json: specials from 128000 (EOS 128001) and <|image|> at 128256, one past the
  // vocab_size of Llama 3.2's text models.
  const Tokenizer& tok = TokenizerFixtures::get().llama3();
  ASSERT_EQ(tok.vocab_size(), 128257);
  EXPECT_EQ(check_tokenizer_fits(tok, 128257, "config.json"), "");
  const std::string image = check_tokenizer_fits(tok, 128256, "m/config.json");
  EXPECT_NE(image.find("1 special token(s) at or above the model's vocab_size 128256 (m/config.json): 128256 <|image|>"),
            std::string::npos) << image;
  const std::string warning = check_tokenizer_fits(tok, 128010, "m/config.json");
  EXPECT_NE(warning.find("247 special token(s) at or above the model's vocab_size 128010 (m/config.json)"),
            std::string::npos) << warning;
  EXPECT_NE(warning.find(": 128010 <|"), std::string::npos) << warning;
  EXPECT_NE(warning.find("(247 in all)"), std::string::npos) << warning;
  expect_error([&] { check_tokenizer_fits(tok, 128001, "m/config.json"); },
               {tok.path(), "128257 ids, more than the model's vocab_size 128001", "ids 128001 <|end_of_text|>",
                "Use the model's own tokenizer"});
  expect_error([&] { check_tokenizer_fits(tok, 127990, "m/config.json"); }, {"ids 127990 "});
  // At encode time: a prompt that parses an id the model has no embedding for.
  const std::vector<int32_t> ids = tok.encode("hi<|eot_id|>", SpecialTokens::parse);
  EXPECT_NO_THROW(check_ids_fit(tok, ids, 128256, "the prompt"));
  expect_error([&] { check_ids_fit(tok, ids, 128005, "the prompt"); },
               {"the prompt: token 128009 (<|eot_id|>) is at or above the model's vocab_size 128005"});
  const std::vector<int32_t> image_ids = tok.encode("<|image|>", SpecialTokens::parse);
  expect_error([&] { check_ids_fit(tok, image_ids, 128256, "the prompt"); }, {"token 128256 (<|image|>)"});
  for (int32_t id : tok.encode("<|image|>")) EXPECT_LT(id, 128000);  // as text: plain tokens
  // The model's vocab_size comes from the config.json beside the tokenizer.
  TempDir dir;
  std::string config;
  EXPECT_EQ(model_vocab_beside(dir.path().string(), &config), 0);
  testing_data::write_file(dir.file("config.json"), R"({"vocab_size": 128000})");
  EXPECT_EQ(model_vocab_beside(dir.path().string(), &config), 128000);
  EXPECT_EQ(config, dir.file("config.json"));
  EXPECT_EQ(model_vocab_beside(dir.file("tokenizer.json"), &config), 128000);
}

TEST(TokenizerFormats, DirectoriesFindTheirTokenizer) {
  const TokenizerFixtures& f = TokenizerFixtures::get();
  EXPECT_EQ(Tokenizer(f.llama3_dir()).path(), f.llama3_json());
  TempDir dir;
  // Only original/tokenizer.model (tiktoken) and the config above it.
  std::filesystem::create_directories(dir.path() / "original");
  std::filesystem::copy_file(f.llama3_tiktoken(), dir.path() / "original/tokenizer.model");
  EXPECT_EQ(Tokenizer(dir.path().string()).format(), TokenizerFormat::tiktoken);
  // Beside a sentencepiece tokenizer.model (LLaMA 2's downloads have both), the tokenizer.json is read, as
  // transformers' AutoTokenizer reads it; naming the .model reads that.
  std::filesystem::copy_file(f.spm_model(), dir.file("tokenizer.model"));
  std::filesystem::copy_file(f.llama3_json(), dir.file("tokenizer.json"));
  EXPECT_EQ(Tokenizer(dir.path().string()).format(), TokenizerFormat::hf_bpe);
  EXPECT_EQ(Tokenizer(dir.file("tokenizer.model")).format(), TokenizerFormat::sentencepiece);
}

TEST(TokenizerFormats, FingerprintsTellVocabulariesApart) {
  const TokenizerFixtures& f = TokenizerFixtures::get();
  const uint64_t llama3 = f.llama3().fingerprint(), spm = f.spm().fingerprint();
  EXPECT_NE(llama3, spm);
  EXPECT_EQ(Tokenizer(f.spm_model()).fingerprint(), spm);
  // The tiktoken file with Meta's 256 special tokens (no <|image|>) is another vocabulary than the json's 257.
  TempDir dir;
  std::filesystem::copy_file(f.llama3_tiktoken(), dir.file("tokenizer.model"));
  EXPECT_NE(Tokenizer(dir.file("tokenizer.model")).fingerprint(), llama3);
}

TEST(TokenizerFormats, LongPiecesMergeAsShortOnesDo) {
  // Pieces over 48 bytes merge through a heap, shorter ones by rescans: the same order. A long word, its
  // halves' ids and a long run of punctuation, compared with the tiktoken file (a different merge table
  // built from the ranks).
  const TokenizerFixtures& f = TokenizerFixtures::get();
  const Tokenizer &json = f.llama3(), &tiktoken = f.llama3_from_tiktoken();
  for (const std::string& text :
       {std::string("Pneumonoultramicroscopicsilicovolcanoconiosis") + "antidisestablishmentarianism" +
            "supercalifragilisticexpialidocious",
        std::string(200, '='), std::string("http://") + std::string(100, 'w') + ".example.org",
        std::string("Mississippi") + std::string(60, 's') + "ippi"}) {
    const auto ids = json.encode(text);
    EXPECT_EQ(tiktoken.encode(text), ids) << text;
    EXPECT_EQ(json.decode(ids), text);
  }
}

TEST(TokenizerFormats, BadTokenizerJsonIsRefusedByName) {
  TempDir dir;
  auto write = [&](const std::string& name, const std::string& json) {
    testing_data::write_file(dir.file(name), json);
    return dir.file(name);
  };
  const std::string wordpiece =
      write("wordpiece.json", R"({"version": "1.0", "normalizer": null, "pre_tokenizer": null,
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "vocab": {"[UNK]": 0, "a": 1}}})");
  expect_error([&] { Tokenizer t(wordpiece); }, {wordpiece, "model.type", "WordPiece", "not supported"});
  const std::string unigram = write("unigram.json", R"({"model": {"type": "Unigram", "vocab": [["a", -1.0]]}})");
  expect_error([&] { Tokenizer t(unigram); }, {unigram, "Unigram", "not supported"});
  const std::string precompiled =
      write("t5.json", R"({"normalizer": {"type": "Sequence", "normalizers": [{"type": "Precompiled", "precompiled_charsmap": ""}]},
        "pre_tokenizer": null, "model": {"type": "BPE", "byte_fallback": true, "vocab": {"a": 0}, "merges": []}})");
  expect_error([&] { Tokenizer t(precompiled); }, {precompiled, "normalizer.normalizers[0]", "Precompiled", "tokenizer.model"});
  const std::string not_tokenizer = write("config.json", R"({"hidden_size": 64})");
  expect_error([&] { Tokenizer t(not_tokenizer); }, {not_tokenizer, "not a Hugging Face tokenizer.json"});
  const std::string broken = write("broken.json", R"({"model": {"type": "BPE", )");
  expect_error([&] { Tokenizer t(broken); }, {broken, "not valid JSON"});
  const std::string dropout = write(
      "dropout.json", R"({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
        "model": {"type": "BPE", "dropout": 0.1, "vocab": {}, "merges": []}})");
  expect_error([&] { Tokenizer t(dropout); }, {dropout, "model.dropout", "BPE dropout"});
  // A byte-level BPE whose vocabulary lacks a byte drops it, as the library does (and names it for prepare).
  const std::string missing_byte =
      write("bytes.json", R"({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}})");
  const Tokenizer lacking(missing_byte);
  EXPECT_EQ(lacking.encode("ab!"), std::vector<int32_t>({2}));
  EXPECT_NE(lacking.impl().missing_bytes().find('!'), std::string::npos);
}

// Ids and texts a crafted tokenizer.json gets wrong (tests/fuzz/corpus/tokenizer_json): each refused
// by name before it is allocated or indexed.
TEST(TokenizerFormats, InconsistentTokenizerJsonIsRefused) {
  TempDir dir;
  auto tokenizer = [&](const std::string& name, const std::string& vocab, const std::string& added) {
    testing_data::write_file(dir.file(name), R"({"pre_tokenizer": {"type": "ByteLevel", "use_regex": true},
        "added_tokens": [)" + added + R"(], "model": {"type": "BPE", "vocab": {)" + vocab + R"(}, "merges": []}})");
    return dir.file(name);
  };
  // One id of 2^30 - 1 would have allocated a table of 2^30 tokens (32 GB).
  const std::string far_vocab = tokenizer("far_vocab.json", R"("a": 0, "b": 1073741823)", "");
  expect_error([&] { Tokenizer t(far_vocab); }, {far_vocab, "model.vocab and added_tokens", "ids up to 1073741823",
                                                 "more than 65536 ids would have no token"});
  const std::string far_added = tokenizer("far_added.json", R"("a": 0)", R"({"id": 70000, "content": "<x>"})");
  expect_error([&] { Tokenizer t(far_added); }, {far_added, "ids up to 70000"});
  // An added token on a vocabulary id with other text, or two on one id: the library gives each the next free id
  // (and warns), and so does tuna; the vocabulary entry stays.
  const std::string replaced = tokenizer("replaced.json", R"("abcdefghijklmnopqrstuvwxyz": 0)",
                                         R"({"id": 0, "content": "<|a special token longer than the one it replaces|>"})");
  const Tokenizer moved(replaced);
  EXPECT_EQ(moved.token_id("<|a special token longer than the one it replaces|>"), 1);
  EXPECT_EQ(moved.piece(0), "abcdefghijklmnopqrstuvwxyz");
  const std::string twice = tokenizer("twice.json", R"("a": 0)",
                                      R"({"id": 1, "content": "<x>"}, {"id": 1, "content": "<y>"})");
  const Tokenizer both(twice);
  EXPECT_EQ(both.token_id("<x>"), 1);
  EXPECT_EQ(both.token_id("<y>"), 2);
  testing_data::write_file(dir.file("repeated.json"), R"({"model": {"type": "BPE", "vocab": {}, "merges": []},
      "model": {"type": "BPE", "vocab": {}, "merges": []}})");
  expect_error([&] { Tokenizer t(dir.file("repeated.json")); }, {dir.file("repeated.json"), "key 'model' appears twice"});
}

// Several pre-tokenizer regexes (Split steps before a ByteLevel with its own regex) split each other's pieces;
// the inner split reused the thread's match data and corrupted the outer one's position: wrong pieces or an
// endless loop. (add_prefix_space is given: the library's default is true, which puts a space before each piece.)
TEST(TokenizerFormats, NestedPreTokenizerRegexes) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; b++) vocab[byte_level_encode(std::string(1, static_cast<char>(b)))] = b;
  const nlohmann::json split = {{"type", "Split"}, {"pattern", {{"Regex", "\\d"}}}, {"behavior", "Isolated"}};
  const nlohmann::json t = {
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers", {split, {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}}}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
  TempDir dir;
  testing_data::write_file(dir.file("tokenizer.json"), t.dump());
  const Tokenizer tok(dir.file("tokenizer.json"));
  std::vector<std::string> pieces;
  tok.impl().segment("hello 12 world", SpecialTokens::as_text, [&](std::string_view s) { pieces.emplace_back(s); },
                     [](int32_t) {});
  EXPECT_EQ(pieces, (std::vector<std::string>{"hello", " ", "1", "2", " world"}));
  EXPECT_EQ(tok.decode(tok.encode("hello 12 world")), "hello 12 world");
}

TEST(TokenizerFormats, BadTiktokenFilesAreRefused) {
  TempDir dir;
  testing_data::write_file(dir.file("small.tiktoken"), "IQ== 0\nIg== 1\n");
  expect_error([&] { Tokenizer t(dir.file("small.tiktoken")); },
               {dir.file("small.tiktoken"), "2 ranks", "not Llama 3's vocabulary", "tokenizer.json"});
  testing_data::write_file(dir.file("gap.tiktoken"), "IQ== 0\nIg== 2\n");
  expect_error([&] { Tokenizer t(dir.file("gap.tiktoken")); }, {dir.file("gap.tiktoken") + ":2", "rank 2", "1 was expected"});
  testing_data::write_file(dir.file("bad.tiktoken"), "IQ== 0\n!!!! 1\n");
  expect_error([&] { Tokenizer t(dir.file("bad.tiktoken")); }, {dir.file("bad.tiktoken") + ":2", "base64 rank"});
  // Llama 3's ranks with a tokenizer_config.json whose added tokens are far from them, or not ids at all.
  std::filesystem::create_directories(dir.path() / "original");
  std::filesystem::copy_file(TokenizerFixtures::get().llama3_tiktoken(), dir.path() / "original/tokenizer.model");
  const std::string ranks = (dir.path() / "original/tokenizer.model").string(), config = dir.file("tokenizer_config.json");
  testing_data::write_file(config, R"({"added_tokens_decoder": {"1073741823": {"content": "<|far|>", "special": true}}})");
  expect_error([&] { Tokenizer t(ranks); }, {config, "ids up to 1073741823", "would have no token"});
  testing_data::write_file(config, R"({"added_tokens_decoder": {"128000x": {"content": "<|x|>"}}})");
  expect_error([&] { Tokenizer t(ranks); }, {config, "added_tokens_decoder['128000x']", "expected a decimal id"});
  testing_data::write_file(config, R"({"added_tokens_decoder": {"128000": {"content": 7}}})");
  expect_error([&] { Tokenizer t(ranks); }, {config, "added_tokens_decoder['128000']", "expected {\"content\": string"});
  testing_data::write_file(config, R"({"added_tokens_decoder": )" + std::string(1000, '[') + std::string(1000, ']') + "}");
  expect_error([&] { Tokenizer t(ranks); }, {config, "nested deeper than 64"});
}

TEST(TokenizerFormats, InvalidUtf8IsAnErrorForBpe) {
  const Tokenizer& tok = TokenizerFixtures::get().llama3();
  expect_error([&] { tok.encode("caf\xE9"); }, {"not valid UTF-8"});
}

// What a checkpoint carries is exactly the tokenizer named, and loads back the same.
TEST(TokenizerFiles, CarryExactlyTheNamedTokenizer) {
  const TokenizerFixtures& f = TokenizerFixtures::get();
  TempDir dir;
  // A sentencepiece file under another name, beside a tokenizer.model of another tokenizer.
  std::filesystem::create_directories(dir.path() / "toks");
  std::filesystem::copy_file(f.spm_model(), dir.path() / "toks/contracts-8k.model");
  std::filesystem::copy_file(f.llama3_tiktoken(), dir.path() / "toks/tokenizer.model");
  auto carried = [&](const std::string& source) {
    const std::filesystem::path out = dir.path() / ("ckpt-" + std::to_string(std::hash<std::string>()(source)));
    std::filesystem::create_directories(out);
    const auto files = tokenizer_files(source);
    copy_tokenizer_files(files, out);
    std::vector<std::string> names;
    for (const auto& file : files) names.push_back(file.name);
    const Tokenizer original(source), copy(out.string());
    EXPECT_EQ(copy.fingerprint(), original.fingerprint()) << source;
    EXPECT_EQ(copy.bos_id(), original.bos_id()) << source;
    EXPECT_EQ(copy.eos_id(), original.eos_id()) << source;
    return names;
  };
  EXPECT_EQ(carried((dir.path() / "toks/contracts-8k.model").string()), std::vector<std::string>{"tokenizer.model"});
  EXPECT_EQ(carried(f.llama3_json()), (std::vector<std::string>{"tokenizer.json", "tokenizer_config.json"}));
  EXPECT_EQ(carried(f.llama3_tiktoken()), (std::vector<std::string>{"tokenizer.model", "tokenizer_config.json"}));
  EXPECT_EQ(carried(f.llama3_dir()), (std::vector<std::string>{"tokenizer.json", "tokenizer_config.json"}));
  // A path that does not exist or does not parse is an error, not an empty checkpoint.
  expect_error([&] { tokenizer_files(dir.file("nope.model")); }, {dir.file("nope.model"), "no such file"});
  testing_data::write_file(dir.file("junk.model"), "junk");
  expect_error([&] { tokenizer_files(dir.file("junk.model")); }, {dir.file("junk.model"), "not a tokenizer"});
  // A model directory without a tokenizer carries none when allowed (training from scratch).
  std::filesystem::create_directories(dir.path() / "bare");
  EXPECT_TRUE(tokenizer_files((dir.path() / "bare").string(), /*allow_none=*/true).empty());
  expect_error([&] { tokenizer_files((dir.path() / "bare").string()); }, {"holds no tokenizer"});
}

}  // namespace
}  // namespace tuna

#include <sentencepiece_trainer.h>

#include <random>

namespace tuna {
namespace {

using testing_data::TempDir;
using testing_data::TokenizerFixtures;

// Sentencepiece models as spm_train makes them by default (the nmt_nfkc normalization rule, extra
// whitespace removed: tuna normalizes the document itself and caches the normalized words) besides the
// LLaMA-style fixture (identity, whitespace kept): the cached encoder against the library's ids on the real
// reference texts, on random slices of them (cut anywhere, even inside a UTF-8 character, with whitespace
// runs inserted), on long words that merge through the heap, and on characters that normalization changes.
class SentencepieceCache : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    std::string lines;
    for (const std::string& text : TokenizerFixtures::get().texts()) lines += text + "\n";
    testing_data::write_file(dir_->file("corpus.txt"), lines);
    for (const char* type : {"bpe", "unigram"}) {
      const auto status = sentencepiece::SentencePieceTrainer::Train(
          std::string("--input=") + dir_->file("corpus.txt") + " --model_prefix=" + dir_->file(type) +
          " --model_type=" + type + " --vocab_size=1500 --byte_fallback=true --num_threads=2 --minloglevel=2");
      ASSERT_TRUE(status.ok()) << status.ToString();
    }
    // LLaMA-style (identity, whitespace kept) with user-defined pieces, which match first and never merge.
    const auto status = sentencepiece::SentencePieceTrainer::Train(
        std::string("--input=") + dir_->file("corpus.txt") + " --model_prefix=" + dir_->file("user") +
        " --model_type=bpe --vocab_size=1500 --byte_fallback=true --num_threads=2 --minloglevel=2"
        " --normalization_rule_name=identity --remove_extra_whitespaces=false --split_digits=true"
        " --user_defined_symbols=License,<br>,Licen");
    ASSERT_TRUE(status.ok()) << status.ToString();
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string model(const char* type) { return dir_->file(std::string(type) + ".model"); }
  static TempDir* dir_;

  // Cached ids (twice: the second time from the cache) and segment-by-segment ids equal the library's.
  static void expect_library_ids(const Tokenizer& tok, const CachedEncoder& encoder, const std::string& text) {
    const std::vector<int32_t> expected = tok.encode(text);
    for (int round = 0; round < 2; ++round) {
      std::vector<int32_t> ids;
      encoder.encode(text, &ids);
      ASSERT_EQ(ids, expected) << tok.path() << " round " << round << ": " << testing::PrintToString(text);
    }
    ASSERT_EQ(encoder.encode_by_words(text), expected) << tok.path() << ": " << testing::PrintToString(text);
  }
};
TempDir* SentencepieceCache::dir_ = nullptr;

TEST_F(SentencepieceCache, NormalizingBpeIsCachedAndExactOnRealText) {
  const Tokenizer tok(model("bpe"));
  const CachedEncoder encoder(tok);
  ASSERT_TRUE(encoder.exact());
  EXPECT_STREQ(encoder.segment_encoder(), "tuna's sentencepiece normalizer and BPE");
  size_t tokens = 0;
  for (const std::string& text : TokenizerFixtures::get().texts()) {
    expect_library_ids(tok, encoder, text);
    tokens += tok.encode(text).size();
  }
  EXPECT_GT(tokens, 90'000u);
}

TEST_F(SentencepieceCache, NormalizingUnigramEncodesWholeDocuments) {
  const Tokenizer tok(model("unigram"));
  const CachedEncoder encoder(tok);
  EXPECT_FALSE(encoder.exact());
  expect_library_ids(tok, encoder, TokenizerFixtures::get().texts()[0]);
}

TEST_F(SentencepieceCache, RandomSlicesOfRealTextMatchTheLibrary) {
  const auto& texts = TokenizerFixtures::get().texts();
  for (const std::string& path : {model("bpe"), model("user"), TokenizerFixtures::get().spm_model()}) {
    const Tokenizer tok(path);
    const CachedEncoder encoder(tok);
    ASSERT_TRUE(encoder.exact()) << path;
    std::mt19937 rng(7);
    for (int i = 0; i < 1500; ++i) {
      const std::string& text = texts[rng() % texts.size()];
      if (text.empty()) continue;
      const size_t begin = rng() % text.size();
      std::string slice = text.substr(begin, 1 + rng() % 400);
      for (int k = 0; k < 3; ++k) {  // whitespace runs the cleaner would have collapsed
        static const char* const kRuns[] = {"  ", "\t", "\n\n", " \n ", "   \t"};
        slice.insert(rng() % (slice.size() + 1), kRuns[rng() % 5]);
      }
      expect_library_ids(tok, encoder, slice);
      if (HasFatalFailure()) return;
    }
  }
}

TEST_F(SentencepieceCache, LongWordsAndNormalizedCharactersMatchTheLibrary) {
  for (const std::string& path : {model("bpe"), model("user"), TokenizerFixtures::get().spm_model()}) {
    const Tokenizer tok(path);
    const CachedEncoder encoder(tok);
    ASSERT_TRUE(encoder.exact()) << path;
    EXPECT_NE(std::string(encoder.segment_encoder()).find("tuna's"), std::string::npos) << path;
    for (const std::string& text :
         {std::string("Pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism"),
          std::string(500, 'a'), std::string(200, '='), std::string(" ") + std::string(300, ' ') + "x",
          std::string("libs/geometry/include/boost/geometry/algorithms/detail/overlay/get_turn_info_helpers.hpp"),
          std::string("https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/") + std::string(80, '-'),
          std::string("the the the the the the the the the the the the the the the the the the the"),
          // Ligatures, full-width letters, circled and superscript digits, fractions, no-break and
          // ideographic spaces, a combining accent, control characters, CRLF, a written "▁".
          std::string("\xEF\xAC\x81le \xEF\xBC\xA1\xEF\xBC\xA2\xEF\xBC\xA3 \xE2\x91\xA0 x\xC2\xB2 \xC2\xBD\xC2\xA0n "
                      "\xE3\x80\x80i e\xCC\x81t\xC3\xA9 \x01\x7F\r\n\xE2\x96\x81 \xE2\x96\x81\xE2\x96\x81w"),
          std::string("invalid \xFF bytes \xC3( and \xE2\x82 cut"), std::string("\xE2\x96\x81"),
          std::string(" \n \t "), std::string("\xEF\xAC\x81"),
          std::string("the License<br>Licensed, LicenseLicense Licen<br><br>")}) {
      expect_library_ids(tok, encoder, text);
      if (HasFatalFailure()) return;
    }
  }
}

}  // namespace
}  // namespace tuna
