// One streamed, fsynced writer for every tensor file tuna writes (safetensors: ckpt/safetensors.h; GGUF: ckpt/gguf.h).
// The format's header bytes, then each tensor's bytes in the order declared, each padded with zeros to `alignment`;
// written into path + ".tmp", fsynced, renamed over path, and the directory fsynced. A caller streams the tensors'
// bytes through `append` (so no one holds a 140 GB file's data at once); more or fewer bytes than the tensors
// declare is an error naming the tensor. On any failure (a full disk, an unwritable directory: every write is
// checked) the message names path and the errno, the temporary file is removed, and an existing file at path is
// left as it was.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "core/checksum.h"  // FileDigest

namespace tuna {

class ProgressLine;

struct TensorFileEntry {
  std::string name;  // for messages
  uint64_t bytes = 0;
};
using TensorAppend = std::function<void(const void* data, uint64_t bytes)>;

// Returns the file's size and XXH3-64, computed from the bytes as they are written (a checkpoint's manifest costs
// no second read). `progress`, when given, advances by every tensor byte written.
FileDigest write_tensor_file(const std::filesystem::path& path, const std::string& header,
                             const std::vector<TensorFileEntry>& tensors, uint64_t alignment,
                             const std::function<void(const TensorAppend& append)>& produce,
                             ProgressLine* progress = nullptr);

}  // namespace tuna
