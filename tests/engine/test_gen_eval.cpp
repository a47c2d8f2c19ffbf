// engine/gen_eval: lm-evaluation-harness itself on tests/fixtures/mc_eval/gen (tools/reference/make_gen_fixtures.py:
// the multiple-choice fixture's tiny LLaMA and byte-level BPE, three generate_until tasks answered by lm-eval 0.4.13 in
// float64): every record's context ids and answer, and exact_match with its standard error per task and over the
// group. Then the rules one at a time on a hand-driven model: the look-back stop, the EOS, the length limit, stop
// strings cut afterwards, the strip and a list of targets.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/tokenizer.h"
#include "engine/engine.h"
#include "engine/gen_eval.h"
#include "model/config.h"

namespace tuna {
namespace {

const std::filesystem::path kFixture = "tests/fixtures/mc_eval";

TEST(GenEval, EqualsLmEvalOnItsOwnFixture) {
  nlohmann::json ref;
  std::ifstream(kFixture / "gen" / "reference.json") >> ref;
  ASSERT_TRUE(ref.is_object()) << "tests/fixtures/mc_eval/gen/reference.json";
  const LlamaConfig config = LlamaConfig::load(kFixture.string());
  const Tokenizer tokenizer(kFixture.string());
  const McTasks tasks = read_mc_tasks({(kFixture / "gen" / "tasks").string()}, /*skip_bad=*/false);
  ASSERT_EQ(tasks.generative.size(), 60u);
  EXPECT_TRUE(tasks.records.empty());
  const GenTokenizer tok = gen_tokenizer(tokenizer, config.eos_token_ids, /*special_tokens=*/true);
  EXPECT_TRUE(tok.clean_up_spaces);  // the fixture's tokenizer_config.json sets it, as Llama 3's does
  const std::vector<GenRequest> requests = encode_gen_requests(tasks, tok, config.max_position_embeddings);
  int64_t longest = 0;
  for (const GenRequest& q : requests) longest = std::max<int64_t>(longest, static_cast<int64_t>(q.context.size()) + q.max_new);
  std::unique_ptr<ForwardModel> model = make_forward_model(config, Device::Cpu, 1, longest, weights_from_directory(kFixture));
  const std::vector<std::vector<int32_t>> generated =
      generate_requests(*model, config.vocab_size, tasks, requests, tok, GenRun{});
  std::vector<std::string> answers;
  int64_t matches = 0, stopped_early = 0;
  for (size_t i = 0; i < requests.size(); i++) {
    const GenRecord& r = tasks.generative[i];
    SCOPED_TRACE(r.task + " " + r.id);
    const nlohmann::json* expected = nullptr;
    for (const nlohmann::json& e : ref.at("tasks").at(r.task).at("records"))
      if (nlohmann::json(e.at("id")).dump() == r.id) expected = &e;
    ASSERT_NE(expected, nullptr);
    EXPECT_EQ(requests[i].context, expected->at("context_ids").get<std::vector<int32_t>>());
    answers.push_back(gen_answer(generated[i], r.until, tok));
    EXPECT_EQ(answers.back(), expected->at("response").get<std::string>());
    EXPECT_EQ(gen_exact_match(answers.back(), r.targets), expected->at("exact_match").get<double>() == 1.0);
    matches += gen_exact_match(answers.back(), r.targets);
    stopped_early += static_cast<int64_t>(generated[i].size()) < r.max_gen_toks;
  }
  // Both sides of exact_match, and answers that stop before the length limit (a stop string or the EOS).
  EXPECT_GT(matches, 10);
  EXPECT_LT(matches, 50);
  EXPECT_GT(stopped_early, 5);
  // Per task as lm-eval's results report them, exactly; the group to the last bits (its tasks summed in lm-eval's
  // order, tuna's in file-name order).
  const std::vector<McMetrics> metrics = gen_metrics(tasks, answers);
  ASSERT_EQ(metrics.size(), 4u);
  for (const McMetrics& m : metrics) {
    SCOPED_TRACE(m.task);
    EXPECT_TRUE(m.generative);
    const bool group = m.task == "all_generative";
    const nlohmann::json& e = group ? ref.at("group") : ref.at("tasks").at(m.task);
    const double tol = group ? 1e-15 : 0.0;
    EXPECT_EQ(m.records, group ? e.at("records").get<int64_t>() : static_cast<int64_t>(e.at("records").size()));
    EXPECT_NEAR(m.exact_match, e.at("exact_match").get<double>(), tol);
    EXPECT_NEAR(m.exact_match_stderr, e.at("exact_match_stderr").get<double>(), tol);
  }
}

// A model whose next token is scripted: the logits put all mass on script[step] (then on `fallback`).
class ScriptedModel : public ForwardModel {
 public:
  ScriptedModel(int64_t vocab, std::vector<int32_t> script) : vocab_(vocab), script_(std::move(script)) {}
  std::string describe() const override { return "scripted"; }
  LossSum forward_loss(const int32_t*, const int32_t*, int64_t, int64_t, const int32_t*) override { return {}; }
  void forward_logits(const int32_t*, int64_t, int64_t, float*) override {}
  void forward_target_logps(const int32_t*, const int32_t*, int64_t, int64_t, const int32_t*, float*, uint8_t*) override {}
  bool packs_documents() const override { return false; }
  void clear_cache(int64_t batch) override { step_ = 0, fed_ = 0; }
  void forward_cached(const int32_t* tokens, int64_t n, float* last_logits) override {
    fed_ += n;
    std::fill(last_logits, last_logits + vocab_, 0.0f);
    const int32_t next = step_ < static_cast<int64_t>(script_.size()) ? script_[step_] : 0;
    last_logits[next] = 1.0f;
    step_++;
  }
  int64_t fed() const { return fed_; }

 private:
  int64_t vocab_;
  std::vector<int32_t> script_;
  int64_t step_ = 0, fed_ = 0;
};

struct Scripted {
  Tokenizer tokenizer{kFixture.string()};
  LlamaConfig config = LlamaConfig::load(kFixture.string());
  GenTokenizer tok = gen_tokenizer(tokenizer, config.eos_token_ids, true);
  // The ids of `text`, one token per byte where the vocabulary has them (the script spells a text out).
  std::vector<int32_t> ids(const std::string& text) const { return tokenizer.encode(text); }
  std::vector<int32_t> run(const std::vector<int32_t>& script, const std::vector<std::string>& until, int64_t max_new) {
    ScriptedModel model(config.vocab_size, script);
    GenRequest q;
    q.context = ids("Question: which licence?\nAnswer:");
    q.max_new = max_new;
    return generate_greedy(model, config.vocab_size, q, until, tok);
  }
};

TEST(GenEval, StopsAtEosStopStringOrLength) {
  Scripted s;
  const std::vector<int32_t> answer = s.ids(" MIT License");
  const int32_t eos = static_cast<int32_t>(s.config.eos_token_ids.at(0));
  std::vector<int32_t> script = answer;
  script.push_back(eos);
  script.push_back(answer[0]);
  // The EOS ends it (and is kept among the ids; the answer leaves it out).
  std::vector<int32_t> got = s.run(script, {}, 50);
  EXPECT_EQ(got.size(), answer.size() + 1);
  EXPECT_EQ(got.back(), eos);
  EXPECT_EQ(gen_answer(got, {}, s.tok), " MIT License");
  EXPECT_TRUE(gen_exact_match(gen_answer(got, {}, s.tok), {"Apache", "MIT License"}));  // stripped, any target
  EXPECT_FALSE(gen_exact_match(gen_answer(got, {}, s.tok), {"MIT"}));
  // The length limit.
  got = s.run(script, {}, 2);
  EXPECT_EQ(got.size(), 2u);
  // A stop string: generation ends on the token that completes it, and the answer is cut before it.
  got = s.run(script, {" Lic"}, 50);
  EXPECT_LT(got.size(), answer.size() + 1);
  EXPECT_EQ(gen_answer(got, {" Lic"}, s.tok), " MIT");
  // Several stop strings: the earliest occurrence cuts, whatever their order.
  EXPECT_EQ(gen_answer(answer, {"cense", "IT"}, s.tok), " M");
}

TEST(GenEval, LookBackSeesOnlyTheLastTokens) {
  Scripted s;
  // A stop string spelled over more tokens than its own ids + 2 is not seen by lm-eval's look-back: generation runs on
  // (here to the length limit), and the answer is cut at it afterwards.
  std::vector<int32_t> spelled;
  for (char c : std::string(" a b c d e f"))
    for (int32_t id : s.ids(std::string(1, c))) spelled.push_back(id);
  const std::string stop = " a b c d e f";
  ASSERT_LE(s.tokenizer.encode(stop).size() + 2, spelled.size() - 1);
  std::vector<int32_t> script = spelled;
  for (int32_t id : s.ids(" tail")) script.push_back(id);
  const std::vector<int32_t> got = s.run(script, {stop}, static_cast<int64_t>(script.size()));
  EXPECT_EQ(got.size(), script.size());
  EXPECT_EQ(gen_answer(got, {stop}, s.tok), "");
}

TEST(GenEval, ContextsTruncatedOnTheLeftAndTooLongAnswersRefused) {
  Scripted s;
  McTasks tasks;
  GenRecord r;
  r.task = "t", r.context = "one two three four five six seven eight nine ten", r.targets = {"x"}, r.max_gen_toks = 4;
  r.file = "t.jsonl", r.line = 3;
  tasks.generative = {r};
  tasks.generative_tasks = {"t"};
  const std::vector<int32_t> whole = s.tokenizer.encode(r.context);
  std::vector<GenRequest> q = encode_gen_requests(tasks, s.tok, 1 << 20);
  ASSERT_EQ(q.size(), 1u);
  EXPECT_FALSE(q[0].truncated);
  EXPECT_EQ(q[0].context.size(), whole.size() + 1);  // the BOS the tokenizer's post-processor adds
  q = encode_gen_requests(tasks, s.tok, 10);
  EXPECT_TRUE(q[0].truncated);
  EXPECT_EQ(q[0].context, std::vector<int32_t>(whole.end() - 6, whole.end()));  // 10 - max_gen_toks
  try {
    encode_gen_requests(tasks, s.tok, 4);
    FAIL() << "max_gen_toks equal to max_length accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("t.jsonl:3: max_gen_toks 4"), std::string::npos) << e.what();
  }
}

TEST(GenEval, CleanUpAndStripAsPython) {
  EXPECT_EQ(clean_up_tokenization("a . b ? c ! d , e ' f n't g 'm h 's i 've j 're"), "a. b? c! d, e'fn't g'm h's i've j're");
  EXPECT_EQ(std::string(python_strip("\u3000\x1c x y \n\t\x1f")), "x y");  // ideographic space, Python's \x1c-\x1f
  EXPECT_EQ(std::string(python_strip(" \n ")), "");
  EXPECT_TRUE(gen_exact_match("  Paris\n", {"Paris"}));
  EXPECT_FALSE(gen_exact_match("paris", {"Paris"}));
}

}  // namespace
}  // namespace tuna
