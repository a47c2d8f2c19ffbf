// data/tokenizer: train a tiny model on demo text, then encode/decode round trips and bad model files.
#include <gtest/gtest.h>

#include <memory>

#include "data/tokenizer.h"
#include "tests/data/data_test_util.h"

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
  expect_error([&] { Tokenizer t(dir.file("junk.model")); },
               {dir.file("junk.model"), "not a valid sentencepiece model"});
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
