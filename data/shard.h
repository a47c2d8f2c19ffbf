// Token shards: the one on-disk format between build/prepare (writes) and the trainer's loader (reads).
//
// A shard is one file, little-endian throughout, laid out so that it can be mmapped and read in place:
//
//   offset  size                     field
//   0       8                        magic "TUNATOKS"
//   8       4  u32                   format version: 3 (versions 1 and 2 are read too: 1 has no fingerprint,
//                                    neither has flag bit 1)
//   12      4  u32                   token width in bytes: 2 (uint16 tokens) or 4 (uint32 tokens)
//   16      4  u32                   flags; bit 0 = the shard carries a loss mask; bit 1 = its documents are
//                                    preference pairs (below; needs bit 0); other bits are 0
//   20      4  u32                   vocab_size of the tokenizer that wrote it (every token is below it)
//   24      8  u64                   token_count
//   32      8  u64                   document_count
//   40      8  u64                   fingerprint of the tokenizer that wrote it (Tokenizer::fingerprint, an
//                                    XXH3-64 of its vocabulary); 0: unknown (version 1, or written without one)
//   48      16                       reserved, zeros
//   64      token_count * width      tokens, every document back to back (BOS ... EOS as prepare writes them)
//           0..7                     zeros, so that the next section starts at a multiple of 8
//           (document_count + 1) * 8 document start offsets, u64, in tokens: first 0, non-decreasing,
//                                    last token_count; document d is tokens [offsets[d], offsets[d+1])
//           token_count * 1          only when flag bit 0: loss mask, one u8 per token, 1 = train on it
//                                    (predicting this token counts in the loss), 0 = context only
//
// Preference pairs (flag bit 1, version 3): documents 2p and 2p + 1 are pair p, its chosen and its rejected answer
// to one prompt, each document the prompt's tokens then the completion's (BOS ... and the chat template's or EOS's
// end), the loss mask 1 on the completion's tokens only. So the pairing costs no bytes: it is the documents' order,
// and the prompt is each document's mask-0 head. The document count is even and every pair is whole in one shard.
//
// The file size is exactly what the header implies; anything else is a truncated or corrupt shard.
// Why this shape: the header is fixed-size so a reader validates it before touching anything else; tokens
// come first so the hot data is one contiguous mmapped array at a 64-byte offset (aligned for any width);
// uint16 halves the bytes of every vocabulary up to 65536 (LLaMA-2's 32000); the document index lets the
// loader and tools find boundaries without scanning for EOS; the mask lives apart from the tokens so
// pretraining shards pay nothing for it. Version 2 added the fingerprint so that the trainer can refuse shards
// of another tokenizer with the same vocabulary size (version 1 caught only a larger one). Version 3 added the
// pairs flag: a reader of version 2 refuses a pair shard (an unknown version) rather than train on its documents
// one by one.
#pragma once

#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace tuna {

inline constexpr char kShardMagic[8] = {'T', 'U', 'N', 'A', 'T', 'O', 'K', 'S'};
inline constexpr uint32_t kShardVersion = 3;  // what ShardWriter writes
inline constexpr uint32_t kOldestShardVersion = 1;
inline constexpr uint64_t kShardHeaderBytes = 64;
inline constexpr uint32_t kShardFlagLossMask = 1u << 0;
inline constexpr uint32_t kShardFlagPairs = 1u << 1;  // version 3 on
inline constexpr const char* kShardExtension = ".bin";

// The decoded header (what ShardReader validated, or what ShardWriter will write).
struct ShardHeader {
  uint32_t version = kShardVersion;
  uint32_t token_width = 0;  // bytes per token: 2 or 4
  uint32_t flags = 0;
  uint32_t vocab_size = 0;
  uint64_t token_count = 0;
  uint64_t document_count = 0;
  uint64_t tokenizer_fingerprint = 0;  // 0: unknown
};

// Token width a shard of this vocabulary uses: 2 when every id fits in uint16 (vocab_size <= 65536), else 4.
uint32_t shard_token_width(uint32_t vocab_size);

// Streams documents into one shard. Tokens go straight into `path.tmp` behind a placeholder header (a
// bounded in-memory buffer in front of it); the mask, when there is one, into `path.mask.tmp`; only the
// document offsets (8 bytes per document) stay in memory. finish() appends offsets and mask, writes the
// header, fsyncs and renames to `path`, so a crash never leaves a partial file under the final name.
// Destroying an unfinished writer removes its temporary files.
class ShardWriter {
 public:
  // with_mask: the shard carries a loss mask, and every add_document must pass one. tokenizer_fingerprint:
  // Tokenizer::fingerprint() of the tokenizer that made the tokens (0: unknown). pairs: the documents are preference
  // pairs (see above; needs with_mask): finish() refuses an odd document count.
  ShardWriter(std::string path, uint32_t vocab_size, bool with_mask = false, uint64_t tokenizer_fingerprint = 0,
              bool pairs = false);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // Appends one document. Every token must lie in [0, vocab_size): anything else is a tuna::Error naming
  // the shard, the document and the value. An empty document is allowed (it gets an empty range).
  void add_document(std::span<const int32_t> tokens);
  // Same, with one mask byte per token (0 or 1). Only for writers made with with_mask.
  void add_document(std::span<const int32_t> tokens, std::span<const uint8_t> mask);

  // Writes the shard and renames it into place. Call once; nothing may be added afterwards.
  void finish();

  const std::string& path() const { return path_; }
  uint64_t token_count() const { return offsets_.back(); }
  uint64_t document_count() const { return offsets_.size() - 1; }
  uint32_t token_width() const { return width_; }

 private:
  void append_tokens(std::span<const int32_t> tokens);
  void flush_buffer();
  void remove_temporaries();

  std::string path_;
  uint32_t vocab_size_;
  uint32_t width_;
  bool with_mask_;
  bool pairs_;
  uint64_t fingerprint_;
  bool finished_ = false;
  std::FILE* out_ = nullptr;     // path.tmp: header placeholder, then tokens
  std::FILE* mask_ = nullptr;    // path.mask.tmp
  std::vector<uint8_t> buffer_;  // encoded tokens not yet written, bounded by kBufferBytes
  std::vector<uint64_t> offsets_{0};
};

// A shard mapped read-only and validated at open: size, magic, version, width, flags, that the file size
// equals what the header implies, and the document offsets. Every failure is a tuna::Error naming the
// file and what was wrong. Token values are checked against a model's vocabulary by the loader, at read.
class ShardReader {
 public:
  explicit ShardReader(std::string path);
  ~ShardReader();
  ShardReader(ShardReader&& other) noexcept;
  ShardReader& operator=(ShardReader&& other) noexcept;
  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;

  const std::string& path() const { return path_; }
  const ShardHeader& header() const { return header_; }
  uint32_t vocab_size() const { return header_.vocab_size; }
  uint64_t tokenizer_fingerprint() const { return header_.tokenizer_fingerprint; }  // 0: unknown
  uint32_t token_width() const { return header_.token_width; }
  uint64_t token_count() const { return header_.token_count; }
  uint64_t document_count() const { return header_.document_count; }
  bool has_mask() const { return (header_.flags & kShardFlagLossMask) != 0; }
  bool has_pairs() const { return (header_.flags & kShardFlagPairs) != 0; }
  uint64_t pair_count() const { return has_pairs() ? header_.document_count / 2 : 0; }

  // Token i, widened to int32 (a uint32 id at or above 2^31 reads negative; no vocabulary is that big,
  // and the loader refuses it as out of range).
  int32_t token(uint64_t i) const {
    return header_.token_width == 2 ? static_cast<int32_t>(tokens16_[i]) : static_cast<int32_t>(tokens32_[i]);
  }
  // Copies tokens [begin, begin + count) widened to int32 into out.
  void read_tokens(uint64_t begin, uint64_t count, int32_t* out) const;
  // Loss-mask byte of token i as stored (0 or 1 in a valid shard); 1 when the shard has no mask.
  uint8_t mask(uint64_t i) const { return mask_ ? mask_[i] : 1; }
  const uint8_t* mask_data() const { return mask_; }  // null when the shard has no mask
  // Document d is tokens [first, second).
  std::pair<uint64_t, uint64_t> document(uint64_t d) const { return {offsets_[d], offsets_[d + 1]}; }
  // The document that holds token i (i < token_count): binary search over the offsets.
  uint64_t document_of(uint64_t i) const;

 private:
  void close();

  std::string path_;
  ShardHeader header_;
  void* map_ = nullptr;
  uint64_t map_bytes_ = 0;
  const uint16_t* tokens16_ = nullptr;
  const uint32_t* tokens32_ = nullptr;
  const uint64_t* offsets_ = nullptr;
  const uint8_t* mask_ = nullptr;
};

}  // namespace tuna
