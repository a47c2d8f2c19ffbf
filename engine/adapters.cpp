// The adapters component (engine/adapters.h): its options, where a run's adapters come from, and what it hands on.
#include "engine/adapters.h"

#include <cstdio>

#include "ckpt/checkpoint.h"  // checkpoint_bytes
#include "ckpt/peft.h"        // lora_start, is_lora_directory, check_quantizable_base
#include "core/error.h"
#include "engine/checkpointer.h"
#include "model/lora.h"     // parse_lora_targets, validate_lora, lora_parameter_count
#include "model/support.h"  // base_quant_support

namespace tuna {

void declare_adapter_shape(Options& o, AdapterOptions& a) {
  o.add("lora_rank", &a.lora_rank,
        "LoRA: train rank-r adapters (r >= 1) on --lora_targets with the base frozen (ZeRO 0-3; at 3 the base is sharded "
        "too); unset (shown as 0): a full fine-tune",
        Bounds::closed(0, 1 << 20));
  o.add("lora_targets", &a.lora_targets,
        "LoRA: the projections that get adapters, a comma list of PEFT's module names (default: all seven)");
  o.add("lora_dropout", &a.lora_dropout,
        "LoRA: dropout probability on the adapters' input, in training (PEFT's lora_dropout; the mask is drawn again "
        "for the backward)");
  o.add("base_quant", &a.base_quant,
        "LoRA (cpu: ZeRO 0-2, any tp; cuda: nf4 at tp 1, ZeRO 0-2): hold the frozen base quantized, nf4 (QLoRA: 4-bit "
        "NormalFloat, blocksize 64, double-quantized absmax) or int8 (an absmax per row), each tensor quantized whole "
        "from --init as it is read; the adapters train on the dequantized weights. Recorded in the checkpoint (a resume "
        "keeps it)",
        {"none", "nf4", "int8"});
}

void declare_adapter_training(Options& o, AdapterOptions& a) {
  o.add("lora_alpha", &a.lora_alpha,
        "LoRA: the adapters' output is scaled by alpha / rank (alpha > 0); unset (shown as 0): the rank, a scale of 1");
  o.add("lora_init", &a.lora_init,
        "LoRA: start from this PEFT adapter directory (adapter_config.json + adapter_model.safetensors, or a tuna LoRA "
        "checkpoint); its rank, alpha, dropout and targets are the run's (an option that disagrees is an error)");
  o.add("base", &a.base,
        "LoRA --resume: the frozen base's directory, instead of the path the checkpoint recorded (its checksum must "
        "match)");
}

LoraPlan adapter_shape(const AdapterOptions& a) {
  LoraPlan plan;
  plan.rank = a.lora_rank;
  plan.targets = parse_lora_targets(a.lora_targets);
  plan.dropout = a.lora_dropout;
  plan.base_quant = parse_base_quant(a.base_quant, "option 'base_quant'");
  return plan;
}

namespace {

// The adapters the options ask for (rank 0: none, a full fine-tune): a rank given as 0, or a LoRA option without
// --lora_rank (or --lora_init, or a LoRA checkpoint to resume, which give the rank) is an error naming it. validate_lora
// checks the values against the model once it is known.
LoraConfig lora_options(const AdapterOptions& a, const Options& options, bool resuming_lora) {
  LoraConfig lora;
  if (!options.was_set("lora_rank")) {
    if (a.lora_init.empty() && !resuming_lora)
      for (const char* name : {"lora_alpha", "lora_dropout", "lora_targets"})
        if (options.was_set(name)) fail("option '", name, "' is for LoRA training: give --lora_rank too");
    return lora;
  }
  if (a.lora_rank < 1) fail("option 'lora_rank': expected a rank of at least 1, found ", a.lora_rank);
  lora.rank = a.lora_rank;
  lora.alpha = options.was_set("lora_alpha") ? a.lora_alpha : static_cast<double>(a.lora_rank);
  lora.dropout = a.lora_dropout;
  lora.targets = parse_lora_targets(a.lora_targets);
  return lora;
}

// Which LoRA options the user set: only those must agree with an adapter_config.json (--lora_init, a resume).
LoraOptionsGiven lora_options_given(const AdapterOptions& a, const Options& options) {
  LoraOptionsGiven given;
  if (options.was_set("lora_rank")) given.rank = a.lora_rank;
  if (options.was_set("lora_alpha")) given.alpha = a.lora_alpha;
  if (options.was_set("lora_dropout")) given.dropout = a.lora_dropout;
  if (options.was_set("lora_targets")) given.targets = parse_lora_targets(a.lora_targets);
  return given;
}

}  // namespace

Adapters Adapters::open(const AdapterOptions& a, const Options& options, const std::filesystem::path& init_dir,
                        const std::optional<std::filesystem::path>& resume_from, bool plan_only, Comm& world) {
  Adapters r;
  const std::optional<BaseQuant> quant =
      options.was_set("base_quant") ? std::optional(parse_base_quant(a.base_quant, "option 'base_quant'")) : std::nullopt;
  // A run: the options, --lora_init or the LoRA checkpoint resumed, which reads the base from its own directory.
  const bool resuming_lora = resume_from && is_lora_directory(*resume_from);
  if (!plan_only && (options.was_set("lora_rank") || !a.lora_init.empty() || resuming_lora)) {
    const LoraStart start = lora_start(lora_options(a, options, resuming_lora), lora_options_given(a, options),
                                       a.lora_init, init_dir, resume_from, a.base, world, quant);
    static_cast<LoraConfig&>(r.plan_) = start.lora;
    r.plan_.base_quant = start.base_quant;
    r.base_ = start.base;
    r.starting_ = start.adapters;
    return r;
  }
  if (!a.base.empty()) fail("option 'base' is for LoRA runs: give --lora_rank (or --resume a LoRA checkpoint)");
  // A plan needs the adapters' shape, not their values.
  if (plan_only && options.was_set("lora_rank")) {
    static_cast<LoraConfig&>(r.plan_) = lora_options(a, options, /*resuming_lora=*/false);
    if (quant) r.plan_.base_quant = *quant;
    return r;
  }
  // No adapters: an adapter option is an error naming it (the support table's for base_quant, model/support.h).
  LoraPlan none;
  none.base_quant = quant.value_or(BaseQuant::None);
  if (const Support s = base_quant_support(none, quant.has_value()); !s.runs()) fail(s.reason);
  lora_options(a, options, /*resuming_lora=*/false);
  return r;
}

WeightFill Adapters::base_weights() const { return base_.empty() ? WeightFill() : weights_from_directory(base_); }

void Adapters::record(AdapterOptions& a) const {
  if (enabled()) a.base_quant = base_quant_name(plan_.base_quant);
}

void Adapters::configure(EngineOptions& engine, const LlamaConfig& model) const {
  if (!enabled()) return;
  engine.lora = plan_;
  validate_lora(engine.lora, model);
  engine.adapters = starting_;
  engine.base_quant = plan_.base_quant;
  if (engine.base_quant != BaseQuant::None && !base_.empty()) check_quantizable_base(base_, model, engine.base_quant);
}

int64_t Adapters::trainable_parameters(const LlamaConfig& model) const {
  return enabled() ? lora_parameter_count(model, plan_) : model.n_params();
}

std::string Adapters::describe(const LlamaConfig& model) const {
  if (!enabled()) return str("trainable parameters: all ", model.n_params());
  char line[160];
  std::snprintf(line, sizeof line, "trainable parameters: %lld LoRA adapter parameters (%.3f%% of the %lld frozen base's)",
                (long long)trainable_parameters(model), 100.0 * trainable_parameters(model) / model.n_params(),
                (long long)model.n_params());
  return line;
}

int64_t Adapters::checkpoint_bytes(const LlamaConfig& model, const std::vector<TokenizerFile>& tokenizer_files) const {
  // A LoRA checkpoint holds the adapters only: their weights and moments, and adapter_model.safetensors (4 bytes more
  // each: with several ranks it is assembled beside the rank files).
  const int64_t trained = trainable_parameters(model);
  return tuna::checkpoint_bytes(trained, tokenizer_files) + (enabled() ? 4 * trained : 0);
}

void Adapters::attach(Checkpointer& checkpointer) const {
  if (!base_.empty()) checkpointer.set_lora(plan_, base_, plan_.base_quant);
}

}  // namespace tuna
