#include "ckpt/peft.h"

#include <algorithm>
#include <memory>
#include <set>
#include <vector>

#include "comm/comm.h"
#include "core/checksum.h"
#include "core/error.h"
#include "core/file.h"
#include "core/json.h"
#include "ckpt/safetensors.h"
#include "data/tokenizer.h"  // kTokenizerFileNames (a plain list)
#include "model/quantized_weights.h"  // dequantized_base_fill: a QLoRA checkpoint's base

namespace tuna {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr LoraTarget kTargets[kLoraTargets] = {LoraTarget::Q,    LoraTarget::K,  LoraTarget::V,   LoraTarget::O,
                                               LoraTarget::Gate, LoraTarget::Up, LoraTarget::Down};

std::string weight_name(int64_t layer, LoraTarget t) {
  return str("model.layers.", layer, ".", lora_target_module(t), ".", lora_target_name(t), ".weight");
}

std::string absolute_path(const fs::path& p) {
  fs::path a = fs::absolute(p).lexically_normal();
  if (a.filename().empty()) a = a.parent_path();  // "base/"
  return a.string();
}

// The checksum of a directory without a manifest: config.json, then every tensor's name, dtype, shape and bytes in
// name order, each run of bytes released from this process once hashed (the page cache keeps it).
uint64_t tensors_checksum(const fs::path& base) {
  Checksum sum;
  const std::string config = read_regular_file(base / "config.json", "model config", uint64_t(1) << 26);
  sum.update(config.data(), config.size());
  const HfCheckpointDir dir(base);
  std::vector<std::string> names = dir.tensor_names();
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const HfCheckpointDir::Entry e = dir.find(name);
    if (!e) fail(base.string(), ": has no tensor '", name, "'");
    sum.update(name.data(), name.size() + 1);  // with its terminating zero: names cannot run into each other
    const std::string dtype(dtype_name(e.info->dtype));
    sum.update(dtype.data(), dtype.size() + 1);
    const int64_t dims = static_cast<int64_t>(e.info->shape.size());
    sum.update(&dims, sizeof dims);
    sum.update(e.info->shape.data(), e.info->shape.size() * sizeof(int64_t));
    const std::byte* data = e.file->data(*e.info);
    constexpr uint64_t kRun = uint64_t(64) << 20;
    for (uint64_t at = 0; at < e.info->nbytes(); at += kRun) {
      const uint64_t n = std::min(kRun, e.info->nbytes() - at);
      sum.update(data + at, n);
      e.file->release(data + at, n);
    }
  }
  return sum.digest().xxh3;
}

std::string describe(const std::string& method, uint64_t xxh3) { return str(method, " ", hex64(xxh3)); }

// What tuna writes into every checkpoint, and a PEFT adapter directory from elsewhere does not have.
bool tuna_written(const fs::path& dir) {
  std::error_code ec;
  return fs::exists(dir / kManifestFile, ec) || fs::exists(dir / "state.json", ec);
}

// The rank against each target's dimensions (validate_lora's rule), naming the file and its key: a rank above the
// smaller dimension adds parameters and no capacity.
void check_rank_fits(const LoraConfig& lora, const LlamaConfig& config, const std::string& file, const fs::path& base) {
  for (LoraTarget t : kTargets) {
    if (!lora.has(t)) continue;
    const auto [out, in] = lora_target_shape(config, t);
    if (lora.rank > std::min(out, in))
      fail(file, ": field 'r': ", lora.rank, " exceeds the smaller dimension of ", lora_target_name(t), " (", out, " x ",
           in, ") of the base ", base.string(), " (an adapter of another base model?)");
  }
}

// An adapter file against its configuration on the base: exactly the adapters the configuration targets, each of
// the base's shape. A reader that took what it expects and ignored the rest would silently drop adapters (a resume
// would train and save a part of them).
void check_adapter_tensors(const SafetensorsFile& file, const LoraConfig& lora, const LlamaConfig& config,
                           const fs::path& base, const std::string& config_file) {
  const LoraLayout global = lora_layout(config, lora);
  const std::string described = str(config_file, " (target_modules ", lora_targets_string(lora.targets), ", r = ",
                                    lora.rank, ") on the base ", base.string(), " (", config.num_hidden_layers, " layers)");
  std::set<std::string> expected;
  for (const ParamTensor& t : global.params.tensors()) {
    expected.insert(t.name);
    const TensorInfo* info = file.find(t.name);
    if (!info)
      fail(file.path().string(), ": has no tensor '", t.name, "', an adapter of ", described,
           ": the adapter file and its configuration disagree");
    if (info->shape != t.global_shape)
      fail("tensor '", t.name, "' in ", file.path().string(), ": expected shape ", format_shape(t.global_shape),
           " for the base ", base.string(), " at r = ", lora.rank, ", found ", format_shape(info->shape),
           " (an adapter of another base model?)");
  }
  for (const TensorInfo& t : file.tensors())
    if (!expected.count(t.name))
      fail(file.path().string(), ": tensor '", t.name, "' is not an adapter of ", described,
           ": the adapter file and its configuration disagree (a reader that skipped it would drop adapters)");
}

// Steps 1 and 2 of open_lora_checkpoint (peft.h): the files every LoRA directory has, and base_model.json in a
// tuna checkpoint. True for a tuna checkpoint.
bool check_lora_files(const fs::path& dir) {
  require_directory(dir, "LoRA checkpoint or PEFT adapter directory");
  std::error_code ec;
  if (!fs::is_regular_file(dir / kAdapterConfigFile, ec))
    fail(dir.string(), ": has no ", kAdapterConfigFile, " (a LoRA checkpoint or PEFT adapter directory holds ",
         kAdapterConfigFile, " and ", kAdapterWeightsFile, ")");
  if (!fs::exists(dir / kAdapterWeightsFile, ec)) {
    if (fs::exists(dir / "adapter_model.bin", ec))
      fail(dir.string(), ": holds adapter_model.bin (a PyTorch pickle), which tuna does not read: save the adapter "
           "with safe_serialization=True (PEFT's default) to get adapter_model.safetensors");
    fail((dir / kAdapterWeightsFile).string(), ": missing (a PEFT adapter directory holds adapter_config.json and "
         "adapter_model.safetensors)");
  }
  const bool tuna = tuna_written(dir);
  if (tuna && !fs::exists(dir / kBaseModelFile, ec))
    fail(dir.string(), ": a tuna LoRA checkpoint (it has ", fs::exists(dir / kManifestFile, ec) ? kManifestFile : "state.json",
         ") without ", kBaseModelFile, ", which names the base its adapters were trained on and that base's checksum: "
         "without it nothing holds the adapters to their base. Restore the file from where the checkpoint was written; "
         "or, to use the adapters on a base you name, copy ", kAdapterConfigFile, " and ", kAdapterWeightsFile,
         " alone into a new directory and import it with `build/convert peft-to-tuna NEW_DIR OUT_DIR --base BASE_DIR`");
  return tuna;
}

// Step 4, after steps 1 and 2, and step 3's sizes and listing when the checksums are the caller's.
LoraCheckpoint read_lora_directory(const fs::path& dir, LoraManifest manifest) {
  LoraCheckpoint c;
  c.dir = dir;
  c.tuna = check_lora_files(dir);
  if (manifest == LoraManifest::ChecksumsVerifiedByCaller) {
    bool unverified = false;
    const std::string problem =
        verify_checkpoint_files(dir, [](const std::string&) { return false; }, 0, 1, &unverified);
    if (!problem.empty()) fail(dir.string(), ": fails verification against its ", kManifestFile, ", not used: ", problem);
    c.manifest = !unverified;
  }
  c.lora = read_peft_adapter_config(dir / kAdapterConfigFile);
  c.quant = lora_base_quant(dir);
  return c;
}

// Step 6: the configuration and the adapter file against the base's config.json.
void check_lora_on_base(LoraCheckpoint& c) {
  c.base_config = LlamaConfig::load(c.base.string());
  const std::string config_file = (c.dir / kAdapterConfigFile).string();
  check_rank_fits(c.lora, c.base_config, config_file, c.base);
  check_adapter_tensors(SafetensorsFile(c.dir / kAdapterWeightsFile), c.lora, c.base_config, c.base, config_file);
}

}  // namespace

bool is_lora_directory(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / kAdapterConfigFile, ec);
}

json BaseIdentity::to_json() const {
  return json{{"path", path}, {"checksum", {{"method", method}, {"xxh3_64", hex64(xxh3)}}}};
}

BaseIdentity base_identity(const fs::path& base) {
  require_directory(base, "base model");
  BaseIdentity id;
  id.path = absolute_path(base);
  std::error_code ec;
  if (fs::exists(base / kManifestFile, ec)) {
    id.method = "manifest";
    id.xxh3 = digest_file(base / kManifestFile).xxh3;
  } else {
    id.method = "tensors";
    id.xxh3 = tensors_checksum(base);
  }
  return id;
}

LoraFiles lora_files(const LoraConfig& lora, const fs::path& base, BaseQuant quant) {
  json record = base_identity(base).to_json();
  if (quant != BaseQuant::None) record["quantization"] = base_quant_name(quant);
  return LoraFiles{lora, record};
}

BaseQuant lora_base_quant(const fs::path& lora_dir) {
  const fs::path record_path = lora_dir / kBaseModelFile;
  if (std::error_code ec; !fs::exists(record_path, ec)) return BaseQuant::None;
  const json record = read_json_file(record_path, "the base of a LoRA checkpoint");
  if (!record.is_object() || !record.contains("quantization")) return BaseQuant::None;
  const std::string where = str(record_path.string(), ": field 'quantization'");
  if (!record["quantization"].is_string()) fail(where, ": expected none, nf4 or int8, found ", record["quantization"].dump());
  return parse_base_quant(record["quantization"].get<std::string>(), where);
}

fs::path lora_base(const fs::path& lora_dir, const fs::path& override_base) {
  const fs::path record_path = lora_dir / kBaseModelFile;
  const std::string where = record_path.string();
  std::error_code ec;
  if (!fs::exists(record_path, ec)) {
    // A PEFT adapter directory from elsewhere: its base by --base, or by adapter_config.json where that is a
    // directory here; there is no checksum to hold it to.
    if (!override_base.empty()) return override_base;
    const json config = read_json_file(lora_dir / kAdapterConfigFile, "PEFT adapter config");
    const std::string named = config.is_object() && config.contains("base_model_name_or_path") &&
                                      config["base_model_name_or_path"].is_string()
                                  ? config["base_model_name_or_path"].get<std::string>()
                                  : "";
    if (named.empty() || !fs::is_directory(named, ec))
      fail(lora_dir.string(), ": has no ", kBaseModelFile, " and its ", kAdapterConfigFile,
           " names no base directory here ('base_model_name_or_path': '", named, "'): give the base with --base DIR");
    return named;
  }
  const json record = read_json_file(record_path, "the base of a LoRA checkpoint");
  if (!record.is_object() || !record.contains("path") || !record["path"].is_string())
    fail(where, ": field 'path': expected the base model's directory");
  const std::string recorded = record["path"].get<std::string>();
  const json checksum = record.value("checksum", json());
  if (!checksum.is_object() || !checksum.contains("method") || !checksum["method"].is_string() ||
      (checksum["method"] != "manifest" && checksum["method"] != "tensors") || !checksum.contains("xxh3_64") ||
      !checksum["xxh3_64"].is_string())
    fail(where, ": field 'checksum': expected {\"method\": \"manifest\" or \"tensors\", \"xxh3_64\": 16 hex digits}, found ",
         checksum.dump());
  const std::string method = checksum["method"].get<std::string>();
  const uint64_t expected = parse_hex64(checksum["xxh3_64"].get<std::string>(), where + ": field 'checksum.xxh3_64'");
  const fs::path base = override_base.empty() ? fs::path(recorded) : override_base;
  if (!fs::is_directory(base, ec)) {
    if (override_base.empty())
      fail(where, ": the base model ", recorded, " is not a directory (moved or deleted?): give its new place with "
           "--base DIR");
    fail("option 'base': ", base.string(), " is not a directory");
  }
  // A manifested base's files against its manifest (the checksum stands for them only then).
  if (fs::exists(base / kManifestFile, ec)) verify_model_directory(base, ModelFiles::Weights);
  const BaseIdentity found = base_identity(base);
  if (found.method != method || found.xxh3 != expected)
    fail("the base model has changed since ", lora_dir.string(), " was written: ", where, " records ", recorded,
         " with checksum ", describe(method, expected), ", and ", found.path, " has ", describe(found.method, found.xxh3),
         " (adapters trained on other weights do not fit these; give the base they were trained on with --base DIR)");
  return base;
}

fs::path lora_base(const fs::path& lora_dir, const fs::path& override_base, Comm& world) {
  fs::path base;
  std::string problem;
  if (world.rank() == 0) {
    try {
      base = lora_base(lora_dir, override_base);
    } catch (const Error& e) {
      problem = e.what();
    }
  }
  int64_t failed = problem.empty() ? 0 : 1;
  world.all_reduce_sum(&failed, 1, "LoRA base check");
  if (failed) fail(problem.empty() ? str(lora_dir.string(), ": its base fails the check on rank 0 (see its message)") : problem);
  if (world.rank() == 0) return base;
  // The others take the path rank 0 checked: --base, else the recorded one (no checksum of their own).
  if (!override_base.empty()) return override_base;
  if (std::error_code ec; !fs::exists(lora_dir / kBaseModelFile, ec)) return lora_base(lora_dir, override_base);
  const json record = read_json_file(lora_dir / kBaseModelFile, "the base of a LoRA checkpoint");
  return record["path"].get<std::string>();
}

LoraCheckpoint open_lora_checkpoint(const fs::path& dir, const fs::path& base, LoraManifest manifest) {
  bool verified = false;
  if (manifest == LoraManifest::Verify) {  // the checksums first: nothing else is read from a damaged directory
    check_lora_files(dir);
    verified = verify_model_directory(dir, ModelFiles::Weights);
  }
  LoraCheckpoint c = read_lora_directory(dir, manifest);
  if (manifest == LoraManifest::Verify) c.manifest = verified;
  c.base = lora_base(dir, base);
  check_lora_on_base(c);
  return c;
}

LoraCheckpoint open_lora_checkpoint(const fs::path& dir, const fs::path& base, Comm& world, LoraManifest manifest) {
  LoraCheckpoint c;
  std::string problem;
  const auto agree = [&](const char* label) {
    int64_t failed = problem.empty() ? 0 : 1;
    world.all_reduce_sum(&failed, 1, label);
    if (failed) fail(problem.empty() ? str(dir.string(), ": refused on another rank (see its message)") : problem);
  };
  try {
    check_lora_files(dir);
  } catch (const Error& e) {
    problem = e.what();
  }
  agree("LoRA checkpoint files");
  const bool verified = manifest == LoraManifest::Verify && verify_model_directory(dir, ModelFiles::Weights, world);
  try {
    c = read_lora_directory(dir, manifest);
    if (manifest == LoraManifest::Verify) c.manifest = verified;
  } catch (const Error& e) {
    problem = e.what();
  }
  agree("LoRA checkpoint read");
  c.base = lora_base(dir, base, world);
  try {
    check_lora_on_base(c);
  } catch (const Error& e) {
    problem = e.what();
  }
  agree("LoRA checkpoint against its base");
  return c;
}

MergedWeightReader::MergedWeightReader(const fs::path& base, const fs::path& lora_dir, const ParamLayout& layout)
    : base_(base, layout),
      quant_(lora_base_quant(lora_dir)),
      base_fill_(dequantized_base_fill(
          [this](const ParamLayout&, const Segment& piece, float* out) { base_.read(piece, out); }, quant_)),
      layout_(layout),
      config_(LlamaConfig::load(base.string())),
      lora_(read_peft_adapter_config(lora_dir)),
      adapter_path_(lora_dir / kAdapterWeightsFile) {
  try {
    validate_lora(lora_, config_);
  } catch (const Error& e) {
    fail(lora_dir.string(), "/", kAdapterConfigFile, " on the base ", base.string(), ": ", e.what());
  }
  adapter_.emplace(adapter_path_);
  // Exactly the adapters adapter_config.json targets, each of the base's shapes (checked before any piece is read).
  check_adapter_tensors(*adapter_, lora_, config_, base, (lora_dir / kAdapterConfigFile).string());
  for (int64_t l = 0; l < config_.num_hidden_layers; l++)
    for (LoraTarget target : kTargets) {
      if (!lora_.has(target)) continue;
      const ParamTensor* w = layout_.find(weight_name(l, target));
      TUNA_CHECK(w && w->shape.size() == 2, "no weight ", weight_name(l, target), " in the layout");
      targeted_.push_back({w, l, target});
    }
  std::sort(targeted_.begin(), targeted_.end(),
            [](const Targeted& a, const Targeted& b) { return a.weight->offset < b.weight->offset; });
}

void MergedWeightReader::load_adapter(int64_t layer, LoraTarget t) {
  if (cached_layer_ == layer && cached_target_ == static_cast<int>(t)) return;
  const auto [out, in] = lora_target_shape(config_, t);
  const int64_t r = lora_.rank;
  a_.resize(r * in), b_.resize(out * r);
  adapter_->read_f32(lora_tensor_name(layer, t, 'A'), {r, in}, a_.data());
  adapter_->read_f32(lora_tensor_name(layer, t, 'B'), {out, r}, b_.data());
  cached_layer_ = layer, cached_target_ = static_cast<int>(t);
}

void MergedWeightReader::read(const Segment& piece, float* out) {
  base_fill_(layout_, piece, out);
  const double scale = lora_.scale();
  const int64_t r = lora_.rank;
  for (const Targeted& p : targeted_) {
    const ParamTensor* t = p.weight;
    const int64_t begin = std::max(piece.begin, t->offset), end = std::min(piece.begin + piece.size, t->offset + t->numel);
    if (begin >= end) continue;
    load_adapter(p.layer, p.target);
    const int64_t cols = t->shape[1], in = t->global_shape[1];
    // This rank's block of W is rows [split_begin, ...) (split_dim 0) or columns (split_dim 1) of the global one.
    // r multiply-adds per element, over all cores (a 70B merge is about 10^12 of them); each element is written by
    // one thread, in the same order of k, so the result does not depend on the thread count.
#pragma omp parallel for schedule(static)
    for (int64_t e = begin - t->offset; e < end - t->offset; e++) {
      const int64_t row = e / cols, col = e % cols;
      const int64_t grow = t->split_dim == 0 ? t->split_begin + row : row;
      const int64_t gcol = t->split_dim == 1 ? t->split_begin + col : col;
      double delta = 0;
      for (int64_t k = 0; k < r; k++) delta += double(b_[grow * r + k]) * double(a_[k * in + gcol]);
      float& w = out[t->offset + e - piece.begin];
      w = static_cast<float>(double(w) + scale * delta);
    }
  }
}

LayoutFill merged_lora_weights(const fs::path& base, const fs::path& lora_dir) {
  auto reader = std::make_shared<std::unique_ptr<MergedWeightReader>>();
  return [base, lora_dir, reader](const ParamLayout& layout, const Segment& piece, float* out) {
    if (!*reader) *reader = std::make_unique<MergedWeightReader>(base, lora_dir, layout);
    (*reader)->read(piece, out);
  };
}

ModelSource open_model(const fs::path& dir, const fs::path& override_base) {
  if (!is_lora_directory(dir)) {
    if (!override_base.empty())
      fail("option 'base': ", dir.string(), " is not a LoRA checkpoint (it has no ", kAdapterConfigFile,
           "); --base names the base model of one");
    auto reader = std::make_shared<std::unique_ptr<WeightReader>>();
    return {dir, {}, [dir, reader](const ParamLayout& layout, const Segment& piece, float* out) {
              if (!*reader) *reader = std::make_unique<WeightReader>(dir, layout);
              (*reader)->read(piece, out);
            }};
  }
  // The caller verified dir against its manifest (verify_model_directory): the rule of every LoRA reader.
  const LoraCheckpoint c = open_lora_checkpoint(dir, override_base, LoraManifest::ChecksumsVerifiedByCaller);
  return {c.base, dir, merged_lora_weights(c.base, dir)};
}

void check_quantizable_base(const fs::path& base, const LlamaConfig& config, BaseQuant quant) {
  if (quant == BaseQuant::None || is_sharded_checkpoint(base)) return;
  const HfCheckpointDir dir(base);
  const ParamLayout layout(config);
  for (const ParamTensor& t : layout.tensors()) {
    if (!base_tensor_quantized(t)) continue;
    if (const HfCheckpointDir::Entry e = dir.find(t.name))
      check_base_dtype_for_quant(quant, e.info->dtype, str(e.file->path().string(), ": tensor '", t.name, "'"));
  }
}

LoraConfig lora_init_config(const fs::path& dir, const LoraOptionsGiven& given, const std::string& continues) {
  const fs::path file = dir / kAdapterConfigFile;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail("option 'lora_init': ", dir.string(), " is not a directory");
  if (!fs::exists(file, ec))
    fail("option 'lora_init': ", file.string(), " is missing (--lora_init takes a PEFT adapter directory: "
         "adapter_config.json and adapter_model.safetensors)");
  const LoraConfig c = read_peft_adapter_config(file);
  const std::string src = file.string();
  if (given.rank && *given.rank != c.rank)
    fail("option 'lora_rank' is ", *given.rank, ", but ", src, " says r = ", c.rank,
         " (", continues, ": leave the option out or give its value)");
  if (given.alpha && *given.alpha != c.alpha)
    fail("option 'lora_alpha' is ", *given.alpha, ", but ", src, " says lora_alpha = ", c.alpha,
         " (", continues, ": leave the option out or give its value)");
  if (given.dropout && *given.dropout != c.dropout)
    fail("option 'lora_dropout' is ", *given.dropout, ", but ", src, " says lora_dropout = ", c.dropout,
         " (", continues, ": leave the option out or give its value)");
  if (given.targets && *given.targets != c.targets)
    fail("option 'lora_targets' is ", lora_targets_string(*given.targets), ", but ", src, " says target_modules = ",
         lora_targets_string(c.targets), " (", continues, ": leave the option out or give its value)");
  return c;
}

LayoutFill adapter_weights_from_peft(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir / kAdapterConfigFile, ec))
    fail("option 'lora_init': ", (dir / kAdapterConfigFile).string(), " is missing (not a PEFT adapter directory)");
  if (!fs::exists(dir / kAdapterWeightsFile, ec) && !is_sharded_checkpoint(dir))
    fail("option 'lora_init': ", (dir / kAdapterWeightsFile).string(), " is missing",
         fs::exists(dir / "adapter_model.bin", ec) ? " (the adapter is a PyTorch pickle, adapter_model.bin: save it with "
                                                     "safe_serialization=True)"
                                                   : "");
  auto reader = std::make_shared<std::unique_ptr<WeightReader>>();
  return [dir, reader](const ParamLayout& layout, const Segment& piece, float* out) {
    if (!*reader) *reader = std::make_unique<WeightReader>(dir, layout);
    (*reader)->read(piece, out);
  };
}

LoraStart lora_start(const LoraConfig& options, const LoraOptionsGiven& given, const fs::path& lora_init,
                     const fs::path& init,
                     const std::optional<fs::path>& resume_from, const fs::path& override_base, Comm& world,
                     std::optional<BaseQuant> base_quant) {
  LoraStart start;
  // The quantization a checkpoint records is what its adapters were trained on: an option must agree with it.
  const auto recorded_quant = [&](const fs::path& dir, const char* how) {
    const BaseQuant recorded = lora_base_quant(dir);
    if (base_quant && *base_quant != recorded)
      fail("option 'base_quant' is ", base_quant_name(*base_quant), ", but ", (dir / kBaseModelFile).string(),
           " records ", base_quant_name(recorded), " (its adapters were trained on that base; ", how,
           ": leave the option out or give its value)");
    return recorded;
  };
  if (resume_from && is_lora_directory(*resume_from)) {
    start.lora = lora_init_config(*resume_from, given, "--resume continues that run");  // a changed option: an error
    start.base_quant = recorded_quant(*resume_from, "--resume continues that run");
    // resume_checkpoint verified every file's checksum on every rank; the rest of the rule of every reader.
    start.base = open_lora_checkpoint(*resume_from, override_base, world, LoraManifest::ChecksumsVerifiedByCaller).base;
    return start;
  }
  start.base_quant = base_quant.value_or(BaseQuant::None);
  if (resume_from)
    fail(resume_from->string(), ": is a full model's checkpoint, not a LoRA checkpoint: a LoRA run cannot resume it "
         "(start a new out_dir with --init ", resume_from->string(), ")");
  if (!override_base.empty())
    fail("option 'base' names the base of a LoRA checkpoint to resume; a new run's base is --init (", init.string(),
         "), given with --base ", override_base.string());
  if (init.empty()) fail("LoRA adapters train on a base model: give it with --init DIR");
  start.base = init;
  if (!lora_init.empty()) {
    start.lora = lora_init_config(lora_init, given);
    // Verified, and a tuna LoRA checkpoint names its base: it must be the one this run trains on.
    const LoraCheckpoint c = open_lora_checkpoint(lora_init, init, world, LoraManifest::Verify);
    if (c.tuna) start.base_quant = recorded_quant(lora_init, "--lora_init continues that adapter");
    start.adapters = adapter_weights_from_peft(lora_init);
    return start;
  }
  start.lora = options;
  return start;
}

void import_peft(const fs::path& peft_dir, const fs::path& out_dir, const fs::path& override_base,
                 const std::vector<TokenizerFile>& tokenizer, bool overwrite) {
  if (!is_lora_directory(peft_dir))
    fail(peft_dir.string(), ": is not a PEFT adapter directory (no ", kAdapterConfigFile, ")");
  // Verified as every reader verifies it: a damaged checkpoint is refused, not given a fresh manifest.
  const LoraCheckpoint source = open_lora_checkpoint(peft_dir, override_base, LoraManifest::Verify);
  const fs::path& base = source.base;
  const LoraConfig& lora = source.lora;
  const json config_json = read_config_json(base);
  const LoraLayout layout = lora_layout(LlamaConfig::from_json(config_json, (base / "config.json").string()), lora);
  std::vector<float> params(layout.params.total());
  adapter_weights_from_peft(peft_dir)(layout.params, Segment{0, layout.params.total()}, params.data());
  std::error_code ec;
  if (fs::exists(out_dir, ec)) {
    if (!fs::is_directory(out_dir, ec) || (!fs::is_empty(out_dir, ec) && !is_lora_directory(out_dir)))
      fail(out_dir.string(), ": exists and is not a LoRA checkpoint: not writing into it; choose a new output directory");
    if (!fs::is_empty(out_dir, ec) && !overwrite)
      fail(out_dir.string(), ": already holds a LoRA checkpoint: --overwrite to replace it, or choose a new output "
           "directory");
    if (fs::equivalent(out_dir, peft_dir, ec)) fail(out_dir.string(), ": output directory is the input directory");
  }
  // The quantization its adapters were trained on travels with them (QLoRA: eval and the exports apply it).
  const LoraFiles files = lora_files(lora, base, source.quant);
  // Written by the checkpoint writer (atomic, manifested) under a temporary root, then renamed into place.
  fs::path out = fs::absolute(out_dir).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();
  const fs::path root = out.parent_path() / (".tmp-import-" + out.filename().string());
  fs::remove_all(root, ec);
  CheckpointContents c{&config_json, params.data(), {}, json{{"step", 0}, {"source", absolute_path(peft_dir)},
                                                             {"producer", "tuna convert"}},
                       tokenizer};
  c.lora = &files;
  const fs::path written = save_checkpoint(root, 0, layout.params, c, 0);
  fs::remove_all(out, ec);
  fs::rename(written, out, ec);
  if (ec) fail(out.string(), ": cannot move the imported checkpoint into place: ", ec.message());
  fs::remove_all(root, ec);
}

ConvertReport merge_lora(const fs::path& lora_dir, const fs::path& out_dir, const std::string& dtype,
                         int64_t max_shard_bytes, const fs::path& override_base, std::FILE* progress, bool overwrite) {
  if (!is_lora_directory(lora_dir))
    fail(lora_dir.string(), ": is not a LoRA checkpoint (no ", kAdapterConfigFile,
         "); a full model exports with `build/convert tuna-to-hf`");
  // What ships must be what training wrote: the adapter's files against its manifest, the base against its identity.
  if (const std::string problem = verify_checkpoint(lora_dir); !problem.empty())
    fail(lora_dir.string(), ": fails verification, nothing exported: ", problem);
  const fs::path base = open_lora_checkpoint(lora_dir, override_base, LoraManifest::ChecksumsVerifiedByCaller).base;
  const json config_json = read_config_json(base);
  const LlamaConfig config = LlamaConfig::from_json(config_json, (base / "config.json").string());
  const ParamLayout layout(config);
  MergedWeightReader reader(base, lora_dir, layout);
  if (progress && reader.base_quant() != BaseQuant::None)
    std::fprintf(progress, "note: the adapters were trained on the base quantized as %s (QLoRA): merged onto the "
                 "dequantized base, as PEFT merges a 4-bit model, so the merged weights hold the quantization's error\n",
                 base_quant_name(reader.base_quant()));
  // The tokenizer the adapters trained with travels in the checkpoint; a PEFT directory may have none: the base's.
  fs::path tokenizer_dir = base;
  for (const char* name : kTokenizerFileNames)
    if (std::error_code ec; fs::is_regular_file(lora_dir / name, ec)) tokenizer_dir = lora_dir;
  std::error_code ec;
  if (fs::exists(out_dir, ec) && fs::equivalent(out_dir, base, ec))
    fail(out_dir.string(), ": output directory is the base model's directory");
  return export_hf_pieces(config_json, layout, [&](const Segment& piece, float* out) { reader.read(piece, out); },
                          dtype, max_shard_bytes, lora_dir, tokenizer_dir, out_dir, progress, overwrite);
}

}  // namespace tuna
