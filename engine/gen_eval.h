// Generative evaluation (build/eval --tasks, records with a "target": data/mc_tasks.h): each context answered by
// greedy generation and scored by exact match, as lm-evaluation-harness 0.4's Hugging Face backend does for
// output_type generate_until with the remove_whitespace filter:
//
//   context   encoded as lm-eval's tok_batch_encode (the tokenizer's own special tokens unless the text starts with the
//             BOS's text), its first tokens dropped when it is longer than max_length - max_gen_toks (lm-eval's left
//             truncation); max_length is the model's context (--seq_len when given).
//   generate  the most likely token (the first of equal maxima, torch.argmax) until one of the model's EOS ids, a stop
//             string, or max_gen_toks tokens. A stop string ends generation when it is found in the last
//             len(encode(stop)) + 2 generated tokens decoded with their special tokens (lm-eval's MultiTokenEOSCriteria
//             looks back no further: a stop string that forms across more tokens is cut afterwards, and a decoded
//             look-back window that starts inside a character can hold U+FFFD where the whole answer does not).
//   answer    the generated tokens decoded without special tokens (with transformers' clean-up of spaces before
//             punctuation when tokenizer_config.json sets clean_up_tokenization_spaces), cut before the first stop
//             string or the EOS's text.
//   score     exact_match: the answer with Python's strip() equals a target (any of a list) exactly. Per task the mean
//             and its standard error, and over the generative tasks (more than one) the size-weighted mean and
//             pooled standard error, as for multiple choice.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "data/mc_tasks.h"
#include "engine/mc_eval.h"  // McMetrics

namespace tuna {

class ForwardModel;

// The ids and text rules of one tokenizer and model, as lm-eval's generation uses them.
struct GenTokenizer {
  const Tokenizer* tokenizer = nullptr;
  std::vector<int32_t> eos_ids;     // the model's (config.json eos_token_id), else the tokenizer's EOS
  std::string eos_text;             // the tokenizer's EOS as text, a stop string lm-eval always adds
  bool clean_up_spaces = false;     // tokenizer_config.json's clean_up_tokenization_spaces
  bool special_tokens = true;       // lm-eval's default add_bos_token (unset): the tokenizer's own frame
  SpecialFrame frame;
  // ids[begin..] decoded as transformers' tokenizer.decode (data/mc_tasks.h hf_decode).
  std::string decode(const std::vector<int32_t>& ids, size_t begin, bool skip_special) const;
};
// model_eos: the model config's eos_token_id list (may be empty).
GenTokenizer gen_tokenizer(const Tokenizer& tokenizer, const std::vector<int64_t>& model_eos, bool special_tokens);

// One record's prompt: its context ids, cut to max_length - max_gen_toks.
struct GenRequest {
  int64_t record = 0;
  std::vector<int32_t> context;
  int64_t max_new = 0;
  bool truncated = false;
};
// Every generative record's request. A record whose max_gen_toks is not below max_length is an error naming it
// (lm-eval's assertion: no room for the context).
std::vector<GenRequest> encode_gen_requests(const McTasks& tasks, const GenTokenizer& tok, int64_t max_length);

// Greedy generation with the model's KV cache (ForwardModel::clear_cache / forward_cached, one sequence): the
// generated ids, the EOS included when it ended them.
std::vector<int32_t> generate_greedy(ForwardModel& model, int64_t vocab, const GenRequest& request,
                                     const std::vector<std::string>& until, const GenTokenizer& tok);

// The answer of generated ids (above), and whether it matches a target.
std::string gen_answer(const std::vector<int32_t>& generated, const std::vector<std::string>& until,
                       const GenTokenizer& tok);
bool gen_exact_match(const std::string& answer, const std::vector<std::string>& targets);

// Each generative task's exact_match (McMetrics with generative set), in order, then "all_generative" over more than one.
std::vector<McMetrics> gen_metrics(const McTasks& tasks, const std::vector<std::string>& answers);
// --output's row for generative record i.
nlohmann::json gen_record_json(const McTasks& tasks, int64_t record, const std::vector<int32_t>& generated,
                               const std::string& answer);

struct GenRun {
  int rank = 0, ranks = 1;  // this rank generates records rank, rank + ranks, ...
  std::function<void(int64_t done, int64_t planned)> progress;
};
// This rank's share of the requests generated (the others' entries stay empty).
std::vector<std::vector<int32_t>> generate_requests(ForwardModel& model, int64_t vocab, const McTasks& tasks,
                                                    const std::vector<GenRequest>& requests, const GenTokenizer& tok,
                                                    const GenRun& run);

}  // namespace tuna
