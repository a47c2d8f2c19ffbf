// build/prepare's command line: every flag in both spellings (--a-b and --a_b), a misspelt flag answered with
// the nearest name (not the whole help), out-of-range values refused by name, a FIFO input refused at once
// (not a hang), and progress lines on stderr when it is not a terminal.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
using testing_util::read_file;
using testing_util::run_command;
using testing_util::TempDir;

const std::string kPrepare = testing_util::build_dir() + "/prepare";

class PrepareTool : public ::testing::Test {
 protected:
  // A small tokenizer and a few documents of the demo corpus, once for the suite.
  static void SetUpTestSuite() {
    dir_ = new TempDir("prepare_tool");
    TokenizerTrainOptions options;
    options.num_threads = 2;
    train_tokenizer({"demo/corpus/text/GPL-3/001.txt", "demo/corpus/text/GPL-3/002.txt"}, (dir_->path / "tok").string(),
                    400, options);
    fs::create_directories(dir_->path / "in");
    for (const char* name : {"001.txt", "002.txt", "003.txt", "004.txt"})
      fs::copy_file(fs::path("demo/corpus/text/Apache-2.0") / name, dir_->path / "in" / name);
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  // build/prepare with the tokenizer and the inputs, output to a fresh directory `out`, then `flags`.
  static testing_util::RunResult prepare(const std::string& out, const std::string& flags) {
    return run_command("timeout 60 " + kPrepare + " --tokenizer " + (dir_->path / "tok.model").string() + " --out " +
                           (dir_->path / out).string() + " " + flags,
                       dir_->path / (out + ".log"));
  }
  static nlohmann::json report(const std::string& out) {
    return nlohmann::json::parse(read_file(dir_->path / out / "report.json"));
  }
  static std::string in() { return (dir_->path / "in").string(); }

  static TempDir* dir_;
};
TempDir* PrepareTool::dir_ = nullptr;

TEST_F(PrepareTool, TakesDashesAndUnderscoresAlike) {
  auto a = prepare("a", "--quiet --val_fraction 0.25 --min_chars=3 --max-repeated-line-chars 0.9 " + in());
  ASSERT_EQ(a.exit_code, 0) << a.output;
  auto b = prepare("b", "--quiet --val-fraction=0.25 --min-chars 3 --max_repeated_line_chars=0.9 " + in());
  ASSERT_EQ(b.exit_code, 0) << b.output;
  for (const char* out : {"a", "b"}) {
    const auto options = report(out).at("options");
    EXPECT_EQ(options.at("val_fraction"), 0.25) << out;
    EXPECT_EQ(options.at("min_chars"), 3) << out;
    EXPECT_EQ(options.at("max_repeated_line_chars"), 0.9) << out;
  }
  // Every default the flags had before they moved onto core/options.
  auto c = prepare("c", "--quiet " + in());
  ASSERT_EQ(c.exit_code, 0) << c.output;
  const auto options = report("c").at("options");
  EXPECT_EQ(options.at("val_fraction"), 0.05);
  EXPECT_EQ(options.at("text_field"), "text");
  EXPECT_EQ(options.at("max_document_bytes"), 64 << 20);
  EXPECT_EQ(options.at("min_chars"), 1);
  EXPECT_EQ(options.at("min_alpha_fraction"), 0.25);
  EXPECT_EQ(options.at("shingle_words"), 5);
  EXPECT_EQ(options.at("shard_tokens"), 100000000);
  EXPECT_EQ(options.at("exact_dedup"), true);
  EXPECT_EQ(options.at("near_dedup"), true);
  auto d = prepare("d", "--quiet --no-near-dedup --no_exact_dedup " + in());
  ASSERT_EQ(d.exit_code, 0) << d.output;
  EXPECT_EQ(report("d").at("options").at("near_dedup"), false);
  EXPECT_EQ(report("d").at("options").at("exact_dedup"), false);
}

TEST_F(PrepareTool, BadFlagsAreNamedWithoutTheWholeHelp) {
  auto typo = prepare("e", "--val-fractoin 0.1 " + in());
  EXPECT_EQ(typo.exit_code, 1);
  EXPECT_NE(typo.output.find("unknown option 'val-fractoin' (did you mean 'val_fraction'?)"), std::string::npos)
      << typo.output;
  EXPECT_EQ(typo.output.find("--shard_tokens"), std::string::npos) << "the whole help was printed";
  auto range = prepare("f", "--threads -1 " + in());
  EXPECT_EQ(range.exit_code, 1);
  EXPECT_NE(range.output.find("'--threads': expected an integer in [0, "), std::string::npos) << range.output;
  auto type = prepare("g", "--val-fraction half " + in());
  EXPECT_EQ(type.exit_code, 1);
  EXPECT_NE(type.output.find("val_fraction"), std::string::npos) << type.output;
  auto none = prepare("h", "");
  EXPECT_EQ(none.exit_code, 1);
  EXPECT_NE(none.output.find("no INPUT given"), std::string::npos) << none.output;
  auto help = run_command(kPrepare + " --help", dir_->path / "help.log");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.output.find("--max_repeated_line_chars"), std::string::npos);
  EXPECT_NE(help.output.find("--follow_symlinks"), std::string::npos);
}

TEST_F(PrepareTool, RefusesAFifoAtOnce) {
  const fs::path fifo = dir_->path / "pipe.jsonl";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto r = prepare("i", "--quiet " + fifo.string());  // `timeout 60` ends a hang with 124
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(fifo.string() + ": a FIFO (named pipe), not a regular file"), std::string::npos) << r.output;
}

// Inputs with nothing readable (a folder holding only a FIFO) write no shard: an error, exit code 1, not 0.
TEST_F(PrepareTool, NoShardWrittenIsAnError) {
  const fs::path only_fifo = dir_->path / "only_fifo";
  fs::create_directories(only_fifo);
  ASSERT_EQ(::mkfifo((only_fifo / "pipe.jsonl").c_str(), 0600), 0);
  auto r = prepare("k", "--quiet " + only_fifo.string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("error: no shard written to " + (dir_->path / "k").string()), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("1 not regular files"), std::string::npos) << r.output;
}

// A model directory's tokenizer files are checked against its manifest, as every tool checks what it reads.
TEST_F(PrepareTool, ChecksAModelDirectorysManifest) {
  const fs::path model = dir_->path / "model";
  fs::create_directories(model);
  fs::copy_file(dir_->path / "tok.model", model / "tokenizer.model");
  std::ofstream(model / "manifest.json") << R"({"format": "tuna checkpoint manifest", "version": 1, "files": {)"
                                         << R"("tokenizer.model": {"bytes": )" << fs::file_size(model / "tokenizer.model")
                                         << R"(, "xxh3_64": "0000000000000000"}}})";
  auto r = run_command("timeout 60 " + kPrepare + " --tokenizer " + model.string() + " --out " +
                           (dir_->path / "l").string() + " --quiet " + in(),
                       dir_->path / "l.log");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find((model / "tokenizer.model").string() + ": checksum"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("the file is damaged"), std::string::npos) << r.output;
}

TEST_F(PrepareTool, ShowsProgressInALog) {
  auto r = prepare("j", "--progress-seconds 0.000001 " + in());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Not a terminal: whole lines, each with the share done, MB/s, documents/s and an ETA (or the time taken).
  for (const char* pass : {"pass 1/2", "pass 2/2"}) {
    const size_t at = r.output.find(std::string("prepare: ") + pass);
    ASSERT_NE(at, std::string::npos) << r.output;
    const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
    EXPECT_NE(line.find("%"), std::string::npos) << line;
    EXPECT_NE(line.find("MB/s"), std::string::npos) << line;
    EXPECT_NE(line.find("docs/s"), std::string::npos) << line;
    EXPECT_TRUE(line.find("ETA") != std::string::npos || line.find("done in") != std::string::npos) << line;
  }
  EXPECT_NE(r.output.find("100.0%"), std::string::npos);
  EXPECT_EQ(r.output.find('\r'), std::string::npos) << "no live line when stderr is not a terminal";
}

}  // namespace
}  // namespace tuna
