// Input files: plain, gzip and zstd streams, and a line reader that bounds memory. See data/input.h.
#include "data/input.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>

#include "core/error.h"

namespace tuna {

namespace {

namespace fs = std::filesystem;

constexpr size_t kChunk = size_t{1} << 20;

// What a file that is neither regular nor a directory is, for messages.
const char* special_kind(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// Whether canonical path `path` is `root` or lies under it.
bool is_inside(const std::string& path, const std::string& root) {
  if (root == "/") return true;
  return path.compare(0, root.size(), root) == 0 && (path.size() == root.size() || path[root.size()] == '/');
}

using SkipFn = std::function<void(InputSkip, const std::string&)>;

// One directory of an input, recursively: regular files into *found. root: the input directory, canonical.
// visited: the directories read so far (device, inode), so that a link loop is read once.
void walk(const fs::path& dir, const std::string& root, bool follow, std::set<std::pair<dev_t, ino_t>>& visited,
          std::vector<fs::path>& found, const SkipFn& skipped) {
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) return skipped(InputSkip::unreadable, str(dir.string(), ": cannot list the directory: ", ec.message()));
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) return skipped(InputSkip::unreadable, str(dir.string(), ": cannot list the directory: ", ec.message()));
    const fs::path path = it->path();
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) {
      skipped(InputSkip::unreadable, str(path.string(), ": ", std::strerror(errno)));
      continue;
    }
    const bool link = S_ISLNK(st.st_mode);
    if (link) {
      char* real = ::realpath(path.c_str(), nullptr);
      if (!real) {
        const int err = errno;
        skipped(InputSkip::unreadable, str(path.string(), ": ", err == ELOOP    ? "symbolic link loop"
                                                                 : err == ENOENT ? "broken symbolic link"
                                                                                 : std::strerror(err)));
        continue;
      }
      const std::string target = real;
      std::free(real);
      if (::stat(path.c_str(), &st) != 0) {
        skipped(InputSkip::unreadable, str(path.string(), ": ", std::strerror(errno)));
        continue;
      }
      if (!follow && S_ISDIR(st.st_mode)) {
        skipped(InputSkip::symlink, str(path.string(), " -> ", target,
                                        ": a symbolic link to a directory, not followed (--follow-symlinks)"));
        continue;
      }
      if (!follow && !is_inside(target, root)) {
        skipped(InputSkip::symlink, str(path.string(), " -> ", target,
                                        ": a symbolic link out of the input directory, not followed (--follow-symlinks)"));
        continue;
      }
    }
    if (S_ISDIR(st.st_mode)) {
      if (visited.insert({st.st_dev, st.st_ino}).second)
        walk(path, root, follow, visited, found, skipped);
      else if (link)
        skipped(InputSkip::symlink, str(path.string(), ": a symbolic link to a directory already read (a loop)"));
    } else if (S_ISREG(st.st_mode)) {
      found.push_back(path);
    } else {
      skipped(InputSkip::not_regular, str(path.string(), ": ", special_kind(st.st_mode), ", not a regular file"));
    }
  }
}

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

class PlainStream : public ByteStream {
 public:
  explicit PlainStream(std::FILE* f) : f_(f) {}
  ~PlainStream() override { std::fclose(f_); }
  size_t read(char* buf, size_t n) override {
    if (!error_.empty()) return 0;
    size_t got = std::fread(buf, 1, n, f_);
    consumed_ += got;
    if (got == 0 && std::ferror(f_)) error_ = str("read error at byte ", consumed_, ": ", std::strerror(errno));
    return got;
  }

 private:
  std::FILE* f_;
};

// Shared by the two decompressors: compressed bytes come from a FILE through in_.
class CompressedStream : public ByteStream {
 public:
  explicit CompressedStream(std::FILE* f) : f_(f), in_(kChunk) {}
  ~CompressedStream() override { std::fclose(f_); }

 protected:
  // Refills in_ when it is used up; false at the end of the file (or a read error, then error_ is set).
  bool refill() {
    if (in_pos_ < in_len_) return true;
    in_len_ = std::fread(in_.data(), 1, in_.size(), f_);
    in_pos_ = 0;
    consumed_ += in_len_;
    if (in_len_ == 0 && std::ferror(f_)) error_ = str("read error at byte ", consumed_, ": ", std::strerror(errno));
    return in_len_ > 0;
  }
  uint64_t position() const { return consumed_ - (in_len_ - in_pos_); }  // compressed bytes used

  std::FILE* f_;
  std::vector<char> in_;
  size_t in_pos_ = 0, in_len_ = 0;
};

class GzipStream : public CompressedStream {
 public:
  explicit GzipStream(std::FILE* f) : CompressedStream(f) {
    std::memset(&z_, 0, sizeof z_);
    // 15 + 32: a window of 32 KiB, gzip or zlib header detected automatically.
    if (inflateInit2(&z_, 15 + 32) != Z_OK) error_ = "cannot start zlib";
  }
  ~GzipStream() override { inflateEnd(&z_); }

  size_t read(char* buf, size_t n) override {
    size_t produced = 0;
    while (produced < n && error_.empty() && !done_) {
      if (in_pos_ == in_len_ && !refill()) {
        // The file ended: fine between members, a truncation inside one.
        if (error_.empty() && in_member_) error_ = str("truncated gzip data: the file ends at byte ", consumed_,
                                                        " inside a compressed member");
        done_ = true;
        break;
      }
      z_.next_in = reinterpret_cast<Bytef*>(in_.data() + in_pos_);
      z_.avail_in = static_cast<uInt>(in_len_ - in_pos_);
      z_.next_out = reinterpret_cast<Bytef*>(buf + produced);
      z_.avail_out = static_cast<uInt>(n - produced);
      in_member_ = true;
      const int rc = inflate(&z_, Z_NO_FLUSH);
      produced = n - z_.avail_out;
      in_pos_ = in_len_ - z_.avail_in;
      if (rc == Z_STREAM_END) {
        in_member_ = false;
        inflateReset(&z_);  // another member may follow
      } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
        error_ = str("corrupt gzip data near byte ", position(), ": ", z_.msg ? z_.msg : zError(rc));
      }
    }
    return produced;
  }

 private:
  z_stream z_;
  bool in_member_ = false;
  bool done_ = false;
};

class ZstdStream : public CompressedStream {
 public:
  explicit ZstdStream(std::FILE* f) : CompressedStream(f), ctx_(ZSTD_createDCtx()) {
    if (!ctx_) error_ = "cannot start zstd";
  }
  ~ZstdStream() override { ZSTD_freeDCtx(ctx_); }

  size_t read(char* buf, size_t n) override {
    ZSTD_outBuffer out{buf, n, 0};
    while (out.pos < n && error_.empty() && !done_) {
      if (in_pos_ == in_len_ && !pending_output_ && !refill()) {
        if (error_.empty() && in_frame_)
          error_ = str("truncated zstd data: the file ends at byte ", consumed_, " inside a frame");
        done_ = true;
        break;
      }
      ZSTD_inBuffer in{in_.data(), in_len_, in_pos_};
      const size_t rc = ZSTD_decompressStream(ctx_, &out, &in);
      in_pos_ = in.pos;
      if (ZSTD_isError(rc)) {
        error_ = str("corrupt zstd data near byte ", position(), ": ", ZSTD_getErrorName(rc));
        break;
      }
      in_frame_ = rc != 0;
      // A full output buffer may leave decoded bytes inside zstd: call again before reading more input.
      pending_output_ = out.pos == n;
    }
    return out.pos;
  }

 private:
  ZSTD_DCtx* ctx_;
  bool in_frame_ = false;
  bool pending_output_ = false;
  bool done_ = false;
};

}  // namespace

bool classify_input(const std::string& path, InputKind* kind, Compression* compression) {
  std::string name = path;
  *compression = Compression::none;
  if (ends_with(name, ".gz")) {
    *compression = Compression::gzip;
    name.resize(name.size() - 3);
  } else if (ends_with(name, ".zst")) {
    *compression = Compression::zstd;
    name.resize(name.size() - 4);
  }
  if (ends_with(name, ".txt") || ends_with(name, ".md")) return *kind = InputKind::text, true;
  if (ends_with(name, ".jsonl")) return *kind = InputKind::jsonl, true;
  return false;
}

std::vector<InputFile> list_inputs(const std::vector<std::string>& inputs, bool follow_symlinks,
                                   const SkipFn& skipped) {
  if (inputs.empty()) fail("prepare: no inputs given (files or directories of .txt, .md, .jsonl, maybe .gz/.zst)");
  std::vector<InputFile> files;
  auto add = [&](const fs::path& p, InputKind kind, Compression compression) {
    std::error_code ec;
    const uint64_t size = fs::file_size(p, ec);
    files.push_back({p.string(), kind, compression, ec ? 0 : size});
  };
  for (const std::string& input : inputs) {
    struct stat st;
    if (::lstat(input.c_str(), &st) != 0) {
      if (errno == ENOENT) fail("prepare: input ", input, ": no such file or directory");
      fail("prepare: input ", input, ": ", std::strerror(errno));
    }
    // A link named on the command line is followed: the user chose it. It must lead somewhere.
    if (::stat(input.c_str(), &st) != 0) {
      if (errno == ELOOP) fail("prepare: input ", input, ": a symbolic link loop (", std::strerror(ELOOP), ")");
      if (errno == ENOENT) fail("prepare: input ", input, ": a broken symbolic link (its target does not exist)");
      fail("prepare: input ", input, ": ", std::strerror(errno));
    }
    InputKind kind;
    Compression compression;
    if (S_ISDIR(st.st_mode)) {
      char* real = ::realpath(input.c_str(), nullptr);
      if (!real) fail("prepare: input ", input, ": ", std::strerror(errno));
      const std::string root = real;
      std::free(real);
      std::set<std::pair<dev_t, ino_t>> visited{{st.st_dev, st.st_ino}};
      std::vector<fs::path> found;
      walk(input, root, follow_symlinks, visited, found, skipped);
      std::sort(found.begin(), found.end());
      for (const fs::path& p : found) {
        if (classify_input(p.string(), &kind, &compression))
          add(p, kind, compression);
        else
          skipped(InputSkip::name, p.string());
      }
    } else if (S_ISREG(st.st_mode)) {
      if (!classify_input(input, &kind, &compression))
        fail("prepare: input ", input, ": unsupported file type '", fs::path(input).extension().string(),
             "' (expected .txt, .md or .jsonl, each maybe compressed as .gz or .zst)");
      add(input, kind, compression);
    } else {
      fail("prepare: input ", input, ": ", special_kind(st.st_mode),
           ", not a regular file: prepare reads every input twice, so inputs must be regular files (write the "
           "stream to a file first)");
    }
  }
  return files;
}

std::unique_ptr<ByteStream> open_input(const InputFile& file, std::string* why) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer. Regular files ignore it.
  const int fd = ::open(file.path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    *why = std::strerror(errno);
    return nullptr;
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    *why = ::fstat(fd, &st) != 0 ? std::strerror(errno) : str(special_kind(st.st_mode), ", not a regular file");
    ::close(fd);
    return nullptr;
  }
  const int flags = ::fcntl(fd, F_GETFL);
  std::FILE* f = flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) < 0 ? nullptr : ::fdopen(fd, "rb");
  if (!f) {
    *why = std::strerror(errno);
    ::close(fd);
    return nullptr;
  }
  switch (file.compression) {
    case Compression::gzip:
      return std::make_unique<GzipStream>(f);
    case Compression::zstd:
      return std::make_unique<ZstdStream>(f);
    case Compression::none:
      break;
  }
  return std::make_unique<PlainStream>(f);
}

LineReader::LineReader(ByteStream* stream, uint64_t max_bytes)
    : stream_(stream), max_bytes_(max_bytes), buffer_(kChunk) {}

bool LineReader::fill() {
  if (eof_) return false;
  if (begin_ > 0) {  // keep the unfinished line at the front
    std::memmove(buffer_.data(), buffer_.data() + begin_, end_ - begin_);
    end_ -= begin_;
    begin_ = 0;
  }
  if (end_ == buffer_.size()) buffer_.resize(buffer_.size() * 2);
  const size_t got = stream_->read(buffer_.data() + end_, buffer_.size() - end_);
  if (got == 0) eof_ = true;
  end_ += got;
  return got > 0;
}

bool LineReader::next(std::string* line, bool* oversized, bool* cut) {
  line->clear();
  *oversized = false;
  *cut = false;
  size_t scanned = begin_;  // bytes of the current line already searched for '\n'
  uint64_t skipped = 0;     // bytes of an oversized line dropped so far
  for (;;) {
    const char* nl = static_cast<const char*>(std::memchr(buffer_.data() + scanned, '\n', end_ - scanned));
    if (nl) {
      const size_t stop = static_cast<size_t>(nl - buffer_.data());
      if (skipped + (stop - begin_) > max_bytes_) *oversized = true;
      if (!*oversized) line->assign(buffer_.data() + begin_, stop - begin_);
      begin_ = stop + 1;
      return true;
    }
    scanned = end_;
    if (skipped + (end_ - begin_) > max_bytes_) {
      // Too long to keep: drop what is buffered and go on looking for the end of the line.
      *oversized = true;
      skipped += end_ - begin_;
      begin_ = end_ = scanned = 0;
    }
    const size_t offset = scanned - begin_;
    if (!fill()) {
      if (begin_ == end_ && skipped == 0) return false;  // clean end between lines
      *cut = true;                                        // the last line has no '\n' (or was cut)
      if (!*oversized) line->assign(buffer_.data() + begin_, end_ - begin_);
      begin_ = end_;
      return true;
    }
    scanned = begin_ + offset;
  }
}

bool read_all(ByteStream* stream, uint64_t max_bytes, std::string* out) {
  out->clear();
  // One buffer per thread: a zeroed megabyte per document cost more than reading a small file.
  thread_local std::vector<char> chunk(kChunk);
  for (;;) {
    const size_t got = stream->read(chunk.data(), chunk.size());
    if (got == 0) return true;
    if (out->size() + got > max_bytes) {
      out->clear();
      out->shrink_to_fit();
      return false;
    }
    out->append(chunk.data(), got);
  }
}

}  // namespace tuna
