// build/eval — how good is a model: mean loss and perplexity on token shards, or multiple-choice accuracy on task
// records as lm-evaluation-harness reports it, so a user can compare the base model with the fine-tuned one.
//
//   build/eval --checkpoint DIR --data prepared/ [--seq_len N] [--micro_batch 4] [--device cuda]
//   build/eval --checkpoint DIR --tasks FILE|DIR[,...] [--output scores.jsonl] [--skip_bad_records]
//   mpirun -np 4 build/eval --checkpoint DIR --tasks ...      (data parallel: each rank scores a share)
//
// --data: prints a human line and a JSON line on stdout (progress on stderr). Every window of the shards is scored
// once, in order; the loss is the mean over every predicted token (targets masked out by the shards' loss
// mask are not counted). Windows are as long as the checkpoint's training windows unless --seq_len says
// otherwise, so that eval reproduces the trainer's validation loss; a model that was not trained by tuna has
// no such length and gets 1024 (compare two models on the same --seq_len). Packed documents likewise: attention
// masked at document boundaries and RoPE positions restarted as the checkpoint's run trained (the defaults,
// true and restart, for a model tuna did not train), unless --document_mask / --document_positions say.
// --tasks: every record's choices scored by log-likelihood (engine/mc_eval.h, data/mc_tasks.h): acc, acc_norm and
// their standard errors per task and over all, one line each and a JSON line; --output writes every record's
// per-choice log-likelihoods. Requests are packed many to a window under the document mask (cpu); windows are as
// long as the longest request unless --seq_len says. Records with a "target" instead of choices are answered by greedy
// generation and scored by exact match (engine/gen_eval.h), as lm-eval's generate_until tasks.
// A LoRA checkpoint (or PEFT adapter directory) is scored on its base with the adapters merged on load; --base DIR
// names the base when it has moved (its checksum must be the recorded one: ckpt/peft.h).

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/options.h"
#include "core/progress.h"  // ProgressLine
#include "core/threads.h"
#include "comm/comm.h"      // make_world_comm: the ranks of mpirun (--tasks)
#include "data/mc_tasks.h"  // read_mc_tasks, encode_mc_requests
#include "engine/gen_eval.h"  // generate_requests, gen_metrics: records with a target
#include "engine/mc_eval.h"  // score_mc_requests, mc_metrics
#include "data/loader.h"
#include "data/tokenizer.h"  // model_tokenizer
#include "ckpt/checkpoint.h"
#include "ckpt/peft.h"        // open_model: a LoRA checkpoint is its base with the adapters merged
#include "model/config.h"
#include "engine/engine.h"  // ForwardModel: the forward pass on cpu or cuda

namespace tuna {
namespace {

struct TaskRun {
  std::string tasks, output, tokenizer, device;
  bool skip_bad = false, special_tokens = true, quiet = false, share_context = true;
  int64_t seq_len = 0, micro_batch = 4;
};

std::vector<std::string> comma_list(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) items.push_back(item);
  return items;
}

// --tasks: every request scored (this rank's share of the windows under mpirun), the scores summed over the ranks,
// the metrics printed by rank 0.
int eval_tasks(const TaskRun& run, const std::string& checkpoint, const ModelSource& source, const LlamaConfig& config,
               const std::string& config_dir) {
  std::unique_ptr<Comm> world = make_world_comm(/*timeout_s=*/0);
  const bool root = world->rank() == 0, talk = root && !run.quiet;
  const McTasks tasks = read_mc_tasks(comma_list(run.tasks), run.skip_bad);
  const Tokenizer tokenizer(run.tokenizer.empty() ? checkpoint : run.tokenizer);
  if (const std::string warning = check_tokenizer_fits(tokenizer, config.vocab_size, config_dir + "/config.json");
      !warning.empty() && talk)
    std::fprintf(stderr, "warning: %s\n", warning.c_str());
  // lm-eval cuts a request to the model's context (its max_length); --seq_len cuts it to the window.
  const int64_t max_tokens = run.seq_len > 0 ? run.seq_len : config.max_position_embeddings;
  int64_t truncated = 0, longest = 1;
  const std::vector<McRequest> requests = encode_mc_requests(tasks, tokenizer, run.special_tokens, max_tokens, &truncated);
  for (const McRequest& q : requests) longest = std::max<int64_t>(longest, static_cast<int64_t>(q.tokens.size()) - 1);
  // Windows as long as the longest request (at least 256 tokens, so that short requests share them), in steps of 64.
  const int64_t window = run.seq_len > 0 ? run.seq_len
                                         : std::min<int64_t>(config.max_position_embeddings,
                                                             (std::max<int64_t>(longest, 256) + 63) / 64 * 64);
  check_seq_len(config, window, "seq_len", config_dir + "/config.json");
  // Generative records: each context and its answer in the KV cache (engine/gen_eval.h).
  const GenTokenizer gen_tok = gen_tokenizer(tokenizer, config.eos_token_ids, run.special_tokens);
  const std::vector<GenRequest> gen_requests = encode_gen_requests(tasks, gen_tok, max_tokens);
  int64_t gen_seq = 0, gen_truncated = 0, gen_longest = 0;
  for (const GenRequest& q : gen_requests) {
    gen_seq = std::max<int64_t>(gen_seq, static_cast<int64_t>(q.context.size()) + q.max_new);
    gen_longest = std::max(gen_longest, q.max_new);
    gen_truncated += q.truncated;
  }
  // A record's choices go through one forward together when they share their context: as many rows as choices.
  size_t choices = 1;
  for (const McRecord& r : tasks.records) choices = std::max(choices, r.choices.size());
  std::unique_ptr<ForwardModel> model =
      make_forward_model(config, resolve_device(run.device), std::max<int64_t>(run.micro_batch, choices),
                         std::max(window, gen_seq), source.fill, DocumentMode{true, true});
  McScoring how;
  how.batch = run.micro_batch, how.seq = window, how.packed = model->packs_documents();
  how.rank = world->rank(), how.ranks = world->size();
  if (model->shares_context() && run.share_context)
    how.shared = [&](const int32_t* context, int64_t c, const int32_t* tokens, const int32_t* targets, int64_t k,
                     int64_t m, float* logps, uint8_t* greedy) {
      model->forward_shared_logps(context, c, tokens, targets, k, m, logps, greedy);
    };
  const McPacking packing = pack_mc_requests(requests, how);
  if (talk) {
    std::fprintf(stderr, "eval: %zu records of %zu task(s) in %zu file(s), %zu requests (%s)\n", tasks.records.size(),
                 tasks.tasks.size(), tasks.files.size(), requests.size(), tokenizer.describe().c_str());
    if (!tasks.generative.empty())
      std::fprintf(stderr, "eval: %zu generative records of %zu task(s), up to %lld tokens each (greedy)\n",
                   tasks.generative.size(), tasks.generative_tasks.size(), static_cast<long long>(gen_longest));
    for (const auto& [why, count] : tasks.skipped)
      std::fprintf(stderr, "eval: skipped %lld bad record(s): %s\n", static_cast<long long>(count), why.c_str());
    if (truncated > 0)
      std::fprintf(stderr, "eval: %lld request(s) longer than %lld tokens keep their last %lld (as lm-eval cuts them)\n",
                   static_cast<long long>(truncated), static_cast<long long>(max_tokens),
                   static_cast<long long>(max_tokens + 1));
    if (gen_truncated > 0)
      std::fprintf(stderr, "eval: %lld generative context(s) keep their last max_length - max_gen_toks tokens (as lm-eval "
                   "cuts them; max_length %lld)\n", static_cast<long long>(gen_truncated), static_cast<long long>(max_tokens));
    if (!requests.empty())
      std::fprintf(stderr, "eval: %lld windows of %lld tokens (%.0f%% filled), %lld per batch, %d rank(s), on %s\n",
                   static_cast<long long>(packing.windows), static_cast<long long>(window),
                   100.0 * static_cast<double>(packing.tokens) / static_cast<double>(packing.windows * window),
                   static_cast<long long>(run.micro_batch), world->size(), model->describe().c_str());
  }
  McScores scores;
  if (!requests.empty()) {
    ProgressLine progress("eval", static_cast<double>(packing.windows), ProgressLine::Unit::Items, talk ? stderr : nullptr,
                          5.0, "windows");
    how.progress = [&](int64_t done, int64_t planned) {
      if (done == 0 || planned == 0) return;
      progress.update(static_cast<double>(done) * static_cast<double>(packing.windows) / static_cast<double>(planned));
    };
    scores = score_mc_requests(requests, how, [&](const int32_t* inputs, const int32_t* targets, const int32_t* positions,
                                                  int64_t batch, int64_t seq, float* logps, uint8_t* greedy) {
      model->forward_target_logps(inputs, targets, batch, seq, positions, logps, greedy);
    });
    progress.finish();
    if (world->size() > 1) {  // each request was scored on one rank; the others hold 0
      std::vector<double> greedy(scores.greedy.begin(), scores.greedy.end());
      world->all_reduce(scores.loglikelihood.data(), static_cast<int64_t>(requests.size()), CommType::F64, ReduceOp::Sum,
                        "eval log-likelihoods");
      world->all_reduce(greedy.data(), static_cast<int64_t>(greedy.size()), CommType::F64, ReduceOp::Sum, "eval greedy");
      for (size_t i = 0; i < greedy.size(); i++) scores.greedy[i] = greedy[i] > 0.5;
    }
  }
  std::vector<std::vector<int32_t>> generated;
  if (!gen_requests.empty()) {
    ProgressLine progress("generate", static_cast<double>(gen_requests.size()), ProgressLine::Unit::Items,
                          talk ? stderr : nullptr, 5.0, "records");
    GenRun gen_run;
    gen_run.rank = world->rank(), gen_run.ranks = world->size();
    gen_run.progress = [&](int64_t done, int64_t planned) {
      progress.update(static_cast<double>(done) * static_cast<double>(gen_requests.size()) / static_cast<double>(planned));
    };
    generated = generate_requests(*model, config.vocab_size, tasks, gen_requests, gen_tok, gen_run);
    progress.finish();
    if (world->size() > 1) {  // each record was answered on one rank: its length and ids, summed over the ranks
      const size_t row = static_cast<size_t>(gen_longest) + 1;
      std::vector<double> rows(generated.size() * row, 0.0);
      for (size_t i = 0; i < generated.size(); i++) {
        rows[i * row] = static_cast<double>(generated[i].size());
        for (size_t t = 0; t < generated[i].size(); t++) rows[i * row + 1 + t] = generated[i][t];
      }
      world->all_reduce(rows.data(), static_cast<int64_t>(rows.size()), CommType::F64, ReduceOp::Sum, "eval generations");
      for (size_t i = 0; i < generated.size(); i++) {
        generated[i].resize(static_cast<size_t>(rows[i * row]));
        for (size_t t = 0; t < generated[i].size(); t++) generated[i][t] = static_cast<int32_t>(rows[i * row + 1 + t]);
      }
    }
  }
  std::vector<std::string> answers;
  for (size_t i = 0; i < generated.size(); i++)
    answers.push_back(gen_answer(generated[i], tasks.generative[gen_requests[i].record].until, gen_tok));
  std::vector<McMetrics> metrics = mc_metrics(tasks, requests, scores);
  for (McMetrics& m : gen_metrics(tasks, answers)) metrics.push_back(std::move(m));
  if (!root) return 0;
  if (!run.output.empty()) {
    std::ofstream out(run.output, std::ios::binary | std::ios::trunc);
    if (!out) fail(run.output, ": cannot write (--output)");
    const std::vector<int64_t> first = mc_first_requests(tasks, requests);
    for (size_t i = 0; i < tasks.records.size(); i++)
      out << mc_record_json(tasks, requests, scores, static_cast<int64_t>(i), first).dump() << '\n';
    for (size_t i = 0; i < answers.size(); i++)
      out << gen_record_json(tasks, static_cast<int64_t>(i), generated[i], answers[i]).dump() << '\n';
    out.flush();
    if (!out) fail(run.output, ": write failed (--output)");
  }
  std::printf("%s on %s:\n%s", checkpoint.c_str(), run.tasks.c_str(), format_mc_metrics(metrics).c_str());
  nlohmann::json line = {{"checkpoint", checkpoint}, {"tasks", run.tasks}, {"metrics", mc_metrics_json(metrics)},
                         {"records", tasks.records.size()}, {"requests", requests.size()},
                         {"generative_records", tasks.generative.size()},
                         {"skipped", tasks.skipped}, {"truncated", truncated + gen_truncated},
                         {"add_special_tokens", run.special_tokens},
                         {"device", model->describe()}, {"ranks", world->size()}};
  std::printf("%s\n", line.dump().c_str());
  return 0;
}

}  // namespace
}  // namespace tuna

int main(int argc, char** argv) {
  using namespace tuna;
  return guarded_main([&] {
    std::string checkpoint, base, data, device = "auto", document_mask = "auto", document_positions = "auto";
    int64_t seq_len = 0, micro_batch = 4, max_batches = 0, threads = 0;
    bool quiet = false;
    TaskRun task_run;
    Options options("build/eval", "Mean loss and perplexity of a model directory on token shards, or its "
                    "multiple-choice accuracy on task records.");
    options.add("checkpoint", &checkpoint, "model directory: a tuna checkpoint (runs/X/ckpt/latest too), a LoRA checkpoint "
                "or a Hugging Face download");
    options.add("base", &base, "a LoRA checkpoint's base model, instead of the one it records (same checksum required)");
    options.add("data", &data, "token shards: files, directories (their val-* shards) or globs, comma-separated");
    options.add("tasks", &task_run.tasks, "task records (JSONL: task, context, choices, gold; or task, context, until, "
                "target for greedy generation): files or directories of *.jsonl, comma-separated; instead of --data");
    options.add("output", &task_run.output, "with --tasks: write every record's per-choice log-likelihoods (or its "
                "generated answer) here (JSONL)");
    options.add("skip_bad_records", &task_run.skip_bad, "with --tasks: count and skip bad records instead of stopping at "
                "the first");
    options.add("add_special_tokens", &task_run.special_tokens, "with --tasks: encode each text with the tokenizer's own "
                "special tokens (Llama's BOS first), as lm-eval's Hugging Face backend does by default; false: plain ids "
                "(lm-eval's add_bos_token=False)");
    options.add("share_context", &task_run.share_context, "with --tasks: a record's choices that share their context "
                "compute it once (a KV cache; cpu); false: every request packed on its own");
    options.add("tokenizer", &task_run.tokenizer, "with --tasks: the tokenizer (file or directory); default: the "
                "checkpoint's");
    options.add("seq_len", &seq_len, "tokens per window (windows do not overlap); 0: the checkpoint's training seq_len, "
                "or 1024 for a model tuna did not train", Bounds::closed(0, 1 << 22));
    options.add("micro_batch", &micro_batch, "windows per forward pass", Bounds::closed(1, 1 << 22));
    options.add("max_batches", &max_batches, "stop after this many batches; 0: all", Bounds::at_least(0));
    options.add("threads", &threads, "CPU threads; 0: all cores", Bounds::closed(0, 1 << 16));
    options.add("device", &device, "cuda when a GPU is visible (auto), or the one named", {"auto", "cpu", "cuda"});
    options.add("quiet", &quiet, "no progress lines on stderr");
    options.add("document_mask", &document_mask,
                "attention inside each document of a window: true, false, or auto (as the checkpoint's run trained; "
                "true for a model tuna did not train)", {"auto", "true", "false"});
    options.add("document_positions", &document_positions,
                "RoPE positions of packed windows: restart, continue, or auto (as the checkpoint's run trained; "
                "restart for a model tuna did not train)", {"auto", "restart", "continue"});
    if (!options.parse(argc, argv).empty()) fail("unexpected positional argument (options are --name value)");
    if (checkpoint.empty() || data.empty() == task_run.tasks.empty())
      fail("--checkpoint and one of --data or --tasks are required (see --help)");
    set_cpu_threads(threads);

    checkpoint = resolve_checkpoint(checkpoint).string();
    // The files read, against the directory's manifest (ckpt/checkpoint.h: one rule in every tool).
    if (!verify_model_directory(checkpoint, ModelFiles::Weights) && !quiet)
      std::fprintf(stderr, "note: %s\n", unverified_note(checkpoint).c_str());
    const ModelSource source = open_model(checkpoint, base);
    const std::string config_dir = source.config_dir.string();
    LlamaConfig config = LlamaConfig::load(config_dir);
    if (!task_run.tasks.empty()) {
      task_run.seq_len = seq_len, task_run.micro_batch = micro_batch, task_run.device = device, task_run.quiet = quiet;
      return eval_tasks(task_run, checkpoint, source, config, config_dir);
    }
    std::string seq_len_source = "--seq_len";
    if (seq_len == 0) {
      const std::optional<int64_t> trained = training_seq_len(checkpoint);
      seq_len = trained ? *trained : std::min<int64_t>(1024, config.max_position_embeddings);
      seq_len_source = trained ? "the checkpoint's training seq_len" : "default: the model has no training seq_len";
    }
    check_seq_len(config, seq_len, "seq_len", config_dir + "/config.json");
    if (micro_batch * seq_len > (int64_t{1} << 31))
      fail("options 'micro_batch' x 'seq_len' = ", micro_batch * seq_len, " tokens per batch: at most 2^31");
    if (!quiet)
      std::fprintf(stderr, "eval: loading %s (%lld parameters); windows of %lld tokens (%s)\n", checkpoint.c_str(),
                   (long long)config.n_params(), (long long)seq_len, seq_len_source.c_str());
    const std::optional<TrainedDocumentMode> trained_documents = training_document_mode(checkpoint);
    DocumentMode documents;
    if (trained_documents) documents = {trained_documents->mask, trained_documents->restart_positions};
    if (document_mask != "auto") documents.mask = document_mask == "true";
    if (document_positions != "auto") documents.restart_positions = parse_document_positions(document_positions);
    std::unique_ptr<ForwardModel> model =
        make_forward_model(config, resolve_device(device), micro_batch, seq_len,
                           source.fill, documents);
    std::vector<std::string> specs;
    std::stringstream in(data);
    for (std::string item; std::getline(in, item, ',');)
      if (!item.empty()) specs.push_back(item);
    LoaderOptions lo;
    lo.seq_len = seq_len;
    lo.micro_batch = micro_batch;
    lo.vocab_size = config.vocab_size;
    lo.eval = true;
    // Shards written by another tokenizer than the checkpoint's are refused (when it has one tuna reads).
    const ModelTokenizer tokenizer = model_tokenizer("", checkpoint, config.vocab_size);
    lo.tokenizer_fingerprint = tokenizer.fingerprint;
    lo.tokenizer_name = tokenizer.description;
    DataLoader loader(expand_shard_paths(specs, ShardRole::Val), lo);

    std::vector<int32_t> inputs(micro_batch * seq_len), targets(micro_batch * seq_len), positions(micro_batch * seq_len);
    LossSum total;
    int64_t batches = 0;
    const int64_t planned = max_batches > 0 ? std::min<int64_t>(max_batches, loader.batches_per_epoch())
                                            : static_cast<int64_t>(loader.batches_per_epoch());
    if (!quiet)
      std::fprintf(stderr, "eval: %llu windows in %zu shard(s), %lld batches of %lld on %s\n",
                   (unsigned long long)loader.total_windows(), loader.shard_count(), (long long)planned,
                   (long long)micro_batch, model->describe().c_str());
    ProgressLine progress("eval", double(planned), ProgressLine::Unit::Items, quiet ? nullptr : stderr, 5.0, "batches");
    while ((max_batches == 0 || batches < max_batches) && loader.next(inputs.data(), targets.data(), positions.data())) {
      LossSum l = model->forward_loss(inputs.data(), targets.data(), micro_batch, seq_len, positions.data());
      total.sum += l.sum;
      total.count += l.count;
      progress.update(double(++batches));
    }
    progress.finish();
    if (total.count == 0) fail(data, ": no token to score (the shards hold fewer than seq_len + 1 tokens?)");
    const double loss = total.sum / total.count;
    // The last batch of the pass may be padded with empty rows: count windows, not rows.
    const int64_t windows = std::min<int64_t>(batches * micro_batch, static_cast<int64_t>(loader.total_windows()));
    std::printf("%s on %s: loss %.4f, perplexity %.3f over %lld tokens (%lld windows of %lld; %s)\n",
                checkpoint.c_str(), data.c_str(), loss, std::exp(loss), (long long)total.count, (long long)windows,
                (long long)seq_len, model->describe().c_str());
    std::printf("%s\n", nlohmann::json{{"checkpoint", checkpoint}, {"data", data}, {"loss", loss},
                                       {"perplexity", std::exp(loss)}, {"tokens", total.count}, {"seq_len", seq_len},
                                       {"document_mask", documents.mask},
                                       {"document_positions", document_positions_name(documents.restart_positions)},
                                       {"device", model->describe()}}
                            .dump()
                            .c_str());
    return 0;
  });
}
