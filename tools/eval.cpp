// build/eval — mean loss and perplexity of a checkpoint on token shards, so a user can compare the base
// model with the fine-tuned one on held-out documents.
//
//   build/eval --checkpoint DIR --data prepared/ [--seq_len N] [--micro_batch 4] [--device cuda]
//
// Prints a human line and a JSON line on stdout (progress on stderr). Every window of the shards is scored
// once, in order; the loss is the mean over every predicted token (targets masked out by the shards' loss
// mask are not counted). Windows are as long as the checkpoint's training windows unless --seq_len says
// otherwise, so that eval reproduces the trainer's validation loss; a model that was not trained by tuna has
// no such length and gets 1024 (compare two models on the same --seq_len). Packed documents likewise: attention
// masked at document boundaries and RoPE positions restarted as the checkpoint's run trained (the defaults,
// true and restart, for a model tuna did not train), unless --document_mask / --document_positions say.
// A LoRA checkpoint (or PEFT adapter directory) is scored on its base with the adapters merged on load; --base DIR
// names the base when it has moved (its checksum must be the recorded one: ckpt/peft.h).

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/options.h"
#include "core/progress.h"  // ProgressLine
#include "core/threads.h"
#include "data/loader.h"
#include "data/tokenizer.h"  // model_tokenizer
#include "ckpt/checkpoint.h"
#include "ckpt/peft.h"        // open_model: a LoRA checkpoint is its base with the adapters merged
#include "model/config.h"
#include "engine/engine.h"  // ForwardModel: the forward pass on cpu or cuda

int main(int argc, char** argv) {
  using namespace tuna;
  return guarded_main([&] {
    std::string checkpoint, base, data, device = "auto", document_mask = "auto", document_positions = "auto";
    int64_t seq_len = 0, micro_batch = 4, max_batches = 0, threads = 0;
    bool quiet = false;
    Options options("build/eval", "Mean loss and perplexity of a model directory on token shards.");
    options.add("checkpoint", &checkpoint, "model directory: a tuna checkpoint (runs/X/ckpt/latest too), a LoRA checkpoint "
                "or a Hugging Face download");
    options.add("base", &base, "a LoRA checkpoint's base model, instead of the one it records (same checksum required)");
    options.add("data", &data, "token shards: files, directories (their val-* shards) or globs, comma-separated");
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
    if (checkpoint.empty() || data.empty()) fail("--checkpoint and --data are required (see --help)");
    set_cpu_threads(threads);

    checkpoint = resolve_checkpoint(checkpoint).string();
    // The files read, against the directory's manifest (ckpt/checkpoint.h: one rule in every tool).
    if (!verify_model_directory(checkpoint, ModelFiles::Weights) && !quiet)
      std::fprintf(stderr, "note: %s\n", unverified_note(checkpoint).c_str());
    const ModelSource source = open_model(checkpoint, base);
    const std::string config_dir = source.config_dir.string();
    LlamaConfig config = LlamaConfig::load(config_dir);
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
