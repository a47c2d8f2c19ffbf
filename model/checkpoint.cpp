#include "model/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <vector>

#include "core/error.h"
#include "model/optimizer.h"
#include "model/safetensors.h"

namespace tuna {

namespace fs = std::filesystem;
using nlohmann::json;

const char* const kTokenizerFiles[] = {"tokenizer.model",         "tokenizer.json", "tokenizer_config.json",
                                       "special_tokens_map.json", "generation_config.json", nullptr};

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

void fsync_path(const fs::path& p, bool directory) {
  int fd = ::open(p.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) fail(p.string(), ": cannot open to fsync");
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) fail(p.string(), ": fsync failed");
}

void write_text_file(const fs::path& p, const std::string& text) {
  {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    if (!out) fail(p.string(), ": cannot create file");
    out << text;
    out.flush();
    if (!out) fail(p.string(), ": write failed (disk full?)");
  }
  fsync_path(p, false);
}

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

// step_* directories under root sorted by step, complete ones only.
std::vector<std::pair<int64_t, fs::path>> list_checkpoints(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> found;
  if (!fs::is_directory(root)) return found;
  for (const fs::directory_entry& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory() || name.rfind("step_", 0) != 0) continue;
    const std::string digits = name.substr(5);
    if (digits.empty() || !std::all_of(digits.begin(), digits.end(), ::isdigit)) continue;
    if (!fs::exists(e.path() / "state.json")) continue;
    found.emplace_back(std::stoll(digits), e.path());
  }
  std::sort(found.begin(), found.end());
  return found;
}

}  // namespace

json read_config_json(const fs::path& dir) {
  const fs::path p = dir / "config.json";
  std::ifstream in(p);
  if (!in) fail(p.string(), ": cannot open (a model directory needs config.json)");
  try {
    return json::parse(in);
  } catch (const json::parse_error& e) {
    fail(p.string(), ": not valid JSON: ", e.what());
  }
}

void load_weights(const fs::path& dir, const ParamLayout& layout, float* params) {
  HfCheckpointDir ckpt(dir);
  for (const ParamTensor& t : layout.tensors()) ckpt.read_f32(t.name, t.shape, params + t.offset);
  refuse_foreign_tensors(ckpt, layout);
}

void refuse_foreign_tensors(const HfCheckpointDir& dir, const ParamLayout& layout) {
  const bool tied = layout.lm_head() == layout.embed_tokens();
  for (const std::string& name : dir.tensor_names()) {
    if (layout.find(name)) continue;
    if (ends_with(name, "rotary_emb.inv_freq")) continue;  // recomputed from config.json
    if (tied && name == "lm_head.weight") continue;       // some exports store the tied copy too
    fail(dir.dir().string(), ": tensor '", name,
         "' is not part of a LlamaForCausalLM with this config.json (another architecture, or a config that "
         "does not match the weights)");
  }
}

fs::path save_checkpoint(const fs::path& root, int64_t step, const ParamLayout& layout,
                         const CheckpointContents& c, int64_t keep_last) {
  TUNA_CHECK(c.config_json && c.params, "checkpoint contents incomplete");
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) fail(root.string(), ": cannot create the checkpoint directory: ", ec.message());
  const fs::path final_dir = root / step_dir_name(step);
  const fs::path tmp_dir = root / (".tmp-" + step_dir_name(step));
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  if (ec) fail(tmp_dir.string(), ": cannot create: ", ec.message());

  write_text_file(tmp_dir / "config.json", c.config_json->dump(2) + "\n");
  {
    SafetensorsWriter w;
    w.add_metadata("format", "pt");  // transformers checks this key when loading
    w.add_metadata("producer", "tuna");
    for (const ParamTensor& t : layout.tensors()) w.add(t.name, DType::F32, t.shape, c.params + t.offset);
    w.write(tmp_dir / "model.safetensors");
  }
  if (c.optimizer) {
    SafetensorsWriter w;
    w.add_metadata("producer", "tuna");
    w.add_metadata("steps_taken", std::to_string(c.optimizer->steps_taken));
    for (const ParamTensor& t : layout.tensors()) {
      w.add("exp_avg." + t.name, DType::F32, t.shape, c.optimizer->m.data() + t.offset);
      w.add("exp_avg_sq." + t.name, DType::F32, t.shape, c.optimizer->v.data() + t.offset);
    }
    w.write(tmp_dir / "optimizer.safetensors");
  }
  if (!c.copy_tokenizer_from.empty()) {
    for (const char* const* f = kTokenizerFiles; *f; f++) {
      const fs::path src = c.copy_tokenizer_from / *f;
      if (!fs::exists(src)) continue;
      fs::copy_file(src, tmp_dir / *f, fs::copy_options::overwrite_existing, ec);
      if (ec) fail(src.string(), ": cannot copy into the checkpoint: ", ec.message());
      fsync_path(tmp_dir / *f, false);
    }
  }
  json state = c.state;
  state["step"] = step;
  write_text_file(tmp_dir / "state.json", state.dump(2) + "\n");  // last: its presence marks completeness
  fsync_path(tmp_dir, true);

  if (fs::exists(final_dir)) fs::remove_all(final_dir, ec);  // an older run's step of the same number
  fs::rename(tmp_dir, final_dir, ec);
  if (ec) fail(final_dir.string(), ": cannot rename the finished checkpoint into place: ", ec.message());
  fsync_path(root, true);

  if (keep_last > 0) {
    auto all = list_checkpoints(root);
    for (size_t i = 0; i + keep_last < all.size(); i++) fs::remove_all(all[i].second, ec);
  }
  return final_dir;
}

std::optional<fs::path> latest_checkpoint(const fs::path& root) {
  auto all = list_checkpoints(root);
  if (all.empty()) return std::nullopt;
  return all.back().second;
}

json read_state(const fs::path& dir) {
  const fs::path p = dir / "state.json";
  std::ifstream in(p);
  if (!in) fail(p.string(), ": cannot open (not a complete tuna checkpoint)");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::parse_error& e) {
    fail(p.string(), ": not valid JSON: ", e.what());
  }
  if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer())
    fail(p.string(), ": expected an object with an integer 'step'");
  return j;
}

void load_optimizer(const fs::path& dir, const ParamLayout& layout, AdamW& opt) {
  const fs::path p = dir / "optimizer.safetensors";
  if (!fs::exists(p)) fail(p.string(), ": missing (a checkpoint to resume from needs the optimizer state)");
  SafetensorsFile f(p);
  for (const ParamTensor& t : layout.tensors()) {
    f.read_f32("exp_avg." + t.name, t.shape, opt.m.data() + t.offset);
    f.read_f32("exp_avg_sq." + t.name, t.shape, opt.v.data() + t.offset);
  }
  auto it = f.metadata().find("steps_taken");
  if (it == f.metadata().end()) fail(p.string(), ": metadata 'steps_taken' is missing");
  try {
    opt.steps_taken = std::stoll(it->second);
  } catch (const std::exception&) {
    fail(p.string(), ": metadata 'steps_taken': expected an integer, found '", it->second, "'");
  }
}

}  // namespace tuna
