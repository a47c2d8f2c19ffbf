// data/shard: round trips in both widths, with and without a loss mask, and every kind of bad shard.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "data/shard.h"
#include "tests/data/data_test_util.h"

namespace tuna {
namespace {

using testing_data::expect_error;
using testing_data::read_file;
using testing_data::TempDir;
using testing_data::write_file;

struct Doc {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
};

std::vector<Doc> random_docs(uint32_t vocab, int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Doc> docs(count);
  for (int d = 0; d < count; ++d) {
    size_t n = d == 3 ? 0 : rng() % 300;  // one empty document
    for (size_t i = 0; i < n; ++i) {
      docs[d].tokens.push_back(static_cast<int32_t>(rng() % vocab));
      docs[d].mask.push_back(static_cast<uint8_t>(rng() % 2));
    }
  }
  if (!docs[0].tokens.empty()) docs[0].tokens[0] = static_cast<int32_t>(vocab - 1);  // the largest id
  return docs;
}

void round_trip(uint32_t vocab, bool with_mask, uint32_t expected_width) {
  TempDir dir;
  const std::string path = dir.file("shard.bin");
  std::vector<Doc> docs = random_docs(vocab, 40, vocab + with_mask);
  {
    ShardWriter writer(path, vocab, with_mask);
    for (const Doc& d : docs) {
      if (with_mask)
        writer.add_document(d.tokens, d.mask);
      else
        writer.add_document(d.tokens);
    }
    writer.finish();
  }
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  EXPECT_FALSE(std::filesystem::exists(path + ".mask.tmp"));

  ShardReader reader(path);
  EXPECT_EQ(reader.vocab_size(), vocab);
  EXPECT_EQ(reader.token_width(), expected_width);
  EXPECT_EQ(reader.has_mask(), with_mask);
  EXPECT_EQ(reader.document_count(), docs.size());
  uint64_t total = 0;
  for (const Doc& d : docs) total += d.tokens.size();
  EXPECT_EQ(reader.token_count(), total);
  // File size is exactly what the format says.
  uint64_t expected_size = kShardHeaderBytes + (total * expected_width + 7) / 8 * 8 + (docs.size() + 1) * 8 +
                           (with_mask ? total : 0);
  EXPECT_EQ(std::filesystem::file_size(path), expected_size);

  uint64_t at = 0;
  std::vector<int32_t> copy;
  for (size_t d = 0; d < docs.size(); ++d) {
    auto [begin, end] = reader.document(d);
    ASSERT_EQ(begin, at);
    ASSERT_EQ(end - begin, docs[d].tokens.size());
    copy.resize(end - begin);
    reader.read_tokens(begin, end - begin, copy.data());
    EXPECT_EQ(copy, docs[d].tokens) << "document " << d;
    for (size_t i = 0; i < docs[d].tokens.size(); ++i) {
      ASSERT_EQ(reader.token(begin + i), docs[d].tokens[i]);
      ASSERT_EQ(reader.mask(begin + i), with_mask ? docs[d].mask[i] : 1);
    }
    at = end;
  }
}

TEST(Shard, RoundTripUint16) { round_trip(32000, false, 2); }
TEST(Shard, RoundTripUint16WithMask) { round_trip(32000, true, 2); }
TEST(Shard, RoundTripUint32) { round_trip(128256, false, 4); }
TEST(Shard, RoundTripUint32WithMask) { round_trip(128256, true, 4); }

TEST(Shard, WidthFollowsVocabulary) {
  EXPECT_EQ(shard_token_width(256), 2u);
  EXPECT_EQ(shard_token_width(65536), 2u);  // ids up to 65535 fit uint16
  EXPECT_EQ(shard_token_width(65537), 4u);
}

TEST(Shard, LargeShardCrossesTheWriteBuffer) {
  TempDir dir;
  const std::string path = dir.file("big.bin");
  std::vector<int32_t> doc(1 << 20);
  for (size_t i = 0; i < doc.size(); ++i) doc[i] = static_cast<int32_t>(i % 50000);
  {
    ShardWriter writer(path, 50000);
    for (int k = 0; k < 5; ++k) writer.add_document(doc);  // 10 MB of tokens, several buffer flushes
    writer.finish();
  }
  ShardReader reader(path);
  ASSERT_EQ(reader.token_count(), 5u * doc.size());
  for (uint64_t i : {uint64_t{0}, uint64_t{123457}, uint64_t{3} * doc.size() + 77, reader.token_count() - 1})
    EXPECT_EQ(reader.token(i), static_cast<int32_t>((i % doc.size()) % 50000));
}

TEST(Shard, EmptyShardIsValid) {
  TempDir dir;
  const std::string path = dir.file("empty.bin");
  {
    ShardWriter writer(path, 100);
    writer.finish();
  }
  ShardReader reader(path);
  EXPECT_EQ(reader.token_count(), 0u);
  EXPECT_EQ(reader.document_count(), 0u);
}

TEST(Shard, WriterRefusesBadDocuments) {
  TempDir dir;
  const std::string path = dir.file("bad.bin");
  {
    ShardWriter writer(path, 100);
    std::vector<int32_t> too_big = {1, 2, 100};
    expect_error([&] { writer.add_document(too_big); },
                 {path, "document 0", "token 2", "id 100", "[0, 100)"});
    std::vector<int32_t> negative = {-1};
    expect_error([&] { writer.add_document(negative); }, {path, "id -1"});
    std::vector<int32_t> ok = {1, 2};
    std::vector<uint8_t> mask = {1, 1};
    expect_error([&] { writer.add_document(ok, mask); }, {path, "opened without one"});
    EXPECT_EQ(writer.document_count(), 0u);  // nothing of a refused document was kept
  }
  // An unfinished writer leaves nothing behind.
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  ShardWriter masked(path, 100, /*with_mask=*/true);
  std::vector<int32_t> tokens = {1, 2, 3};
  std::vector<uint8_t> short_mask = {1, 0};
  expect_error([&] { masked.add_document(tokens, short_mask); },
               {path, "one mask byte per token (3)", "found 2"});
  std::vector<uint8_t> bad_mask = {1, 2, 0};
  expect_error([&] { masked.add_document(tokens, bad_mask); }, {path, "mask byte 1", "0 or 1", "found 2"});
  expect_error([&] { masked.add_document(tokens); }, {path, "came without one"});
}

// A valid shard on disk to corrupt: 3 documents, 10 tokens, uint16.
std::string valid_shard(const TempDir& dir, bool with_mask = false) {
  const std::string path = dir.file("victim.bin");
  ShardWriter writer(path, 1000, with_mask);
  std::vector<std::vector<int32_t>> docs = {{1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10}};
  for (const auto& d : docs) {
    if (with_mask)
      writer.add_document(d, std::vector<uint8_t>(d.size(), 1));
    else
      writer.add_document(d);
  }
  writer.finish();
  return path;
}

// Overwrites bytes of a file at an offset.
template <typename T>
void patch(const std::string& path, size_t offset, T value) {
  std::string bytes = read_file(path);
  ASSERT_LE(offset + sizeof(T), bytes.size());
  std::memcpy(bytes.data() + offset, &value, sizeof(T));
  write_file(path, bytes);
}

// Offsets of the victim shard: 64 + pad8(10 tokens * 2 bytes = 20) = 88.
constexpr size_t kVictimOffsets = 88;

TEST(Shard, ShortFile) {
  TempDir dir;
  const std::string path = dir.file("short.bin");
  write_file(path, "TUNATOKS");
  expect_error([&] { ShardReader r(path); }, {path, "too short", "8 bytes", "64"});
}

TEST(Shard, MissingFile) {
  TempDir dir;
  expect_error([&] { ShardReader r(dir.file("nope.bin")); }, {dir.file("nope.bin"), "cannot open"});
}

TEST(Shard, BadMagic) {
  TempDir dir;
  const std::string path = valid_shard(dir);
  patch(path, 0, uint64_t{0x0a0d474e50890000});  // bytes of a PNG header, roughly
  expect_error([&] { ShardReader r(path); },
               {path, "bad magic", "expected \"TUNATOKS\"", "found \"\\x00\\x00\\x89PNG\\x0d\\x0a\""});
}

TEST(Shard, UnsupportedVersion) {
  TempDir dir;
  const std::string path = valid_shard(dir);
  patch(path, 8, uint32_t{4});
  expect_error([&] { ShardReader r(path); }, {path, "unsupported format version 4", "versions 1 to 3"});
  patch(path, 8, uint32_t{0});
  expect_error([&] { ShardReader r(path); }, {path, "unsupported format version 0"});
}

// Version 2 records the tokenizer's fingerprint; a version-1 shard (the same layout, those bytes reserved)
// still reads, its fingerprint unknown.
TEST(Shard, TokenizerFingerprintAndVersionOne) {
  TempDir dir;
  const std::string path = dir.file("fp.bin");
  {
    ShardWriter w(path, 1000, /*with_mask=*/false, /*tokenizer_fingerprint=*/0x1234'5678'9abc'def0ull);
    w.add_document(std::vector<int32_t>{1, 2, 3});
    w.finish();
  }
  {
    ShardReader r(path);
    EXPECT_EQ(r.header().version, 3u);
    EXPECT_EQ(r.tokenizer_fingerprint(), 0x1234'5678'9abc'def0ull);
  }
  patch(path, 8, uint32_t{2});  // version 2 (before preference pairs): the same layout, read as it is
  {
    ShardReader v2(path);
    EXPECT_EQ(v2.header().version, 2u);
    EXPECT_EQ(v2.tokenizer_fingerprint(), 0x1234'5678'9abc'def0ull);
    EXPECT_FALSE(v2.has_pairs());
  }
  patch(path, 8, uint32_t{1});  // as an old build wrote it: version 1, reserved bytes zero
  patch(path, 40, uint64_t{0});
  ShardReader old(path);
  EXPECT_EQ(old.header().version, 1u);
  EXPECT_EQ(old.tokenizer_fingerprint(), 0u);
  EXPECT_EQ(old.token_count(), 3u);
  EXPECT_EQ(old.token(2), 3);
}

// Reserved header bytes are zeros: a damaged header, or a newer format's field, is refused naming the byte.
TEST(Shard, NonZeroReservedBytes) {
  TempDir dir;
  const std::string path = valid_shard(dir);
  patch(path, 50, uint8_t{7});
  expect_error([&] { ShardReader r(path); }, {path, "reserved header byte 50 is 7", "expected 0"});
  patch(path, 50, uint8_t{0});
  patch(path, 8, uint32_t{1});  // version 1 reserved the fingerprint's bytes too
  patch(path, 40, uint8_t{1});
  expect_error([&] { ShardReader r(path); }, {path, "reserved header byte 40 is 1"});
}

TEST(Shard, BadWidth) {
  TempDir dir;
  const std::string path = valid_shard(dir);
  patch(path, 12, uint32_t{3});
  expect_error([&] { ShardReader r(path); }, {path, "bad token width", "2 or 4", "found 3"});
}

TEST(Shard, UnknownFlags) {
  TempDir dir;
  const std::string path = valid_shard(dir);
  patch(path, 16, uint32_t{4});
  expect_error([&] { ShardReader r(path); }, {path, "unknown flags 0x4"});
}

// Version 3: documents 2p and 2p + 1 are pair p (chosen, rejected), the mask marking their completions. The flag
// needs the mask and an even document count, and means nothing to a version-2 shard (an unknown flag there).
TEST(Shard, PreferencePairs) {
  TempDir dir;
  const std::string path = dir.file("pairs.bin");
  {
    ShardWriter w(path, 100, /*with_mask=*/true, /*tokenizer_fingerprint=*/0, /*pairs=*/true);
    w.add_document(std::vector<int32_t>{1, 5, 6, 7, 2}, std::vector<uint8_t>{0, 0, 1, 1, 1});
    w.add_document(std::vector<int32_t>{1, 5, 8, 2}, std::vector<uint8_t>{0, 0, 1, 1});
    w.finish();
  }
  {
    ShardReader r(path);
    EXPECT_TRUE(r.has_pairs());
    EXPECT_EQ(r.pair_count(), 1u);
    EXPECT_EQ(r.document(1), (std::pair<uint64_t, uint64_t>{5, 9}));
  }
  patch(path, 8, uint32_t{2});
  expect_error([&] { ShardReader r(path); }, {path, "unknown flags 0x3", "format version 2"});
  patch(path, 8, uint32_t{3});
  patch(path, 16, uint32_t{2});  // pairs without the mask: the file size no longer fits either
  expect_error([&] { ShardReader r(path); }, {path, "preference pairs", "loss mask"});
  {
    const std::string odd = dir.file("odd.bin");
    ShardWriter w(odd, 100, /*with_mask=*/true, 0, /*pairs=*/true);
    w.add_document(std::vector<int32_t>{1, 5, 2}, std::vector<uint8_t>{0, 1, 1});
    expect_error([&] { w.finish(); }, {odd, "even number of documents", "found 1"});
  }
}

TEST(Shard, Truncated) {
  TempDir dir;
  const std::string path = valid_shard(dir);
  std::string bytes = read_file(path);
  write_file(path, bytes.substr(0, bytes.size() - 5));
  expect_error([&] { ShardReader r(path); }, {path, "truncated", "implies " + std::to_string(bytes.size()),
                                              "has " + std::to_string(bytes.size() - 5)});
}

TEST(Shard, TrailingBytes) {
  TempDir dir;
  const std::string path = valid_shard(dir);
  write_file(path, read_file(path) + "junk");
  expect_error([&] { ShardReader r(path); }, {path, "trailing bytes"});
}

TEST(Shard, MaskFlagWithoutMaskIsTruncated) {
  TempDir dir;
  const std::string path = valid_shard(dir);
  patch(path, 16, kShardFlagLossMask);
  expect_error([&] { ShardReader r(path); }, {path, "truncated", "loss mask"});
}

TEST(Shard, HugeTokenCount) {
  TempDir dir;
  const std::string path = valid_shard(dir);
  patch(path, 24, uint64_t{1} << 62);
  expect_error([&] { ShardReader r(path); }, {path, "truncated or corrupt", "tokens"});
}

TEST(Shard, OffsetsNotMonotonic) {
  TempDir dir;
  const std::string path = valid_shard(dir);
  patch(path, kVictimOffsets + 16, uint64_t{2});  // offsets 0 3 2 10
  expect_error([&] { ShardReader r(path); }, {path, "not monotonic", "offset 2 is 2", "offset 1 = 3"});
}

TEST(Shard, OffsetsNotEndingAtTokenCount) {
  TempDir dir;
  const std::string path = valid_shard(dir);
  patch(path, kVictimOffsets + 24, uint64_t{9});
  expect_error([&] { ShardReader r(path); }, {path, "must end at token_count 10", "the last is 9"});
}

TEST(Shard, OffsetsNotStartingAtZero) {
  TempDir dir;
  const std::string path = valid_shard(dir);
  patch(path, kVictimOffsets, uint64_t{1});
  expect_error([&] { ShardReader r(path); }, {path, "start at 0", "found 1"});
}

}  // namespace
}  // namespace tuna
