// data/input: plain, gzip and zstd streams (several members/frames), damage reported with its place, the
// line reader's bounded memory and line ends.
#include <gtest/gtest.h>

#include <string>

#include "data/input.h"
#include "tests/data/data_test_util.h"

namespace tuna {
namespace {

using testing_data::gzip_bytes;
using testing_data::TempDir;
using testing_data::write_file;
using testing_data::zstd_bytes;

// Reads a whole input through open_input in small pieces (so that buffers refill many times).
std::string read_through(const InputFile& file, std::string* error) {
  std::string why;
  auto stream = open_input(file, &why);
  EXPECT_TRUE(stream) << why;
  if (!stream) return {};
  std::string out;
  char buf[777];
  while (size_t n = stream->read(buf, sizeof buf)) out.append(buf, n);
  *error = stream->error();
  return out;
}

InputFile input(const std::string& path) {
  InputFile f;
  f.path = path;
  EXPECT_TRUE(classify_input(path, &f.kind, &f.compression)) << path;
  return f;
}

std::string sample_text(size_t bytes) {
  std::string text;
  for (int i = 0; text.size() < bytes; ++i) text += "line " + std::to_string(i * 7919 % 1000) + " of a sample\n";
  return text;
}

TEST(Input, ClassifiesByName) {
  InputKind kind;
  Compression c;
  ASSERT_TRUE(classify_input("a/b.jsonl.zst", &kind, &c));
  EXPECT_EQ(kind, InputKind::jsonl);
  EXPECT_EQ(c, Compression::zstd);
  ASSERT_TRUE(classify_input("b.txt.gz", &kind, &c));
  EXPECT_EQ(kind, InputKind::text);
  EXPECT_EQ(c, Compression::gzip);
  ASSERT_TRUE(classify_input("c.md", &kind, &c));
  EXPECT_EQ(c, Compression::none);
  EXPECT_FALSE(classify_input("d.csv.gz", &kind, &c));
  EXPECT_FALSE(classify_input("e.gz", &kind, &c));
}

TEST(Input, DecompressesEveryMemberAndFrame) {
  TempDir dir;
  const std::string a = sample_text(300000), b = sample_text(5000);
  write_file(dir.file("x.txt.gz"), gzip_bytes(a) + gzip_bytes(b));
  write_file(dir.file("x.txt.zst"), zstd_bytes(a) + zstd_bytes(b));
  write_file(dir.file("x.txt"), a + b);
  for (const char* name : {"x.txt.gz", "x.txt.zst", "x.txt"}) {
    std::string error;
    EXPECT_EQ(read_through(input(dir.file(name)), &error), a + b) << name;
    EXPECT_EQ(error, "") << name;
  }
}

TEST(Input, DamageEndsTheStreamAndSaysWhere) {
  TempDir dir;
  const std::string text = sample_text(200000);
  const std::string gz = gzip_bytes(text), zst = zstd_bytes(text);
  write_file(dir.file("cut.txt.gz"), gz.substr(0, gz.size() / 2));
  write_file(dir.file("cut.txt.zst"), zst.substr(0, zst.size() / 2));
  std::string bad = gz;
  for (size_t i = 100; i < 200; ++i) bad[i] = static_cast<char>(bad[i] ^ 0x5a);
  write_file(dir.file("corrupt.txt.gz"), bad);
  write_file(dir.file("garbage.txt.zst"), "this is not zstd at all");
  for (const char* name : {"cut.txt.gz", "cut.txt.zst"}) {
    std::string error;
    const std::string got = read_through(input(dir.file(name)), &error);
    EXPECT_NE(error.find("truncated"), std::string::npos) << name << ": " << error;
    EXPECT_NE(error.find("byte"), std::string::npos) << error;
    EXPECT_LT(got.size(), text.size());
    EXPECT_EQ(got, text.substr(0, got.size())) << "what was read before the cut is intact";
  }
  for (const char* name : {"corrupt.txt.gz", "garbage.txt.zst"}) {
    std::string error;
    read_through(input(dir.file(name)), &error);
    EXPECT_NE(error.find("corrupt"), std::string::npos) << name << ": " << error;
  }
  std::string why;
  EXPECT_FALSE(open_input(input(dir.file("missing.txt")), &why));
  EXPECT_FALSE(why.empty());
}

TEST(Input, LineReaderBoundsLongLines) {
  TempDir dir;
  const std::string huge(3'000'000, 'x');
  write_file(dir.file("l.jsonl"), "first\n" + huge + "\n\nlast without newline");
  std::string why;
  auto stream = open_input(input(dir.file("l.jsonl")), &why);
  LineReader lines(stream.get(), /*max_bytes=*/1'000'000);
  std::string line;
  bool oversized, cut;
  ASSERT_TRUE(lines.next(&line, &oversized, &cut));
  EXPECT_EQ(line, "first");
  EXPECT_FALSE(oversized);
  ASSERT_TRUE(lines.next(&line, &oversized, &cut));
  EXPECT_TRUE(oversized);
  EXPECT_TRUE(line.empty());
  ASSERT_TRUE(lines.next(&line, &oversized, &cut));
  EXPECT_EQ(line, "");
  ASSERT_TRUE(lines.next(&line, &oversized, &cut));
  EXPECT_EQ(line, "last without newline");
  EXPECT_TRUE(cut);
  EXPECT_FALSE(lines.next(&line, &oversized, &cut));
}

TEST(Input, ReadAllRefusesWhatIsTooLong) {
  TempDir dir;
  write_file(dir.file("big.txt"), std::string(5000, 'a'));
  std::string why, out;
  auto stream = open_input(input(dir.file("big.txt")), &why);
  EXPECT_FALSE(read_all(stream.get(), 4999, &out));
  EXPECT_TRUE(out.empty());
  stream = open_input(input(dir.file("big.txt")), &why);
  EXPECT_TRUE(read_all(stream.get(), 5000, &out));
  EXPECT_EQ(out.size(), 5000u);
}

}  // namespace
}  // namespace tuna
