// build/sample — generates text from a checkpoint with its tokenizer (sentencepiece, tokenizer.json or tiktoken).
//
//   build/sample --checkpoint DIR --prompt "This Agreement" [--max_tokens 64] [--temperature 0.8]
//                [--top_p 0.95] [--greedy] [--seed 1] [--device cuda] [--kv_cache false]
//
// The prompt runs through the model once, filling a KV cache (each layer's keys and values per position);
// each new token then costs one position's forward (ForwardModel::forward_cached). --kv_cache false reruns
// the whole context per token instead, the code path training tests, which the cached one equals (tests).
// The last line, on stderr, gives the time and tokens/s. A LoRA checkpoint (or PEFT adapter directory) runs on
// its base with the adapters merged on load; --base DIR names the base when it has moved (ckpt/peft.h).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <random>

#include "core/error.h"
#include "core/memory.h"
#include "core/options.h"
#include "core/threads.h"
#include "data/tokenizer.h"
#include "ckpt/checkpoint.h"
#include "ckpt/peft.h"        // open_model: a LoRA checkpoint is its base with the adapters merged
#include "model/config.h"
#include "engine/engine.h"  // ForwardModel: the forward pass on cpu or cuda

namespace {

// Draws an index from logits: softmax at `temperature`, restricted to the smallest set of most likely
// tokens whose probability reaches top_p (nucleus sampling).
int32_t sample_token(const float* logits, int64_t vocab, double temperature, double top_p, std::mt19937_64& rng) {
  std::vector<double> p(vocab);
  const double max_logit = *std::max_element(logits, logits + vocab);
  double sum = 0;
  for (int64_t i = 0; i < vocab; i++) sum += p[i] = std::exp((logits[i] - max_logit) / temperature);
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  double kept = 0;
  size_t n = 0;
  while (n < order.size() && (n == 0 || kept < top_p * sum)) kept += p[order[n++]];
  const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * kept;
  double acc = 0;
  for (size_t i = 0; i < n; i++) {
    acc += p[order[i]];
    if (u < acc) return order[i];
  }
  return order[n - 1];
}

// The same rule as train and eval: the tokenizer must be the model's. Against the one the checkpoint carries (its
// fingerprint), else against the BOS and EOS ids of its config.json; and it must fit the model.
void check_model_tokenizer(const tuna::Tokenizer& tokenizer, const tuna::LlamaConfig& config,
                           const std::string& checkpoint, const std::string& config_dir) {
  using namespace tuna;
  const std::string config_path = config_dir + "/config.json";
  const std::string fit = check_tokenizer_fits(tokenizer, config.vocab_size, config_path);
  if (!fit.empty()) std::fprintf(stderr, "warning: %s\n", fit.c_str());
  const ModelTokenizer own = model_tokenizer("", checkpoint, config.vocab_size);
  if (own.fingerprint != 0 && tokenizer.fingerprint() != own.fingerprint)
    fail("tokenizer ", tokenizer.path(), " is not the model's: ", checkpoint, " carries ", own.description,
         " (another vocabulary); leave out --tokenizer to use the model's own");
  if (own.fingerprint == 0 && config.bos_token_id >= 0 && tokenizer.bos_id() >= 0 && tokenizer.bos_id() != config.bos_token_id)
    fail("tokenizer ", tokenizer.path(), " is not the model's: its BOS is id ", tokenizer.bos_id(), ", ", config_path,
         " says ", config.bos_token_id);
  if (own.fingerprint == 0 && !config.eos_token_ids.empty() && tokenizer.eos_id() >= 0 &&
      std::find(config.eos_token_ids.begin(), config.eos_token_ids.end(), tokenizer.eos_id()) == config.eos_token_ids.end())
    fail("tokenizer ", tokenizer.path(), " is not the model's: its EOS is id ", tokenizer.eos_id(), ", which ",
         config_path, " does not list among its eos_token_id");
}

}  // namespace

int main(int argc, char** argv) {
  using namespace tuna;
  return guarded_main([&] {
    std::string checkpoint, base, tokenizer_path, prompt, device = "auto", logits_out;
    int64_t max_tokens = 64, seed = 1, threads = 0, seq_len = 0;
    double temperature = 0.8, top_p = 0.95;
    bool greedy = false, stop_at_eos = true, kv_cache = true, print_ids = false;
    Options options("build/sample", "Generates a continuation of a prompt from a model directory.");
    options.add("checkpoint", &checkpoint, "model directory: a tuna checkpoint (runs/X/ckpt/latest too), a LoRA checkpoint "
                "or a Hugging Face download");
    options.add("base", &base, "a LoRA checkpoint's base model, instead of the one it records (same checksum required)");
    options.add("tokenizer", &tokenizer_path,
                "tokenizer file (sentencepiece, tokenizer.json, tiktoken) or model directory; default: the checkpoint's");
    options.add("prompt", &prompt, "text to continue");
    options.add("max_tokens", &max_tokens, "tokens to generate at most", Bounds::closed(1, 1 << 22));
    options.add("seq_len", &seq_len, "longest context (prompt + generated tokens); 0: the checkpoint's training seq_len, "
                "or max_position_embeddings for a model tuna did not train", Bounds::closed(0, 1 << 22));
    options.add("temperature", &temperature, "softmax temperature (> 0 unless --greedy)", Bounds::closed(0, 1e6));
    options.add("top_p", &top_p, "nucleus sampling: keep the most likely tokens up to this probability",
                Bounds::open_closed(0, 1));
    options.add("greedy", &greedy, "always take the most likely token (ignores temperature and top_p)");
    options.add("stop_at_eos", &stop_at_eos, "stop when the model emits an end-of-sequence token");
    options.add("seed", &seed, "sampling seed", Bounds::at_least(0));
    options.add("threads", &threads, "CPU threads; 0: all cores", Bounds::closed(0, 1 << 16));
    options.add("device", &device, "cuda when a GPU is visible (auto), or the one named", {"auto", "cpu", "cuda"});
    options.add("kv_cache", &kv_cache, "keep each layer's keys and values, so a token costs one position's forward; "
                "false reruns the whole context per token");
    options.add("print_ids", &print_ids, "print the token ids on stderr (the prompt's, then the generated ones): what "
                "another runtime must reproduce");
    options.add("logits_out", &logits_out, "write each generated token's logits (the distribution it was drawn from) to "
                "this file: vocab_size fp32 values per token, little-endian");
    if (!options.parse(argc, argv).empty()) fail("unexpected positional argument (options are --name value)");
    if (checkpoint.empty()) fail("--checkpoint is required (see --help)");
    if (!greedy && temperature == 0) fail("option 'temperature': expected > 0 (or --greedy), found 0");
    set_cpu_threads(threads);
    checkpoint = resolve_checkpoint(checkpoint).string();
    // The files read, against the directory's manifest (ckpt/checkpoint.h: one rule in every tool).
    if (!verify_model_directory(checkpoint, ModelFiles::Weights))
      std::fprintf(stderr, "note: %s\n", unverified_note(checkpoint).c_str());

    const ModelSource source = open_model(checkpoint, base);
    const std::string config_dir = source.config_dir.string();
    // The directory's own tokenizer (a PEFT adapter directory without one: its base's).
    if (tokenizer_path.empty()) tokenizer_path = has_tokenizer(checkpoint) ? checkpoint : config_dir;
    Tokenizer tokenizer(tokenizer_path);
    LlamaConfig config = LlamaConfig::load(config_dir);
    check_model_tokenizer(tokenizer, config, checkpoint, config_dir);
    std::vector<int32_t> tokens;
    if (tokenizer.bos_id() >= 0) tokens.push_back(tokenizer.bos_id());
    // Special tokens written in the prompt (<|start_header_id|>, <|eot_id|>) are the model's control tokens.
    for (int32_t t : tokenizer.encode(prompt, SpecialTokens::parse)) tokens.push_back(t);
    check_ids_fit(tokenizer, tokens, config.vocab_size, "the prompt");
    // The model is asked for no longer a context than it was trained on (a base model: what its config allows).
    const std::optional<int64_t> trained = training_seq_len(checkpoint);
    if (seq_len == 0) seq_len = trained ? *trained : config.max_position_embeddings;
    check_seq_len(config, seq_len, "seq_len", config_dir + "/config.json");
    const int64_t context = std::min<int64_t>(seq_len, tokens.size() + max_tokens);
    if (static_cast<int64_t>(tokens.size()) >= context)
      fail("the prompt (", tokens.size(), " tokens) leaves no room in a context of ", seq_len, " tokens (--seq_len; ",
           trained ? "the checkpoint's training seq_len" : "max_position_embeddings", ")");
    std::fprintf(stderr, "sample: loading %s (%lld parameters); prompt %zu tokens, context up to %lld\n",
                 checkpoint.c_str(), (long long)config.n_params(), tokens.size(), (long long)context);
    std::unique_ptr<ForwardModel> model =
        make_forward_model(config, resolve_device(device), 1, context,
                           source.fill);

    std::vector<int64_t> eos = config.eos_token_ids;
    if (tokenizer.eos_id() >= 0) eos.push_back(tokenizer.eos_id());
    std::mt19937_64 rng(static_cast<uint64_t>(seed));
    // Without the cache, logits of the whole context per token; with it, of the last position only.
    const int64_t logit_rows = kv_cache ? 1 : context;
    std::vector<float> logits;
    allocate_host(str("the logits of ", logit_rows, " positions x ", config.vocab_size, " tokens"),
                  uint64_t(logit_rows) * config.vocab_size * sizeof(float), [&] { logits.resize(logit_rows * config.vocab_size); });
    // Decode the prompt and continuation together and print what is new: pieces can merge bytes across
    // tokens, and sentencepiece drops the leading space of a text's first piece.
    const size_t text_begin = tokenizer.bos_id() >= 0 ? 1 : 0;
    auto decode_all = [&] { return tokenizer.decode(std::span<const int32_t>(tokens).subspan(text_begin)); };
    std::string printed = decode_all();
    std::printf("%s", printed.c_str());
    using Clock = std::chrono::steady_clock;
    const Clock::time_point start = Clock::now();
    Clock::time_point prompt_done = start;
    const int64_t prompt_tokens = static_cast<int64_t>(tokens.size());
    std::FILE* logits_file = nullptr;
    if (!logits_out.empty() && !(logits_file = std::fopen(logits_out.c_str(), "wb")))
      fail("option --logits_out: cannot create ", logits_out);
    if (kv_cache) model->clear_cache(1);
    while (static_cast<int64_t>(tokens.size()) < context) {
      const int64_t n = static_cast<int64_t>(tokens.size());
      const float* last = logits.data();
      if (!kv_cache) {
        model->forward_logits(tokens.data(), 1, n, logits.data());
        last = logits.data() + (n - 1) * config.vocab_size;
      } else if (n == prompt_tokens) {
        model->forward_cached(tokens.data(), n, logits.data());  // the prompt, all at once
      } else {
        model->forward_cached(&tokens.back(), 1, logits.data());  // the token drawn last
      }
      if (n == prompt_tokens) prompt_done = Clock::now();
      if (logits_file && std::fwrite(last, sizeof(float), config.vocab_size, logits_file) != size_t(config.vocab_size))
        fail("option --logits_out: cannot write ", logits_out, " (disk full?)");
      const int32_t next = greedy ? static_cast<int32_t>(std::max_element(last, last + config.vocab_size) - last)
                                  : sample_token(last, config.vocab_size, temperature, top_p, rng);
      if (stop_at_eos && std::find(eos.begin(), eos.end(), next) != eos.end()) break;
      tokens.push_back(next);
      // A character whose bytes are split across tokens decodes to U+FFFD until its last byte comes (the library's
      // decode is lossy): that tail waits.
      std::string text = decode_all();
      while (text.size() >= 3 && text.compare(text.size() - 3, 3, "\xEF\xBF\xBD") == 0) text.resize(text.size() - 3);
      if (text.size() > printed.size() && text.compare(0, printed.size(), printed) == 0) {
        std::printf("%s", text.c_str() + printed.size());
        std::fflush(stdout);
        printed = text;
      }
    }
    // What the library decodes, whole: the held-back tail too.
    const std::string all = decode_all();
    if (all.size() > printed.size() && all.compare(0, printed.size(), printed) == 0)
      std::printf("%s", all.c_str() + printed.size());
    const Clock::time_point end = Clock::now();
    std::printf("\n");
    std::fflush(stdout);
    if (logits_file && std::fclose(logits_file) != 0) fail("option --logits_out: cannot write ", logits_out);
    if (print_ids) {
      std::string line = "ids:";
      for (int64_t i = 0; i < static_cast<int64_t>(tokens.size()); ++i)
        line += (i == prompt_tokens ? " | " : " ") + std::to_string(tokens[i]);
      std::fprintf(stderr, "%s\n", line.c_str());
    }
    // The first token comes from the prompt's forward; each later one from a forward of its own.
    const int64_t generated = static_cast<int64_t>(tokens.size()) - prompt_tokens;
    const double prompt_s = std::chrono::duration<double>(prompt_done - start).count();
    const double decode_s = std::chrono::duration<double>(end - prompt_done).count();
    std::fprintf(stderr, "%lld tokens in %.2f s: prompt of %lld tokens %.3f s, then %.1f tokens/s (%s, %s)\n",
                 (long long)generated, prompt_s + decode_s, (long long)prompt_tokens, prompt_s,
                 generated > 1 ? (generated - 1) / decode_s : 0.0, model->describe().c_str(),
                 kv_cache ? "KV cache" : "no KV cache: whole context per token");
    if (static_cast<int64_t>(tokens.size()) == seq_len)
      std::fprintf(stderr, "sample: stopped at the context limit of %lld tokens (--seq_len)\n", (long long)seq_len);
    return 0;
  });
}
