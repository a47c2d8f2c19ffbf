// data/loader: windows, rank disjointness, seeded order, exact resume, loss mask, bad tokens, eval pass.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "data/loader.h"
#include "kernels/cpu/classifier.h"  // kIgnoreIndex
#include "tests/data/data_test_util.h"

namespace tuna {
namespace {

using testing_data::expect_error;
using testing_data::TempDir;

// Shard s holds tokens s * 100000 + i (i = 0..n-1) in documents of 7 tokens, so that a window is named by
// its first input token. vocab 1 << 20 makes them uint32 shards.
constexpr uint32_t kVocab = 1 << 20;

std::string make_shard(const TempDir& dir, const std::string& name, int s, uint64_t n,
                       uint32_t vocab = kVocab) {
  const std::string path = dir.file(name);
  ShardWriter writer(path, vocab);
  std::vector<int32_t> doc;
  for (uint64_t i = 0; i < n; ++i) {
    doc.push_back(static_cast<int32_t>(s * 100000 + i));
    if (doc.size() == 7 || i + 1 == n) {
      writer.add_document(doc);
      doc.clear();
    }
  }
  writer.finish();
  return path;
}

// Three shards: 101 tokens (T=8: 12 windows), 5 tokens (none), 64 tokens (7 windows): N = 19.
struct Corpus {
  TempDir dir;
  std::vector<std::string> paths = {make_shard(dir, "a.bin", 1, 101), make_shard(dir, "b.bin", 2, 5),
                                    make_shard(dir, "c.bin", 3, 64)};
};

LoaderOptions options(int64_t T, int64_t B, int64_t rank = 0, int64_t dp = 1, uint64_t seed = 7) {
  LoaderOptions o;
  o.seq_len = T;
  o.micro_batch = B;
  o.dp_rank = rank;
  o.dp_size = dp;
  o.seed = seed;
  o.vocab_size = kVocab;
  return o;
}

struct Batch {
  std::vector<int32_t> inputs, targets;
  bool operator==(const Batch&) const = default;
};

Batch next_batch(DataLoader& loader) {
  const auto& o = loader.options();
  Batch b{std::vector<int32_t>(o.micro_batch * o.seq_len), std::vector<int32_t>(o.micro_batch * o.seq_len)};
  EXPECT_TRUE(loader.next(b.inputs.data(), b.targets.data()));
  return b;
}

TEST(Loader, CountsWindowsAndShortShards) {
  Corpus c;
  DataLoader loader(c.paths, options(8, 2));
  EXPECT_EQ(loader.total_windows(), 19u);
  EXPECT_EQ(loader.windows_per_epoch(), 19u);
  EXPECT_EQ(loader.batches_per_epoch(), 9u);
  EXPECT_EQ(loader.total_tokens(), 170u);
  EXPECT_EQ(loader.shard_count(), 3u);
  EXPECT_EQ(loader.short_shards(), 1u);
}

TEST(Loader, WindowsAreShiftedSlicesOfOneShard) {
  Corpus c;
  const int64_t T = 8;
  DataLoader loader(c.paths, options(T, 1));
  std::set<int32_t> starts;
  for (uint64_t k = 0; k < loader.windows_per_epoch(); ++k) {
    Batch b = next_batch(loader);
    const int32_t first = b.inputs[0];
    const int32_t shard = first / 100000, offset = first % 100000;
    EXPECT_EQ(offset % T, 0) << "window starts at a multiple of T";
    for (int64_t j = 0; j < T; ++j) {
      EXPECT_EQ(b.inputs[j], first + j);
      EXPECT_EQ(b.targets[j], first + j + 1);  // targets are inputs shifted by one
    }
    EXPECT_NE(shard, 2) << "the 5-token shard holds no window";
    starts.insert(first);
  }
  // One epoch visits every window once: 12 of shard 1 (starts 0..88), 7 of shard 3 (starts 0..48).
  std::set<int32_t> expected;
  for (int w = 0; w < 12; ++w) expected.insert(100000 + w * 8);
  for (int w = 0; w < 7; ++w) expected.insert(300000 + w * 8);
  EXPECT_EQ(starts, expected);
}

TEST(Loader, RanksAreDisjointAndCoverTheEpoch) {
  Corpus c;
  const int64_t dp = 3;  // 19 windows: 6 per rank, one dropped
  std::map<int32_t, int> seen;
  for (int64_t rank = 0; rank < dp; ++rank) {
    DataLoader loader(c.paths, options(8, 2, rank, dp));
    ASSERT_EQ(loader.windows_per_epoch(), 6u);
    for (int k = 0; k < 3; ++k) {
      Batch b = next_batch(loader);
      for (int row = 0; row < 2; ++row) seen[b.inputs[row * 8]] += 1;
    }
    EXPECT_EQ(loader.cursor().epoch, 0u);
    EXPECT_EQ(loader.cursor().position, 6u);
  }
  EXPECT_EQ(seen.size(), 18u);  // disjoint: 18 distinct windows
  for (auto [start, count] : seen) EXPECT_EQ(count, 1) << "window " << start;
  // Over many epochs the dropped window changes, so every window gets seen.
  std::set<int32_t> all;
  DataLoader loader(c.paths, options(8, 1, 0, dp));
  for (int k = 0; k < 6 * 20; ++k) all.insert(next_batch(loader).inputs[0]);
  EXPECT_GT(all.size(), 6u);
}

TEST(Loader, OrderIsDeterministicForASeedAndDiffersAcrossSeedsAndEpochs) {
  Corpus c;
  DataLoader a(c.paths, options(8, 19, 0, 1, 7)), b(c.paths, options(8, 19, 0, 1, 7)),
      other(c.paths, options(8, 19, 0, 1, 8));
  Batch a0 = next_batch(a), b0 = next_batch(b), o0 = next_batch(other);
  EXPECT_EQ(a0, b0);
  EXPECT_NE(a0, o0);
  Batch a1 = next_batch(a);  // the next epoch, exactly (B = N)
  EXPECT_NE(a0, a1);
  std::vector<int32_t> s0, s1;
  for (int r = 0; r < 19; ++r) s0.push_back(a0.inputs[r * 8]), s1.push_back(a1.inputs[r * 8]);
  std::sort(s0.begin(), s0.end());
  std::sort(s1.begin(), s1.end());
  EXPECT_EQ(s0, s1);  // same windows, another order
}

TEST(Loader, PermutationIsABijection) {
  for (uint64_t n : {1, 2, 3, 4, 5, 15, 16, 17, 100, 257, 1000}) {
    for (uint64_t seed : {0, 1, 99}) {
      WindowPermutation p(n, seed, 3);
      std::vector<int> hit(n, 0);
      uint64_t fixed = 0;
      for (uint64_t i = 0; i < n; ++i) {
        uint64_t v = p(i);
        ASSERT_LT(v, n);
        hit[v] += 1;
        fixed += v == i;
      }
      for (uint64_t v = 0; v < n; ++v) ASSERT_EQ(hit[v], 1) << "n " << n << " seed " << seed;
      if (n >= 100) {
        EXPECT_LT(fixed, n / 10) << "a shuffle, not the identity";
      }
    }
  }
}

TEST(Loader, CursorResumesExactly) {
  Corpus c;
  for (int64_t dp : {1, 2}) {
    for (int64_t rank = 0; rank < dp; ++rank) {
      DataLoader original(c.paths, options(8, 3, rank, dp));
      for (int k = 0; k < 5; ++k) next_batch(original);  // k = 5 batches: past the first epoch for dp 2
      const std::string saved = nlohmann::json(original.cursor()).dump();
      std::vector<Batch> expected;
      for (int m = 0; m < 7; ++m) expected.push_back(next_batch(original));  // crosses an epoch boundary

      DataLoader resumed(c.paths, options(8, 3, rank, dp));
      resumed.set_cursor(nlohmann::json::parse(saved).get<LoaderCursor>());
      for (int m = 0; m < 7; ++m)
        EXPECT_EQ(next_batch(resumed), expected[m]) << "dp " << dp << " batch " << m;
    }
  }
}

TEST(Loader, CursorJsonRoundTripAndMismatch) {
  Corpus c;
  DataLoader loader(c.paths, options(8, 2));
  next_batch(loader);
  LoaderCursor cursor = loader.cursor();
  nlohmann::json j = cursor;
  EXPECT_EQ(j["position"], 2);
  EXPECT_EQ(j["total_windows"], 19);
  EXPECT_EQ(j.get<LoaderCursor>(), cursor);

  DataLoader other_seed(c.paths, options(8, 2, 0, 1, 8));
  expect_error([&] { other_seed.set_cursor(cursor); }, {"data cursor", "'seed'", "saved with 7", "has 8"});
  DataLoader other_dp(c.paths, options(8, 2, 0, 2));
  expect_error([&] { other_dp.set_cursor(cursor); }, {"'dp_size'"});
  expect_error(
      [&] {
        nlohmann::json{{"epoch", 1}}.get<LoaderCursor>();
      },
      {"data cursor", "'position' is missing"});
  expect_error(
      [&] {
        nlohmann::json{{"epoch", -1}}.get<LoaderCursor>();
      },
      {"'epoch'", "non-negative integer", "-1"});
}

// A resume checks the cursor against the step: from its segment's start, micro_batch x grad_accum windows per
// step per rank. An edited position or epoch is refused; dp sizes that would overflow a product are refused.
TEST(Loader, CursorMustAgreeWithTheStep) {
  Corpus c;
  DataLoader loader(c.paths, options(8, 3));  // 19 windows, 3 per batch
  for (int k = 0; k < 8; ++k) next_batch(loader);  // 8 steps of 3 windows (grad_accum 1): 24 = epoch 1, position 5
  const LoaderCursor cursor = loader.cursor();
  EXPECT_EQ(cursor.epoch, 1u);
  EXPECT_EQ(cursor.position, 5u);
  EXPECT_NO_THROW(check_cursor_progress(cursor, 8, 3, "state.json"));
  EXPECT_NO_THROW(check_cursor_progress(cursor, 4, 6, "state.json"));  // micro_batch 3 x grad_accum 2
  expect_error([&] { check_cursor_progress(cursor, 9, 3, "state.json"); },
               {"state.json: data cursor (epoch 1, position 5) is not where step 9 leaves the data", "epoch 1, position 8"});
  LoaderCursor edited = cursor;
  edited.position = 4;
  expect_error([&] { check_cursor_progress(edited, 8, 3, "s"); }, {"position 4", "hand-edited"});
  edited = cursor;
  edited.epoch = 0;
  expect_error([&] { check_cursor_progress(edited, 8, 3, "s"); }, {"epoch 0, position 5"});
  // A resumed segment: set_cursor carries its start, so a later cursor is checked from there.
  LoaderCursor resumed_at = cursor;
  resumed_at.segment_step = 8, resumed_at.segment_epoch = 1, resumed_at.segment_position = 5;
  DataLoader resumed(c.paths, options(8, 3));
  resumed.set_cursor(resumed_at);
  for (int k = 0; k < 2; ++k) next_batch(resumed);
  EXPECT_NO_THROW(check_cursor_progress(resumed.cursor(), 10, 3, "s"));
  EXPECT_EQ(nlohmann::json(resumed.cursor())["segment"]["step"], 8);
  // A cursor written before cursors carried their segment is not checked.
  nlohmann::json old = cursor;
  old.erase("segment");
  EXPECT_FALSE(old.get<LoaderCursor>().has_segment);
  EXPECT_NO_THROW(check_cursor_progress(old.get<LoaderCursor>(), 9, 3, "s"));

  // dp_size 2^62 or 2^63 made position x dp_size overflow to 0 (the data order silently restarted).
  nlohmann::json huge = cursor;
  for (const uint64_t dp : {uint64_t{1} << 62, uint64_t{1} << 63}) {
    huge["dp_size"] = dp;
    expect_error([&] { huge.get<LoaderCursor>(); }, {"'dp_size'", "expected 1 to 2^24 ranks"});
  }
  LoaderCursor wide = cursor;
  wide.position = uint64_t{1} << 62, wide.dp_size = 1 << 24;
  expect_error([&] { reshard_cursor(wide, 2); }, {"position x dp_size", "overflows 64 bits"});
  wide.epoch = uint64_t{1} << 62, wide.position = 0, wide.total_windows = uint64_t{1} << 40, wide.dp_size = 1;
  expect_error([&] { check_cursor_progress(wide, 8, 3, "s"); }, {"overflows 64 bits"});
  LoaderCursor two = cursor;  // 2 ranks at position 5 = 10 windows of the epoch: 5 on 2 ranks, 10 on 1
  two.dp_size = 2;
  EXPECT_EQ(reshard_cursor(two, 1).position, 10u);
  expect_error([&] { reshard_cursor(two, 3); }, {"not a multiple of 3"});
}

TEST(Loader, MaskedTargetsAreIgnored) {
  TempDir dir;
  const std::string path = dir.file("sft.bin");
  {
    ShardWriter writer(path, 1000, /*with_mask=*/true);
    // prompt (mask 0) then response (mask 1), twice
    std::vector<int32_t> tokens = {1, 10, 11, 12, 20, 21, 2, 1, 30, 31, 40, 41, 42, 2};
    std::vector<uint8_t> mask = {0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1};
    writer.add_document(tokens, mask);
    writer.finish();
  }
  LoaderOptions o = options(13, 1);
  o.vocab_size = 1000;
  DataLoader loader({path}, o);
  ASSERT_EQ(loader.total_windows(), 1u);
  Batch b = next_batch(loader);
  const int32_t I = cpu::kIgnoreIndex;
  EXPECT_EQ(b.inputs, (std::vector<int32_t>{1, 10, 11, 12, 20, 21, 2, 1, 30, 31, 40, 41, 42}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{I, I, I, 20, 21, 2, I, I, I, 40, 41, 42, 2}));
}

TEST(Loader, PositionsMarkDocumentBoundaries) {
  TempDir dir;
  const std::string path = dir.file("docs.bin");
  {
    ShardWriter writer(path, 1000);
    writer.add_document(std::vector<int32_t>{1, 5, 6, 2});
    writer.add_document(std::vector<int32_t>{});  // empty: no position of its own
    writer.add_document(std::vector<int32_t>{1, 7, 2});
    writer.add_document(std::vector<int32_t>{1, 8, 9, 10, 2});
    writer.finish();
  }
  LoaderOptions o = options(5, 2);
  o.vocab_size = 1000;
  o.eval = true;
  DataLoader loader({path}, o);
  ASSERT_EQ(loader.total_windows(), 3u);  // 12 tokens, T = 5: two whole windows and the padded tail
  std::vector<int32_t> in(10), tg(10), pos(10);
  ASSERT_TRUE(loader.next(in.data(), tg.data(), pos.data()));
  EXPECT_EQ(in, (std::vector<int32_t>{1, 5, 6, 2, 1, 7, 2, 1, 8, 9}));
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 2, 3, 0, 1, 2, 0, 1, 2}));
  EXPECT_EQ(ShardReader(path).document_of(4), 2u) << "the empty document 1 holds no token";
}

TEST(Loader, RefusesAShardOfALargerVocabulary) {
  TempDir dir;
  const std::string path = make_shard(dir, "big-vocab.bin", 0, 50, 50000);
  LoaderOptions o = options(8, 1);
  o.vocab_size = 32000;
  expect_error([&] { DataLoader l({path}, o); }, {path, "vocab_size 50000", "model's vocab_size 32000"});
}

// A shard of another tokenizer with the same vocabulary size is refused, naming both tokenizers (the one
// from prepare's report.json beside the shard); a shard without a fingerprint (version 1) passes.
TEST(Loader, RefusesAShardOfAnotherTokenizer) {
  TempDir dir;
  const std::string path = dir.file("train-00000.bin");
  {
    ShardWriter w(path, 1000, false, /*tokenizer_fingerprint=*/0xaaaa);
    w.add_document(std::vector<int32_t>(40, 7));
    w.finish();
  }
  testing_data::write_file(dir.file("report.json"), R"({"tokenizer": {"path": "toks/contracts-8k.model"}})");
  LoaderOptions o = options(8, 1);
  o.vocab_size = 1000;
  o.tokenizer_fingerprint = 0xbbbb;
  o.tokenizer_name = "ckpt/base/tokenizer.json";
  expect_error([&] { DataLoader l({path}, o); },
               {path, "another tokenizer", "toks/contracts-8k.model", "000000000000aaaa", "ckpt/base/tokenizer.json",
                "000000000000bbbb"});
  o.tokenizer_fingerprint = 0xaaaa;
  EXPECT_NO_THROW(DataLoader({path}, o));
  const std::string old = make_shard(dir, "old.bin", 0, 40, 1000);  // fingerprint 0: unknown
  o.tokenizer_fingerprint = 0xbbbb;
  EXPECT_NO_THROW(DataLoader({old}, o));
}

TEST(Loader, RefusesATokenOutsideTheVocabulary) {
  TempDir dir;
  const std::string path = make_shard(dir, "corrupt.bin", 0, 40, 500);
  // Token 7 becomes 600 behind the writer's back (uint16 tokens from byte 64).
  std::string bytes = testing_data::read_file(path);
  uint16_t bad = 600;
  std::memcpy(bytes.data() + 64 + 7 * 2, &bad, 2);
  testing_data::write_file(path, bytes);
  LoaderOptions o = options(39, 1);  // one window: every token is read
  o.vocab_size = 500;
  DataLoader loader({path}, o);
  std::vector<int32_t> in(39), tg(39);
  expect_error([&] { loader.next(in.data(), tg.data()); }, {path, "token 7", "is 600", "[0, 500)"});
}

// A header whose vocab_size is smaller than the tokens it carries (vocab_size 1, tokens up to 499) is refused
// at read, naming the shard's declared vocabulary.
TEST(Loader, RefusesATokenAboveTheShardsOwnVocabulary) {
  TempDir dir;
  const std::string path = make_shard(dir, "lying.bin", 0, 40, 500);
  std::string bytes = testing_data::read_file(path);
  const uint32_t one = 1;
  std::memcpy(bytes.data() + 20, &one, 4);
  testing_data::write_file(path, bytes);
  LoaderOptions o = options(39, 1);
  o.vocab_size = 500;
  DataLoader loader({path}, o);
  std::vector<int32_t> in(39), tg(39);
  expect_error([&] { loader.next(in.data(), tg.data()); }, {path, "outside the vocabulary its header declares", "[0, 1)"});
}

// Without a model tokenizer to compare with, the shards of one loader must still share one tokenizer.
TEST(Loader, WithoutATokenizerTheShardsMustAgree) {
  TempDir dir;
  for (const auto& [name, fp] : {std::pair<const char*, uint64_t>{"a.bin", 0xaaaa}, {"b.bin", 0xbbbb}, {"c.bin", 0xaaaa}}) {
    ShardWriter w(dir.file(name), 1000, false, fp);
    w.add_document(std::vector<int32_t>(40, 7));
    w.finish();
  }
  LoaderOptions o = options(8, 1);
  o.vocab_size = 1000;
  EXPECT_NO_THROW(DataLoader({dir.file("a.bin"), dir.file("c.bin")}, o));
  expect_error([&] { DataLoader l({dir.file("a.bin"), dir.file("b.bin")}, o); },
               {dir.file("b.bin"), "another tokenizer", "000000000000bbbb", dir.file("a.bin"), "one tokenizer"});
}

TEST(Loader, NoWindowSaysHowManyTokens) {
  TempDir dir;
  const std::string a = make_shard(dir, "a.bin", 0, 10), b = make_shard(dir, "b.bin", 1, 12);
  expect_error(
      [&] {
        DataLoader l({a, b}, options(16, 1));
      },
      {"no training window", "seq_len + 1 = 17", "largest shard has 12", "all shards together 22"});
  expect_error([&] { DataLoader l({a}, options(4, 1, 0, 4)); }, {"2 window(s)", "4 data-parallel ranks"});
}

TEST(Loader, BadOptions) {
  Corpus c;
  expect_error([&] { DataLoader l(c.paths, options(0, 1)); }, {"'seq_len'", "found 0"});
  expect_error([&] { DataLoader l(c.paths, options(8, 1, 2, 2)); }, {"'dp_rank'", "found 2"});
}

TEST(Loader, OnlyRegularFilesAreShards) {
  // A FIFO given as data used to block the trainer forever in open(); devices and loops fail by name too.
  TempDir dir;
  const std::string fifo = dir.file("train-00000.bin");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_error([&] { DataLoader l({fifo}, options(4, 1)); }, {fifo, "is a FIFO (named pipe)", "token shard"});
  expect_error([&] { DataLoader l({dir.path().string()}, options(4, 1)); }, {"no shards match"});  // a FIFO is no *.bin shard
  expect_error([&] { DataLoader l({"/dev/zero"}, options(4, 1)); }, {"/dev/zero", "character device"});
  const std::string loop = dir.file("loop.bin");
  ASSERT_EQ(::symlink(loop.c_str(), loop.c_str()), 0);
  expect_error([&] { DataLoader l({loop}, options(4, 1)); }, {loop, "symbolic links"});
}

TEST(Loader, ShardSpecs) {
  TempDir dir;
  make_shard(dir, "train-00001.bin", 1, 30);
  make_shard(dir, "train-00000.bin", 0, 30);
  make_shard(dir, "val-00000.bin", 2, 30);
  testing_data::write_file(dir.file("report.json"), "{}");
  EXPECT_EQ(expand_shard_paths({dir.path().string()}),
            (std::vector<std::string>{dir.file("train-00000.bin"), dir.file("train-00001.bin"),
                                      dir.file("val-00000.bin")}));
  EXPECT_EQ(expand_shard_paths({dir.file("train-*.bin")}),
            (std::vector<std::string>{dir.file("train-00000.bin"), dir.file("train-00001.bin")}));
  EXPECT_EQ(expand_shard_paths({dir.file("val-00000.bin")}),
            (std::vector<std::string>{dir.file("val-00000.bin")}));
  expect_error([&] { expand_shard_paths({dir.file("test-*.bin")}); }, {"no shards match", "test-*.bin"});
  expect_error([&] { expand_shard_paths({dir.file("missing.bin")}); }, {"missing.bin", "does not exist"});
}

// A prepare output directory holds both splits: given for one role, it gives that role's shards only.
TEST(Loader, DirectorySelectsTheSplitOfItsRole) {
  TempDir dir;
  make_shard(dir, "train-r00001-00000.bin", 1, 30);
  make_shard(dir, "train-r00000-00000.bin", 0, 30);
  make_shard(dir, "val-00000.bin", 2, 30);
  EXPECT_EQ(expand_shard_paths({dir.path().string()}, ShardRole::Train),
            (std::vector<std::string>{dir.file("train-r00000-00000.bin"), dir.file("train-r00001-00000.bin")}));
  EXPECT_EQ(expand_shard_paths({dir.path().string()}, ShardRole::Val),
            (std::vector<std::string>{dir.file("val-00000.bin")}));
  // Files and globs are taken as given, whatever the role.
  EXPECT_EQ(expand_shard_paths({dir.file("train-r00000-00000.bin")}, ShardRole::Val),
            (std::vector<std::string>{dir.file("train-r00000-00000.bin")}));

  // A directory with one split only: the other role is refused, naming what is missing.
  TempDir train_only;
  make_shard(train_only, "train-00000.bin", 0, 30);
  expect_error([&] { expand_shard_paths({train_only.path().string()}, ShardRole::Val); },
               {train_only.path().string(), "no val-*.bin", "validation"});

  // Shards not named by split: a directory gives all of them for any role.
  TempDir own;
  make_shard(own, "b.bin", 0, 30);
  make_shard(own, "a.bin", 1, 30);
  EXPECT_EQ(expand_shard_paths({own.path().string()}, ShardRole::Val),
            (std::vector<std::string>{own.file("a.bin"), own.file("b.bin")}));
}

TEST(Loader, EvalVisitsEveryWindowOnceInOrder) {
  Corpus c;
  std::vector<int32_t> starts;
  int64_t padding_rows = 0;
  for (int64_t rank = 0; rank < 2; ++rank) {
    LoaderOptions o = options(8, 4, rank, 2);
    o.eval = true;
    DataLoader loader(c.paths, o);
    // Evaluation windows: 13, 1 and 8 (each shard's tail a padded window): 22, ceil(22 / 2) per rank.
    EXPECT_EQ(loader.windows_per_epoch(), 11u);
    EXPECT_EQ(loader.batches_per_epoch(), 3u);
    std::vector<int32_t> in(32), tg(32);
    int batches = 0;
    while (loader.next(in.data(), tg.data())) {
      ++batches;
      for (int row = 0; row < 4; ++row) {
        if (tg[row * 8] == cpu::kIgnoreIndex) {  // a padding row
          ++padding_rows;
          for (int j = 0; j < 8; ++j) EXPECT_EQ(tg[row * 8 + j], cpu::kIgnoreIndex);
        } else {
          starts.push_back(in[row * 8]);
        }
      }
    }
    EXPECT_EQ(batches, 3);
    EXPECT_FALSE(loader.next(in.data(), tg.data()));
    loader.reset();
    EXPECT_TRUE(loader.next(in.data(), tg.data()));
  }
  EXPECT_EQ(padding_rows, 2 * 12 - 22);
  std::sort(starts.begin(), starts.end());
  std::vector<int32_t> expected;
  for (int w = 0; w < 13; ++w) expected.push_back(100000 + w * 8);
  expected.push_back(200000);  // the 5-token shard: one short window
  for (int w = 0; w < 8; ++w) expected.push_back(300000 + w * 8);
  EXPECT_EQ(starts, expected);
}

// Every target is scored once in evaluation: a shard's tail, and a shard shorter than a window (one short SFT
// conversation in a validation split), are windows padded after their last token.
TEST(Loader, EvalPadsTailsAndShortShards) {
  TempDir dir;
  const std::string path = dir.file("val-00000.bin");
  {
    ShardWriter writer(path, 1000, /*with_mask=*/true);
    writer.add_document(std::vector<int32_t>{1, 5, 6, 7, 2}, std::vector<uint8_t>{0, 0, 1, 1, 1});
    writer.finish();
  }
  LoaderOptions o = options(16, 2);
  o.vocab_size = 1000;
  expect_error([&] { DataLoader l({path}, o); }, {"no training window"});
  o.eval = true;
  DataLoader loader({path}, o);
  ASSERT_EQ(loader.total_windows(), 1u);
  std::vector<int32_t> in(32), tg(32), pos(32);
  ASSERT_TRUE(loader.next(in.data(), tg.data(), pos.data()));
  std::vector<int32_t> want_in(16, 0), want_tg(16, cpu::kIgnoreIndex), want_pos(16, 0);
  for (int j = 0; j < 5; ++j) want_in[j] = std::vector<int32_t>{1, 5, 6, 7, 2}[j], want_pos[j] = j;
  want_tg[1] = 6, want_tg[2] = 7, want_tg[3] = 2;  // the response's tokens; the prompt's are masked
  EXPECT_EQ(std::vector<int32_t>(in.begin(), in.begin() + 16), want_in);
  EXPECT_EQ(std::vector<int32_t>(tg.begin(), tg.begin() + 16), want_tg);
  EXPECT_EQ(std::vector<int32_t>(pos.begin(), pos.begin() + 16), want_pos);
  for (int j = 16; j < 32; ++j) EXPECT_EQ(tg[j], cpu::kIgnoreIndex);  // the batch's padding row
  // A shard of one token has no target: nothing to evaluate, and the message says what to do.
  const std::string lone = dir.file("val-00001.bin");
  {
    ShardWriter writer(lone, 1000);
    writer.add_document(std::vector<int32_t>{1});
    writer.finish();
  }
  expect_error([&] { DataLoader l({lone}, o); }, {"nothing to evaluate", "--val-fraction", "--val_data"});
}


// ---------------------------------------------------------------------------------------------------
// Preference pairs

// Pair p of shard s: a prompt of 2 + p % 3 tokens (BOS first), a chosen answer of 2 + p % 2 and a rejected one of 3
// tokens (each ending in EOS 2), ids naming the shard, pair and role so that a row can be read back.
struct PairShard {
  std::vector<std::vector<int32_t>> docs;
  std::vector<std::vector<uint8_t>> masks;
};

PairShard pair_docs(int s, int pairs) {
  PairShard out;
  for (int p = 0; p < pairs; ++p) {
    std::vector<int32_t> prompt{1};
    for (int i = 1; i < 2 + p % 3; ++i) prompt.push_back(1000 * s + 10 * p + i);
    for (int half = 0; half < 2; ++half) {
      std::vector<int32_t> doc = prompt;
      std::vector<uint8_t> mask(prompt.size(), 0);
      const int n = half == 0 ? 2 + p % 2 : 3;
      for (int i = 0; i + 1 < n; ++i) doc.push_back(100000 * (half + 1) + 1000 * s + 10 * p + i), mask.push_back(1);
      doc.push_back(2), mask.push_back(1);
      out.docs.push_back(doc), out.masks.push_back(mask);
    }
  }
  return out;
}

std::string write_pairs(const TempDir& dir, const std::string& name, const PairShard& shard) {
  const std::string path = dir.file(name);
  ShardWriter w(path, kVocab, /*with_mask=*/true, 0, /*pairs=*/true);
  for (size_t d = 0; d < shard.docs.size(); ++d) w.add_document(shard.docs[d], shard.masks[d]);
  w.finish();
  return path;
}

// Whole pairs in each window, as many as fit, in shard order; each document's tokens, positions from 0, targets its
// own next tokens, completion flags from the mask, sequence 2p / 2p + 1, and the pairs' global ids.
TEST(Loader, PairsPackWholeIntoWindows) {
  TempDir dir;
  const PairShard a = pair_docs(1, 5), b = pair_docs(2, 2);
  const std::vector<std::string> paths = {write_pairs(dir, "a.bin", a), write_pairs(dir, "b.bin", b)};
  const int64_t T = 16;
  LoaderOptions o = options(T, 1);
  o.eval = true;  // natural order
  DataLoader loader(paths, o);
  ASSERT_TRUE(loader.pairs());
  EXPECT_EQ(loader.total_pairs(), 7u);
  // Pair tokens, shard a: p0 2+2+2+3=9, p1 3+3+3+3=12, p2 4+2+4+3=13, p3 2+3+2+3=10, p4 3+2+3+3=11 -> one pair a
  // window (any two exceed 16); shard b: p0 9, p1 12 -> one each. Windows never mix shards.
  EXPECT_EQ(loader.total_windows(), 7u);
  std::vector<int32_t> in(T), tg(T), pos(T), seq(T);
  std::vector<uint8_t> comp(T);
  std::vector<uint64_t> ids;
  uint64_t expect_id = 0;
  for (const PairShard* shard : {&a, &b}) {
    for (size_t p = 0; p < shard->docs.size() / 2; ++p, ++expect_id) {
      ASSERT_TRUE(loader.next_pairs(in.data(), tg.data(), pos.data(), seq.data(), comp.data(), &ids));
      ASSERT_EQ(ids, std::vector<uint64_t>{expect_id});
      int64_t at = 0;
      for (int half = 0; half < 2; ++half) {
        const std::vector<int32_t>& doc = shard->docs[2 * p + half];
        const std::vector<uint8_t>& mask = shard->masks[2 * p + half];
        for (size_t j = 0; j < doc.size(); ++j, ++at) {
          EXPECT_EQ(in[at], doc[j]);
          EXPECT_EQ(pos[at], static_cast<int32_t>(j));
          EXPECT_EQ(seq[at], half);
          EXPECT_EQ(tg[at], j + 1 < doc.size() ? doc[j + 1] : cpu::kIgnoreIndex);
          EXPECT_EQ(comp[at], j + 1 < doc.size() ? mask[j + 1] : 0);
        }
      }
      for (; at < T; ++at) EXPECT_TRUE(seq[at] == -1 && tg[at] == cpu::kIgnoreIndex && comp[at] == 0 && in[at] == 0);
    }
  }
  EXPECT_FALSE(loader.next_pairs(in.data(), tg.data(), pos.data(), seq.data(), comp.data(), &ids));
}

// With a longer window several pairs share it, numbered 0, 1, ... inside the micro-batch, across its rows too.
TEST(Loader, ManyPairsShareAWindowAndNumberAcrossRows) {
  TempDir dir;
  const PairShard a = pair_docs(1, 6);  // 9, 12, 13, 10, 11, 9 tokens
  const std::string path = write_pairs(dir, "a.bin", a);
  const int64_t T = 32, B = 2;
  LoaderOptions o = options(T, B);
  o.eval = true;
  DataLoader loader({path}, o);
  // Windows: {p0, p1} (21), {p2, p3} (23), {p4, p5} (20).
  ASSERT_EQ(loader.total_windows(), 3u);
  EXPECT_EQ(loader.pairs_in_window(0), 2u);
  std::vector<int32_t> in(B * T), tg(B * T), pos(B * T), seq(B * T);
  std::vector<uint8_t> comp(B * T);
  std::vector<uint64_t> ids;
  ASSERT_TRUE(loader.next_pairs(in.data(), tg.data(), pos.data(), seq.data(), comp.data(), &ids));
  EXPECT_EQ(ids, (std::vector<uint64_t>{0, 1, 2, 3}));
  EXPECT_EQ(seq[0], 0);
  EXPECT_EQ(seq[9], 2);       // row 0: pair 1's chosen starts after pair 0's 9 tokens
  EXPECT_EQ(seq[T], 4);       // row 1 starts with the micro-batch's pair 2
  EXPECT_EQ(seq[T + 13], 6);  // and its pair 3 after 13 tokens
  ASSERT_TRUE(loader.next_pairs(in.data(), tg.data(), pos.data(), seq.data(), comp.data(), &ids));
  EXPECT_EQ(ids, (std::vector<uint64_t>{4, 5}));  // the second row is padding (eval)
  EXPECT_TRUE(std::all_of(seq.begin() + T, seq.end(), [](int32_t x) { return x == -1; }));
}

TEST(Loader, PairsRefuseWhatTheyCannotHold) {
  TempDir dir;
  const std::string pairs = write_pairs(dir, "a.bin", pair_docs(1, 3));
  expect_error([&] { DataLoader l({pairs}, options(10, 1)); },
               {pairs, "preference pair 1 holds 12 tokens", "more than seq_len 10", "--preference --seq_len 10"});
  const std::string plain = make_shard(dir, "p.bin", 1, 101);
  expect_error([&] { DataLoader l({pairs, plain}, options(16, 1)); }, {plain, "no preference pairs", "all pairs"});
  DataLoader loader({pairs}, options(16, 1));
  std::vector<int32_t> in(16), tg(16);
  expect_error([&] { loader.next(in.data(), tg.data()); }, {"preference objective"});
  DataLoader plain_loader({plain}, options(16, 1));
  std::vector<int32_t> pos(16), seq(16);
  std::vector<uint8_t> comp(16);
  std::vector<uint64_t> ids;
  expect_error([&] { plain_loader.next_pairs(in.data(), tg.data(), pos.data(), seq.data(), comp.data(), &ids); },
               {"prepare --preference", plain});
}

// Training order over pair windows is the plain windows' (seeded permutation, ranks disjoint, exact cursor).
TEST(Loader, PairWindowsFollowTheTrainingOrderAndCursor) {
  TempDir dir;
  const std::string path = write_pairs(dir, "a.bin", pair_docs(1, 9));
  const int64_t T = 16;
  std::set<uint64_t> seen;
  for (int64_t rank = 0; rank < 2; ++rank) {
    DataLoader loader({path}, options(T, 1, rank, 2));
    std::vector<int32_t> in(T), tg(T), pos(T), seq(T);
    std::vector<uint8_t> comp(T);
    std::vector<uint64_t> ids;
    for (uint64_t i = 0; i < loader.windows_per_epoch(); ++i) {
      loader.next_pairs(in.data(), tg.data(), pos.data(), seq.data(), comp.data(), &ids);
      for (uint64_t id : ids) EXPECT_TRUE(seen.insert(id).second) << "pair " << id << " twice";
    }
    const LoaderCursor c = loader.cursor();
    loader.next_pairs(in.data(), tg.data(), pos.data(), seq.data(), comp.data(), &ids);
    const std::vector<uint64_t> expected = ids;
    DataLoader resumed({path}, options(T, 1, rank, 2));
    resumed.set_cursor(c);
    resumed.next_pairs(in.data(), tg.data(), pos.data(), seq.data(), comp.data(), &ids);
    EXPECT_EQ(ids, expected);
  }
  EXPECT_EQ(seen.size(), 8u);  // 9 windows of one pair each, 4 per rank: one dropped this epoch
}

}  // namespace
}  // namespace tuna
