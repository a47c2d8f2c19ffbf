// Token shards: writer and reader of the format documented in data/shard.h.
#include "data/shard.h"

#include <algorithm>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/file.h"

namespace tuna {

static_assert(std::endian::native == std::endian::little,
              "shards are little-endian and are read in place; a big-endian host needs byte swapping");

namespace {

// Tokens are encoded into this buffer and written in blocks: bounded memory whatever the shard size.
constexpr size_t kBufferBytes = size_t{4} << 20;

uint64_t pad8(uint64_t bytes) { return (bytes + 7) / 8 * 8; }

std::string errno_text() { return std::strerror(errno); }

// Bytes as a reader can see them: printable ASCII as is, the rest as \xNN.
std::string printable(const uint8_t* bytes, size_t n) {
  std::string out = "\"";
  for (size_t i = 0; i < n; ++i) {
    uint8_t c = bytes[i];
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
      out += static_cast<char>(c);
    } else {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out + "\"";
}

template <typename T>
void put(uint8_t* at, T value) {
  std::memcpy(at, &value, sizeof(T));
}

template <typename T>
T get(const uint8_t* at) {
  T value;
  std::memcpy(&value, at, sizeof(T));
  return value;
}

void write_all(std::FILE* f, const void* data, size_t bytes, const std::string& path) {
  if (bytes && std::fwrite(data, 1, bytes, f) != bytes)
    fail("shard ", path, ": write failed: ", errno_text());
}

// fsync the directory holding path, so that a rename into it survives a crash.
void sync_parent_dir(const std::string& path) {
  std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (parent.empty()) parent = ".";
  int fd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;  // best effort: some file systems do not allow opening a directory
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

uint32_t shard_token_width(uint32_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

// ---------------------------------------------------------------------------------------------------
// ShardWriter

ShardWriter::ShardWriter(std::string path, uint32_t vocab_size, bool with_mask, uint64_t tokenizer_fingerprint,
                         bool pairs)
    : path_(std::move(path)),
      vocab_size_(vocab_size),
      width_(shard_token_width(vocab_size)),
      with_mask_(with_mask),
      pairs_(pairs),
      fingerprint_(tokenizer_fingerprint) {
  if (vocab_size == 0) fail("shard ", path_, ": vocab_size must be at least 1, found 0");
  TUNA_CHECK(!pairs || with_mask, "shard ", path_, ": preference pairs need the loss mask (their completions)");
  std::string tmp = path_ + ".tmp";
  out_ = std::fopen(tmp.c_str(), "wb");
  if (!out_) fail("shard ", path_, ": cannot create ", tmp, ": ", errno_text());
  if (with_mask_) {
    std::string mask_tmp = path_ + ".mask.tmp";
    mask_ = std::fopen(mask_tmp.c_str(), "w+b");
    if (!mask_) {
      std::string why = errno_text();
      remove_temporaries();
      fail("shard ", path_, ": cannot create ", mask_tmp, ": ", why);
    }
  }
  // Placeholder header: the real one is written by finish(), once the counts are known.
  uint8_t zeros[kShardHeaderBytes] = {};
  try {
    write_all(out_, zeros, sizeof zeros, path_);
  } catch (...) {
    remove_temporaries();
    throw;
  }
  buffer_.reserve(kBufferBytes);
}

ShardWriter::~ShardWriter() {
  if (!finished_) remove_temporaries();
}

void ShardWriter::remove_temporaries() {
  if (out_) std::fclose(out_);
  if (mask_) std::fclose(mask_);
  out_ = mask_ = nullptr;
  std::remove((path_ + ".tmp").c_str());
  std::remove((path_ + ".mask.tmp").c_str());
}

void ShardWriter::add_document(std::span<const int32_t> tokens) {
  TUNA_CHECK(!finished_, "shard ", path_, " is finished");
  if (with_mask_)
    fail("shard ", path_, ": this shard carries a loss mask, but document ", document_count(),
         " came without one");
  append_tokens(tokens);
}

void ShardWriter::add_document(std::span<const int32_t> tokens, std::span<const uint8_t> mask) {
  TUNA_CHECK(!finished_, "shard ", path_, " is finished");
  if (!with_mask_)
    fail("shard ", path_, ": document ", document_count(),
         " came with a loss mask, but the shard was opened without one");
  if (mask.size() != tokens.size())
    fail("shard ", path_, ": document ", document_count(), ": expected one mask byte per token (",
         tokens.size(), "), found ", mask.size());
  for (size_t i = 0; i < mask.size(); ++i)
    if (mask[i] > 1)
      fail("shard ", path_, ": document ", document_count(), ": mask byte ", i, " must be 0 or 1, found ",
           int{mask[i]});
  append_tokens(tokens);  // validates tokens before anything of this document is written
  write_all(mask_, mask.data(), mask.size(), path_);
}

void ShardWriter::append_tokens(std::span<const int32_t> tokens) {
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || static_cast<uint32_t>(tokens[i]) >= vocab_size_)
      fail("shard ", path_, ": document ", document_count(), ", token ", i, ": id ", tokens[i],
           " is outside the vocabulary [0, ", vocab_size_, ")");
  for (int32_t t : tokens) {
    if (buffer_.size() + width_ > kBufferBytes) flush_buffer();
    size_t at = buffer_.size();
    buffer_.resize(at + width_);
    if (width_ == 2)
      put(buffer_.data() + at, static_cast<uint16_t>(t));
    else
      put(buffer_.data() + at, static_cast<uint32_t>(t));
  }
  offsets_.push_back(offsets_.back() + tokens.size());
}

void ShardWriter::flush_buffer() {
  write_all(out_, buffer_.data(), buffer_.size(), path_);
  buffer_.clear();
}

void ShardWriter::finish() {
  TUNA_CHECK(!finished_, "shard ", path_, " finished twice");
  if (pairs_ && document_count() % 2 != 0)
    fail("shard ", path_, ": a shard of preference pairs holds an even number of documents, found ", document_count());
  flush_buffer();
  const uint64_t token_bytes = token_count() * width_;
  const uint8_t zeros[8] = {};
  write_all(out_, zeros, pad8(token_bytes) - token_bytes, path_);
  write_all(out_, offsets_.data(), offsets_.size() * sizeof(uint64_t), path_);
  if (with_mask_) {
    // Copy the spilled mask behind the offsets.
    if (std::fflush(mask_) != 0 || std::fseek(mask_, 0, SEEK_SET) != 0)
      fail("shard ", path_, ": cannot read back the mask: ", errno_text());
    std::vector<uint8_t> block(kBufferBytes);
    uint64_t copied = 0;
    while (size_t n = std::fread(block.data(), 1, block.size(), mask_)) {
      write_all(out_, block.data(), n, path_);
      copied += n;
    }
    TUNA_CHECK(copied == token_count(), "mask of ", path_, " has ", copied, " bytes for ", token_count(),
               " tokens");
  }

  uint8_t header[kShardHeaderBytes] = {};
  std::memcpy(header, kShardMagic, sizeof kShardMagic);
  put<uint32_t>(header + 8, kShardVersion);
  put<uint32_t>(header + 12, width_);
  put<uint32_t>(header + 16, (with_mask_ ? kShardFlagLossMask : 0) | (pairs_ ? kShardFlagPairs : 0));
  put<uint32_t>(header + 20, vocab_size_);
  put<uint64_t>(header + 24, token_count());
  put<uint64_t>(header + 32, document_count());
  put<uint64_t>(header + 40, fingerprint_);
  if (std::fseek(out_, 0, SEEK_SET) != 0) fail("shard ", path_, ": seek failed: ", errno_text());
  write_all(out_, header, sizeof header, path_);
  if (std::fflush(out_) != 0 || ::fsync(fileno(out_)) != 0)
    fail("shard ", path_, ": cannot flush to disk: ", errno_text());
  std::fclose(out_);
  out_ = nullptr;
  if (mask_) std::fclose(mask_);
  mask_ = nullptr;
  std::remove((path_ + ".mask.tmp").c_str());
  if (std::rename((path_ + ".tmp").c_str(), path_.c_str()) != 0)
    fail("shard ", path_, ": cannot rename ", path_, ".tmp into place: ", errno_text());
  sync_parent_dir(path_);
  finished_ = true;
}

// ---------------------------------------------------------------------------------------------------
// ShardReader

ShardReader::ShardReader(std::string path) : path_(std::move(path)) {
  uint64_t size = 0;
  const int fd = open_regular_file(path_, "token shard", &size);  // a FIFO would block forever: refused by name
  if (size < kShardHeaderBytes) {
    ::close(fd);
    fail("shard ", path_, ": file is too short to be a shard: ", size, " bytes, the header alone is ",
         kShardHeaderBytes);
  }
  map_ = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);  // the mapping keeps the file open
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    fail("shard ", path_, ": cannot mmap ", size, " bytes: ", errno_text());
  }
  map_bytes_ = size;
  // From here a failure must unmap: close() runs in the catch below.
  try {
    const uint8_t* base = static_cast<const uint8_t*>(map_);
    if (std::memcmp(base, kShardMagic, sizeof kShardMagic) != 0)
      fail("shard ", path_, ": bad magic: expected \"TUNATOKS\", found ", printable(base, 8),
           " (not a tuna token shard)");
    header_.version = get<uint32_t>(base + 8);
    header_.token_width = get<uint32_t>(base + 12);
    header_.flags = get<uint32_t>(base + 16);
    header_.vocab_size = get<uint32_t>(base + 20);
    header_.token_count = get<uint64_t>(base + 24);
    header_.document_count = get<uint64_t>(base + 32);
    if (header_.version < kOldestShardVersion || header_.version > kShardVersion)
      fail("shard ", path_, ": unsupported format version ", header_.version, " (this build reads versions ",
           kOldestShardVersion, " to ", kShardVersion, ")");
    // Version 1 reserved these bytes (zeros): its fingerprint reads as 0, unknown.
    header_.tokenizer_fingerprint = header_.version >= 2 ? get<uint64_t>(base + 40) : 0;
    // Reserved bytes are zeros: anything else is damage, or a later format this build would misread.
    for (uint64_t at = header_.version >= 2 ? 48 : 40; at < kShardHeaderBytes; ++at)
      if (base[at] != 0)
        fail("shard ", path_, ": reserved header byte ", at, " is ", int{base[at]},
             ", expected 0 (a damaged shard, or one of a newer format)");
    if (header_.token_width != 2 && header_.token_width != 4)
      fail("shard ", path_, ": bad token width: expected 2 or 4 bytes, found ", header_.token_width);
    const uint32_t known = kShardFlagLossMask | (header_.version >= 3 ? kShardFlagPairs : 0);
    if (header_.flags & ~known)
      fail("shard ", path_, ": unknown flags 0x", std::hex, header_.flags, std::dec, " for format version ",
           header_.version, " (this build knows bit 0, the loss mask, and from version 3 bit 1, preference pairs)");
    if (has_pairs() && !has_mask())
      fail("shard ", path_, ": flag bit 1 (preference pairs) without bit 0 (the loss mask that marks their completions)");
    if (has_pairs() && header_.document_count % 2 != 0)
      fail("shard ", path_, ": a shard of preference pairs must hold an even number of documents, found ",
           header_.document_count);
    if (header_.vocab_size == 0) fail("shard ", path_, ": vocab_size is 0");
    if (header_.token_width == 2 && header_.vocab_size > 65536)
      fail("shard ", path_, ": vocab_size ", header_.vocab_size, " does not fit 2-byte tokens");

    // Both counts are bounded by the file size before any product is formed, so nothing overflows.
    const uint64_t tokens = header_.token_count, docs = header_.document_count;
    if (tokens > size || docs > size)
      fail("shard ", path_, ": truncated or corrupt: the header claims ", tokens, " tokens and ", docs,
           " documents, more than a ", size, "-byte file can hold");
    const uint64_t token_bytes = tokens * header_.token_width;
    const uint64_t offsets_at = kShardHeaderBytes + pad8(token_bytes);
    const uint64_t mask_at = offsets_at + (docs + 1) * sizeof(uint64_t);
    const uint64_t expected = mask_at + (has_mask() ? tokens : 0);
    if (size != expected)
      fail("shard ", path_, ": ", size < expected ? "truncated" : "has trailing bytes", ": the header (",
           tokens, " tokens of ", header_.token_width, " bytes, ", docs, " documents",
           has_mask() ? ", loss mask" : "", ") implies ", expected, " bytes, the file has ", size);

    if (header_.token_width == 2)
      tokens16_ = reinterpret_cast<const uint16_t*>(base + kShardHeaderBytes);
    else
      tokens32_ = reinterpret_cast<const uint32_t*>(base + kShardHeaderBytes);
    offsets_ = reinterpret_cast<const uint64_t*>(base + offsets_at);
    if (has_mask()) mask_ = base + mask_at;

    if (offsets_[0] != 0) fail("shard ", path_, ": document offsets must start at 0, found ", offsets_[0]);
    for (uint64_t d = 0; d < docs; ++d)
      if (offsets_[d + 1] < offsets_[d])
        fail("shard ", path_, ": document offsets are not monotonic: offset ", d + 1, " is ", offsets_[d + 1],
             ", below offset ", d, " = ", offsets_[d]);
    if (offsets_[docs] != tokens)
      fail("shard ", path_, ": document offsets must end at token_count ", tokens, ", the last is ",
           offsets_[docs]);
  } catch (...) {
    close();
    throw;
  }
}

ShardReader::~ShardReader() { close(); }

void ShardReader::close() {
  if (map_) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
}

ShardReader::ShardReader(ShardReader&& other) noexcept { *this = std::move(other); }

ShardReader& ShardReader::operator=(ShardReader&& other) noexcept {
  if (this != &other) {
    close();
    path_ = std::move(other.path_);
    header_ = other.header_;
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    tokens16_ = std::exchange(other.tokens16_, nullptr);
    tokens32_ = std::exchange(other.tokens32_, nullptr);
    offsets_ = std::exchange(other.offsets_, nullptr);
    mask_ = std::exchange(other.mask_, nullptr);
  }
  return *this;
}

void ShardReader::read_tokens(uint64_t begin, uint64_t count, int32_t* out) const {
  TUNA_CHECK(begin <= header_.token_count && count <= header_.token_count - begin, "tokens [", begin, ", ",
             begin + count, ") of ", path_, " with ", header_.token_count, " tokens");
  if (header_.token_width == 2)
    for (uint64_t i = 0; i < count; ++i) out[i] = tokens16_[begin + i];
  else
    for (uint64_t i = 0; i < count; ++i) out[i] = static_cast<int32_t>(tokens32_[begin + i]);
}

uint64_t ShardReader::document_of(uint64_t i) const {
  // The last document whose start is <= i and that is not empty: upper_bound finds the first start > i.
  const uint64_t* end = offsets_ + header_.document_count + 1;
  const uint64_t* it = std::upper_bound(offsets_, end, i);
  return static_cast<uint64_t>(it - offsets_) - 1;
}

}  // namespace tuna
