// Multiple-choice task records (build/eval --tasks, build/train --eval_tasks): the log-likelihood requests that
// lm-evaluation-harness builds for its multiple-choice tasks, one record per line of JSONL:
//   {"task": "arc_easy", "context": "Question: ...\nAnswer:", "choices": [" a", " b"], "gold": 1, "id": ...}
// The context is already formatted (few-shot examples included); each choice carries its leading target delimiter,
// so that request j is the pair (context, choices[j]). For tasks where lm-eval varies the context and keeps the
// continuation (Winogrande's partial evaluation), "context" is a list, one per choice: request j is
// (context[j], choices[j]). "delimiter" (default " ") is the task's target delimiter, which lm-eval's acc_norm
// leaves out of a choice's length. "id" is optional and kept for --output.
//
// Tokenized as lm-eval 0.4's Hugging Face backend does (TemplateLM._encode_pair, HFLM.tok_encode): whitespace at the
// end of the context (Python's str.isspace) moves to the front of the continuation; each text is encoded as
// transformers' tokenizer.encode does by default (special tokens in the text parsed, and the tokenizer's own special
// tokens around it: Llama's BOS) unless it already starts with the BOS's text; the continuation's ids are those of
// context + continuation encoded whole, after as many ids as the context alone encodes to.
//
// A generative record (lm-eval's output_type generate_until, scored by engine/gen_eval.h) has a "target" instead of
// choices and gold:
//   {"task": "triviaqa", "context": "Question: ...\nAnswer:", "until": ["\n", "."], "target": "Paris", "max_gen_toks": 32}
// "until" (a string or a list; default none: lm-eval adds the EOS's text) holds the stop strings, "target" a string or
// a list of strings (any one matches), "max_gen_toks" (default 256, lm-eval's) bounds the answer. A task is of one
// kind: a task whose records mix the two is an error.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace tuna {

struct McRecord {
  std::string task, id;                // id: the record's "id" as JSON text, or empty
  std::vector<std::string> contexts;   // one, or one per choice
  std::vector<std::string> choices;
  std::string delimiter = " ";
  int64_t gold = 0;
  std::string file;
  int64_t line = 0;                    // 1-based, for messages and --output
  const std::string& context(size_t choice) const { return contexts.size() == 1 ? contexts[0] : contexts[choice]; }
  // lm-eval's acc_norm length of choice j, in code points (Python's len): the choice without its delimiter, or
  // with a context per choice, that context (lm-eval's doc_to_choice gives the contexts then).
  int64_t norm_length(size_t choice) const;
};

// A generative record (above).
struct GenRecord {
  std::string task, id;  // id: the record's "id" as JSON text, or empty
  std::string context;
  std::vector<std::string> until, targets;
  int64_t max_gen_toks = 256;
  std::string file;
  int64_t line = 0;
};

struct McTasks {
  std::vector<McRecord> records;               // multiple-choice records
  std::vector<std::string> tasks;              // their tasks, in order of first appearance
  std::vector<GenRecord> generative;           // generative records
  std::vector<std::string> generative_tasks;   // their tasks, in order of first appearance
  std::map<std::string, int64_t> skipped;      // why -> records skipped (skip_bad)
  std::vector<std::string> files;              // the files read, in order
  int64_t skipped_total() const;
};

// Reads every record of `specs` (files, or directories whose *.jsonl files are read in name order). A bad record
// (not JSON, not UTF-8, a field missing or of the wrong type, no choices, an empty context or choice, gold out of
// range, a context list whose length is not the choices'; for a generative record no or an empty target, an empty
// stop string, max_gen_toks not positive) is an error naming the file, the line and what was found; with skip_bad it
// is counted by reason in `skipped` instead. No record at all is an error either way.
McTasks read_mc_tasks(const std::vector<std::string>& specs, bool skip_bad);

// One choice of one record, tokenized (lm-eval's request): tokens = context ids + continuation ids, of which the
// last `continuation` are scored.
struct McRequest {
  int64_t record = 0;
  int32_t choice = 0;
  int32_t continuation = 0;
  std::vector<int32_t> tokens;
};

// The special tokens transformers' tokenizer.encode puts around a text (add_special_tokens=True): a tokenizer.json's
// post-processor (and LlamaTokenizerFast's add_bos_token), tiktoken's BOS, sentencepiece LlamaTokenizer's BOS.
struct SpecialFrame {
  std::vector<int32_t> before, after;
  std::string prefix_text;  // lm-eval's prefix token (BOS, else EOS) as text: a text starting with it is not framed
};
SpecialFrame special_frame(const Tokenizer& tokenizer);

// One text encoded as lm-eval's Hugging Face backend encodes it: special tokens in the text parsed, and (special_tokens)
// the frame around it unless the text starts with frame.prefix_text.
std::vector<int32_t> encode_lm_eval(const Tokenizer& tokenizer, const std::string& text, bool special_tokens,
                                    const SpecialFrame& frame);

// transformers' tokenizer.decode(ids, skip_special_tokens): the ids' text (tuna's decode, lossy UTF-8 as the library's),
// special tokens left out when skip_special, then clean_up_tokenization when clean_up.
std::string hf_decode(const Tokenizer& tokenizer, std::span<const int32_t> ids, bool skip_special, bool clean_up);
// transformers' clean_up_tokenization: " ." -> ".", " ?", " !", " ,", " ' " -> "'", " n't", " 'm", " 's", " 've", " 're".
std::string clean_up_tokenization(std::string text);
// tokenizer_config.json's clean_up_tokenization_spaces beside the tokenizer (false when absent: transformers' default).
bool clean_up_tokenization_spaces(const Tokenizer& tokenizer);

// Python's str.strip() (lm-eval's remove_whitespace filter): the text without leading and trailing characters for which
// str.isspace is true.
std::string_view python_strip(std::string_view text);

// lm-eval's _encode_pair for one context and continuation, into context and continuation ids. special_tokens: each
// encoding framed as special_frame says (lm-eval's default, add_bos_token unset); false: plain ids (add_bos_token
// False).
void encode_mc_pair(const Tokenizer& tokenizer, const std::string& context, const std::string& continuation,
                    bool special_tokens, std::vector<int32_t>* context_ids, std::vector<int32_t>* continuation_ids);

// Every request of every record, in record then choice order. A request longer than max_tokens + 1 keeps its last
// max_tokens + 1 tokens, as lm-eval cuts a request to the model's max_length (+1: the last token is only a target);
// *truncated counts them. A continuation that alone needs more than max_tokens is an error (nothing would score it).
std::vector<McRequest> encode_mc_requests(const McTasks& tasks, const Tokenizer& tokenizer, bool special_tokens,
                                          int64_t max_tokens, int64_t* truncated);

}  // namespace tuna
