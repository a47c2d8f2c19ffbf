// data/prepare: the pipeline end to end on small inputs. Every bad input counted under its reason
// with its location, the accounting identity, each filter, exact and near dedup keeping the earliest
// document, compressed inputs, SFT loss masks reaching the loader, identical output whatever the thread
// count, partition budget and rank count (mpirun -np 2 of build/prepare), refusal to mix with an earlier
// run, tokenizer training.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <sys/stat.h>
#include <sstream>

#include "data/loader.h"
#include "data/prepare.h"
#include "data/shard.h"
#include "kernels/cpu/classifier.h"  // kIgnoreIndex
#include "tests/data/data_test_util.h"
#include "tests/data/tokenizer_fixtures.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

using testing_data::expect_error;
using testing_data::gzip_bytes;
using testing_data::read_file;
using testing_data::TempDir;
using testing_data::write_file;
using testing_data::zstd_bytes;

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

uint64_t sum_of_outcomes(const PrepareReport& r) {
  uint64_t sum = 0;
  for (const Tally& t : r.outcome) sum += t.count;
  return sum;
}

// Every document of every shard of a split, in shard order: the token stream as the trainer sees it.
std::vector<std::vector<int32_t>> documents_of(const std::vector<std::string>& shards) {
  std::vector<std::vector<int32_t>> docs;
  for (const std::string& path : shards) {
    ShardReader shard(path);
    for (uint64_t d = 0; d < shard.document_count(); ++d) {
      auto [begin, end] = shard.document(d);
      std::vector<int32_t> ids(end - begin);
      shard.read_tokens(begin, end - begin, ids.data());
      docs.push_back(std::move(ids));
    }
  }
  return docs;
}

std::string decode_body(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  EXPECT_GE(ids.size(), 2u);
  EXPECT_EQ(ids.front(), tok.bos_id());
  EXPECT_EQ(ids.back(), tok.eos_id());
  return tok.decode(std::span<const int32_t>(ids).subspan(1, ids.size() - 2));
}

TEST_F(PrepareTest, CountsEveryBadInputWithItsLocation) {
  TempDir dir;
  const std::string in = dir.file("docs");
  write_file(in + "/a.txt", "The first document.\nIt has two lines.\n");
  write_file(in + "/b_empty.txt", "  \n\n\t\n");
  write_file(in + "/c_nul.txt", std::string("Binary\0junk inside a document.", 31));
  write_file(in + "/d_utf8.txt", "Caf\xE9 au lait, latin-1 bytes in a UTF-8 corpus.");
  write_file(in + "/notes.csv", "not,read\n");
  write_file(in + "/sub/e.md", "# Heading\n\nA markdown body.\n");
  write_file(in + "/f.jsonl",
             "{\"text\": \"A JSON document about licenses.\", \"id\": 1}\n"  // 1 kept
             "{\"text\": \"broken\n"                                         // 2 malformed
             "{\"title\": \"no text here\"}\n"                               // 3 missing field
             "\n"                                                            // 4 blank: not a document
             "{\"text\": \"Another JSON document.\"}\n"                      // 5 kept
             "{\"text\": 42}\n"                                              // 6 text is not a string
             "[1, 2]\n"                                                      // 7 not an object
             "{\"text\": \"bad \xFF byte in JSON\"}\n");                     // 8 repaired, kept
  // One line of 100 MB: counted as oversized without being held (max 64 MiB).
  {
    std::ofstream big(in + "/g_big.jsonl", std::ios::binary);
    big << "{\"text\": \"before the big line\"}\n{\"text\": \"";
    const std::string chunk(1 << 20, 'x');
    for (int i = 0; i < 100; ++i) big << chunk;
    big << "\"}\n{\"text\": \"after the big line\"}\n";
  }
  // A .jsonl.gz cut short inside line 3, and a .zst that is not zstd at all.
  {
    std::string lines;
    for (int i = 1; i <= 400; ++i) lines += "{\"text\": \"compressed record number " + std::to_string(i * 7919 % 100003) + "\"}\n";
    const std::string gz = gzip_bytes(lines);
    write_file(in + "/h_cut.jsonl.gz", gz.substr(0, gz.size() / 2));
    write_file(in + "/i_garbage.txt.zst", "definitely not zstd");
  }
  PrepareOptions o = base_options(dir.file("out"));
  o.inputs = {in};
  o.val_fraction = 0.0;
  o.near_dedup = false;  // the compressed records differ in a single number
  o.batch_records = 5;   // many batches: records, damage and locations carried across batch ends
  PrepareReport r = prepare_corpus(o);

  EXPECT_EQ(r.files_skipped.count, 1u);
  EXPECT_EQ(r.files_skipped.first, in + "/notes.csv");
  EXPECT_EQ(r.files_damaged.count, 2u);
  EXPECT_NE(r.files_damaged.first.find(in + "/h_cut.jsonl.gz:"), std::string::npos) << r.files_damaged.first;
  EXPECT_NE(r.files_damaged.first.find("truncated gzip"), std::string::npos) << r.files_damaged.first;
  EXPECT_EQ(r.of(Outcome::empty).count, 1u);
  EXPECT_EQ(r.of(Outcome::empty).first, in + "/b_empty.txt");
  EXPECT_EQ(r.removed_nul.count, 1u);
  EXPECT_EQ(r.removed_nul.first, in + "/c_nul.txt");
  EXPECT_EQ(r.repaired_utf8.count, 2u);
  EXPECT_EQ(r.repaired_utf8.first, in + "/d_utf8.txt");
  EXPECT_EQ(r.of(Outcome::malformed_json).count, 1u);
  EXPECT_EQ(r.of(Outcome::malformed_json).first, in + "/f.jsonl:2");
  EXPECT_EQ(r.of(Outcome::missing_field).count, 3u);
  EXPECT_EQ(r.of(Outcome::missing_field).first, in + "/f.jsonl:3");
  EXPECT_EQ(r.of(Outcome::oversized).count, 1u);
  EXPECT_EQ(r.of(Outcome::oversized).first, in + "/g_big.jsonl:2");
  // The cut .gz: the whole lines before the damage are documents, the cut one is 'truncated'; the garbage
  // .zst is one truncated document (a text file).
  EXPECT_EQ(r.of(Outcome::truncated).count, 2u);
  EXPECT_NE(r.of(Outcome::truncated).first.find(in + "/h_cut.jsonl.gz:"), std::string::npos);
  const uint64_t gz_kept = r.documents_kept() - 9;  // a, c, d, e, f:1, f:5, f:8, g:1, g:3
  EXPECT_GT(gz_kept, 50u);
  EXPECT_LT(gz_kept, 400u);
  EXPECT_EQ(r.documents_read, sum_of_outcomes(r)) << "in == sum of the parts";
  EXPECT_EQ(r.documents_read, r.documents_kept() + 1 + 1 + 3 + 1 + 2);
  EXPECT_EQ(r.train.documents, r.documents_kept());

  // report.json says the same, and reads back.
  nlohmann::json j = nlohmann::json::parse(read_file(dir.file("out/report.json")));
  EXPECT_EQ(j["documents"]["read"], r.documents_read);
  EXPECT_EQ(j["documents"]["outcomes"]["malformed_json"]["first"], in + "/f.jsonl:2");
  PrepareReport back = report_from_json(j);
  EXPECT_EQ(back.documents_read, r.documents_read);
  EXPECT_EQ(back.of(Outcome::oversized).first, r.of(Outcome::oversized).first);
  const std::string summary = report_summary(r);
  EXPECT_NE(summary.find("oversized"), std::string::npos);
  EXPECT_NE(summary.find(in + "/g_big.jsonl:2"), std::string::npos);

  // The shard holds the kept documents in input order, cleaned: NUL gone, bad byte -> U+FFFD.
  Tokenizer tok(tokenizer());
  auto docs = documents_of(r.train.shards);
  ASSERT_EQ(docs.size(), r.documents_kept());
  EXPECT_EQ(decode_body(tok, docs[0]), "The first document.\nIt has two lines.");
  EXPECT_EQ(decode_body(tok, docs[1]), "Binaryjunk inside a document.");
  EXPECT_EQ(decode_body(tok, docs[2]), "Caf\xEF\xBF\xBD au lait, latin-1 bytes in a UTF-8 corpus.");
  EXPECT_EQ(decode_body(tok, docs[3]), "A JSON document about licenses.");
  EXPECT_EQ(decode_body(tok, docs[5]), "bad \xEF\xBF\xBD byte in JSON");
  EXPECT_EQ(decode_body(tok, docs[6]), "before the big line");
  EXPECT_EQ(decode_body(tok, docs[7]), "after the big line");
  EXPECT_EQ(decode_body(tok, docs.back()), "# Heading\n\nA markdown body.");
}

TEST_F(PrepareTest, DropsInvalidUtf8ByOption) {
  TempDir dir;
  write_file(dir.file("in/a.txt"), "fine text here");
  write_file(dir.file("in/b.txt"), "bad \xC3 text");
  write_file(dir.file("in/c.jsonl"), "{\"text\": \"bad \xFF json\"}\n");
  PrepareOptions o = base_options(dir.file("out"));
  o.inputs = {dir.file("in")};
  o.clean.drop_invalid_utf8 = true;
  PrepareReport r = prepare_corpus(o);
  EXPECT_EQ(r.documents_kept(), 1u);
  EXPECT_EQ(r.of(Outcome::invalid_utf8).count, 2u);
  EXPECT_EQ(r.of(Outcome::invalid_utf8).first, dir.file("in/b.txt"));
  EXPECT_EQ(r.of(Outcome::invalid_utf8).count + r.documents_kept(), r.documents_read);
}

TEST_F(PrepareTest, EachFilterCountsUnderItsRule) {
  TempDir dir;
  write_file(dir.file("in/docs.jsonl"),
             "{\"text\": \"A proper sentence that passes every rule.\"}\n"
             "{\"text\": \"tiny\"}\n"
             "{\"text\": \"" + std::string(300, 'a') + "\"}\n"
             "{\"text\": \"1234 5678 9012 3456 7890 1234 5678 | -- ++ 12\"}\n"
             "{\"text\": \"the same line\\nthe same line\\nthe same line\\nanother line\"}\n");
  PrepareOptions o = base_options(dir.file("out"));
  o.inputs = {dir.file("in")};
  o.quality.min_chars = 10;
  o.quality.max_chars = 200;
  o.quality.min_alpha_fraction = 0.5;
  o.quality.max_repeated_line_fraction = 0.3;
  PrepareReport r = prepare_corpus(o);
  EXPECT_EQ(r.documents_kept(), 1u);
  EXPECT_EQ(r.of(Outcome::too_short).first, dir.file("in/docs.jsonl:2"));
  EXPECT_EQ(r.of(Outcome::too_long).first, dir.file("in/docs.jsonl:3"));
  EXPECT_EQ(r.of(Outcome::low_alpha).first, dir.file("in/docs.jsonl:4"));
  EXPECT_EQ(r.of(Outcome::repeated_lines).first, dir.file("in/docs.jsonl:5"));
  EXPECT_EQ(r.documents_read, 5u);
  EXPECT_EQ(sum_of_outcomes(r), 5u);
}

// A corpus of `n` distinct synthetic documents plus exact and near copies, as JSONL lines.
std::string synthetic_line(std::mt19937_64& rng, int words) {
  static const char* vocab[] = {"agreement", "party",   "shall",  "notice", "payment", "term",   "lessee",
                                "lessor",    "premises", "rent",  "breach", "cure",    "written", "default",
                                "assign",    "consent", "period", "annual", "report",  "filing", "audit"};
  std::ostringstream out;
  for (int i = 0; i < words; ++i) out << (i ? " " : "") << vocab[rng() % 21] << (rng() % 50);
  return out.str();
}

TEST_F(PrepareTest, DedupKeepsTheEarliestOfEachCluster) {
  TempDir dir;
  std::mt19937_64 rng(5);
  const std::string a = synthetic_line(rng, 300), b = synthetic_line(rng, 300), c = synthetic_line(rng, 300);
  std::string b_near = b;
  b_near.replace(b_near.find(' '), 1, " inserted ");  // one word added: near, not exact
  auto line = [](const std::string& t) { return "{\"text\": \"" + t + "\"}\n"; };
  // 1 a, 2 b, 3 a again (exact, after whitespace normalization), 4 b with an extra word (near), 5 c.
  write_file(dir.file("in/1.jsonl"), line(a) + line(b));
  write_file(dir.file("in/2.jsonl"), line("  " + a + "  ") + line(b_near) + line(c));
  PrepareOptions o = base_options(dir.file("out"));
  o.inputs = {dir.file("in")};
  o.val_fraction = 0;
  PrepareReport r = prepare_corpus(o);
  EXPECT_EQ(r.documents_kept(), 3u);
  EXPECT_EQ(r.of(Outcome::exact_duplicate).count, 1u);
  EXPECT_EQ(r.of(Outcome::exact_duplicate).first, dir.file("in/2.jsonl:1"));
  EXPECT_EQ(r.of(Outcome::near_duplicate).count, 1u);
  EXPECT_EQ(r.of(Outcome::near_duplicate).first, dir.file("in/2.jsonl:2"));
  Tokenizer tok(tokenizer());
  auto docs = documents_of(r.train.shards);
  ASSERT_EQ(docs.size(), 3u);
  EXPECT_EQ(decode_body(tok, docs[0]), a);
  EXPECT_EQ(decode_body(tok, docs[1]), b);
  EXPECT_EQ(decode_body(tok, docs[2]), c);

  // Both off: everything kept.
  o.overwrite = true;
  o.exact_dedup = o.near_dedup = false;
  EXPECT_EQ(prepare_corpus(o).documents_kept(), 5u);
}

// dropped.jsonl: one line per document not kept, in input order, with its reason; a filter's line says what
// it measured, a duplicate's names the document kept in its place. What the listing skipped is counted.
TEST_F(PrepareTest, ListsEveryDroppedDocumentWithItsReason) {
  TempDir dir;
  std::mt19937_64 rng(7);
  const std::string a = synthetic_line(rng, 300), b = synthetic_line(rng, 300);
  std::string b_near = b;
  b_near.replace(b_near.find(' '), 1, " inserted ");
  auto line = [](const std::string& t) { return "{\"text\": \"" + t + "\"}\n"; };
  std::string repeated;
  for (int i = 0; i < 8; ++i) repeated += "Amount due under this agreement for the quarter\\n";
  write_file(dir.file("in/1.jsonl"), line(a) + line(b) + "{not json\n" + line("tiny") + line(repeated));
  write_file(dir.file("in/2.jsonl"), line(a) + line("b") + line(b_near));
  write_file(dir.file("elsewhere/secret.txt"), "Not corpus text.");
  std::filesystem::create_symlink(dir.file("elsewhere/secret.txt"), dir.file("in/3.txt"));
  ASSERT_EQ(::mkfifo(dir.file("in/4.txt").c_str(), 0600), 0);  // read, it would block: skipped
  PrepareOptions o = base_options(dir.file("out"));
  o.inputs = {dir.file("in")};
  o.quality.min_chars = 5;
  PrepareReport r = prepare_corpus(o);
  EXPECT_EQ(r.documents_read, 8u);
  EXPECT_EQ(r.documents_kept(), 2u);
  EXPECT_EQ(r.files_symlinks.count, 1u);
  EXPECT_EQ(r.files_not_regular.count, 1u);
  EXPECT_EQ(r.files_not_regular.first, dir.file("in/4.txt") + ": a FIFO (named pipe), not a regular file");
  ASSERT_EQ(r.dropped_lists, (std::vector<std::string>{dir.file("out/dropped.jsonl")}));
  std::vector<nlohmann::json> lines;
  std::istringstream in(read_file(dir.file("out/dropped.jsonl")));
  for (std::string l; std::getline(in, l);) lines.push_back(nlohmann::json::parse(l));
  ASSERT_EQ(lines.size(), 6u);
  auto expect_line = [&](size_t k, const std::string& where, const std::string& reason) {
    EXPECT_EQ(lines[k].at("where"), where) << k;
    EXPECT_EQ(lines[k].at("reason"), reason) << k;
  };
  expect_line(0, dir.file("in/1.jsonl:3"), "malformed_json");
  expect_line(1, dir.file("in/1.jsonl:4"), "too_short");
  EXPECT_EQ(lines[1].at("measure"), "chars");
  EXPECT_EQ(lines[1].at("value"), 4.0);
  EXPECT_EQ(lines[1].at("limit"), 5.0);
  expect_line(2, dir.file("in/1.jsonl:5"), "repeated_lines");
  EXPECT_EQ(lines[2].at("measure"), "repeated_line_chars");
  EXPECT_GT(lines[2].at("value").get<double>(), 0.7);
  expect_line(3, dir.file("in/2.jsonl:1"), "exact_duplicate");
  EXPECT_EQ(lines[3].at("duplicate_of"), dir.file("in/1.jsonl:1"));
  expect_line(4, dir.file("in/2.jsonl:2"), "too_short");
  expect_line(5, dir.file("in/2.jsonl:3"), "near_duplicate");
  EXPECT_EQ(lines[5].at("duplicate_of"), dir.file("in/1.jsonl:2"));
  // The report counts the same drops: every line is one of them.
  uint64_t dropped = 0;
  for (size_t k = 1; k < kOutcomes; ++k) dropped += r.outcome[k].count;
  EXPECT_EQ(dropped, lines.size());
}

TEST_F(PrepareTest, CompressedInputsGiveTheSameTokens) {
  TempDir dir;
  const auto corpus = testing_data::demo_corpus() / "LGPL-3";
  std::string jsonl;
  std::vector<std::string> texts;
  for (int i = 1; i <= 6; ++i) {
    char name[16];
    std::snprintf(name, sizeof name, "%03d.txt", i);
    texts.push_back(read_file((corpus / name).string()));
    jsonl += nlohmann::json{{"text", texts.back()}}.dump() + "\n";
  }
  write_file(dir.file("plain/a.jsonl"), jsonl);
  write_file(dir.file("gz/a.jsonl.gz"), gzip_bytes(jsonl.substr(0, 1000)) + gzip_bytes(jsonl.substr(1000)));
  write_file(dir.file("zst/a.jsonl.zst"), zstd_bytes(jsonl));
  std::vector<std::vector<std::vector<int32_t>>> results;
  for (const char* kind : {"plain", "gz", "zst"}) {
    PrepareOptions o = base_options(dir.file(std::string("out-") + kind));
    o.inputs = {dir.file(kind)};
    o.val_fraction = 0;
    PrepareReport r = prepare_corpus(o);
    EXPECT_EQ(r.files_damaged.count, 0u) << kind;
    EXPECT_EQ(r.documents_read, 6u) << kind;
    results.push_back(documents_of(r.train.shards));
  }
  EXPECT_EQ(results[0], results[1]);
  EXPECT_EQ(results[0], results[2]);
}

TEST_F(PrepareTest, SftMasksThePromptAndTheLoaderIgnoresIt) {
  TempDir dir;
  write_file(dir.file("in/sft.jsonl"),
             "{\"prompt\": \"What is the term of the lease?\", \"response\": \"Twelve months from signing.\"}\n"
             "{\"prompt\": \"No response here\"}\n"
             "{\"prompt\": \"\", \"response\": \"A response without a prompt.\"}\n");
  PrepareOptions o = base_options(dir.file("out"));
  o.inputs = {dir.file("in")};
  o.sft = true;
  o.val_fraction = 0;
  PrepareReport r = prepare_corpus(o);
  EXPECT_EQ(r.documents_kept(), 2u);
  EXPECT_EQ(r.of(Outcome::missing_field).first, dir.file("in/sft.jsonl:2"));
  ASSERT_EQ(r.train.shards.size(), 1u);
  ShardReader shard(r.train.shards[0]);
  ASSERT_TRUE(shard.has_mask());
  Tokenizer tok(tokenizer());
  const std::vector<int32_t> prompt = tok.encode("What is the term of the lease?");
  const std::vector<int32_t> response = tok.encode("Twelve months from signing.");
  auto [begin, end] = shard.document(0);
  ASSERT_EQ(end - begin, 1 + prompt.size() + response.size() + 1);
  for (uint64_t i = begin; i < end; ++i) {
    const bool in_response = i - begin > prompt.size();
    EXPECT_EQ(shard.mask(i), in_response ? 1 : 0) << "token " << i;
  }
  EXPECT_EQ(shard.token(begin + 1 + prompt.size()), response[0]);
  auto [begin2, end2] = shard.document(1);
  EXPECT_EQ(shard.mask(begin2), 0) << "BOS is context";
  for (uint64_t i = begin2 + 1; i < end2; ++i) EXPECT_EQ(shard.mask(i), 1);

  // The loader turns the prompt's targets into kIgnoreIndex and says where documents start.
  LoaderOptions lo;
  lo.seq_len = static_cast<int64_t>(shard.token_count() - 1);
  lo.vocab_size = 400;
  lo.eval = true;
  DataLoader loader({r.train.shards[0]}, lo);
  std::vector<int32_t> in(lo.seq_len), tg(lo.seq_len), pos(lo.seq_len);
  ASSERT_TRUE(loader.next(in.data(), tg.data(), pos.data()));
  for (int64_t j = 0; j < lo.seq_len; ++j) {
    const uint64_t target = static_cast<uint64_t>(j) + 1;
    EXPECT_EQ(tg[j] == cpu::kIgnoreIndex, shard.mask(target) == 0) << j;
    EXPECT_EQ(pos[j], static_cast<uint64_t>(j) < end ? j : static_cast<int64_t>(j - end)) << j;
  }
}

// A Llama 3 tokenizer named by its model directory: its tokenizer.json, BOS/EOS from tokenizer_config.json,
// 4-byte tokens, and the shards carry its fingerprint.
TEST_F(PrepareTest, Llama3TokenizerByDirectory) {
  const testing_data::TokenizerFixtures& f = testing_data::TokenizerFixtures::get();
  TempDir dir;
  const std::vector<std::string> texts = {"The Licensee shall pay the fees set out in Schedule 2.",
                                          "Copyright \u00a9 2024 \u2014 all rights reserved. Section 4(b)(ii)."};
  std::string jsonl;
  for (const std::string& t : texts) jsonl += "{\"text\": \"" + t + "\"}\n";
  write_file(dir.file("in/docs.jsonl"), jsonl);
  PrepareOptions o = base_options(dir.file("out"));
  o.tokenizer_path = f.llama3_dir();
  o.inputs = {dir.file("in")};
  o.val_fraction = 0;
  const PrepareReport r = prepare_corpus(o);
  EXPECT_EQ(r.tokenizer_path, f.llama3_json());
  EXPECT_EQ(r.tokenizer_format, "Hugging Face BPE");
  EXPECT_EQ(r.bos_id, 128000);
  EXPECT_EQ(r.eos_id, 128001);
  const Tokenizer& tok = f.llama3();
  EXPECT_EQ(r.tokenizer_fingerprint, tok.fingerprint());
  ASSERT_EQ(r.train.shards.size(), 1u);
  const ShardReader shard(r.train.shards[0]);
  EXPECT_EQ(shard.token_width(), 4u);
  EXPECT_EQ(shard.tokenizer_fingerprint(), tok.fingerprint());
  const auto docs = documents_of(r.train.shards);
  ASSERT_EQ(docs.size(), 2u);
  const std::vector<std::string> decoded = {"The Licensee shall pay the fees set out in Schedule 2.",
                                            "Copyright \xC2\xA9 2024 \xE2\x80\x94 all rights reserved. Section 4(b)(ii)."};
  for (size_t d = 0; d < docs.size(); ++d) {
    std::vector<int32_t> expected = {128000};
    for (int32_t id : tok.encode(decoded[d])) expected.push_back(id);
    expected.push_back(128001);
    EXPECT_EQ(docs[d], expected) << d;
  }
  const nlohmann::json report = nlohmann::json::parse(read_file(dir.file("out/report.json")));
  EXPECT_EQ(report["tokenizer"]["path"], f.llama3_json());
  EXPECT_EQ(report["shard_format"]["version"], 2);
}

// SFT conversations render through the model's chat template; the mask trains on the assistant's turns;
// a conversation the template cannot take is counted, with its location.
TEST_F(PrepareTest, SftConversationsThroughTheChatTemplate) {
  const testing_data::TokenizerFixtures& f = testing_data::TokenizerFixtures::get();
  TempDir dir;
  write_file(dir.file("in/chat.jsonl"),
             R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Term?"}, {"role": "assistant", "content": "Twelve  months."}]})" "\n"
             R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "robot", "content": "Hello"}]})" "\n"
             R"({"messages": "not a list"})" "\n"
             R"({"prompt": "Governing law?", "response": "The laws of Delaware."})" "\n");
  for (const std::string& format : {std::string("llama3"), std::string("llama2")}) {
    const bool llama3 = format == "llama3";
    PrepareOptions o = base_options(dir.file("out-" + format));
    o.tokenizer_path = llama3 ? f.llama3_dir() : tokenizer();
    o.inputs = {dir.file("in")};
    o.sft = true;
    o.val_fraction = 0;
    const PrepareReport r = prepare_corpus(o);
    EXPECT_EQ(r.chat_template, format);
    EXPECT_EQ(r.documents_kept(), 2u) << format;
    EXPECT_EQ(r.of(Outcome::bad_chat).count, 1u) << format;
    EXPECT_EQ(r.of(Outcome::bad_chat).first, dir.file("in/chat.jsonl:2"));
    EXPECT_EQ(r.of(Outcome::missing_field).first, dir.file("in/chat.jsonl:3"));
    const Tokenizer tok(o.tokenizer_path);
    const CachedEncoder encoder(tok);
    RenderedChat expected;
    std::string why;
    // Cleaning collapses the double space before the conversation is rendered.
    ASSERT_TRUE(render_chat(encoder, tok, llama3 ? ChatFormat::llama3 : ChatFormat::llama2,
                            {{"system", "Be brief."}, {"user", "Term?"}, {"assistant", "Twelve months."}}, &expected, &why))
        << why;
    const ShardReader shard(r.train.shards.at(0));
    ASSERT_TRUE(shard.has_mask());
    auto [begin, end] = shard.document(0);
    ASSERT_EQ(end - begin, expected.tokens.size()) << format;
    for (uint64_t i = begin; i < end; ++i) {
      EXPECT_EQ(shard.token(i), expected.tokens[i - begin]) << format << " token " << i;
      EXPECT_EQ(shard.mask(i), expected.mask[i - begin]) << format << " token " << i;
    }
    EXPECT_EQ(documents_of(r.train.shards).size(), 2u) << "the prompt/response record stays as it was";
  }
  // A model whose chat template tuna does not render: the first conversation stops the run, naming it and
  // the template; an explicit --chat-template overrides.
  write_file(dir.file("chatml/tokenizer_config.json"), R"({"chat_template": "<|im_start|>{{ role }}"})");
  std::filesystem::copy_file(tokenizer(), dir.file("chatml/tokenizer.model"));
  PrepareOptions o = base_options(dir.file("out-chatml"));
  o.tokenizer_path = dir.file("chatml");
  o.inputs = {dir.file("in")};
  o.sft = true;
  expect_error([&] { prepare_corpus(o); },
               {dir.file("in/chat.jsonl:1"), "conversation", "neither Llama 3's", "--chat-template"});
  o.chat_template = "llama2";
  o.overwrite = true;
  EXPECT_EQ(prepare_corpus(o).documents_kept(), 2u);
}

TEST_F(PrepareTest, OutputIsIdenticalWhateverTheThreadCountAndBudget) {
  TempDir dir;
  const std::string corpus = testing_data::demo_corpus().string();
  PrepareReport reports[3];
  for (int run = 0; run < 3; ++run) {
    PrepareOptions o = base_options(dir.file("out" + std::to_string(run)));
    o.inputs = {corpus};
    o.threads = run == 0 ? 1 : 2;
    o.dedup_memory_bytes = run == 2 ? 4096 : uint64_t{1} << 30;  // run 2: many partitions per column
    o.batch_records = run == 2 ? 7 : 4096;                       // run 2: 40 batches, read ahead
    o.val_fraction = 0.3;
    o.shard_tokens = 6000;
    reports[run] = prepare_corpus(o);
  }
  const PrepareReport& r = reports[0];
  EXPECT_EQ(r.documents_read, 275u);
  EXPECT_EQ(r.documents_read, sum_of_outcomes(r));
  EXPECT_GT(r.val.documents, 0u);
  EXPECT_GT(r.train.shards.size(), 1u) << "shard_tokens 6000 rotates shards";
  for (int run = 1; run < 3; ++run) {
    for (size_t k = 0; k < kOutcomes; ++k) EXPECT_EQ(reports[run].outcome[k].count, r.outcome[k].count);
    ASSERT_EQ(reports[run].train.shards.size(), r.train.shards.size());
    ASSERT_EQ(reports[run].val.shards.size(), r.val.shards.size());
    for (size_t i = 0; i < r.train.shards.size(); ++i)
      EXPECT_EQ(read_file(r.train.shards[i]), read_file(reports[run].train.shards[i])) << r.train.shards[i];
    for (size_t i = 0; i < r.val.shards.size(); ++i)
      EXPECT_EQ(read_file(r.val.shards[i]), read_file(reports[run].val.shards[i]));
  }
  uint64_t train_tokens = 0;
  for (const std::string& path : r.train.shards) {
    ShardReader shard(path);
    train_tokens += shard.token_count();
    if (shard.document_count() > 1) {
      EXPECT_LE(shard.token_count(), 6000u);
    }
  }
  EXPECT_EQ(train_tokens, r.train.tokens);

  // The loader takes the training split by pattern.
  LoaderOptions lo;
  lo.seq_len = 32;
  lo.micro_batch = 4;
  lo.vocab_size = 400;
  DataLoader loader({dir.file("out1/train-*.bin")}, lo);
  EXPECT_EQ(loader.shard_count(), r.train.shards.size());
  EXPECT_EQ(loader.total_tokens(), r.train.tokens);
}

// build/prepare under mpirun -np 2 against the single-process run: the same documents, in the same order,
// in the same splits, and the same counts.
TEST_F(PrepareTest, TwoRanksUnderMpirunMatchOneProcess) {
  TempDir dir;
  const std::string prepare = testing_util::build_dir() + "/prepare";
  if (!std::filesystem::exists(prepare)) GTEST_SKIP() << prepare << " not built";
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun";
  // The demo corpus plus duplicates planted across the two ranks' shares (files are shared by bytes, so the
  // late copies land on rank 1 and their originals on rank 0).
  const std::string corpus = testing_data::demo_corpus().string();
  write_file(dir.file("extra/zz-copy.txt"), read_file(corpus + "/Apache-2.0/001.txt"));
  std::string near = read_file(corpus + "/Apache-2.0/002.txt");
  near.insert(near.find(' '), " extra");
  write_file(dir.file("extra/zz-near.txt"), near);
  const std::string common = " --tokenizer " + tokenizer() + " --val-fraction 0.2 --shard-tokens 5000 --quiet " + corpus +
                             " " + dir.file("extra");
  auto one = testing_util::run_command(prepare + " --threads 2 --out " + dir.file("one") + common,
                                       dir.file("one.log"));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  auto two = testing_util::run_command("mpirun -np 2 --oversubscribe --allow-run-as-root " + prepare +
                                           " --threads 1 --out " + dir.file("two") + common,
                                       dir.file("two.log"));
  ASSERT_EQ(two.exit_code, 0) << two.output;
  PrepareReport a = report_from_json(nlohmann::json::parse(read_file(dir.file("one/report.json"))));
  PrepareReport b = report_from_json(nlohmann::json::parse(read_file(dir.file("two/report.json"))));
  EXPECT_EQ(b.ranks, 2);
  EXPECT_EQ(a.documents_read, b.documents_read);
  for (size_t k = 0; k < kOutcomes; ++k) {
    EXPECT_EQ(a.outcome[k].count, b.outcome[k].count) << outcome_name(static_cast<Outcome>(k));
    EXPECT_EQ(a.outcome[k].first, b.outcome[k].first) << outcome_name(static_cast<Outcome>(k));
  }
  EXPECT_EQ(a.of(Outcome::exact_duplicate).first, dir.file("extra/zz-copy.txt"));
  EXPECT_GE(a.of(Outcome::near_duplicate).count, 1u);
  EXPECT_EQ(a.train.tokens, b.train.tokens);
  EXPECT_EQ(a.val.tokens, b.val.tokens);
  // The shards' names sort in input order: the concatenated document streams are identical.
  EXPECT_EQ(expand_shard_paths({dir.file("two/train-*.bin")}), b.train.shards);
  EXPECT_GT(b.train.shards.size(), 2u);
  EXPECT_EQ(documents_of(a.train.shards), documents_of(b.train.shards));
  EXPECT_EQ(documents_of(a.val.shards), documents_of(b.val.shards));
  // The ranks' dropped lists, in rank order, are the single process's, duplicates naming the same documents.
  ASSERT_EQ(b.dropped_lists, (std::vector<std::string>{dir.file("two/dropped-r00000.jsonl"), dir.file("two/dropped-r00001.jsonl")}));
  EXPECT_EQ(read_file(dir.file("two/dropped-r00000.jsonl")) + read_file(dir.file("two/dropped-r00001.jsonl")),
            read_file(dir.file("one/dropped.jsonl")));
  EXPECT_NE(read_file(dir.file("one/dropped.jsonl")).find("\"duplicate_of\":\"" + corpus + "/Apache-2.0/001.txt\""),
            std::string::npos);
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
  EXPECT_EQ(r.documents_kept(), 1u);
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
  o.val_fraction = 0.1;
  o.minhash.bands = 0;
  expect_error([&] { prepare_corpus(o); }, {"--minhash-bands"});
  // An output that cannot be a directory: a clear error, before anything is read.
  o = base_options(dir.file("in/a.txt") + "/out");
  o.inputs = {dir.file("in")};
  expect_error([&] { prepare_corpus(o); }, {dir.file("in/a.txt") + "/out", "cannot create the directory"});
}

TEST_F(PrepareTest, CountsUnreadableFiles) {
  TempDir dir;
  write_file(dir.file("in/a.txt"), "Some readable text.");
  std::filesystem::create_symlink(dir.file("in/nowhere.txt"), dir.file("in/b.txt"));
  PrepareOptions o = base_options(dir.file("out"));
  o.inputs = {dir.file("in")};
  PrepareReport r = prepare_corpus(o);
  EXPECT_EQ(r.documents_kept(), 1u);
  EXPECT_EQ(r.files_unreadable.count, 1u);
  EXPECT_EQ(r.files_unreadable.first, dir.file("in/b.txt") + ": broken symbolic link");
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
  EXPECT_EQ(r.documents_read, sum_of_outcomes(r));
  EXPECT_GT(r.train.tokens, 0u);
  EXPECT_EQ(ShardReader(r.train.shards.at(0)).vocab_size(), 380u);
}

}  // namespace
}  // namespace tuna
