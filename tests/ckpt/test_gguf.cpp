// ckpt/gguf.h: the file layout byte by byte (header, typed keys, tensor records, 32-byte aligned data), the
// Q/K row permutation on a hand-worked case, a failed write that leaves nothing under the final name, and the
// --type names. Whole exports, read back by the gguf Python package, are in tests/tools/test_convert.cpp.
#include "ckpt/gguf.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/error.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A little-endian cursor over the file.
struct Cursor {
  const std::string& bytes;
  size_t at = 0;
  template <typename T>
  T get() {
    T v;
    std::memcpy(&v, bytes.data() + at, sizeof(T));
    at += sizeof(T);
    return v;
  }
  std::string str() {
    const uint64_t n = get<uint64_t>();
    std::string s = bytes.substr(at, n);
    at += n;
    return s;
  }
};

TEST(Gguf, PermutesQkRowsFromRotateHalfToInterleaved) {
  // Two heads of 4 rows, 2 columns: within a head, rows (0, 1 | 2, 3) are the halves; row i of the first half
  // goes to 2i, row i of the second to 2i + 1.
  std::vector<float> in(16), out(16);
  for (int r = 0; r < 8; ++r) in[r * 2] = float(r), in[r * 2 + 1] = float(100 + r);
  permute_rope_rows(in.data(), out.data(), 8, 2, 4);
  const int want[] = {0, 2, 1, 3, 4, 6, 5, 7};
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(out[r * 2], float(want[r])) << r;
    EXPECT_EQ(out[r * 2 + 1], float(100 + want[r])) << r;
  }
}

TEST(Gguf, WritesVersion3WithTypedKeysAndAlignedTensors) {
  testing_util::TempDir tmp("gguf");
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_u32("llama.block_count", 2);
  w.add_f32("llama.rope.freq_base", 500000.0f);
  w.add_bool("tokenizer.ggml.add_bos_token", true);
  w.add_strings("tokenizer.ggml.tokens", {"a", "bc"});
  w.add_f32s("tokenizer.ggml.scores", {0.5f, -1.0f});
  w.add_i32s("tokenizer.ggml.token_type", {1, 3});
  w.add_tensor("norm.weight", {3}, GgmlType::f32);
  w.add_tensor("m.weight", {32, 2}, GgmlType::q8_0);
  const float norm[3] = {1, 2, 3};
  std::vector<std::byte> blocks(68, std::byte{7});
  const fs::path path = tmp / "m.gguf";
  const uint64_t size = w.write(path, [&](const GgufWriter::Append& append) {
    append(norm, sizeof norm);
    append(blocks.data(), 30);  // in pieces: the writer joins them
    append(blocks.data() + 30, 38);
  });
  const std::string bytes = read_all(path);
  ASSERT_EQ(bytes.size(), size);
  Cursor c{bytes};
  EXPECT_EQ(bytes.substr(0, 4), "GGUF");
  c.at = 4;
  EXPECT_EQ(c.get<uint32_t>(), 3u);
  EXPECT_EQ(c.get<uint64_t>(), 2u);  // tensors
  EXPECT_EQ(c.get<uint64_t>(), 7u);  // keys
  EXPECT_EQ(c.str(), "general.architecture");
  EXPECT_EQ(c.get<uint32_t>(), 8u);  // string
  EXPECT_EQ(c.str(), "llama");
  EXPECT_EQ(c.str(), "llama.block_count");
  EXPECT_EQ(c.get<uint32_t>(), 4u);  // uint32
  EXPECT_EQ(c.get<uint32_t>(), 2u);
  EXPECT_EQ(c.str(), "llama.rope.freq_base");
  EXPECT_EQ(c.get<uint32_t>(), 6u);  // float32
  EXPECT_EQ(c.get<float>(), 500000.0f);
  EXPECT_EQ(c.str(), "tokenizer.ggml.add_bos_token");
  EXPECT_EQ(c.get<uint32_t>(), 7u);  // bool
  EXPECT_EQ(c.get<uint8_t>(), 1u);
  EXPECT_EQ(c.str(), "tokenizer.ggml.tokens");
  EXPECT_EQ(c.get<uint32_t>(), 9u);  // array
  EXPECT_EQ(c.get<uint32_t>(), 8u);  // of strings
  EXPECT_EQ(c.get<uint64_t>(), 2u);
  EXPECT_EQ(c.str(), "a");
  EXPECT_EQ(c.str(), "bc");
  EXPECT_EQ(c.str(), "tokenizer.ggml.scores");
  EXPECT_EQ(c.get<uint32_t>(), 9u);
  EXPECT_EQ(c.get<uint32_t>(), 6u);
  EXPECT_EQ(c.get<uint64_t>(), 2u);
  EXPECT_EQ(c.get<float>(), 0.5f);
  EXPECT_EQ(c.get<float>(), -1.0f);
  EXPECT_EQ(c.str(), "tokenizer.ggml.token_type");
  EXPECT_EQ(c.get<uint32_t>(), 9u);
  EXPECT_EQ(c.get<uint32_t>(), 5u);  // int32
  EXPECT_EQ(c.get<uint64_t>(), 2u);
  EXPECT_EQ(c.get<int32_t>(), 1);
  EXPECT_EQ(c.get<int32_t>(), 3);
  // Tensor records: name, dimensions (innermost first), type, offset into the data section.
  EXPECT_EQ(c.str(), "norm.weight");
  EXPECT_EQ(c.get<uint32_t>(), 1u);
  EXPECT_EQ(c.get<uint64_t>(), 3u);
  EXPECT_EQ(c.get<uint32_t>(), 0u);  // F32
  EXPECT_EQ(c.get<uint64_t>(), 0u);
  EXPECT_EQ(c.str(), "m.weight");
  EXPECT_EQ(c.get<uint32_t>(), 2u);
  EXPECT_EQ(c.get<uint64_t>(), 32u);
  EXPECT_EQ(c.get<uint64_t>(), 2u);
  EXPECT_EQ(c.get<uint32_t>(), 8u);   // Q8_0
  EXPECT_EQ(c.get<uint64_t>(), 32u);  // 12 bytes of norm, padded to 32
  const size_t data = (c.at + 31) / 32 * 32;
  for (size_t i = c.at; i < data; ++i) EXPECT_EQ(bytes[i], '\0') << i;
  EXPECT_EQ(0, std::memcmp(bytes.data() + data, norm, sizeof norm));
  for (size_t i = data + 12; i < data + 32; ++i) EXPECT_EQ(bytes[i], '\0') << i;
  EXPECT_EQ(bytes.substr(data + 32, 68), std::string(68, '\7'));
  EXPECT_EQ(bytes.size(), data + 32 + 96);  // the last tensor padded too
  EXPECT_FALSE(fs::exists(tmp / "m.gguf.tmp"));
}

TEST(Gguf, AFailedWriteLeavesNothingUnderTheName) {
  testing_util::TempDir tmp("gguf");
  const fs::path path = tmp / "m.gguf";
  GgufWriter w;
  w.add_tensor("big.weight", {1 << 16}, GgmlType::f32);  // 256 KiB
  std::vector<float> big(1 << 16, 1.0f);
  // Too few bytes from the producer: refused, nothing written.
  EXPECT_THROW(w.write(path, [&](const GgufWriter::Append& append) { append(big.data(), 100); }), Error);
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(tmp / "m.gguf.tmp"));

  // A full disk (RLIMIT_FSIZE: write() fails with EFBIG at the limit, as it would with ENOSPC) with an earlier
  // file at the name: the earlier file stays, no temporary file is left.
  std::ofstream(path) << "earlier export";
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
    w.write(path, [&](const GgufWriter::Append& append) { append(big.data(), big.size() * 4); });
  } catch (const Error& e) {
    message = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &old_limit);
  sigaction(SIGXFSZ, &old_action, nullptr);
  EXPECT_NE(message.find("cannot write " + path.string()), std::string::npos) << message;
  EXPECT_NE(message.find("tensor 'big.weight'"), std::string::npos) << message;
  EXPECT_FALSE(fs::exists(tmp / "m.gguf.tmp"));
  EXPECT_EQ(read_all(path), "earlier export");
}

// The value of a metadata key: its bytes after the key's name and value type (u32), read as T.
template <typename T>
T gguf_value(const std::string& file, const std::string& key, uint32_t type) {
  const size_t at = file.find(key);
  if (at == std::string::npos) throw std::runtime_error("no key " + key);
  Cursor c{file, at + key.size()};
  EXPECT_EQ(c.get<uint32_t>(), type) << key;
  return c.get<T>();
}

// rope scaling as llama.cpp reads it: linear and yarn as rope.scaling.* keys (yarn's original context, betas, and
// the trained context as context_length); dynamic, which llama.cpp lacks, refused by name.
TEST(Gguf, RopeScalingKeys) {
  testing_util::TempDir tmp("gguf_rope");
  auto vocabulary = [](int64_t n) {
    GgufVocabulary v;
    v.model = "llama";
    for (int64_t i = 0; i < n; i++) v.tokens.push_back("<t" + std::to_string(i) + ">");
    v.scores.assign(n, 0.0f);
    v.types.assign(n, 1);
    return v;
  };
  export_gguf("tests/fixtures/rope_yarn", tmp / "yarn.gguf", GgufWeights::f32, vocabulary(64));
  const std::string yarn = read_all(tmp / "yarn.gguf");
  const uint32_t kU32 = 4, kF32 = 6, kString = 8;
  Cursor type{yarn, yarn.find("llama.rope.scaling.type") + std::strlen("llama.rope.scaling.type")};
  EXPECT_EQ(type.get<uint32_t>(), kString);
  EXPECT_EQ(type.str(), "yarn");
  EXPECT_EQ(gguf_value<float>(yarn, "llama.rope.scaling.factor", kF32), 4.0f);
  EXPECT_EQ(gguf_value<uint32_t>(yarn, "llama.rope.scaling.original_context_length", kU32), 32u);
  EXPECT_EQ(gguf_value<uint32_t>(yarn, "llama.context_length", kU32), 128u);
  EXPECT_EQ(gguf_value<float>(yarn, "llama.rope.scaling.yarn_beta_fast", kF32), 16.0f);
  EXPECT_EQ(gguf_value<float>(yarn, "llama.rope.scaling.yarn_beta_slow", kF32), 1.0f);

  export_gguf("tests/fixtures/rope_linear", tmp / "linear.gguf", GgufWeights::f32, vocabulary(64));
  const std::string linear = read_all(tmp / "linear.gguf");
  EXPECT_EQ(gguf_value<float>(linear, "llama.rope.scaling.factor", kF32), 2.0f);
  EXPECT_EQ(gguf_value<uint32_t>(linear, "llama.context_length", kU32), 64u);
  EXPECT_EQ(linear.find("original_context_length"), std::string::npos);

  try {
    export_gguf("tests/fixtures/rope_dynamic", tmp / "dynamic.gguf", GgufWeights::f32, vocabulary(64));
    ADD_FAILURE() << "dynamic rope exported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'dynamic'"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(tmp / "dynamic.gguf"));
}

TEST(Gguf, TypeNames) {
  for (const char* name : {"f32", "f16", "bf16", "q8_0", "q4_0"})
    EXPECT_STREQ(gguf_weights_name(parse_gguf_weights(name)), name);
  try {
    parse_gguf_weights("q4_k_m");
    FAIL() << "q4_k_m accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("option --type: expected bf16, f16, f32, q8_0 or q4_0, found 'q4_k_m'"),
              std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tuna
