// The files prepare writes: see data/prepare_output.h.
#include "data/prepare_output.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace tuna {

namespace fs = std::filesystem;

std::vector<KeptLocation> locate_kept(PrepareComm& comm, const std::vector<uint32_t>& kept_as,
                                      const std::vector<Outcome>& fate, LocationLog& log) {
  const std::vector<uint64_t> counts = comm.all_gather_value<uint64_t>(fate.size());
  uint64_t base = 0;
  for (int r = 0; r < comm.rank(); ++r) base += counts[static_cast<size_t>(r)];
  std::vector<uint32_t> wanted;
  for (size_t i = 0; i < fate.size(); ++i)
    if (fate[i] == Outcome::exact_duplicate || fate[i] == Outcome::near_duplicate) wanted.push_back(kept_as[i]);
  std::sort(wanted.begin(), wanted.end());
  wanted.erase(std::unique(wanted.begin(), wanted.end()), wanted.end());
  std::vector<uint32_t> asked = comm.size() == 1 ? wanted : comm.all_gather_values(wanted);
  std::sort(asked.begin(), asked.end());
  asked.erase(std::unique(asked.begin(), asked.end()), asked.end());
  std::vector<KeptLocation> mine;
  for (uint32_t id : asked)
    if (id >= base && id < base + fate.size()) {
      const auto [file, line] = log.at(id - base);
      mine.push_back({id, file, line});
    }
  std::vector<KeptLocation> all = comm.size() == 1 ? std::move(mine) : comm.all_gather_values(mine);
  std::sort(all.begin(), all.end(), [](const KeptLocation& a, const KeptLocation& b) { return a.id < b.id; });
  std::vector<KeptLocation> out;  // only what this rank needs
  for (const KeptLocation& k : all)
    if (std::binary_search(wanted.begin(), wanted.end(), k.id)) out.push_back(k);
  return out;
}

bool is_output_name(const std::string& name) {
  auto starts = [&](const char* p) { return name.rfind(p, 0) == 0; };
  return name == "report.json" ||
         ((starts("train-") || starts("val-")) && (name.ends_with(kShardExtension) || name.ends_with(".tmp"))) ||
         (starts("dropped") && (name.ends_with(".jsonl") || name.ends_with(".jsonl.tmp")));
}

void prepare_out_dir(const PrepareOptions& options) {
  std::error_code ec;
  fs::create_directories(options.out_dir, ec);
  if (ec || !fs::is_directory(options.out_dir))
    fail("prepare: --out ", options.out_dir, ": cannot create the directory",
         ec ? str(": ", ec.message()) : std::string());
  if (::access(options.out_dir.c_str(), W_OK) != 0) fail("prepare: --out ", options.out_dir, ": not writable");
  std::vector<fs::path> earlier;
  for (const auto& entry : fs::directory_iterator(options.out_dir))
    if (entry.is_regular_file() && is_output_name(entry.path().filename().string()))
      earlier.push_back(entry.path());
  std::sort(earlier.begin(), earlier.end());
  if (earlier.empty()) return;
  if (!options.overwrite)
    fail("prepare: --out ", options.out_dir, " already holds the output of an earlier run (",
         earlier.front().filename().string(),
         earlier.size() > 1 ? str(" and ", earlier.size() - 1, " more") : "",
         "); pass --overwrite to replace it, or choose another directory");
  for (const fs::path& p : earlier) fs::remove(p);
}

void write_text_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) fail("prepare: cannot write ", tmp);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) fail("prepare: cannot rename ", tmp, " to ", path, ": ", ec.message());
}

}  // namespace tuna
