// data/prepare: the pipeline on small inputs with bad records; report counts, shards that load, identical
// output whatever the thread count, refusal to mix with an earlier run, tokenizer training.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "data/loader.h"
#include "data/prepare.h"
#include "data/shard.h"
#include "tests/data/data_test_util.h"

namespace tuna {
namespace {

using testing_data::expect_error;
using testing_data::read_file;
using testing_data::TempDir;
using testing_data::write_file;

class PrepareTest : public ::testing::Test {
 protected:
  // One tiny tokenizer for the suite, trained on a few demo documents (byte fallback needs 256 + 3
  // specials + one piece per character seen, so a few hundred is the floor).
  static void SetUpTestSuite() {
    tok_dir_ = new TempDir();
    const auto corpus = testing_data::demo_corpus();
    TokenizerTrainOptions options;
    options.num_threads = 2;
    train_tokenizer({(corpus / "GPL-3/001.txt").string(), (corpus / "GPL-3/002.txt").string(),
                     (corpus / "LGPL-3/001.txt").string()},
                    tok_dir_->file("tok"), 400, options);
  }
  static void TearDownTestSuite() {
    delete tok_dir_;
    tok_dir_ = nullptr;
  }
  static std::string tokenizer() { return tok_dir_->file("tok.model"); }

  PrepareOptions base_options(const std::string& out) const {
    PrepareOptions o;
    o.tokenizer_path = tokenizer();
    o.out_dir = out;
    o.threads = 2;
    o.quiet = true;
    return o;
  }

  static TempDir* tok_dir_;
};
TempDir* PrepareTest::tok_dir_ = nullptr;

TEST_F(PrepareTest, CountsEveryRecordAndWritesLoadableShards) {
  TempDir dir;
  const std::string in = dir.file("docs");
  write_file(in + "/a.txt", "The first document.\nIt has two lines.\n");
  write_file(in + "/empty.txt", "  \n\n\t\n");
  write_file(in + "/sub/b.md", "# Heading\n\nA markdown body.\n");
  write_file(in + "/notes.csv", "not,read\n");
  write_file(in + "/data.jsonl",
             "{\"text\": \"A JSON document about licenses.\", \"id\": 1}\n"  // 1 kept
             "{\"text\": \"broken\n"                                         // 2 malformed
             "{\"title\": \"no text here\"}\n"                               // 3 no text field
             "\n"                                                            // 4 blank: not a document
             "{\"text\": \"Another JSON document.\"}\n"                      // 5 kept
             "{\"text\": 42}\n"                                              // 6 text is not a string
             "[1, 2]\n");                                                    // 7 not an object
  PrepareOptions o = base_options(dir.file("out"));
  o.inputs = {in};
  o.val_fraction = 0.0;
  PrepareReport r = prepare_corpus(o);

  EXPECT_EQ(r.files_read, 4u);
  EXPECT_EQ(r.files_skipped.count, 1u);
  EXPECT_EQ(r.files_skipped.first, in + "/notes.csv");
  EXPECT_EQ(r.documents_read, 9u);
  EXPECT_EQ(r.documents_kept, 4u);
  EXPECT_EQ(r.empty.count, 1u);
  EXPECT_EQ(r.empty.first, in + "/empty.txt");
  EXPECT_EQ(r.malformed_json.count, 1u);
  EXPECT_EQ(r.malformed_json.first, in + "/data.jsonl:2");
  EXPECT_EQ(r.missing_text.count, 3u);
  EXPECT_EQ(r.missing_text.first, in + "/data.jsonl:3");
  EXPECT_EQ(r.tokenize_failed.count, 0u);
  EXPECT_EQ(r.documents_read, r.documents_kept + r.empty.count + r.malformed_json.count +
                                  r.missing_text.count + r.tokenize_failed.count);
  EXPECT_EQ(r.train.documents, 4u);
  EXPECT_EQ(r.val.documents, 0u);
  ASSERT_EQ(r.train.shards.size(), 1u);
  EXPECT_TRUE(r.val.shards.empty());

  // report.json says the same.
  nlohmann::json j = nlohmann::json::parse(read_file(dir.file("out/report.json")));
  EXPECT_EQ(j["documents"]["read"], 9);
  EXPECT_EQ(j["documents"]["malformed_json"]["first"], in + "/data.jsonl:2");
  EXPECT_EQ(j["train"]["tokens"], r.train.tokens);
  EXPECT_FALSE(report_summary(r).empty());

  // The shard holds the kept documents in input order, each BOS + text + EOS.
  Tokenizer tok(tokenizer());
  ShardReader shard(dir.file("out/train-00000.bin"));
  EXPECT_EQ(shard.vocab_size(), 400u);
  EXPECT_EQ(shard.token_count(), r.train.tokens);
  ASSERT_EQ(shard.document_count(), 4u);
  const std::vector<std::string> texts = {"The first document.\nIt has two lines.\n",
                                          "A JSON document about licenses.", "Another JSON document.",
                                          "# Heading\n\nA markdown body.\n"};
  for (size_t d = 0; d < 4; ++d) {
    auto [begin, end] = shard.document(d);
    ASSERT_GE(end - begin, 2u);
    std::vector<int32_t> ids(end - begin);
    shard.read_tokens(begin, end - begin, ids.data());
    EXPECT_EQ(ids.front(), tok.bos_id());
    EXPECT_EQ(ids.back(), tok.eos_id());
    EXPECT_EQ(tok.decode(std::span<const int32_t>(ids).subspan(1, ids.size() - 2)), texts[d]);
  }
}

TEST_F(PrepareTest, OutputIsIdenticalWhateverTheThreadCount) {
  TempDir dir;
  const std::string corpus = (testing_data::demo_corpus() / "GPL-3").string();
  PrepareReport reports[2];
  for (int threads : {1, 2}) {
    PrepareOptions o = base_options(dir.file("out" + std::to_string(threads)));
    o.inputs = {corpus};
    o.threads = threads;
    o.val_fraction = 0.3;
    o.shard_tokens = 3000;
    reports[threads - 1] = prepare_corpus(o);
  }
  const PrepareReport& r = reports[0];
  EXPECT_EQ(r.documents_kept, r.documents_read);
  EXPECT_GT(r.val.documents, 0u);
  EXPECT_GT(r.train.documents, r.val.documents);
  EXPECT_GT(r.train.shards.size(), 1u) << "shard_tokens 3000 rotates shards";
  ASSERT_EQ(reports[1].train.shards.size(), r.train.shards.size());
  ASSERT_EQ(reports[1].val.shards.size(), r.val.shards.size());
  uint64_t train_tokens = 0;
  for (size_t i = 0; i < r.train.shards.size(); ++i) {
    EXPECT_EQ(read_file(r.train.shards[i]), read_file(reports[1].train.shards[i])) << r.train.shards[i];
    ShardReader shard(r.train.shards[i]);
    train_tokens += shard.token_count();
    // A shard closes before a document would push it past shard_tokens (unless it holds only that one).
    if (shard.document_count() > 1) {
      EXPECT_LE(shard.token_count(), 3000u);
    }
  }
  EXPECT_EQ(train_tokens, r.train.tokens);
  for (size_t i = 0; i < r.val.shards.size(); ++i)
    EXPECT_EQ(read_file(r.val.shards[i]), read_file(reports[1].val.shards[i]));

  // The loader takes the training split by pattern.
  LoaderOptions lo;
  lo.seq_len = 32;
  lo.micro_batch = 4;
  lo.vocab_size = 400;
  DataLoader loader({dir.file("out1/train-*.bin")}, lo);
  EXPECT_EQ(loader.shard_count(), r.train.shards.size());
  EXPECT_EQ(loader.total_tokens(), r.train.tokens);
  std::vector<int32_t> in(128), tg(128);
  EXPECT_TRUE(loader.next(in.data(), tg.data()));
}

TEST_F(PrepareTest, RefusesToMixWithAnEarlierRun) {
  TempDir dir;
  write_file(dir.file("in/a.txt"), "Some text for a shard.");
  PrepareOptions o = base_options(dir.file("out"));
  o.inputs = {dir.file("in")};
  prepare_corpus(o);
  expect_error([&] { prepare_corpus(o); }, {dir.file("out"), "earlier run", "--overwrite"});
  o.overwrite = true;
  PrepareReport r = prepare_corpus(o);
  EXPECT_EQ(r.documents_kept, 1u);
}

TEST_F(PrepareTest, BadInvocations) {
  TempDir dir;
  write_file(dir.file("in/a.txt"), "text");
  write_file(dir.file("in/table.csv"), "a,b");
  PrepareOptions o = base_options(dir.file("out"));
  o.inputs = {dir.file("in/missing.txt")};
  expect_error([&] { prepare_corpus(o); }, {dir.file("in/missing.txt"), "no such file"});
  o.inputs = {dir.file("in/table.csv")};
  expect_error([&] { prepare_corpus(o); }, {dir.file("in/table.csv"), "unsupported file type '.csv'"});
  o.inputs = {dir.file("in")};
  o.tokenizer_path = dir.file("missing.model");
  expect_error([&] { prepare_corpus(o); }, {dir.file("missing.model"), "no such file"});
  EXPECT_FALSE(std::filesystem::exists(dir.file("out"))) << "nothing written before the inputs check out";
  o = base_options(dir.file("out"));
  o.inputs = {dir.file("in")};
  o.val_fraction = 1.5;
  expect_error([&] { prepare_corpus(o); }, {"--val-fraction", "1.5"});
}

TEST_F(PrepareTest, TrainsTheTokenizerFirst) {
  TempDir dir;
  PrepareOptions o = base_options(dir.file("out"));
  o.inputs = {(testing_data::demo_corpus() / "LGPL-3").string()};
  o.tokenizer_path = dir.file("tok/new.model");
  std::filesystem::create_directories(dir.file("tok"));
  o.train_tokenizer = true;
  o.vocab_size = 380;
  o.tokenizer_options.num_threads = 2;
  PrepareReport r = prepare_corpus(o);
  EXPECT_TRUE(r.tokenizer_trained);
  EXPECT_EQ(r.vocab_size, 380);
  EXPECT_TRUE(std::filesystem::exists(dir.file("tok/new.model")));
  EXPECT_TRUE(std::filesystem::exists(dir.file("tok/new.vocab")));
  EXPECT_FALSE(std::filesystem::exists(dir.file("out/tokenizer-sample.txt.tmp")));
  EXPECT_EQ(r.documents_kept, r.documents_read);
  EXPECT_GT(r.train.tokens, 0u);
  EXPECT_EQ(ShardReader(r.train.shards.at(0)).vocab_size(), 380u);
}

}  // namespace
}  // namespace tuna
