// Multiple-choice evaluation: engine/mc_eval.h.
#include "engine/mc_eval.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>

#include "comm/comm.h"
#include "core/error.h"
#include "engine/engine.h"
#include "kernels/cpu/classifier.h"  // kIgnoreIndex

namespace tuna {
namespace {

int64_t input_tokens(const McRequest& q) { return static_cast<int64_t>(q.tokens.size()) - 1; }

// numpy's argmax: the first of equal maxima.
size_t first_argmax(const std::vector<double>& v) {
  size_t best = 0;
  for (size_t i = 1; i < v.size(); i++)
    if (v[i] > v[best]) best = i;
  return best;
}

}  // namespace

double lm_eval_mean(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v;
  return s / static_cast<double>(x.size());
}

double lm_eval_mean_stderr(const std::vector<double>& x) {
  if (x.size() < 2) return std::numeric_limits<double>::quiet_NaN();
  const double mu = lm_eval_mean(x);
  double s = 0;
  for (double v : x) s += (v - mu) * (v - mu);
  return std::sqrt(s / static_cast<double>(x.size() - 1)) / std::sqrt(static_cast<double>(x.size()));
}

McMetrics aggregate_metrics(const std::vector<McMetrics>& rows, const std::string& name) {
  auto weighted = [&](double McMetrics::*field) {
    double s = 0, n = 0;
    for (const McMetrics& m : rows) s += m.*field * static_cast<double>(m.records), n += static_cast<double>(m.records);
    return s / n;
  };
  auto pooled = [&](double McMetrics::*field) {
    double var = 0, n = 0;
    for (const McMetrics& m : rows) {
      const double size = static_cast<double>(m.records);
      var += (size - 1) * (m.*field) * (m.*field) * size, n += size;
    }
    var /= n - static_cast<double>(rows.size());
    return std::sqrt(var / n);
  };
  McMetrics all;
  all.task = name;
  all.generative = !rows.empty() && rows.front().generative;
  for (const McMetrics& m : rows) all.records += m.records;
  all.acc = weighted(&McMetrics::acc), all.acc_stderr = pooled(&McMetrics::acc_stderr);
  all.acc_norm = weighted(&McMetrics::acc_norm), all.acc_norm_stderr = pooled(&McMetrics::acc_norm_stderr);
  all.exact_match = weighted(&McMetrics::exact_match), all.exact_match_stderr = pooled(&McMetrics::exact_match_stderr);
  return all;
}

McPacking pack_mc_requests(const std::vector<McRequest>& requests, const McScoring& how,
                           std::vector<std::vector<int64_t>>* windows) {
  TUNA_CHECK(how.seq > 0 && how.batch > 0, "mc packing: a window of ", how.seq, " tokens, ", how.batch, " per batch");
  std::vector<int64_t> order(requests.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  // Longest first (ties in request order), so that a batch's windows are alike and the short choices fill gaps.
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return input_tokens(requests[a]) > input_tokens(requests[b]); });
  std::vector<std::vector<int64_t>> placed;
  std::multimap<int64_t, size_t> room;  // free tokens -> window, for best fit
  McPacking packing;
  for (int64_t r : order) {
    const int64_t need = input_tokens(requests[r]);
    TUNA_CHECK(need >= 1 && need <= how.seq, "mc request ", r, " of ", need, " input tokens in windows of ", how.seq);
    packing.tokens += need;
    auto fit = how.packed ? room.lower_bound(need) : room.end();
    if (fit == room.end()) {
      placed.push_back({r});
      if (how.packed && how.seq - need > 0) room.emplace(how.seq - need, placed.size() - 1);
      continue;
    }
    const size_t w = fit->second;
    const int64_t left = fit->first - need;
    room.erase(fit);
    placed[w].push_back(r);
    if (left > 0) room.emplace(left, w);
  }
  packing.windows = static_cast<int64_t>(placed.size());
  if (windows) *windows = std::move(placed);
  return packing;
}

namespace {

// The records (first request, count) whose requests share their context ids, each of at least two tokens: the shared
// path's. A record's requests are contiguous, in choice order.
std::vector<std::pair<int64_t, int64_t>> shared_context_records(const std::vector<McRequest>& all) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (size_t first = 0; first < all.size();) {
    size_t end = first + 1;
    while (end < all.size() && all[end].record == all[first].record) end++;
    const int64_t context = static_cast<int64_t>(all[first].tokens.size()) - all[first].continuation;
    bool same = context >= 2 && end - first >= 2;
    for (size_t r = first + 1; same && r < end; r++)
      same = static_cast<int64_t>(all[r].tokens.size()) - all[r].continuation == context &&
             std::equal(all[r].tokens.begin(), all[r].tokens.begin() + context, all[first].tokens.begin());
    if (same) out.emplace_back(static_cast<int64_t>(first), static_cast<int64_t>(end - first));
    first = end;
  }
  return out;
}

}  // namespace

McScores score_mc_requests(const std::vector<McRequest>& all, const McScoring& how, const TokenLogps& logps) {
  McScores out;
  out.loglikelihood.assign(all.size(), 0.0), out.greedy.assign(all.size(), 0);
  std::vector<uint8_t> done_shared(all.size(), 0);
  std::vector<std::pair<int64_t, int64_t>> shared;
  if (how.shared) shared = shared_context_records(all);
  for (const auto& [first, k] : shared)
    for (int64_t j = 0; j < k; j++) done_shared[first + j] = 1;
  // Identical requests (the same ids, the same continuation) are scored once: equal scores, as lm-eval gives them,
  // whatever windows they would have landed in.
  std::vector<int64_t> same(all.size(), -1);
  std::vector<McRequest> requests;
  {
    std::map<std::pair<std::vector<int32_t>, int32_t>, int64_t> seen;
    for (size_t r = 0; r < all.size(); r++) {
      if (done_shared[r]) continue;
      auto [it, fresh] = seen.try_emplace({all[r].tokens, all[r].continuation}, static_cast<int64_t>(requests.size()));
      if (fresh) requests.push_back(all[r]);
      same[r] = it->second;
    }
  }
  std::vector<std::vector<int64_t>> windows;
  if (!requests.empty()) pack_mc_requests(requests, how, &windows);
  McScores scores;
  scores.loglikelihood.assign(requests.size(), 0.0);
  scores.greedy.assign(requests.size(), 0);
  const int64_t total = static_cast<int64_t>(windows.size());
  const int64_t batches = (total + how.batch - 1) / how.batch;
  int64_t planned = 0;
  for (int64_t b = how.rank; b < batches; b += how.ranks) planned += std::min(how.batch, total - b * how.batch);
  for (size_t i = how.rank; i < shared.size(); i += how.ranks) planned++;
  std::vector<int32_t> inputs, targets, positions;
  std::vector<float> lp;
  std::vector<uint8_t> greedy;
  int64_t done = 0;
  // Shared contexts: the context but its last token once; row j then holds that token and choice j's continuation
  // but its last, each predicting the next (the same targets as the packed request's).
  for (size_t i = how.rank; i < shared.size(); i += how.ranks) {
    const auto [first, k] = shared[i];
    const McRequest& head = all[first];
    const int64_t context = static_cast<int64_t>(head.tokens.size()) - head.continuation;
    int64_t m = 0;
    for (int64_t j = 0; j < k; j++) m = std::max<int64_t>(m, all[first + j].continuation);
    inputs.assign(k * m, 0), targets.assign(k * m, cpu::kIgnoreIndex);
    for (int64_t j = 0; j < k; j++) {
      const McRequest& q = all[first + j];
      for (int64_t t = 0; t < q.continuation; t++) {
        inputs[j * m + t] = q.tokens[context - 1 + t];
        targets[j * m + t] = q.tokens[context + t];
      }
    }
    lp.assign(k * m, 0.0f), greedy.assign(k * m, 0);
    how.shared(head.tokens.data(), context - 1, inputs.data(), targets.data(), k, m, lp.data(), greedy.data());
    for (int64_t j = 0; j < k; j++) {
      double sum = 0;
      bool all_greedy = true;
      for (int64_t t = 0; t < all[first + j].continuation; t++) {
        sum += lp[j * m + t];
        all_greedy = all_greedy && greedy[j * m + t];
      }
      out.loglikelihood[first + j] = sum, out.greedy[first + j] = all_greedy;
    }
    done++;
    if (how.progress) how.progress(done, planned);
  }
  const int64_t calls = how.lockstep ? (batches + how.ranks - 1) / how.ranks : 0;
  for (int64_t b = how.rank, call = 0; b < batches || call < calls; b += how.ranks, call++) {
    if (b >= batches) {  // lockstep: an empty window, nothing scored
      inputs.assign(how.seq, 0), targets.assign(how.seq, cpu::kIgnoreIndex), positions.assign(how.seq, 0);
      lp.assign(how.seq, 0.0f), greedy.assign(how.seq, 0);
      logps(inputs.data(), targets.data(), how.packed ? positions.data() : nullptr, 1, how.seq, lp.data(), greedy.data());
      continue;
    }
    const int64_t first = b * how.batch, rows = std::min(how.batch, total - first);
    // Without packing a row holds one request: the batch is as long as its longest (the first: longest first).
    const int64_t seq = how.packed ? how.seq : input_tokens(requests[windows[first][0]]);
    const int64_t n = rows * seq;
    inputs.assign(n, 0);
    targets.assign(n, cpu::kIgnoreIndex);
    positions.assign(n, 0);
    for (int64_t w = 0; w < rows; w++) {
      int64_t at = w * seq;
      for (int64_t r : windows[first + w]) {
        const McRequest& q = requests[r];
        const int64_t len = input_tokens(q), scored_from = len - q.continuation;
        for (int64_t t = 0; t < len; t++) {
          inputs[at + t] = q.tokens[t];
          positions[at + t] = static_cast<int32_t>(t);
          if (t >= scored_from) targets[at + t] = q.tokens[t + 1];
        }
        at += len;
      }
      // The window's free tail: a document of its own (positions from 0), nothing scored.
      for (int64_t t = 0; at < (w + 1) * seq; t++, at++) positions[at] = static_cast<int32_t>(t);
    }
    lp.assign(n, 0.0f);
    greedy.assign(n, 0);
    logps(inputs.data(), targets.data(), how.packed ? positions.data() : nullptr, rows, seq, lp.data(), greedy.data());
    for (int64_t w = 0; w < rows; w++) {
      int64_t at = w * seq;
      for (int64_t r : windows[first + w]) {
        const McRequest& q = requests[r];
        const int64_t len = input_tokens(q);
        double sum = 0;
        bool all_greedy = true;
        for (int64_t t = len - q.continuation; t < len; t++) {
          sum += lp[at + t];
          all_greedy = all_greedy && greedy[at + t];
        }
        scores.loglikelihood[r] = sum;
        scores.greedy[r] = all_greedy;
        at += len;
      }
    }
    done += rows;
    if (how.progress) how.progress(done, planned);
  }
  for (size_t r = 0; r < all.size(); r++)
    if (same[r] >= 0) out.loglikelihood[r] = scores.loglikelihood[same[r]], out.greedy[r] = scores.greedy[same[r]];
  return out;
}

std::vector<int64_t> mc_first_requests(const McTasks& tasks, const std::vector<McRequest>& requests) {
  std::vector<int64_t> first(tasks.records.size() + 1, -1);
  for (size_t q = 0; q < requests.size(); q++)
    if (first[requests[q].record] < 0) first[requests[q].record] = static_cast<int64_t>(q);
  first.back() = static_cast<int64_t>(requests.size());
  for (size_t i = 0; i < tasks.records.size(); i++)
    TUNA_CHECK(first[i] >= 0 && requests[first[i]].choice == 0, "mc record ", i, " has no requests in order");
  return first;
}

std::vector<McMetrics> mc_metrics(const McTasks& tasks, const std::vector<McRequest>& requests, const McScores& scores) {
  const std::vector<int64_t> first = mc_first_requests(tasks, requests);
  std::vector<McMetrics> out;
  for (const std::string& task : tasks.tasks) {
    std::vector<double> acc, acc_norm;
    for (size_t i = 0; i < tasks.records.size(); i++) {
      const McRecord& r = tasks.records[i];
      if (r.task != task) continue;
      std::vector<double> ll(r.choices.size()), normed(r.choices.size());
      for (size_t k = 0; k < r.choices.size(); k++) {
        ll[k] = scores.loglikelihood[first[i] + k];
        normed[k] = ll[k] / static_cast<double>(r.norm_length(k));
      }
      acc.push_back(static_cast<int64_t>(first_argmax(ll)) == r.gold ? 1.0 : 0.0);
      acc_norm.push_back(static_cast<int64_t>(first_argmax(normed)) == r.gold ? 1.0 : 0.0);
    }
    McMetrics m;
    m.task = task;
    m.records = static_cast<int64_t>(acc.size());
    m.acc = lm_eval_mean(acc), m.acc_stderr = lm_eval_mean_stderr(acc);
    m.acc_norm = lm_eval_mean(acc_norm), m.acc_norm_stderr = lm_eval_mean_stderr(acc_norm);
    out.push_back(m);
  }
  // lm-eval's aggregate_subtask_metrics (weight_by_size) and pooled_sample_stderr, in task order.
  if (out.size() > 1) out.push_back(aggregate_metrics(out, "all"));
  return out;
}

std::string format_mc_metrics(const std::vector<McMetrics>& metrics) {
  size_t width = 4;
  for (const McMetrics& m : metrics) width = std::max(width, m.task.size());
  std::string out;
  for (const McMetrics& m : metrics) {
    char line[256];
    if (m.generative)
      std::snprintf(line, sizeof line, "%-*s  exact_match %.4f ± %.4f  (%lld records)\n", static_cast<int>(width),
                    m.task.c_str(), m.exact_match, m.exact_match_stderr, static_cast<long long>(m.records));
    else
      std::snprintf(line, sizeof line, "%-*s  acc %.4f ± %.4f  acc_norm %.4f ± %.4f  (%lld records)\n", static_cast<int>(width),
                    m.task.c_str(), m.acc, m.acc_stderr, m.acc_norm, m.acc_norm_stderr, static_cast<long long>(m.records));
    out += line;
  }
  return out;
}

nlohmann::json mc_metrics_json(const std::vector<McMetrics>& metrics) {
  nlohmann::json j = nlohmann::json::object();
  auto number = [](double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); };
  for (const McMetrics& m : metrics)
    j[m.task] = m.generative
                    ? nlohmann::json{{"exact_match", m.exact_match},
                                     {"exact_match_stderr", number(m.exact_match_stderr)},
                                     {"records", m.records}}
                    : nlohmann::json{{"acc", m.acc}, {"acc_stderr", number(m.acc_stderr)}, {"acc_norm", m.acc_norm},
                                     {"acc_norm_stderr", number(m.acc_norm_stderr)}, {"records", m.records}};
  return j;
}

nlohmann::json mc_record_json(const McTasks& tasks, const std::vector<McRequest>& requests, const McScores& scores,
                              int64_t record, const std::vector<int64_t>& first_request) {
  const McRecord& r = tasks.records[record];
  std::vector<double> ll, normed;
  std::vector<bool> greedy;
  for (size_t k = 0; k < r.choices.size(); k++) {
    ll.push_back(scores.loglikelihood[first_request[record] + k]);
    greedy.push_back(scores.greedy[first_request[record] + k] != 0);
    normed.push_back(ll.back() / static_cast<double>(r.norm_length(k)));
  }
  nlohmann::json j = {{"task", r.task}, {"file", r.file}, {"line", r.line}};
  if (!r.id.empty()) j["id"] = nlohmann::json::parse(r.id);
  j["gold"] = r.gold;
  j["loglikelihoods"] = ll;
  j["greedy"] = greedy;
  j["pred"] = first_argmax(ll);
  j["pred_norm"] = first_argmax(normed);
  j["tokens"] = [&] {
    std::vector<int64_t> n;
    for (size_t k = 0; k < r.choices.size(); k++) n.push_back(static_cast<int64_t>(requests[first_request[record] + k].tokens.size()));
    return n;
  }();
  return j;
}

McEvaluator::McEvaluator(const std::string& specs, const Tokenizer& tokenizer, bool skip_bad, int64_t micro_batch,
                         int64_t seq_len, Comm* dp, bool packed)
    : dp_(dp) {
  std::vector<std::string> list;
  for (size_t at = 0; at <= specs.size();) {
    const size_t comma = std::min(specs.find(',', at), specs.size());
    if (comma > at) list.push_back(specs.substr(at, comma - at));
    at = comma + 1;
  }
  tasks_ = read_mc_tasks(list, skip_bad);
  // Generation needs a KV cache on the run's layout, which the engines do not keep: build/eval --tasks answers those.
  if (!tasks_.generative.empty()) {
    tasks_.skipped["generative (build/eval --tasks scores it)"] += static_cast<int64_t>(tasks_.generative.size());
    tasks_.generative.clear();
    tasks_.generative_tasks.clear();
  }
  // A record with a choice longer than the run's windows cannot be scored in them: counted and left out, so that a
  // long run never stops on it (build/eval --tasks takes a longer --seq_len).
  std::vector<McRecord> kept;
  std::vector<int32_t> context, continuation;
  for (McRecord& r : tasks_.records) {
    bool fits = true;
    for (size_t k = 0; fits && k < r.choices.size(); k++) {
      encode_mc_pair(tokenizer, r.context(k), r.choices[k], /*special_tokens=*/true, &context, &continuation);
      fits = static_cast<int64_t>(continuation.size()) <= seq_len;
    }
    if (fits) kept.push_back(std::move(r));
    else tasks_.skipped["a choice longer than seq_len"]++;
  }
  if (kept.empty()) fail("--eval_tasks ", specs, ": no record whose choices fit windows of ", seq_len, " tokens");
  tasks_.records = std::move(kept);
  tasks_.tasks.clear();
  for (const McRecord& r : tasks_.records)
    if (std::find(tasks_.tasks.begin(), tasks_.tasks.end(), r.task) == tasks_.tasks.end()) tasks_.tasks.push_back(r.task);
  requests_ = encode_mc_requests(tasks_, tokenizer, /*special_tokens=*/true, seq_len, &truncated_);
  how_.batch = micro_batch, how_.seq = seq_len, how_.packed = packed, how_.lockstep = true;
  if (dp_) how_.rank = dp_->rank(), how_.ranks = dp_->size();
}

std::string McEvaluator::describe() const {
  std::string skipped;
  for (const auto& [why, count] : tasks_.skipped) skipped += str(", ", count, " skipped: ", why);
  return str("eval_tasks: ", tasks_.tasks.size(), " task(s), ", tasks_.records.size(), " records, ", requests_.size(),
             " requests in ", pack_mc_requests(requests_, how_).windows,
             how_.packed ? str(" windows of ", how_.seq, " tokens") : str(" rows of one request, up to ", how_.seq, " tokens"),
             truncated_ ? str(" (", truncated_, " cut to their last ", how_.seq + 1, " tokens)") : std::string(), skipped);
}

std::vector<McMetrics> McEvaluator::run(Engine& engine) {
  McScores scores = score_mc_requests(requests_, how_, [&](const int32_t* inputs, const int32_t* targets,
                                                           const int32_t* positions, int64_t batch, int64_t seq,
                                                           float* logps, uint8_t* greedy) {
    engine.target_logps(inputs, targets, batch, seq, positions, logps, greedy);
  });
  if (dp_ && dp_->size() > 1) {
    std::vector<double> greedy(scores.greedy.begin(), scores.greedy.end());
    dp_->all_reduce(scores.loglikelihood.data(), static_cast<int64_t>(requests_.size()), CommType::F64, ReduceOp::Sum,
                    "eval_tasks log-likelihoods");
    dp_->all_reduce(greedy.data(), static_cast<int64_t>(greedy.size()), CommType::F64, ReduceOp::Sum, "eval_tasks greedy");
    for (size_t i = 0; i < greedy.size(); i++) scores.greedy[i] = greedy[i] > 0.5;
  }
  return mc_metrics(tasks_, requests_, scores);
}

}  // namespace tuna
