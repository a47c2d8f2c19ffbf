#include "ckpt/tensor_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "core/progress.h"

namespace tuna {

namespace fs = std::filesystem;

namespace {

// write() of every byte, retrying short writes and EINTR (a single write moves at most ~2 GiB).
bool write_all(int fd, const void* data, uint64_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, std::min<uint64_t>(size, uint64_t{1} << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (n == 0) {  // no progress and no error: report it as the disk being full rather than spin
      errno = ENOSPC;
      return false;
    }
    p += n, size -= static_cast<uint64_t>(n);
  }
  return true;
}

uint64_t padded(uint64_t n, uint64_t alignment) { return (n + alignment - 1) / alignment * alignment; }

}  // namespace

FileDigest write_tensor_file(const fs::path& path, const std::string& header, const std::vector<TensorFileEntry>& tensors,
                             uint64_t alignment, const std::function<void(const TensorAppend&)>& produce,
                             ProgressLine* progress) {
  TUNA_CHECK(alignment >= 1 && alignment <= 4096, "tensor file alignment ", alignment);
  const std::string target = path.string(), tmp = target + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot write ", target, ": cannot create ", tmp, ": ", std::strerror(errno));
  // Any failure past this point removes the temporary file, so a failed write leaves no debris and never touches an
  // existing file at path.
  auto give_up = [&](const std::string& what) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    fd = -1;
    ::unlink(tmp.c_str());
    fail("cannot write ", target, ": ", what, err ? std::string(": ") + std::strerror(err) : std::string(),
         err == ENOSPC || err == EDQUOT ? " (the disk is full; nothing was left under that name)" : "");
  };
  Checksum sum;
  const auto out = [&](const void* data, uint64_t n, const std::string& what) {
    if (!write_all(fd, data, n)) give_up(what);
    sum.update(data, n);
  };
  out(header.data(), header.size(), "writing the header to " + tmp);
  constexpr uint64_t kPiece = uint64_t(64) << 20;  // progress moves at least every 64 MB
  static const char kZeros[4096] = {};
  // The appended bytes must be the tensors' in order: `tensor` is the one being filled, `filled` its bytes so far.
  size_t tensor = 0;
  uint64_t filled = 0;
  const auto close_full_tensors = [&] {
    while (tensor < tensors.size() && filled == tensors[tensor].bytes) {
      const uint64_t pad = padded(tensors[tensor].bytes, alignment) - tensors[tensor].bytes;
      if (pad) out(kZeros, pad, "writing to " + tmp);
      tensor++, filled = 0;
    }
  };
  const TensorAppend append = [&](const void* data, uint64_t bytes) {
    for (uint64_t done = 0; done < bytes;) {
      close_full_tensors();
      if (tensor == tensors.size()) {
        errno = 0;
        give_up(str("more bytes than the header's ", tensors.size(), " tensors hold"));
      }
      const uint64_t n = std::min({kPiece, bytes - done, tensors[tensor].bytes - filled});
      out(static_cast<const char*>(data) + done, n, "writing tensor '" + tensors[tensor].name + "' to " + tmp);
      if (progress) progress->add(static_cast<double>(n));
      done += n, filled += n;
    }
  };
  try {
    produce(append);
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  close_full_tensors();
  if (tensor != tensors.size()) {
    errno = 0;
    give_up(str("tensor '", tensors[tensor].name, "' got ", filled, " of its ", tensors[tensor].bytes, " bytes"));
  }
  if (::fsync(fd) != 0) give_up("fsync of " + tmp);
  const int rc = ::close(fd);
  fd = -1;
  if (rc != 0) give_up("closing " + tmp);
  if (::rename(tmp.c_str(), target.c_str()) != 0) give_up("renaming " + tmp + " to " + target);
  // The rename is durable only once the directory entry is on disk. Some filesystems cannot fsync a directory
  // (EINVAL); the data itself is already synced there, so that is not an error.
  const fs::path parent = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  const int dir_fd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    const int sync_rc = ::fsync(dir_fd);
    const int err = errno;
    ::close(dir_fd);
    if (sync_rc != 0 && err != EINVAL && err != ENOTSUP)
      fail("cannot write ", target, ": fsync of directory ", parent.string(), ": ", std::strerror(err));
  }
  return sum.digest();
}

}  // namespace tuna
