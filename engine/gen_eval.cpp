// Generative evaluation: engine/gen_eval.h.
#include "engine/gen_eval.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/engine.h"  // ForwardModel

namespace tuna {

std::string GenTokenizer::decode(const std::vector<int32_t>& ids, size_t begin, bool skip_special) const {
  return hf_decode(*tokenizer, std::span<const int32_t>(ids).subspan(begin), skip_special, clean_up_spaces);
}

GenTokenizer gen_tokenizer(const Tokenizer& tokenizer, const std::vector<int64_t>& model_eos, bool special_tokens) {
  GenTokenizer t;
  t.tokenizer = &tokenizer;
  // transformers' generate stops at the generation config's EOS ids, which come from config.json.
  for (int64_t id : model_eos) t.eos_ids.push_back(static_cast<int32_t>(id));
  if (t.eos_ids.empty() && tokenizer.eos_id() >= 0) t.eos_ids.push_back(tokenizer.eos_id());
  if (tokenizer.eos_id() >= 0) t.eos_text = tokenizer.piece(tokenizer.eos_id());
  t.clean_up_spaces = clean_up_tokenization_spaces(tokenizer);
  t.special_tokens = special_tokens;
  if (special_tokens) t.frame = special_frame(tokenizer);
  return t;
}

std::vector<GenRequest> encode_gen_requests(const McTasks& tasks, const GenTokenizer& tok, int64_t max_length) {
  std::vector<GenRequest> out;
  for (size_t i = 0; i < tasks.generative.size(); i++) {
    const GenRecord& r = tasks.generative[i];
    if (r.max_gen_toks >= max_length)
      fail(r.file, ":", r.line, ": max_gen_toks ", r.max_gen_toks, " leaves no room for the context in the model's ",
           max_length, " tokens (--seq_len)");
    GenRequest q;
    q.record = static_cast<int64_t>(i);
    q.max_new = r.max_gen_toks;
    q.context = encode_lm_eval(*tok.tokenizer, r.context, tok.special_tokens, tok.frame);
    const int64_t room = max_length - r.max_gen_toks;
    if (static_cast<int64_t>(q.context.size()) > room) {
      q.context.erase(q.context.begin(), q.context.end() - room);  // lm-eval's left truncation
      q.truncated = true;
    }
    TUNA_CHECK(!q.context.empty(), r.file, ":", r.line, ": the context encodes to no token");
    out.push_back(std::move(q));
  }
  return out;
}

namespace {

// lm-eval's stop strings for a record: its own, then the EOS's text unless listed.
std::vector<std::string> stop_strings(const std::vector<std::string>& until, const GenTokenizer& tok) {
  std::vector<std::string> stops = until;
  if (!tok.eos_text.empty() && std::find(stops.begin(), stops.end(), tok.eos_text) == stops.end())
    stops.push_back(tok.eos_text);
  return stops;
}

}  // namespace

std::vector<int32_t> generate_greedy(ForwardModel& model, int64_t vocab, const GenRequest& request,
                                     const std::vector<std::string>& until, const GenTokenizer& tok) {
  const std::vector<std::string> stops = stop_strings(until, tok);
  // MultiTokenEOSCriteria's look-back per stop string: its plain ids, and 2 more.
  std::vector<size_t> lookback;
  for (const std::string& s : stops) lookback.push_back(tok.tokenizer->encode(s, SpecialTokens::parse).size() + 2);
  std::vector<float> logits(static_cast<size_t>(vocab));
  std::vector<int32_t> generated;
  model.clear_cache(1);
  model.forward_cached(request.context.data(), static_cast<int64_t>(request.context.size()), logits.data());
  while (static_cast<int64_t>(generated.size()) < request.max_new) {
    // The first of equal maxima, as torch.argmax.
    const int32_t next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    generated.push_back(next);
    if (std::find(tok.eos_ids.begin(), tok.eos_ids.end(), next) != tok.eos_ids.end()) break;
    bool stop = false;
    for (size_t s = 0; s < stops.size() && !stop; s++) {
      const size_t begin = generated.size() > lookback[s] ? generated.size() - lookback[s] : 0;
      stop = tok.decode(generated, begin, /*skip_special=*/false).find(stops[s]) != std::string::npos;
    }
    if (stop || static_cast<int64_t>(generated.size()) == request.max_new) break;
    model.forward_cached(&generated.back(), 1, logits.data());
  }
  return generated;
}

std::string gen_answer(const std::vector<int32_t>& generated, const std::vector<std::string>& until,
                       const GenTokenizer& tok) {
  std::string text = tok.decode(generated, 0, /*skip_special=*/true);
  for (const std::string& s : stop_strings(until, tok))
    if (const size_t at = text.find(s); at != std::string::npos) text.resize(at);
  return text;
}

bool gen_exact_match(const std::string& answer, const std::vector<std::string>& targets) {
  const std::string_view stripped = python_strip(answer);
  return std::any_of(targets.begin(), targets.end(), [&](const std::string& t) { return stripped == t; });
}

std::vector<McMetrics> gen_metrics(const McTasks& tasks, const std::vector<std::string>& answers) {
  TUNA_CHECK(answers.size() == tasks.generative.size(), "gen metrics: ", answers.size(), " answers for ",
             tasks.generative.size(), " records");
  std::vector<McMetrics> out;
  for (const std::string& task : tasks.generative_tasks) {
    std::vector<double> match;
    for (size_t i = 0; i < tasks.generative.size(); i++)
      if (tasks.generative[i].task == task) match.push_back(gen_exact_match(answers[i], tasks.generative[i].targets) ? 1 : 0);
    McMetrics m;
    m.task = task;
    m.generative = true;
    m.records = static_cast<int64_t>(match.size());
    m.exact_match = lm_eval_mean(match), m.exact_match_stderr = lm_eval_mean_stderr(match);
    out.push_back(m);
  }
  if (out.size() > 1) out.push_back(aggregate_metrics(out, "all_generative"));
  return out;
}

nlohmann::json gen_record_json(const McTasks& tasks, int64_t record, const std::vector<int32_t>& generated,
                               const std::string& answer) {
  const GenRecord& r = tasks.generative[record];
  nlohmann::json j = {{"task", r.task}, {"file", r.file}, {"line", r.line}};
  if (!r.id.empty()) j["id"] = nlohmann::json::parse(r.id);
  j["target"] = r.targets.size() == 1 ? nlohmann::json(r.targets[0]) : nlohmann::json(r.targets);
  j["answer"] = answer;
  j["exact_match"] = gen_exact_match(answer, r.targets);
  j["generated_tokens"] = generated.size();
  return j;
}

std::vector<std::vector<int32_t>> generate_requests(ForwardModel& model, int64_t vocab, const McTasks& tasks,
                                                    const std::vector<GenRequest>& requests, const GenTokenizer& tok,
                                                    const GenRun& run) {
  std::vector<std::vector<int32_t>> out(requests.size());
  const int64_t planned = (static_cast<int64_t>(requests.size()) + run.ranks - 1 - run.rank) / run.ranks;
  int64_t done = 0;
  for (size_t i = static_cast<size_t>(run.rank); i < requests.size(); i += static_cast<size_t>(run.ranks)) {
    out[i] = generate_greedy(model, vocab, requests[i], tasks.generative[requests[i].record].until, tok);
    if (run.progress) run.progress(++done, planned);
  }
  return out;
}

}  // namespace tuna
