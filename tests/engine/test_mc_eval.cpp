// engine/mc_eval: lm-evaluation-harness itself on tests/fixtures/mc_eval (tools/reference/make_mc_fixtures.py: a tiny
// LLaMA with a byte-level BPE tokenizer, tasks of 2, 4 and 10 choices and one with a context per choice, scored by
// lm-eval 0.4.13 in float64): every request's ids, log-likelihood (1e-5 relative) and greedy flag, and acc, acc_norm
// and their standard errors per task and over the group. Packed requests score as each request alone (an oracle:
// the model's logits of the request by itself, log-softmax in double); one request per row and dp shares give the
// same; lm-eval's metric formulas on hand-made log-likelihoods.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "data/tokenizer.h"
#include "engine/engine.h"
#include "engine/mc_eval.h"
#include "tests/engine/engine_test_util.h"
#include "tests/model/fixture.h"

namespace tuna {
namespace {

using testing_util::Fixture;

// Random requests over the fixture's vocabulary, three per record: contexts of 1..40 tokens, continuations of 1..5.
// Every other record's choices share their context (as a task record's do); the others each have their own (a
// context per choice).
std::vector<McRequest> random_requests(int64_t count, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<McRequest> requests;
  std::vector<int32_t> context;
  for (int64_t i = 0; i < count; i++) {
    McRequest q;
    q.record = i / 3, q.choice = static_cast<int32_t>(i % 3);
    if (q.choice == 0 || q.record % 2 == 1) {
      context.assign(1 + rng() % 40, 0);
      for (int32_t& t : context) t = static_cast<int32_t>(3 + rng() % (vocab - 3));
    }
    q.tokens = context;
    q.continuation = static_cast<int32_t>(1 + rng() % 5);
    for (int64_t t = 0; t < q.continuation; t++) q.tokens.push_back(static_cast<int32_t>(3 + rng() % (vocab - 3)));
    requests.push_back(std::move(q));
  }
  return requests;
}

TokenLogps model_logps(ForwardModel& model) {
  return [&model](const int32_t* inputs, const int32_t* targets, const int32_t* positions, int64_t batch, int64_t seq,
                  float* logps, uint8_t* greedy) {
    model.forward_target_logps(inputs, targets, batch, seq, positions, logps, greedy);
  };
}

TEST(McEval, PackingPlacesEveryRequestOnce) {
  const std::vector<McRequest> requests = random_requests(200, 128, 1);
  McScoring how;
  how.seq = 64, how.batch = 3;
  std::vector<std::vector<int64_t>> windows;
  const McPacking packing = pack_mc_requests(requests, how, &windows);
  std::vector<int> seen(requests.size(), 0);
  int64_t tokens = 0;
  for (const std::vector<int64_t>& w : windows) {
    int64_t used = 0;
    for (int64_t r : w) used += static_cast<int64_t>(requests[r].tokens.size()) - 1, seen[r]++;
    EXPECT_LE(used, how.seq);
    tokens += used;
  }
  EXPECT_EQ(seen, std::vector<int>(requests.size(), 1));
  EXPECT_EQ(packing.tokens, tokens);
  EXPECT_EQ(packing.windows, static_cast<int64_t>(windows.size()));
  // Best fit leaves less than a tenth of the windows empty on these lengths (24 tokens on average in windows of 64).
  EXPECT_GT(static_cast<double>(tokens) / static_cast<double>(packing.windows * how.seq), 0.9);
  how.packed = false;
  EXPECT_EQ(pack_mc_requests(requests, how).windows, static_cast<int64_t>(requests.size()));
}

// The oracle: each request alone through forward_logits, log-softmax and first argmax in double.
TEST(McEval, PackedScoresEqualEachRequestAlone) {
  const Fixture f("llama2_tiny");
  const int64_t V = f.config.vocab_size, seq = 64;
  std::unique_ptr<ForwardModel> model =
      make_forward_model(f.config, Device::Cpu, 4, seq, testing_util::fixture_weights(f));
  std::vector<McRequest> requests = random_requests(60, V, 2);
  // A greedy continuation: the model's own argmax after a context, so that the greedy flag is seen set too.
  {
    McRequest& q = requests[5];
    const int64_t n = static_cast<int64_t>(q.tokens.size()) - q.continuation;
    std::vector<float> logits(n * V);
    std::vector<int32_t> context(q.tokens.begin(), q.tokens.begin() + n);
    model->forward_logits(context.data(), 1, n, logits.data());
    const float* last = logits.data() + (n - 1) * V;
    q.tokens.resize(n);
    q.tokens.push_back(static_cast<int32_t>(std::max_element(last, last + V) - last));
    q.continuation = 1;
  }
  std::vector<double> expected(requests.size());
  std::vector<uint8_t> expected_greedy(requests.size());
  for (size_t r = 0; r < requests.size(); r++) {
    const McRequest& q = requests[r];
    const int64_t n = static_cast<int64_t>(q.tokens.size()) - 1;
    std::vector<float> logits(n * V);
    model->forward_logits(q.tokens.data(), 1, n, logits.data());
    double sum = 0;
    bool greedy = true;
    for (int64_t t = n - q.continuation; t < n; t++) {
      const float* row = logits.data() + t * V;
      double max = row[0], z = 0;
      for (int64_t j = 0; j < V; j++) max = std::max<double>(max, row[j]);
      for (int64_t j = 0; j < V; j++) z += std::exp(double(row[j]) - max);
      sum += row[q.tokens[t + 1]] - max - std::log(z);
      greedy = greedy && std::max_element(row, row + V) - row == q.tokens[t + 1];
    }
    expected[r] = sum, expected_greedy[r] = greedy;
  }
  EXPECT_EQ(expected_greedy[5], 1);
  McScoring how;
  how.seq = seq, how.batch = 4;
  const McScores packed = score_mc_requests(requests, how, model_logps(*model));
  how.packed = false;
  const McScores rows = score_mc_requests(requests, how, model_logps(*model));
  // Shared contexts through the KV cache (the records that have one), the rest packed.
  how.packed = true;
  int64_t shared_calls = 0;
  how.shared = [&](const int32_t* context, int64_t c, const int32_t* tokens, const int32_t* targets, int64_t k, int64_t m,
                   float* logps, uint8_t* greedy) {
    shared_calls++;
    model->forward_shared_logps(context, c, tokens, targets, k, m, logps, greedy);
  };
  const McScores shared = score_mc_requests(requests, how, model_logps(*model));
  EXPECT_GE(shared_calls, 5);
  how.shared = nullptr;
  // dp 3: each rank's share, summed.
  how.packed = true, how.ranks = 3;
  McScores shares;
  shares.loglikelihood.assign(requests.size(), 0.0);
  shares.greedy.assign(requests.size(), 0);
  for (int rank = 0; rank < 3; rank++) {
    how.rank = rank;
    const McScores part = score_mc_requests(requests, how, model_logps(*model));
    for (size_t r = 0; r < requests.size(); r++) shares.loglikelihood[r] += part.loglikelihood[r], shares.greedy[r] += part.greedy[r];
  }
  for (size_t r = 0; r < requests.size(); r++) {
    SCOPED_TRACE(r);
    const double tol = 1e-5 * std::max(1.0, std::abs(expected[r]));
    EXPECT_NEAR(packed.loglikelihood[r], expected[r], tol);
    EXPECT_NEAR(rows.loglikelihood[r], expected[r], tol);
    EXPECT_NEAR(shared.loglikelihood[r], expected[r], tol);
    EXPECT_EQ(shared.greedy[r], expected_greedy[r]);
    EXPECT_EQ(shares.loglikelihood[r], packed.loglikelihood[r]);
    EXPECT_EQ(packed.greedy[r], expected_greedy[r]);
    EXPECT_EQ(rows.greedy[r], expected_greedy[r]);
    EXPECT_EQ(shares.greedy[r], expected_greedy[r]);
  }
}

TEST(McEval, EqualsLmEvalOnItsOwnFixture) {
  const std::filesystem::path dir = "tests/fixtures/mc_eval";
  nlohmann::json ref;
  std::ifstream(dir / "reference.json") >> ref;
  ASSERT_TRUE(ref.is_object()) << "tests/fixtures/mc_eval/reference.json";
  const LlamaConfig config = LlamaConfig::load(dir.string());
  const Tokenizer tokenizer(dir.string());
  const McTasks tasks = read_mc_tasks({(dir / "tasks").string()}, /*skip_bad=*/false);
  int64_t truncated = 0;
  const std::vector<McRequest> requests =
      encode_mc_requests(tasks, tokenizer, /*special_tokens=*/true, config.max_position_embeddings, &truncated);
  EXPECT_EQ(truncated, 0);
  int64_t longest = 0;
  for (const McRequest& q : requests) longest = std::max<int64_t>(longest, static_cast<int64_t>(q.tokens.size()) - 1);
  std::unique_ptr<ForwardModel> model = make_forward_model(config, Device::Cpu, 4, longest, weights_from_directory(dir));
  McScoring how;
  how.seq = longest, how.batch = 4;
  const McScores scores = score_mc_requests(requests, how, model_logps(*model));
  const std::vector<int64_t> first = mc_first_requests(tasks, requests);
  // Every request: the ids lm-eval fed its model, the log-likelihood, the greedy flag; each record's acc and acc_norm.
  int64_t checked = 0, greedy_seen = 0;
  double worst = 0;
  for (size_t i = 0; i < tasks.records.size(); i++) {
    const McRecord& r = tasks.records[i];
    const nlohmann::json& records = ref.at("tasks").at(r.task).at("records");
    const nlohmann::json* expected = nullptr;
    for (const nlohmann::json& e : records)
      if (e.at("line").get<int64_t>() == r.line) expected = &e;
    ASSERT_NE(expected, nullptr) << r.task << " line " << r.line;
    SCOPED_TRACE(r.task + " line " + std::to_string(r.line));
    const nlohmann::json& choices = expected->at("choices");
    ASSERT_EQ(choices.size(), r.choices.size());
    for (size_t k = 0; k < r.choices.size(); k++) {
      const McRequest& q = requests[first[i] + k];
      std::vector<int32_t> ids = choices[k].at("context_ids").get<std::vector<int32_t>>();
      const std::vector<int32_t> cont = choices[k].at("continuation_ids").get<std::vector<int32_t>>();
      ids.insert(ids.end(), cont.begin(), cont.end());
      EXPECT_EQ(q.tokens, ids) << "choice " << k;
      EXPECT_EQ(q.continuation, static_cast<int32_t>(cont.size())) << "choice " << k;
      EXPECT_EQ(r.norm_length(k), choices[k].at("norm_length").get<int64_t>()) << "choice " << k;
      const double ll = choices[k].at("loglikelihood").get<double>();
      const double got = scores.loglikelihood[first[i] + k];
      EXPECT_NEAR(got, ll, 1e-5 * std::abs(ll)) << "choice " << k;
      worst = std::max(worst, std::abs(got - ll) / std::abs(ll));
      EXPECT_EQ(scores.greedy[first[i] + k] != 0, choices[k].at("is_greedy").get<bool>()) << "choice " << k;
      greedy_seen += choices[k].at("is_greedy").get<bool>();
      checked++;
    }
    const nlohmann::json row = mc_record_json(tasks, requests, scores, static_cast<int64_t>(i), first);
    EXPECT_EQ(row.at("pred").get<int64_t>() == r.gold, expected->at("acc").get<double>() == 1.0);
    EXPECT_EQ(row.at("pred_norm").get<int64_t>() == r.gold, expected->at("acc_norm").get<double>() == 1.0);
  }
  // (No request of this random model is greedy, as lm-eval found: the greedy flag's true side is held by the
  // oracle test below, where a continuation is the model's own argmax.)
  EXPECT_EQ(greedy_seen, 0);
  std::printf("lm-eval fixture: %lld requests, worst relative difference of a log-likelihood %.2e\n",
              static_cast<long long>(checked), worst);
  // The metrics as lm-eval's results report them: per task exactly (the same sums in the same order), the group's
  // to the last bits (its tasks summed in lm-eval's order, tuna's in file-name order).
  const std::vector<McMetrics> metrics = mc_metrics(tasks, requests, scores);
  ASSERT_EQ(metrics.size(), tasks.tasks.size() + 1);
  for (const McMetrics& m : metrics) {
    SCOPED_TRACE(m.task);
    const nlohmann::json& e = m.task == "all" ? ref.at("group") : ref.at("tasks").at(m.task);
    const double tol = m.task == "all" ? 1e-15 : 0.0;
    EXPECT_EQ(m.records, e.at("n").get<int64_t>());
    EXPECT_NEAR(m.acc, e.at("acc").get<double>(), tol);
    EXPECT_NEAR(m.acc_stderr, e.at("acc_stderr").get<double>(), tol);
    EXPECT_NEAR(m.acc_norm, e.at("acc_norm").get<double>(), tol);
    EXPECT_NEAR(m.acc_norm_stderr, e.at("acc_norm_stderr").get<double>(), tol);
  }
}

// lm-eval's formulas by hand: acc and acc_norm (the first of equal maxima), mean_stderr, and the size-weighted
// aggregate with the pooled standard error.
TEST(McEval, MetricsAsLmEvalComputesThem) {
  McTasks tasks;
  tasks.tasks = {"a", "b"};
  auto record = [&](const std::string& task, std::vector<std::string> choices, int64_t gold) {
    McRecord r;
    r.task = task, r.contexts = {"c"}, r.choices = std::move(choices), r.gold = gold;
    tasks.records.push_back(r);
  };
  record("a", {" x", " yyyy"}, 1);        // ll -2, -3: acc 0; per char -2, -0.75: acc_norm 1
  record("a", {" x", " y"}, 0);           // -1, -1: a tie, the first wins: acc 1, acc_norm 1
  record("a", {" xx", " y", " z"}, 2);    // -4, -5, -1: acc 1; -2, -5, -1: acc_norm 1
  record("b", {" p", " q"}, 0);           // -3, -1: acc 0, acc_norm 0
  record("b", {" p", " q"}, 1);           // -3, -1: acc 1, acc_norm 1
  const std::vector<double> ll = {-2, -3, -1, -1, -4, -5, -1, -3, -1, -3, -1};
  std::vector<McRequest> requests;
  for (size_t i = 0, q = 0; i < tasks.records.size(); i++)
    for (size_t k = 0; k < tasks.records[i].choices.size(); k++, q++) {
      McRequest r;
      r.record = static_cast<int64_t>(i), r.choice = static_cast<int32_t>(k);
      requests.push_back(r);
    }
  McScores scores{ll, std::vector<uint8_t>(ll.size(), 0)};
  const std::vector<McMetrics> m = mc_metrics(tasks, requests, scores);
  ASSERT_EQ(m.size(), 3u);
  EXPECT_EQ(m[0].task, "a");
  EXPECT_EQ(m[0].records, 3);
  EXPECT_DOUBLE_EQ(m[0].acc, 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(m[0].acc_norm, 1.0);
  // Sample standard deviation of {0, 1, 1} is sqrt(1/3); over sqrt(3): 1/3.
  EXPECT_DOUBLE_EQ(m[0].acc_stderr, 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(m[0].acc_norm_stderr, 0.0);
  EXPECT_DOUBLE_EQ(m[1].acc, 0.5);
  EXPECT_DOUBLE_EQ(m[1].acc_stderr, 0.5);  // {0, 1}: sd sqrt(1/2), over sqrt(2)
  EXPECT_EQ(m[2].task, "all");
  EXPECT_EQ(m[2].records, 5);
  EXPECT_DOUBLE_EQ(m[2].acc, (2.0 / 3.0 * 3 + 0.5 * 2) / 5);
  EXPECT_DOUBLE_EQ(m[2].acc_norm, (1.0 * 3 + 0.5 * 2) / 5);
  // Pooled: sum (n_i - 1) se_i^2 n_i / (N - k), over N, square root.
  EXPECT_NEAR(m[2].acc_stderr, std::sqrt((2 * (1.0 / 9) * 3 + 1 * 0.25 * 2) / 3 / 5), 1e-15);
  const nlohmann::json j = mc_metrics_json(m);
  EXPECT_EQ(j.at("all").at("records"), 5);
  const std::vector<int64_t> first = mc_first_requests(tasks, requests);
  const nlohmann::json row = mc_record_json(tasks, requests, scores, 0, first);
  EXPECT_EQ(row.at("pred"), 0);
  EXPECT_EQ(row.at("pred_norm"), 1);
  EXPECT_EQ(row.at("loglikelihoods"), nlohmann::json({-2.0, -3.0}));
}

// build/train --eval_tasks scores multiple-choice records on the run's layout; generative ones need a KV cache there,
// so they are counted and left to build/eval --tasks (a long run never stops on them).
TEST(McEval, TrainingEvaluatorLeavesGenerativeRecordsToEval) {
  const std::string dir = "tests/fixtures/mc_eval";
  const Tokenizer tokenizer(dir);
  McEvaluator evaluator(dir + "/tasks," + dir + "/gen/tasks", tokenizer, /*skip_bad=*/false, 4, 256, nullptr);
  const std::string said = evaluator.describe();
  EXPECT_NE(said.find("106 records"), std::string::npos) << said;
  EXPECT_NE(said.find("60 skipped: generative (build/eval --tasks scores it)"), std::string::npos) << said;
}

}  // namespace
}  // namespace tuna
