#include "core/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace tuna {

namespace {

std::string errno_message(int err) {
  if (err == ELOOP) return "too many levels of symbolic links (a symlink loop)";
  return std::strerror(err);
}

}  // namespace

const char* file_type_name(unsigned mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

int open_regular_file(const std::filesystem::path& path, const std::string& what, uint64_t* size) {
  // O_NONBLOCK: opening a FIFO for reading with no writer would wait forever; with it the open returns and
  // fstat says what the path is. It has no effect on reading a regular file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    const int err = errno;
    fail(path.string(), ": cannot open the ", what, ": ", errno_message(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail(path.string(), ": cannot stat the ", what, ": ", errno_message(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path.string(), ": is ", file_type_name(st.st_mode), ", not a regular file (expected the ", what, ")");
  }
  if (size) *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

std::string read_regular_file(const std::filesystem::path& path, const std::string& what, uint64_t max_bytes) {
  uint64_t size = 0;
  const int fd = open_regular_file(path, what, &size);
  if (size > max_bytes) {
    ::close(fd);
    fail(path.string(), ": the ", what, " is ", size, " bytes, more than the ", max_bytes, " this reader accepts");
  }
  std::string text(size, '\0');
  uint64_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(fd, text.data() + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : 0;
      ::close(fd);
      fail(path.string(), ": cannot read the ", what, ": ", n < 0 ? errno_message(err) : "the file shrank while read");
    }
    done += static_cast<uint64_t>(n);
  }
  ::close(fd);
  return text;
}

void require_directory(const std::filesystem::path& path, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    fail(path.string(), ": ", err == ENOENT ? std::string("no such directory") : errno_message(err), " (expected ",
         what, ")");
  }
  if (!S_ISDIR(st.st_mode)) fail(path.string(), ": is ", file_type_name(st.st_mode), ", not a directory (expected ", what, ")");
}

}  // namespace tuna
