// DPO's precomputed reference (--reference precompute, a full fine-tune): each pair's two summed completion log-probs
// under the starting weights, computed in one pass before training and kept beside the shards, so that the reference
// model is never a second copy in memory and a resume or a second run pays nothing for it.
//
// File: <directory of the first training shard>/reference-logps.bin, little-endian:
//   0   8  magic "TUNAREFL"
//   8   4  u32 version 1
//   12  4  u32 0 (reserved)
//   16  8  u64 data key     XXH3-64 over the shards' digests (size and XXH3 of each file, in order)
//   24  8  u64 model key    XXH3-64 over the starting weights' files' digests
//   32  8  u64 options key  XXH3-64 of the options that change the log-probs (the caller's text)
//   40  8  u64 pairs
//   48  pairs x 2 f64       pair p's chosen, then rejected (summed over the completion's tokens)
// Written to a temporary file, fsynced and renamed. A file whose key differs is refused, naming what changed (the
// data, the model or the options), never silently reused or overwritten.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace tuna {

struct ReferenceKey {
  uint64_t data = 0, model = 0, options = 0;
  bool operator==(const ReferenceKey&) const = default;
};

// XXH3-64 over each file's size and XXH3-64, in the order given: the key of a list of files.
uint64_t files_key(const std::vector<std::string>& paths);

struct ReferenceLogps {
  ReferenceKey key;
  std::vector<double> chosen, rejected;  // one per pair, the loader's pair ids
};

// Where the reference of these training shards lives.
std::filesystem::path reference_logps_path(const std::vector<std::string>& shards);
// The file's log-probs when it exists and its key is `key` with `pairs` pairs; nullopt when there is no file. A file
// of another key or pair count, or a damaged one, is an error naming the file and what differs, and how to recompute.
std::optional<ReferenceLogps> read_reference_logps(const std::filesystem::path& path, const ReferenceKey& key,
                                                   uint64_t pairs);
void write_reference_logps(const std::filesystem::path& path, const ReferenceLogps& logps);

}  // namespace tuna
