// Tests for ckpt/safetensors.h: round trips through the writer and reader, the layout the spec
// requires, every kind of bad file (built byte by byte in a temporary directory) and Hugging Face
// checkpoint directories (single file, sharded index, pickle refusal).
#include "ckpt/safetensors.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/memory.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "tuna_safetensors_XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path dir_;
};

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good());
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string le64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(v >> (8 * i));
  return out;
}

// A safetensors file from its parts: the header length is the header's own length unless given.
std::string raw_file(const std::string& header, size_t data_bytes) {
  return le64(header.size()) + header + std::string(data_bytes, '\x11');
}

// Runs fn, which must throw tuna::Error whose message contains every one of `parts`.
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
  } catch (const Error& e) {
    std::string message = e.what();
    for (const std::string& part : parts)
      EXPECT_NE(message.find(part), std::string::npos)
          << "message lacks \"" << part << "\"\n  message: " << message;
    return;
  }
  ADD_FAILURE() << "no tuna::Error thrown";
}

// ---- round trips ----------------------------------------------------------------------------------

TEST_F(Safetensors, RoundTripEveryDTypeAndMetadata) {
  // Distinct bytes per tensor so that a mixed-up offset shows.
  const DType all[] = {DType::F64, DType::F32, DType::F16, DType::BF16, DType::I64,
                       DType::I32, DType::I16, DType::I8,  DType::U8,   DType::BOOL};
  std::vector<std::vector<unsigned char>> payloads;
  SafetensorsWriter writer;
  int k = 0;
  for (DType d : all) {
    std::vector<unsigned char> bytes(2 * 3 * dtype_size(d));
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(17 * k + i);
    if (d == DType::BOOL)
      for (auto& b : bytes) b &= 1;
    payloads.push_back(std::move(bytes));
    ++k;
  }
  k = 0;
  for (DType d : all)
    writer.add(std::string("t_") + std::string(dtype_name(d)), d, {2, 3}, payloads[k++].data());
  float scalar = 2.5f;
  writer.add("scalar", DType::F32, {}, &scalar);
  writer.add("empty", DType::BF16, {0, 4}, nullptr);
  writer.add_metadata("format", "pt");
  writer.add_metadata("step", "1000");
  const fs::path path = dir_ / "all.safetensors";
  writer.write(path);
  EXPECT_FALSE(fs::exists(dir_ / "all.safetensors.tmp"));

  SafetensorsFile file(path);
  EXPECT_EQ(file.path(), path);
  ASSERT_EQ(file.tensors().size(), std::size(all) + 2);
  k = 0;
  for (DType d : all) {
    const TensorInfo& info = file.tensors()[k];  // file order = order added
    EXPECT_EQ(info.name, std::string("t_") + std::string(dtype_name(d)));
    EXPECT_EQ(info.dtype, d);
    EXPECT_EQ(info.shape, (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(info.numel, 6);
    EXPECT_EQ(info.nbytes(), payloads[k].size());
    EXPECT_EQ(file.find(info.name), &info);
    EXPECT_EQ(std::memcmp(file.data(info), payloads[k].data(), payloads[k].size()), 0) << info.name;
    ++k;
  }
  const TensorInfo* s = file.find("scalar");
  ASSERT_NE(s, nullptr);
  EXPECT_TRUE(s->shape.empty());
  EXPECT_EQ(s->numel, 1);
  float scalar_back = 0;
  file.read_f32("scalar", {}, &scalar_back);
  EXPECT_EQ(scalar_back, 2.5f);
  const TensorInfo* e = file.find("empty");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->numel, 0);
  EXPECT_EQ(e->nbytes(), 0u);
  EXPECT_EQ(file.find("absent"), nullptr);
  EXPECT_EQ(file.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"step", "1000"}}));
}

// A reader of pieces drops what it has copied out from its resident memory: 32 MB read through the mapping count
// while mapped, and no longer once released (the page cache keeps them; reading again gives the same bytes).
TEST_F(Safetensors, ReleasedPagesLeaveTheResidentSet) {
  const int64_t n = int64_t(8) << 20;  // 32 MB of float32
  {
    std::vector<float> values(n);
    for (int64_t i = 0; i < n; i++) values[i] = float(i % 1000);
    SafetensorsWriter w;
    w.add("x", DType::F32, {n}, values.data());
    w.write(dir_ / "big.safetensors");
  }
  SafetensorsFile f(dir_ / "big.safetensors");
  const TensorInfo& x = *f.find("x");
  const std::byte* data = f.data(x);
  const double before = host_memory().resident_mb;
  volatile uint8_t touched = 0;  // volatile: every page is read, not optimized away
  for (int64_t i = 0; i < n * 4; i += 4096) touched = touched + std::to_integer<uint8_t>(data[i]);
  const double mapped = host_memory().resident_mb;
  f.release(data, uint64_t(n) * 4);
  const double released = host_memory().resident_mb;
  std::printf("  resident %.1f MB, after reading 33.6 MB through the mapping %.1f MB, after release %.1f MB\n", before,
              mapped, released);
  EXPECT_GT(mapped - before, 30.0);
  EXPECT_LT(released - before, 3.0);
  float back = 0;
  std::memcpy(&back, data + 4 * 999, sizeof back);
  EXPECT_EQ(back, 999.0f);
}

TEST_F(Safetensors, ReadConvertsFloatTypes) {
  // Values exact in every float type, so each read must return them unchanged.
  const std::vector<float> values = {1.0f, -2.5f, 0.15625f, -1024.0f, -0.0f, 3.0f};
  std::vector<uint16_t> bf16(values.size()), f16(values.size());
  std::vector<double> f64(values.size());
  convert_from_f32(values.data(), DType::BF16, bf16.data(), 6);
  convert_from_f32(values.data(), DType::F16, f16.data(), 6);
  convert_from_f32(values.data(), DType::F64, f64.data(), 6);
  const std::vector<int64_t> ints64 = {0, -1, 2147483647, -2147483648LL, 5, 6};
  const std::vector<int32_t> ints32 = {7, 8, 9, -10, 11, 12};
  SafetensorsWriter writer;
  writer.add("f32", DType::F32, {2, 3}, values.data());
  writer.add("bf16", DType::BF16, {2, 3}, bf16.data());
  writer.add("f16", DType::F16, {2, 3}, f16.data());
  writer.add("f64", DType::F64, {2, 3}, f64.data());
  writer.add("i64", DType::I64, {6}, ints64.data());
  writer.add("i32", DType::I32, {6}, ints32.data());
  writer.write(dir_ / "x.safetensors");
  SafetensorsFile file(dir_ / "x.safetensors");

  const std::vector<int64_t> shape = {2, 3};  // the span overload
  for (const char* name : {"f32", "bf16", "f16", "f64"}) {
    std::vector<float> out(6, 99.0f);
    file.read_f32(name, shape, out.data());
    for (int i = 0; i < 6; ++i) EXPECT_EQ(out[i], values[i]) << name << "[" << i << "]";
    std::vector<double> wide(6, 99.0);
    file.read_f64(name, {2, 3}, wide.data());
    for (int i = 0; i < 6; ++i) EXPECT_EQ(wide[i], static_cast<double>(values[i])) << name;
  }
  std::vector<int32_t> out(6);
  file.read_i32("i64", {6}, out.data());
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out[i], ints64[i]);
  file.read_i32("i32", {6}, out.data());
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out[i], ints32[i]);
}

TEST_F(Safetensors, DataSectionIsEightByteAlignedAndHeaderPaddedWithSpaces) {
  // Names of every length mod 8 shift the header length through all paddings.
  for (int len = 1; len <= 8; ++len) {
    SafetensorsWriter writer;
    double value = 1.5;
    std::string name(static_cast<size_t>(len), 'a');
    writer.add(name, DType::F64, {1}, &value);
    writer.add_metadata(std::string(static_cast<size_t>(len), 'k'), "v");
    const fs::path path = dir_ / ("pad" + std::to_string(len) + ".safetensors");
    writer.write(path);
    std::string bytes = read_bytes(path);
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(bytes[i]);
    EXPECT_EQ((8 + header_len) % 8, 0u) << len;
    EXPECT_EQ(bytes.size(), 8 + header_len + 8);
    std::string header = bytes.substr(8, header_len);
    EXPECT_EQ(header.front(), '{');
    size_t close = header.rfind('}');
    EXPECT_EQ(header.find_first_not_of(' ', close + 1), std::string::npos) << "padding is not spaces";
    SafetensorsFile file(path);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(file.data(file.tensors()[0])) % 8, 0u);
    double back = 0;
    file.read_f64(name, {1}, &back);
    EXPECT_EQ(back, 1.5);
  }
}

TEST_F(Safetensors, ReadsHandWrittenFileWithUnsortedHeader) {
  // Another writer may order the header differently from the data; file order is data order.
  std::string header =
      R"({"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},)"
      R"("a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
  std::string bytes = le64(header.size()) + header + std::string("\x01\x02\x05\x06", 4);
  write_bytes(dir_ / "h.safetensors", bytes);
  SafetensorsFile file(dir_ / "h.safetensors");
  ASSERT_EQ(file.tensors().size(), 2u);
  EXPECT_EQ(file.tensors()[0].name, "a");
  EXPECT_EQ(file.tensors()[1].name, "b");
  EXPECT_EQ(std::to_integer<int>(file.data(*file.find("b"))[1]), 6);
  EXPECT_TRUE(file.metadata().empty());
}

TEST_F(Safetensors, FileCanBeMoved) {
  float v = 4.0f;
  SafetensorsWriter writer;
  writer.add("v", DType::F32, {1}, &v);
  writer.write(dir_ / "m.safetensors");
  SafetensorsFile a(dir_ / "m.safetensors");
  SafetensorsFile b = std::move(a);
  float out = 0;
  b.read_f32("v", {1}, &out);
  EXPECT_EQ(out, 4.0f);
  std::vector<SafetensorsFile> files;
  files.push_back(std::move(b));
  files[0].read_f32("v", {1}, &out);
  EXPECT_EQ(out, 4.0f);
}

// ---- read_* errors ------------------------------------------------------------------------------

TEST_F(Safetensors, ReadErrorsNameTensorFileAndShapes) {
  std::vector<float> w(64 * 127, 0.0f);
  std::vector<int64_t> big = {int64_t{1} << 40};
  std::vector<uint8_t> bytes = {1, 2};
  SafetensorsWriter writer;
  writer.add("w", DType::F32, {64, 127}, w.data());
  writer.add("big", DType::I64, {1}, big.data());
  writer.add("bytes", DType::U8, {2}, bytes.data());
  const fs::path path = dir_ / "r.safetensors";
  writer.write(path);
  SafetensorsFile file(path);
  std::vector<float> out(64 * 128);
  expect_error([&] { file.read_f32("missing", {1}, out.data()); },
               {"file " + path.string() + " has no tensor 'missing'"});
  expect_error([&] { file.read_f32("w", {64, 128}, out.data()); },
               {"tensor 'w' in " + path.string() + ": expected shape [64, 128], found [64, 127]"});
  expect_error([&] { file.read_f32("w", {64}, out.data()); }, {"expected shape [64], found [64, 127]"});
  expect_error([&] { file.read_f32("bytes", {2}, out.data()); },
               {path.string(), "'bytes'", "U8", "cannot be read as float"});
  std::vector<double> wide(2);
  expect_error([&] { file.read_f64("bytes", {2}, wide.data()); }, {path.string(), "'bytes'", "U8"});
  int32_t i32[2];
  expect_error([&] { file.read_i32("big", {1}, i32); },
               {path.string(), "'big'", "1099511627776", "does not fit in int32"});
  expect_error([&] { file.read_i32("w", {64, 127}, i32); }, {path.string(), "'w'", "F32", "int32"});
}

// ---- bad files ----------------------------------------------------------------------------------

// Writes `bytes` as bad.safetensors, opens it, and expects an error naming the file and `parts`.
class BadSafetensors : public Safetensors {
 protected:
  void expect_bad(const std::string& bytes, std::initializer_list<std::string> parts) {
    const fs::path path = dir_ / "bad.safetensors";
    write_bytes(path, bytes);
    std::vector<std::string> all(parts);
    all.push_back(path.string());
    try {
      SafetensorsFile file(path);
    } catch (const Error& e) {
      std::string message = e.what();
      for (const std::string& part : all)
        EXPECT_NE(message.find(part), std::string::npos)
            << "message lacks \"" << part << "\"\n  message: " << message;
      return;
    }
    ADD_FAILURE() << "no tuna::Error for a file with bytes of size " << bytes.size();
  }
  // A header holding one tensor entry "t" with the given JSON body, and `data` bytes.
  void expect_bad_entry(const std::string& entry, size_t data,
                        std::initializer_list<std::string> parts) {
    std::vector<std::string> all(parts);
    all.push_back("'t'");
    const fs::path path = dir_ / "bad.safetensors";
    write_bytes(path, raw_file(R"({"t":)" + entry + "}", data));
    try {
      SafetensorsFile file(path);
    } catch (const Error& e) {
      std::string message = e.what();
      for (const std::string& part : all)
        EXPECT_NE(message.find(part), std::string::npos)
            << "entry " << entry << ": message lacks \"" << part << "\"\n  message: " << message;
      EXPECT_NE(message.find(path.string()), std::string::npos) << message;
      return;
    }
    ADD_FAILURE() << "no tuna::Error for entry " << entry;
  }
};

TEST_F(BadSafetensors, MissingFileAndDirectory) {
  expect_error([&] { SafetensorsFile f(dir_ / "nope.safetensors"); },
               {(dir_ / "nope.safetensors").string(), "No such file"});
  expect_error([&] { SafetensorsFile f(dir_); }, {dir_.string(), "not a regular file"});
}

TEST_F(BadSafetensors, ShorterThanEightBytes) {
  expect_bad("", {"0 bytes", "8-byte header length"});
  expect_bad(std::string("\x05\x00\x00", 3), {"3 bytes", "8-byte header length"});
}

TEST_F(BadSafetensors, HeaderLengthPastEndOfFile) {
  expect_bad(le64(1000) + "{}", {"header length 1000", "past the end of the file", "10 bytes"});
  expect_bad(le64(~uint64_t{0}) + "{}", {"header length 18446744073709551615", "past the end"});
}

TEST_F(BadSafetensors, HeaderNotJsonOrNotObject) {
  expect_bad(raw_file("{\"t\": ", 0), {"header: not valid JSON"});
  expect_bad(raw_file("hello", 0), {"header: not valid JSON"});
  expect_bad(raw_file("[1, 2]", 0), {"header is not a JSON object", "array"});
  expect_bad(raw_file("\"s\"", 0), {"header is not a JSON object", "string"});
  expect_bad(raw_file("", 0), {"header: not valid JSON"});
  // Nesting that would overflow the parser's stack is refused before parsing.
  expect_bad(raw_file(std::string(100000, '[') + std::string(100000, ']'), 0), {"nested deeper than 64"});
}

TEST_F(BadSafetensors, EntryMissingFields) {
  expect_bad_entry(R"({"shape":[1],"data_offsets":[0,4]})", 4, {"missing field 'dtype'"});
  expect_bad_entry(R"({"dtype":"F32","data_offsets":[0,4]})", 4, {"missing field 'shape'"});
  expect_bad_entry(R"({"dtype":"F32","shape":[1]})", 4, {"missing field 'data_offsets'"});
}

TEST_F(BadSafetensors, EntryWrongJsonTypes) {
  expect_bad_entry(R"([1, 2])", 4, {"expected an object", "array"});
  expect_bad_entry(R"({"dtype":32,"shape":[1],"data_offsets":[0,4]})", 4,
                   {"field 'dtype'", "expected a string", "number"});
  expect_bad_entry(R"({"dtype":"F32","shape":"1","data_offsets":[0,4]})", 4,
                   {"field 'shape'", "expected an array of integers", "string"});
  expect_bad_entry(R"({"dtype":"F32","shape":["1"],"data_offsets":[0,4]})", 4,
                   {"field 'shape'", "element 0 is not an integer", "\"1\""});
  expect_bad_entry(R"({"dtype":"F32","shape":[1.5],"data_offsets":[0,4]})", 4,
                   {"field 'shape'", "not an integer", "1.5"});
  expect_bad_entry(R"({"dtype":"F32","shape":[1],"data_offsets":"0,4"})", 4,
                   {"field 'data_offsets'", "expected [begin, end]"});
  expect_bad_entry(R"({"dtype":"F32","shape":[1],"data_offsets":[0,"4"]})", 4,
                   {"field 'data_offsets'", "two non-negative integers"});
}

TEST_F(BadSafetensors, UnknownDType) {
  expect_bad_entry(R"({"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]})", 4,
                   {"unknown dtype 'F8_E4M3'", "BF16"});
}

TEST_F(BadSafetensors, NegativeShape) {
  expect_bad_entry(R"({"dtype":"F32","shape":[2,-1],"data_offsets":[0,0]})", 0,
                   {"negative dimension -1", "index 1"});
}

TEST_F(BadSafetensors, DataOffsetsNotBeginEnd) {
  expect_bad_entry(R"({"dtype":"F32","shape":[1],"data_offsets":[0,4,8]})", 8,
                   {"expected [begin, end]", "[0,4,8]"});
  expect_bad_entry(R"({"dtype":"F32","shape":[1],"data_offsets":[4]})", 8, {"expected [begin, end]"});
  expect_bad_entry(R"({"dtype":"F32","shape":[1],"data_offsets":[8,4]})", 8,
                   {"begin 8 is greater than end 4"});
  expect_bad_entry(R"({"dtype":"F32","shape":[1],"data_offsets":[-4,0]})", 8,
                   {"two non-negative integers"});
}

TEST_F(BadSafetensors, TruncatedFile) {
  // 2x3 F32 = 24 bytes declared, only 20 present: the download stopped early.
  expect_bad_entry(R"({"dtype":"F32","shape":[2,3],"data_offsets":[0,24]})", 20,
                   {"[0, 24]", "past the end of the data section (20 bytes)", "truncated"});
}

TEST_F(BadSafetensors, ByteSizeDiffersFromShape) {
  expect_bad_entry(R"({"dtype":"BF16","shape":[2,3],"data_offsets":[0,24]})", 24,
                   {"hold 24 bytes", "shape [2, 3] of BF16 needs 12 bytes"});
  // A shape whose byte count overflows 64 bits is reported, not wrapped around.
  expect_bad_entry(
      R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]})", 0,
      {"shape [4294967296, 4294967296] of F32 needs more than 2^64 bytes"});
  expect_bad_entry(R"({"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]})", 0,
                   {"needs more than 2^64 bytes"});
}

TEST_F(BadSafetensors, OverlappingTensors) {
  std::string header =
      R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
      R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
  expect_bad(raw_file(header, 16), {"'a'", "'b'", "overlap"});
  // Contained inside a larger tensor that is not the immediate predecessor in offset order.
  header =
      R"({"big":{"dtype":"U8","shape":[100],"data_offsets":[0,100]},)"
      R"("x":{"dtype":"U8","shape":[10],"data_offsets":[10,20]},)"
      R"("y":{"dtype":"U8","shape":[10],"data_offsets":[50,60]}})";
  expect_bad(raw_file(header, 100), {"'big'", "'x'", "overlap"});
  // Zero-byte tensors sit anywhere without overlapping.
  header =
      R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
      R"("z":{"dtype":"F32","shape":[0],"data_offsets":[8,8]}})";
  write_bytes(dir_ / "ok.safetensors", raw_file(header, 16));
  EXPECT_NO_THROW(SafetensorsFile(dir_ / "ok.safetensors"));
}

TEST_F(BadSafetensors, HolesAndTrailingBytesAreRefused) {
  // The format requires the tensors to cover the data section exactly. Bytes inserted into a file shift every
  // later tensor (which would then load as garbage): the hole or the trailing bytes they leave are refused.
  std::string header =
      R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
      R"("b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})";
  expect_bad(raw_file(header, 6), {"bytes [2, 4) of the data section belong to no tensor", "'b'"});
  header = R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
  expect_bad(raw_file(header, 5), {"3 trailing bytes"});
  header = R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})";
  expect_bad(raw_file(header, 3), {"bytes [0, 1)"});
}

TEST_F(BadSafetensors, NonFiniteValuesAreRefusedAtRead) {
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    std::vector<float> w = {1, 2, bad, 4, bad};
    SafetensorsWriter writer;
    writer.add("w", DType::F32, {5}, w.data());
    std::vector<uint16_t> b16 = {0x3f80, 0x7fc0};  // bf16 1.0, NaN
    writer.add("b", DType::BF16, {2}, b16.data());
    writer.write(dir_ / "nan.safetensors");
    SafetensorsFile file(dir_ / "nan.safetensors");
    std::vector<float> out(5);
    expect_error([&] { file.read_f32("w", {5}, out.data()); }, {"tensor 'w'", "element 2 is"});
    expect_error([&] { file.read_f32("b", {2}, out.data()); }, {"tensor 'b'", "element 1 is nan"});
    std::vector<double> out64(5);
    expect_error([&] { file.read_f64("w", {5}, out64.data()); }, {"element 2"});
  }
}

TEST_F(BadSafetensors, DuplicateTensorName) {
  std::string header =
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
      R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  expect_bad(raw_file(header, 8), {"key 'a' appears more than once"});
}

TEST_F(BadSafetensors, BadMetadata) {
  expect_bad(raw_file(R"({"__metadata__":["x"]})", 0), {"__metadata__", "expected an object of strings"});
  expect_bad(raw_file(R"({"__metadata__":{"step":1000}})", 0),
             {"__metadata__ entry 'step'", "expected a string", "number"});
}

// ---- writer errors ------------------------------------------------------------------------------

TEST_F(Safetensors, WriterRejectsBadTensors) {
  float v = 0;
  SafetensorsWriter writer;
  writer.add("a", DType::F32, {1}, &v);
  expect_error([&] { writer.add("a", DType::F32, {1}, &v); }, {"tensor 'a' added twice"});
  expect_error([&] { writer.add("__metadata__", DType::F32, {1}, &v); }, {"reserved"});
  expect_error([&] { writer.add("", DType::F32, {1}, &v); }, {"name is empty"});
  expect_error([&] { writer.add("n", DType::F32, {2, -3}, &v); }, {"'n'", "negative dimension", "[2, -3]"});
  expect_error([&] { writer.add("p", DType::F32, {2}, nullptr); }, {"'p'", "null"});
  writer.add_metadata("k", "v");
  expect_error([&] { writer.add_metadata("k", "w"); }, {"metadata key 'k' added twice"});
}

TEST_F(Safetensors, WriterReportsUnwritableDirectory) {
  float v = 0;
  SafetensorsWriter writer;
  writer.add("a", DType::F32, {1}, &v);
  const fs::path path = dir_ / "no_such_dir" / "out.safetensors";
  expect_error([&] { writer.write(path); }, {"cannot write " + path.string(), "No such file"});
}

TEST_F(Safetensors, WriterReportsFullDiskAndKeepsExistingFile) {
  // RLIMIT_FSIZE makes write() fail with EFBIG once the file reaches the limit: the same path through
  // the writer as a full disk, without needing one. SIGXFSZ would kill the process; ignore it.
  const fs::path path = dir_ / "full.safetensors";
  write_bytes(path, "previous checkpoint");
  std::vector<float> big(1 << 16, 1.0f);  // 256 KiB
  SafetensorsWriter writer;
  writer.add("big", DType::F32, {1 << 16}, big.data());

  struct rlimit old_limit {};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  struct sigaction ignore {}, old_action {};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(sigaction(SIGXFSZ, &ignore, &old_action), 0);
  struct rlimit small = old_limit;
  small.rlim_cur = 4096;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string message;
  try {
    writer.write(path);
  } catch (const Error& e) {
    message = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &old_limit);
  sigaction(SIGXFSZ, &old_action, nullptr);

  EXPECT_NE(message.find("cannot write " + path.string()), std::string::npos) << message;
  EXPECT_NE(message.find("tensor 'big'"), std::string::npos) << message;
  EXPECT_NE(message.find("File too large"), std::string::npos) << message;
  EXPECT_FALSE(fs::exists(dir_ / "full.safetensors.tmp"));
  EXPECT_EQ(read_bytes(path), "previous checkpoint");
}

TEST_F(Safetensors, WriterReplacesExistingFileAtomically) {
  const fs::path path = dir_ / "ckpt.safetensors";
  write_bytes(path, "old");
  int32_t v = 42;
  SafetensorsWriter writer;
  writer.add("v", DType::I32, {1}, &v);
  writer.write(path);
  SafetensorsFile file(path);
  int32_t out = 0;
  file.read_i32("v", {1}, &out);
  EXPECT_EQ(out, 42);
}

// ---- Hugging Face directories ------------------------------------------------------------------

void write_tensor_file(const fs::path& path, const std::vector<std::pair<std::string, float>>& tensors) {
  SafetensorsWriter writer;
  for (const auto& [name, value] : tensors) writer.add(name, DType::F32, {1}, &value);
  writer.write(path);
}

TEST_F(Safetensors, HfSingleFile) {
  write_tensor_file(dir_ / "model.safetensors", {{"embed", 1.0f}, {"norm", 2.0f}});
  write_bytes(dir_ / "pytorch_model.bin", "pickle");  // safetensors wins when both are present
  HfCheckpointDir ckpt(dir_);
  EXPECT_EQ(ckpt.tensor_names(), (std::vector<std::string>{"embed", "norm"}));
  ASSERT_EQ(ckpt.shard_paths().size(), 1u);
  HfCheckpointDir::Entry e = ckpt.find("norm");
  ASSERT_TRUE(e);
  EXPECT_EQ(e.file->path(), dir_ / "model.safetensors");
  EXPECT_EQ(e.info->name, "norm");
  EXPECT_FALSE(ckpt.find("absent"));
  float out = 0;
  ckpt.read_f32("embed", {1}, &out);
  EXPECT_EQ(out, 1.0f);
  expect_error([&] { ckpt.read_f32("absent", {1}, &out); },
               {dir_.string() + " has no tensor 'absent'"});
  EXPECT_NO_THROW(ckpt.verify());
}

TEST_F(Safetensors, HfShardedIndex) {
  write_tensor_file(dir_ / "model-00001-of-00002.safetensors", {{"a", 1.0f}, {"b", 2.0f}});
  write_tensor_file(dir_ / "model-00002-of-00002.safetensors", {{"c", 3.0f}});
  write_bytes(dir_ / "model.safetensors.index.json",
              R"({"metadata": {"total_size": 12}, "weight_map": {)"
              R"("a": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors",)"
              R"("b": "model-00001-of-00002.safetensors"}})");
  HfCheckpointDir ckpt(dir_);
  EXPECT_EQ(ckpt.tensor_names(), (std::vector<std::string>{"a", "c", "b"}));
  ASSERT_EQ(ckpt.shard_paths().size(), 2u);
  EXPECT_EQ(ckpt.shard_paths()[1], dir_ / "model-00002-of-00002.safetensors");
  for (auto [name, value] : {std::pair{"a", 1.0f}, {"b", 2.0f}, {"c", 3.0f}}) {
    float out = 0;
    ckpt.read_f32(name, {1}, &out);
    EXPECT_EQ(out, value) << name;
  }
  EXPECT_EQ(ckpt.find("c").file->path(), dir_ / "model-00002-of-00002.safetensors");
  EXPECT_EQ(ckpt.find("a").file, ckpt.find("b").file);  // a shard opens once
  EXPECT_NO_THROW(ckpt.verify());
  HfCheckpointDir moved = std::move(ckpt);  // open shards move along
  EXPECT_EQ(moved.find("c").file->path(), dir_ / "model-00002-of-00002.safetensors");
}

TEST_F(Safetensors, HfIndexNamesMissingShard) {
  write_tensor_file(dir_ / "model-00001-of-00002.safetensors", {{"a", 1.0f}});
  write_bytes(dir_ / "model.safetensors.index.json",
              R"({"weight_map": {"a": "model-00001-of-00002.safetensors",)"
              R"("lm_head.weight": "model-00002-of-00002.safetensors"}})");
  expect_error([&] { HfCheckpointDir ckpt(dir_); },
               {"model.safetensors.index.json", "'lm_head.weight'", "model-00002-of-00002.safetensors",
                "does not exist"});
}

TEST_F(Safetensors, HfIndexShardsArePlainFileNamesInTheDirectory) {
  // An index must not make the reader open files outside the model directory.
  fs::create_directories(dir_ / "model");
  write_tensor_file(dir_ / "outside.safetensors", {{"a", 1.0f}});
  write_tensor_file(dir_ / "model" / "inside.safetensors", {{"a", 1.0f}});
  for (const std::string& shard : std::vector<std::string>{"../outside.safetensors", (dir_ / "outside.safetensors").string(),
                                  "sub/inside.safetensors", "..", ".", ""}) {
    write_bytes(dir_ / "model" / "model.safetensors.index.json",
                nlohmann::json{{"weight_map", {{"a", shard}}}}.dump());
    expect_error([&] { HfCheckpointDir ckpt(dir_ / "model"); }, {"weight_map entry 'a'", "not a plain file name"});
  }
  write_bytes(dir_ / "model" / "model.safetensors.index.json", R"({"weight_map": {"a": "inside.safetensors"}})");
  EXPECT_NO_THROW(HfCheckpointDir(dir_ / "model").verify());
}

TEST_F(Safetensors, HfIndexNamesTensorNotInShard) {
  write_tensor_file(dir_ / "shard1.safetensors", {{"a", 1.0f}});
  write_bytes(dir_ / "model.safetensors.index.json",
              R"({"weight_map": {"a": "shard1.safetensors", "ghost": "shard1.safetensors"}})");
  HfCheckpointDir ckpt(dir_);
  expect_error([&] { ckpt.find("ghost"); },
               {"model.safetensors.index.json", "'ghost'", "shard1.safetensors", "no such tensor"});
  expect_error([&] { ckpt.verify(); }, {"'ghost'", "shard1.safetensors"});
}

TEST_F(Safetensors, HfBadIndex) {
  const fs::path index = dir_ / "model.safetensors.index.json";
  write_bytes(index, "{not json");
  expect_error([&] { HfCheckpointDir ckpt(dir_); }, {index.string(), "not valid JSON"});
  write_bytes(index, R"({"metadata": {}})");
  expect_error([&] { HfCheckpointDir ckpt(dir_); }, {index.string(), "missing field 'weight_map'"});
  write_bytes(index, R"({"weight_map": {"a": 3}})");
  expect_error([&] { HfCheckpointDir ckpt(dir_); }, {index.string(), "'a'", "expected a shard file name"});
  write_bytes(index, R"({"weight_map": {}})");
  expect_error([&] { HfCheckpointDir ckpt(dir_); }, {index.string(), "'weight_map' is empty"});
}

TEST_F(Safetensors, HfRefusesPickleWeights) {
  write_bytes(dir_ / "config.json", "{}");
  write_bytes(dir_ / "pytorch_model.bin", "pickle");
  expect_error([&] { HfCheckpointDir ckpt(dir_); },
               {dir_.string() + " holds PyTorch pickle weights (pytorch_model.bin); tuna reads only "
                                "safetensors: convert them first, e.g. with transformers: "
                                "model.save_pretrained(out_dir, safe_serialization=True)"});
  fs::remove(dir_ / "pytorch_model.bin");
  write_bytes(dir_ / "pytorch_model.bin.index.json", "{}");
  expect_error([&] { HfCheckpointDir ckpt(dir_); },
               {"PyTorch pickle weights (pytorch_model.bin.index.json)", "safe_serialization=True"});
  // Next to a Trainer's optimizer.pt, the model weights are what the message names.
  write_bytes(dir_ / "optimizer.pt", "pickle");
  expect_error([&] { HfCheckpointDir ckpt(dir_); }, {"(pytorch_model.bin.index.json)"});
  fs::remove(dir_ / "optimizer.pt");
  fs::remove(dir_ / "pytorch_model.bin.index.json");
  write_bytes(dir_ / "consolidated.00.pth", "pickle");
  expect_error([&] { HfCheckpointDir ckpt(dir_); },
               {"PyTorch pickle weights (consolidated.00.pth)", "tuna reads only safetensors",
                "convert_llama_weights_to_hf.py"});
}

TEST_F(Safetensors, HfNothingFound) {
  write_bytes(dir_ / "config.json", "{}");
  write_bytes(dir_ / "adapter_model.safetensors", "x");
  expect_error([&] { HfCheckpointDir ckpt(dir_); },
               {dir_.string(), "no model weights", "model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "*.pth", "adapter_model.safetensors"});
  expect_error([&] { HfCheckpointDir ckpt(dir_ / "missing"); }, {"missing", "no such directory"});
  expect_error([&] { HfCheckpointDir ckpt(dir_ / "config.json"); }, {"config.json", "not a directory"});
}

}  // namespace
}  // namespace tuna
