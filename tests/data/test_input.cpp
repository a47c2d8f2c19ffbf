// data/input: plain, gzip and zstd streams (several members/frames), damage reported with its place, the
// line reader's bounded memory and line ends; the listing of inputs: regular files only (a FIFO, a device or
// a link loop named as an input is refused by name, found in a directory it is skipped and counted), links
// out of an input directory not followed unless asked, loops cut when they are.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <map>
#include <string>

#include "data/input.h"
#include "tests/data/data_test_util.h"

namespace tuna {
namespace {

using testing_data::expect_error;
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

// The listing of `inputs`: file paths relative to `root`, and what was skipped, by reason.
struct Listing {
  std::vector<std::string> files;
  std::map<InputSkip, std::vector<std::string>> skipped;
};
Listing listing(const std::vector<std::string>& inputs, bool follow, const std::filesystem::path& root) {
  Listing out;
  for (const InputFile& f : list_inputs(inputs, follow, [&](InputSkip why, const std::string& what) {
         out.skipped[why].push_back(what);
       }))
    out.files.push_back(std::filesystem::path(f.path).lexically_relative(root).string());
  return out;
}

TEST(Input, NamedInputsMustBeRegularFiles) {
  TempDir dir;
  namespace fs = std::filesystem;
  ASSERT_EQ(::mkfifo(dir.file("pipe.txt").c_str(), 0600), 0);
  fs::create_symlink(dir.file("loop-b.txt"), dir.file("loop-a.txt"));
  fs::create_symlink(dir.file("loop-a.txt"), dir.file("loop-b.txt"));
  fs::create_symlink(dir.file("gone.txt"), dir.file("broken.txt"));
  expect_error([&] { list_inputs({dir.file("pipe.txt")}, false, {}); }, {dir.file("pipe.txt"), "a FIFO (named pipe)", "regular files"});
  expect_error([&] { list_inputs({"/dev/null"}, false, {}); }, {"/dev/null", "a character device"});
  expect_error([&] { list_inputs({dir.file("loop-a.txt")}, false, {}); }, {dir.file("loop-a.txt"), "symbolic link loop"});
  expect_error([&] { list_inputs({dir.file("broken.txt")}, false, {}); }, {dir.file("broken.txt"), "broken symbolic link"});
  expect_error([&] { list_inputs({dir.file("nothing.txt")}, false, {}); }, {dir.file("nothing.txt"), "no such file"});
  // A FIFO opened for reading does not block: it is refused.
  InputFile fifo{dir.file("pipe.txt"), InputKind::text, Compression::none, 0};
  std::string why;
  EXPECT_FALSE(open_input(fifo, &why));
  EXPECT_EQ(why, "a FIFO (named pipe), not a regular file");
}

// A symbolic link named on the command line is followed, to a file or a directory wherever it leads: the user
// chose it (as `find -H` does). The rule for links found inside an input directory is the next test's.
TEST(Input, ASymlinkNamedOnTheCommandLineIsFollowed) {
  TempDir dir;
  namespace fs = std::filesystem;
  const fs::path elsewhere = dir.path() / "elsewhere";
  write_file((elsewhere / "a.txt").string(), "a");
  write_file((elsewhere / "sub/b.txt").string(), "b");
  fs::create_symlink(elsewhere / "a.txt", dir.path() / "file-link.txt");
  fs::create_symlink(elsewhere, dir.path() / "dir-link");
  const std::vector<InputFile> file = list_inputs({(dir.path() / "file-link.txt").string()}, false, {});
  ASSERT_EQ(file.size(), 1u);
  EXPECT_EQ(file[0].path, (dir.path() / "file-link.txt").string());
  const std::vector<InputFile> tree = list_inputs({(dir.path() / "dir-link").string()}, false, {});
  ASSERT_EQ(tree.size(), 2u);
  EXPECT_EQ(fs::path(tree[1].path).filename(), "b.txt");
}

TEST(Input, DirectoriesKeepToThemselvesUnlessAsked) {
  TempDir dir;
  namespace fs = std::filesystem;
  const fs::path in = dir.path() / "in", outside = dir.path() / "outside";
  write_file((in / "a.txt").string(), "a");
  write_file((in / "sub/b.jsonl").string(), "{}");
  write_file((in / "table.csv").string(), "x,y");
  write_file((outside / "secret.txt").string(), "not corpus text");
  write_file((outside / "more/c.txt").string(), "c");
  fs::create_symlink(in / "a.txt", in / "inside-link.txt");           // stays inside: followed
  fs::create_symlink(outside / "secret.txt", in / "escape.txt");       // leads out: skipped
  fs::create_symlink(outside / "more", in / "dir-link");               // a directory: skipped
  fs::create_symlink(in, in / "sub/loop");                             // a loop back to the input
  fs::create_symlink(in / "missing.txt", in / "dangling.txt");
  ASSERT_EQ(::mkfifo((in / "pipe.txt").c_str(), 0600), 0);

  Listing plain = listing({in.string()}, false, in);
  EXPECT_EQ(plain.files, (std::vector<std::string>{"a.txt", "inside-link.txt", "sub/b.jsonl"}));
  ASSERT_EQ(plain.skipped[InputSkip::symlink].size(), 3u);
  EXPECT_NE(plain.skipped[InputSkip::symlink][0].find("a symbolic link"), std::string::npos);
  std::string all_links;
  for (const std::string& s : plain.skipped[InputSkip::symlink]) all_links += s + "\n";
  EXPECT_NE(all_links.find((in / "escape.txt").string() + " -> " + (outside / "secret.txt").string() +
                           ": a symbolic link out of the input directory, not followed (--follow-symlinks)"),
            std::string::npos)
      << all_links;
  EXPECT_NE(all_links.find((in / "dir-link").string() + " -> "), std::string::npos) << all_links;
  EXPECT_NE(all_links.find((in / "sub/loop").string() + " -> "), std::string::npos) << all_links;
  EXPECT_EQ(plain.skipped[InputSkip::not_regular],
            (std::vector<std::string>{(in / "pipe.txt").string() + ": a FIFO (named pipe), not a regular file"}));
  EXPECT_EQ(plain.skipped[InputSkip::unreadable],
            (std::vector<std::string>{(in / "dangling.txt").string() + ": broken symbolic link"}));
  EXPECT_EQ(plain.skipped[InputSkip::name], (std::vector<std::string>{(in / "table.csv").string()}));

  // Asked to follow: the links out are read, and the loop back to the input is read once.
  Listing followed = listing({in.string()}, true, in);
  EXPECT_EQ(followed.files, (std::vector<std::string>{"a.txt", "dir-link/c.txt", "escape.txt", "inside-link.txt",
                                                      "sub/b.jsonl"}));
  ASSERT_EQ(followed.skipped[InputSkip::symlink].size(), 1u);
  EXPECT_NE(followed.skipped[InputSkip::symlink][0].find("already read (a loop)"), std::string::npos);
}

}  // namespace
}  // namespace tuna
