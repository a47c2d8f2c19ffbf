// data/mc_tasks: task records read and refused by reason (file and line named, or counted under skip_bad), and
// lm-eval's pair encoding on the real Llama 3 tokenizer: trailing context whitespace moved, continuation ids taken
// from the whole encoding, BOS, truncation.
#include <gtest/gtest.h>

#include <filesystem>

#include "core/error.h"
#include "data/mc_tasks.h"
#include "tests/data/tokenizer_fixtures.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

using testing_data::TokenizerFixtures;
using testing_data::write_file;
using testing_util::error_of;
using testing_util::TempDir;

TEST(McTasks, ReadsRecordsInFileAndLineOrder) {
  TempDir dir("mc_tasks");
  write_file((dir / "b.jsonl").string(),
             "{\"task\": \"t2\", \"context\": \"Q: two?\", \"choices\": [\" yes\", \" no\"], \"gold\": 1, \"id\": 7}\n"
             "\n"
             "{\"task\": \"t1\", \"context\": [\"A cat\", \"A dog\"], \"choices\": [\" runs\", \" runs\"], \"gold\": 0}\r\n");
  write_file((dir / "a.jsonl").string(),
             "{\"task\": \"t1\", \"context\": \"Énoncé\", \"choices\": [\" é\", \" ab\", \"c\"], \"gold\": 2, "
             "\"delimiter\": \"\"}\n");
  write_file((dir / "notes.txt").string(), "not a task file\n");
  const McTasks tasks = read_mc_tasks({dir.path.string()}, /*skip_bad=*/false);
  ASSERT_EQ(tasks.records.size(), 3u);
  EXPECT_EQ(tasks.files, (std::vector<std::string>{(dir / "a.jsonl").string(), (dir / "b.jsonl").string()}));
  EXPECT_EQ(tasks.tasks, (std::vector<std::string>{"t1", "t2"}));
  const McRecord& a = tasks.records[0];
  EXPECT_EQ(a.gold, 2);
  EXPECT_EQ(a.norm_length(0), 2);  // " é": no delimiter to leave out; two code points (three bytes)
  EXPECT_EQ(a.norm_length(2), 1);
  const McRecord& q = tasks.records[1];
  EXPECT_EQ(q.line, 1);
  EXPECT_EQ(q.id, "7");
  EXPECT_EQ(q.context(1), "Q: two?");
  EXPECT_EQ(q.norm_length(0), 3);  // " yes" without the default delimiter " "
  const McRecord& w = tasks.records[2];
  EXPECT_EQ(w.line, 3);  // the blank line counts as a line and is no record
  EXPECT_EQ(w.context(1), "A dog");
  EXPECT_EQ(w.norm_length(1), 5);  // a context per choice: lm-eval's choices are the contexts
}

// Each kind of bad record: the error names the file, the line and what was found; skip_bad counts it by reason.
TEST(McTasks, BadRecordsNamedOrCounted) {
  struct Case {
    std::string line, reason, message;
  };
  const std::vector<Case> cases = {
      {"{\"task\": \"t\", \"context\": \"c\", \"choices\": [\" a\", \" b\"], \"gold\": 2}", "gold out of range",
       "gold 2 is not an index of the 2 choices"},
      {"{\"task\": \"t\", \"context\": \"c\", \"choices\": [\" a\"], \"gold\": -1}", "gold out of range", "gold -1"},
      {"{\"task\": \"t\", \"context\": \"c\", \"choices\": [], \"gold\": 0}", "no choices", "empty list"},
      {"{\"task\": \"t\", \"context\": \"\", \"choices\": [\" a\"], \"gold\": 0}", "empty context",
       "field \"context\" is empty"},
      {"{\"task\": \"t\", \"context\": \"c\", \"choices\": [\" a\", \"\"], \"gold\": 0}", "empty choice", "choices[1] is empty"},
      {"{\"task\": \"t\", \"context\": \"c\", \"choices\": [\" a\", 3], \"gold\": 0}", "choice not a string",
       "choices[1] should be a string, found number"},
      {"{\"task\": \"t\", \"context\": [\"c\"], \"choices\": [\" a\", \" b\"], \"gold\": 0}", "contexts not one per choice",
       "a list of 1 but there are 2 choices"},
      {"{\"task\": \"t\", \"context\": \"c\", \"choices\": [\" a\"], \"gold\": \"0\"}", "gold not an integer", "\"0\""},
      {"{\"context\": \"c\", \"choices\": [\" a\"], \"gold\": 0}", "no \"task\"", "field \"task\" is missing"},
      {"{\"task\": \"t\", \"context\": \"c\", \"choices\": [\" a\"]", "not JSON", "not a JSON object"},
      {"{\"task\": \"t\", \"context\": \"c\", \"choices\": [\" a\"], \"gold\": 1e400}", "not JSON", "number overflow"},
      {"{\"task\": \"t\", \"context\": \"\xff\xfe\", \"choices\": [\" a\"], \"gold\": 0}", "not UTF-8", "not valid UTF-8"},
      // Generative records (engine/gen_eval.h).
      {"{\"task\": \"g\", \"context\": \"c\", \"until\": [\"\\n\"]}", "no \"target\"", "field \"target\" is missing"},
      {"{\"task\": \"g\", \"context\": \"c\", \"target\": []}", "no \"target\"", "field \"target\" is an empty list"},
      {"{\"task\": \"g\", \"context\": \"c\", \"target\": [\"x\", \"\"]}", "empty target", "target[1] is empty"},
      {"{\"task\": \"g\", \"context\": \"c\", \"target\": \"x\", \"until\": [\"\\n\", \"\"]}", "empty stop string",
       "until[1] is empty"},
      {"{\"task\": \"g\", \"context\": \"c\", \"target\": \"x\", \"until\": 7}", "\"until\" not a string",
       "should be a string or a list of strings, found number"},
      {"{\"task\": \"g\", \"context\": \"c\", \"target\": \"x\", \"max_gen_toks\": 0}", "max_gen_toks not positive",
       "should be a positive integer, found 0"},
      {"{\"task\": \"g\", \"context\": \"\", \"target\": \"x\"}", "empty context", "field \"context\" is empty"},
      {"{\"task\": \"g\", \"context\": \"c\", \"target\": \"x\", \"choices\": [\" a\"], \"gold\": 0}",
       "both target and choices", "found both"},
      {"{\"task\": \"t\", \"context\": \"c\", \"target\": \"x\"}", "task of both kinds",
       "task \"t\" has multiple-choice records before this generative one"},
  };
  const std::string good = "{\"task\": \"t\", \"context\": \"c\", \"choices\": [\" a\", \" b\"], \"gold\": 1}\n";
  TempDir dir("mc_bad");
  std::string all = good;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.line);
    const std::string path = (dir / "one.jsonl").string();
    write_file(path, good + c.line + "\n" + good);
    const std::string message = error_of([&] { read_mc_tasks({path}, false); });
    EXPECT_NE(message.find(path + ":2: "), std::string::npos) << message;
    EXPECT_NE(message.find(c.message), std::string::npos) << message;
    const McTasks skipped = read_mc_tasks({path}, true);
    EXPECT_EQ(skipped.records.size(), 2u);
    EXPECT_EQ(skipped.skipped.at(c.reason), 1);
    all += c.line + "\n";
  }
  write_file((dir / "all.jsonl").string(), all);
  const McTasks tasks = read_mc_tasks({(dir / "all.jsonl").string()}, true);
  EXPECT_EQ(tasks.records.size(), 1u);
  EXPECT_EQ(tasks.skipped_total(), static_cast<int64_t>(cases.size()));
  EXPECT_EQ(tasks.skipped.at("gold out of range"), 2);
  // Nothing left to evaluate, a missing file, a directory without task files: errors either way.
  write_file((dir / "bad.jsonl").string(), cases[0].line + "\n");
  EXPECT_NE(error_of([&] { read_mc_tasks({(dir / "bad.jsonl").string()}, true); }).find("no task record"), std::string::npos);
  EXPECT_NE(error_of([&] { read_mc_tasks({(dir / "none.jsonl").string()}, false); }).find("no such task file"),
            std::string::npos);
  TempDir empty("mc_empty");
  EXPECT_NE(error_of([&] { read_mc_tasks({empty.path.string()}, false); }).find("no *.jsonl"), std::string::npos);
}

// Generative records beside multiple-choice ones: each kind in its own list, its tasks in order of first appearance;
// "until" and "target" a string or a list, max_gen_toks 256 unless given (lm-eval's default).
TEST(McTasks, ReadsGenerativeRecords) {
  TempDir dir("mc_gen");
  const std::string path = (dir / "mixed.jsonl").string();
  write_file(path,
             "{\"task\": \"qa\", \"id\": 7, \"context\": \"Q: capital?\\nA:\", \"until\": \"\\n\", \"target\": \"Paris\"}\n"
             "{\"task\": \"mc\", \"context\": \"c\", \"choices\": [\" a\", \" b\"], \"gold\": 1}\n"
             "{\"task\": \"qa2\", \"context\": \"Q\", \"until\": [\".\", \"\\n\\n\"], \"target\": [\"x\", \"y\"], "
             "\"max_gen_toks\": 12}\n");
  const McTasks tasks = read_mc_tasks({path}, false);
  ASSERT_EQ(tasks.records.size(), 1u);
  EXPECT_EQ(tasks.tasks, std::vector<std::string>({"mc"}));
  ASSERT_EQ(tasks.generative.size(), 2u);
  EXPECT_EQ(tasks.generative_tasks, std::vector<std::string>({"qa", "qa2"}));
  const GenRecord& a = tasks.generative[0];
  EXPECT_EQ(a.id, "7");
  EXPECT_EQ(a.context, "Q: capital?\nA:");
  EXPECT_EQ(a.until, std::vector<std::string>({"\n"}));
  EXPECT_EQ(a.targets, std::vector<std::string>({"Paris"}));
  EXPECT_EQ(a.max_gen_toks, 256);
  EXPECT_EQ(a.line, 1);
  const GenRecord& b = tasks.generative[1];
  EXPECT_EQ(b.until, std::vector<std::string>({".", "\n\n"}));
  EXPECT_EQ(b.targets, std::vector<std::string>({"x", "y"}));
  EXPECT_EQ(b.max_gen_toks, 12);
  EXPECT_EQ(b.line, 3);
}

// lm-eval's _encode_pair on the real Llama 3 tokenizer, plain (add_bos_token=False) and framed (its default: the
// tokenizer.json's post-processor puts <|begin_of_text|> first).
TEST(McTasks, EncodesPairsAsLmEval) {
  const Tokenizer& tok = TokenizerFixtures::get().llama3();
  for (const bool special : {false, true}) {
    SCOPED_TRACE(special);
    auto encode = [&](const std::string& text) {
      std::vector<int32_t> ids = tok.encode(text, SpecialTokens::parse);
      if (special) ids.insert(ids.begin(), tok.bos_id());
      return ids;
    };
    auto tail = [](const std::vector<int32_t>& whole, size_t from) {
      return std::vector<int32_t>(whole.begin() + static_cast<std::ptrdiff_t>(from), whole.end());
    };
    std::vector<int32_t> context, continuation;
    // No trailing whitespace: the continuation is what the whole encoding has past the context's ids.
    encode_mc_pair(tok, "The licence is the", " GPL", special, &context, &continuation);
    EXPECT_EQ(context, encode("The licence is the"));
    EXPECT_EQ(continuation, tail(encode("The licence is the GPL"), context.size()));
    // Trailing whitespace of the context (Python's isspace: a space, a no-break space, U+001F) moves to the
    // continuation, so the context is encoded without it.
    for (const std::string space : {" ", "  \n", "\u00a0", "\x1f", "\u3000 "}) {
      SCOPED_TRACE(space);
      encode_mc_pair(tok, "Answer:" + space, "yes", special, &context, &continuation);
      EXPECT_EQ(context, encode("Answer:"));
      EXPECT_EQ(continuation, tail(encode("Answer:" + space + "yes"), context.size()));
    }
    // Special tokens written in the text are parsed, as transformers' encode does; a text that starts with the BOS's
    // text gets no second one.
    encode_mc_pair(tok, "<|begin_of_text|>Q", " A", special, &context, &continuation);
    EXPECT_EQ(context, tok.encode("<|begin_of_text|>Q", SpecialTokens::parse));
    EXPECT_EQ(context.front(), tok.bos_id());
    EXPECT_EQ(context.size(), 2u);
  }
  const SpecialFrame frame = special_frame(tok);
  EXPECT_EQ(frame.before, std::vector<int32_t>{tok.bos_id()});
  EXPECT_TRUE(frame.after.empty());
  EXPECT_EQ(frame.prefix_text, "<|begin_of_text|>");
}

TEST(McTasks, RequestsInRecordOrderAndCutLikeLmEval) {
  TempDir dir("mc_requests");
  const std::string path = (dir / "t.jsonl").string();
  write_file(path,
             "{\"task\": \"t\", \"context\": \"one two three four five six seven eight\", \"choices\": [\" nine\", "
             "\" ten eleven\"], \"gold\": 0}\n"
             "{\"task\": \"t\", \"context\": [\"red\", \"blue\"], \"choices\": [\" sky\", \" sky\"], \"gold\": 1}\n");
  const McTasks tasks = read_mc_tasks({path}, false);
  const Tokenizer& tok = TokenizerFixtures::get().llama3();
  int64_t truncated = -1;
  std::vector<McRequest> requests = encode_mc_requests(tasks, tok, /*special_tokens=*/false, 1024, &truncated);
  ASSERT_EQ(requests.size(), 4u);
  EXPECT_EQ(truncated, 0);
  for (size_t i = 0; i < requests.size(); i++) {
    EXPECT_EQ(requests[i].record, static_cast<int64_t>(i / 2));
    EXPECT_EQ(requests[i].choice, static_cast<int32_t>(i % 2));
  }
  std::vector<int32_t> context, continuation;
  encode_mc_pair(tok, "blue", " sky", false, &context, &continuation);
  context.insert(context.end(), continuation.begin(), continuation.end());
  EXPECT_EQ(requests[3].tokens, context);
  EXPECT_EQ(requests[3].continuation, static_cast<int32_t>(continuation.size()));
  // A request longer than max_tokens + 1 keeps its last max_tokens + 1 tokens (lm-eval's cut to max_length).
  const std::vector<int32_t> full = requests[1].tokens;
  requests = encode_mc_requests(tasks, tok, /*special_tokens=*/false, 4, &truncated);
  EXPECT_EQ(truncated, 2);
  EXPECT_EQ(requests[1].tokens, std::vector<int32_t>(full.end() - 5, full.end()));
  // A continuation that alone exceeds the window cannot be scored.
  EXPECT_NE(error_of([&] { encode_mc_requests(tasks, tok, /*special_tokens=*/false, 1, nullptr); }).find(path + ":1: choice 1 alone is"),
            std::string::npos);
}

}  // namespace
}  // namespace tuna
