// Reading the corpus: which files are inputs, and their bytes, decompressed on the fly.
//
// An input is a file or a directory (searched recursively, in name order). Only regular files are read:
// prepare reads every input twice, and a FIFO or a device would block or give other bytes the second time.
// Named on the command line, a FIFO, a device, a socket or a symbolic link loop is an error that says which;
// found inside a directory, it is skipped and counted. A symbolic link inside a directory is followed only
// when it stays inside that directory (a link to /etc/passwd named notes.txt is not corpus text), and a link
// to a directory only with follow_symlinks; with it, every link is followed and loops are cut. The kind comes from the name:
// .txt / .md are one document per file, .jsonl one record per line, each optionally compressed as .gz
// (zlib, any number of concatenated members) or .zst (any number of frames). Decompression streams through
// a fixed buffer, so a 100 GB .jsonl.zst costs the same memory as a small one.
//
// A compressed file that is cut short or corrupt is not an error of the run: the stream ends where the damage
// starts, everything before it is read normally, and error() says what happened and at which compressed byte.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace tuna {

enum class InputKind { text, jsonl };
enum class Compression { none, gzip, zstd };

struct InputFile {
  std::string path;
  InputKind kind = InputKind::text;
  Compression compression = Compression::none;
  uint64_t bytes = 0;  // size on disk (compressed), for progress and for sharing files among ranks
};

// Why a file under an input directory was not taken. Each skip comes with "path: why".
enum class InputSkip {
  name,         // a name prepare does not read (.csv, .pdf)
  symlink,      // a symbolic link out of the input directory, or to a directory, not followed
  not_regular,  // a FIFO, a socket or a device
  unreadable,   // a broken link, a link loop, a directory that cannot be listed
};

// The input files in order: each input in the order given, a directory's files in path order. A bad input
// named on the command line (missing, unsupported name, not a regular file) is a tuna::Error; what a
// directory holds that cannot be read goes to `skipped`.
std::vector<InputFile> list_inputs(const std::vector<std::string>& inputs, bool follow_symlinks,
                                   const std::function<void(InputSkip, const std::string&)>& skipped);

// The kind of a file from its name (x.jsonl.zst -> jsonl, zstd); false when prepare does not read it.
bool classify_input(const std::string& path, InputKind* kind, Compression* compression);

// A sequential byte source: a plain file or a decompressor over one.
class ByteStream {
 public:
  virtual ~ByteStream() = default;
  // Up to n bytes into buf; 0 at the end of the data or at the first damage (see error()).
  virtual size_t read(char* buf, size_t n) = 0;
  // Empty while the stream is healthy; else what went wrong, e.g. "truncated gzip data at byte 4096".
  const std::string& error() const { return error_; }
  // Bytes of the file consumed so far (compressed bytes for a compressed file): progress.
  uint64_t consumed() const { return consumed_; }

 protected:
  std::string error_;
  uint64_t consumed_ = 0;
};

// Opens a file for reading, through the decompressor its name asks for. Null, with *why set, when the file
// cannot be opened or is not a regular file (checked on the open file, without blocking on a FIFO).
std::unique_ptr<ByteStream> open_input(const InputFile& file, std::string* why);

// Lines of a ByteStream ('\n' ends a line and is not part of it; a final line without '\n' counts).
// A line longer than max_bytes is not held in memory: it is skipped to its end and reported as oversized.
class LineReader {
 public:
  LineReader(ByteStream* stream, uint64_t max_bytes);
  // The next line into *line; false at the end of the stream. *oversized: the line was longer than
  // max_bytes (then *line is empty). *cut: the stream ended (damage or no final newline) inside this line.
  bool next(std::string* line, bool* oversized, bool* cut);

 private:
  bool fill();

  ByteStream* stream_;
  uint64_t max_bytes_;
  std::vector<char> buffer_;
  size_t begin_ = 0, end_ = 0;
  bool eof_ = false;
};

// Reads a whole stream into *out, up to max_bytes: false (and *out empty) when there is more than that.
bool read_all(ByteStream* stream, uint64_t max_bytes, std::string* out);

}  // namespace tuna
