// kernels/attention*.cu against kernels/cpu/attention.cpp in double: forward out and lse, backward dq, dk, dv;
// head dims 64 and 128, grouped-query heads, sequence lengths that are not multiples of the tiles (and 1),
// determinism of the backward, packed documents (masks, skipped key blocks, restarted RoPE). Both paths of head
// dims 64 and 128 (attention.cuh) pass the same checks with the same tolerances: mma (FlashAttention-2 style) and
// hopper (FlashAttention-3 style, sm_90a: on a GPU these run on an sm_90 device only; the host emulator runs them
// everywhere).
//
// The naive same-precision version is attention_reference.h's (see gpu_test_util.h for the rule).
#if TUNA_CUDA
#include <cmath>
#include <string>

#include "kernels/attention.cuh"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/rope.h"
#include "tests/kernels/attention_reference.h"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

#define TUNA_REQUIRE_SM90()                                                                           \
  do {                                                                                                \
    TUNA_REQUIRE_GPU();                                                                               \
    if (!cuda::attention_hopper_available()) GTEST_SKIP() << "no sm_90 device or no sm_90a code"; \
  } while (0)

// With `rope`, the backward also applies RoPE's backward to dq and dk (attention.cuh's AttentionRope): the
// references then rotate theirs, the naive version in fp32 from its bf16 dq, dk, rounding again.
// With `doc_lengths` (per sequence, summing to s.seq), every version attends inside those packed documents, and
// RoPE (with `rope`) restarts its positions at each.
void check(const AttentionShape& s, TestRng& rng, AttentionPath path = AttentionPath::kMma,
           bool rope = false, const std::vector<std::vector<int64_t>>& doc_lengths = {}) {
  SCOPED_TRACE(s.describe() + " path " + cuda::attention_path_name(path) + (rope ? " with RoPE" : "") +
               (doc_lengths.empty() ? "" : " with documents"));
  std::printf(" %s, %s path%s%s\n", s.describe().c_str(), cuda::attention_path_name(path), rope ? ", RoPE" : "",
              doc_lengths.empty() ? "" : ", documents");
  std::vector<int32_t> doc_start, positions;
  for (const std::vector<int64_t>& row : doc_lengths) {
    int64_t at = 0;
    for (int64_t n : row) {
      for (int64_t i = 0; i < n; ++i) doc_start.push_back(static_cast<int32_t>(at)), positions.push_back(static_cast<int32_t>(i));
      at += n;
    }
  }
  ASSERT_TRUE(doc_lengths.empty() || static_cast<int64_t>(doc_start.size()) == s.batch * s.seq);
  const int32_t* docs = doc_lengths.empty() ? nullptr : doc_start.data();
  const int32_t* rope_positions = doc_lengths.empty() ? nullptr : positions.data();
  std::vector<float> q = random_bf16_values(rng, s.q_count(), -2, 2), k = random_bf16_values(rng, s.kv_count(), -2, 2),
                     v = random_bf16_values(rng, s.kv_count()), dout = random_bf16_values(rng, s.q_count());
  const std::vector<double> qd(q.begin(), q.end()), kd(k.begin(), k.end()), vd(v.begin(), v.end()),
      gd(dout.begin(), dout.end());
  // Reference forward in double.
  std::vector<double> ref_out(s.q_count()), ref_lse(s.batch * s.heads * s.seq);
  cpu::attention_fwd(ref_out.data(), ref_lse.data(), qd.data(), kd.data(), vd.data(), s.batch, s.seq, s.heads,
                     s.kv_heads, s.dim, docs);
  // The backward's inputs out (bf16) and lse (fp32), shared by every version so that the backward is checked
  // on its own.
  std::vector<float> out_bf(s.q_count()), lse_f(ref_lse.size());
  for (size_t i = 0; i < out_bf.size(); ++i) out_bf[i] = round_bf16(ref_out[i]);
  for (size_t i = 0; i < lse_f.size(); ++i) lse_f[i] = static_cast<float>(ref_lse[i]);
  const std::vector<double> out_d(out_bf.begin(), out_bf.end()), lse_d(lse_f.begin(), lse_f.end());
  std::vector<double> ref_dq(s.q_count()), ref_dk(s.kv_count()), ref_dv(s.kv_count());
  cpu::attention_bwd(ref_dq.data(), ref_dk.data(), ref_dv.data(), gd.data(), out_d.data(), lse_d.data(), qd.data(),
                     kd.data(), vd.data(), s.batch, s.seq, s.heads, s.kv_heads, s.dim, docs);
  NaiveAttention naive = naive_attention(s, qd, kd, vd, gd, out_d, lse_d, docs);
  std::vector<float> cos_table(s.seq * s.dim / 2), sin_table(s.seq * s.dim / 2);
  if (rope) {
    std::vector<double> inv_freq(s.dim / 2);
    cpu::rope_inv_freq(inv_freq.data(), s.dim, 10000.0, cpu::RopeScaling{});
    cpu::rope_table(cos_table.data(), sin_table.data(), inv_freq.data(), s.seq, s.dim);
    const std::vector<double> cos_d(cos_table.begin(), cos_table.end()), sin_d(sin_table.begin(), sin_table.end());
    cpu::rope_bwd(ref_dq.data(), ref_dq.data(), cos_d.data(), sin_d.data(), s.batch, s.seq, s.heads, s.dim,
                  s.heads * s.dim, s.heads * s.dim, rope_positions);
    cpu::rope_bwd(ref_dk.data(), ref_dk.data(), cos_d.data(), sin_d.data(), s.batch, s.seq, s.kv_heads, s.dim,
                  s.kv_heads * s.dim, s.kv_heads * s.dim, rope_positions);
    for (auto [grad, heads] : {std::pair{&naive.dq, s.heads}, std::pair{&naive.dk, s.kv_heads}}) {
      std::vector<float> g(grad->begin(), grad->end());
      cpu::rope_bwd(g.data(), g.data(), cos_table.data(), sin_table.data(), s.batch, s.seq, heads, s.dim, heads * s.dim,
                    heads * s.dim, rope_positions);
      for (size_t i = 0; i < g.size(); ++i) (*grad)[i] = round_bf16(g[i]);
    }
  }
  DeviceBuffer<float> d_cos(cos_table), d_sin(sin_table);
  DeviceBuffer<int32_t> d_doc_start(doc_start), d_positions(positions);
  const int32_t* dev_docs = docs ? d_doc_start.get() : nullptr;
  const cuda::AttentionRope tables =
      rope ? cuda::AttentionRope{d_cos.get(), d_sin.get(), rope_positions ? d_positions.get() : nullptr}
           : cuda::AttentionRope{};

  DeviceBf16 d_q(q), d_k(k), d_v(v), d_dout(dout), d_out(s.q_count()), d_out_in(out_bf);
  DeviceBuffer<float> d_lse(ref_lse.size()), d_lse_in(lse_f),
      d_scratch(cuda::attention_bwd_scratch_floats(s.batch, s.seq, s.heads, s.dim, path));
  d_out.poison(), d_lse.poison();
  cuda::attention_fwd(d_out.bf(), d_lse.get(), d_q.bf(), d_k.bf(), d_v.bf(), s.batch, s.seq, s.heads, s.kv_heads,
                      s.dim, dev_docs, nullptr, path);
  expect_close_to_naive("attention out", d_out.values(), naive.out, ref_out);
  expect_close_to_naive("attention lse (fp32)", d_lse.download(), naive.lse, ref_lse);

  std::vector<uint16_t> first[3];
  for (int run = 0; run < 2; ++run) {
    DeviceBf16 d_dq(s.q_count()), d_dk(s.kv_count()), d_dv(s.kv_count());
    d_dq.poison(), d_dk.poison(), d_dv.poison();
    cuda::attention_bwd(d_dq.bf(), d_dk.bf(), d_dv.bf(), d_dout.bf(), d_out_in.bf(), d_lse_in.get(), d_q.bf(), d_k.bf(),
                        d_v.bf(), d_scratch.get(), s.batch, s.seq, s.heads, s.kv_heads, s.dim, dev_docs, nullptr, path,
                        tables);
    if (run == 0) {
      first[0] = d_dq.download(), first[1] = d_dk.download(), first[2] = d_dv.download();
      expect_close_to_naive("attention dq", bf16_bits_to_double(first[0]), naive.dq, ref_dq);
      expect_close_to_naive("attention dk", bf16_bits_to_double(first[1]), naive.dk, ref_dk);
      expect_close_to_naive("attention dv", bf16_bits_to_double(first[2]), naive.dv, ref_dv);
    } else {
      EXPECT_TRUE(bitwise_equal(first[0], d_dq.download()) && bitwise_equal(first[1], d_dk.download()) &&
                  bitwise_equal(first[2], d_dv.download()))
          << "attention backward is not deterministic";
    }
  }
}

TEST(AttentionGpu, HeadDim64GroupedQuery) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check({2, 100 + rng.integer(0, 27), 4, 2, 64}, rng);
  check({1, 1, 2, 1, 64}, rng);
  check({1, 64, 3, 3, 64}, rng);
}

TEST(AttentionGpu, HeadDim128GroupedQuery) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check({2, 150 + rng.integer(0, 27), 4, 1, 128}, rng);
  check({1, 33, 2, 2, 128}, rng);
  check({1, 257, 8, 2, 128}, rng);
}

// The hopper path's tiles are 128 queries (two warpgroups of 64) by 128 keys forward and 128 keys by 64
// queries backward: these shapes take several key blocks, the diagonal block, a partial last tile, grouped-query
// heads and a single row; the emulator's cost keeps them small.
TEST(AttentionGpu, HeadDim64HopperPath) {
  TUNA_REQUIRE_SM90();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check({2, 260 + rng.integer(0, 27), 4, 2, 64}, rng, AttentionPath::kHopper);
  check({1, 1, 2, 1, 64}, rng, AttentionPath::kHopper);
}

TEST(AttentionGpu, HeadDim128HopperPath) {
  TUNA_REQUIRE_SM90();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check({1, 150 + rng.integer(0, 27), 4, 1, 128}, rng, AttentionPath::kHopper);
  check({1, 128, 2, 2, 128}, rng, AttentionPath::kHopper);
}

// The hopper path across waves of CTAs, on a GPU: 384 forward tiles over at most 132 persistent CTAs (an
// H100/H200's SMs), so each walks several (the Q barrier's later phases, the K/V ring and the turn barriers
// across tiles, which the small shapes above, one tile per CTA there, never reach on hardware), and 192
// backward CTAs, so the ordered dQ additions also wait on CTAs of an earlier wave. On the emulator the
// `--sms 3` run (test_gpu_emulated.cpp) walks several tiles per CTA at the shapes above; this one would take
// it minutes, so the emulated build leaves it out (its runs require every test to run, none skipped).
#ifndef TUNA_EMULATOR
TEST(AttentionGpu, HopperPathAcrossWavesOfCtas) {
  TUNA_REQUIRE_SM90();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check({4, 260, 32, 16, 64}, rng, AttentionPath::kHopper);
}
#endif

// RoPE's backward applied by attention_bwd: fused into the hopper path's epilogues, after the mma path's kernels.
TEST(AttentionGpu, BackwardAppliesRopeBackward) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check({1, 70, 2, 1, 64}, rng, AttentionPath::kMma, /*rope=*/true);
  if (!cuda::attention_hopper_available()) GTEST_SKIP() << "no sm_90 device or no sm_90a code";
  check({1, 70, 2, 1, 64}, rng, AttentionPath::kHopper, /*rope=*/true);
  check({1, 70, 2, 2, 128}, rng, AttentionPath::kHopper, /*rope=*/true);
}

// Tables that are not 16-byte aligned (a slice of a larger table) are refused before any launch, on either path.
TEST(AttentionGpu, BackwardRefusesUnalignedRopeTables) {
  TUNA_REQUIRE_GPU();
  DeviceBuffer<float> table(std::vector<float>(1 + 70 * 32, 0.5f));
  for (AttentionPath path : {AttentionPath::kMma, AttentionPath::kHopper}) {
    try {
      cuda::attention_bwd(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 1,
                          70, 2, 1, 64, /*doc_start=*/nullptr, /*stream=*/nullptr, path,
                          cuda::AttentionRope{table.get() + 1, table.get() + 1});
      ADD_FAILURE() << "no error on the " << cuda::attention_path_name(path) << " path";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("RoPE tables must be 16-byte aligned"), std::string::npos) << e.what();
    }
  }
}

TEST(AttentionGpu, SmallHeadDimsOfTinyModels) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check({2, 37, 4, 2, 8}, rng);
  check({1, 20, 2, 1, 16}, rng);
  check({1, 45, 3, 1, 32}, rng);
}

// Packed documents on the mma path and the small kernels: odd lengths, one-token documents, a document filling the
// row, boundaries inside a 64-row tile and on its edge, a long document spanning key blocks after short ones (its
// queries skip the earlier blocks; the dK/dV kernel's queries end at its document's end); RoPE restarted.
TEST(AttentionGpu, DocumentMasksOnTheMmaPath) {
  TUNA_REQUIRE_GPU();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check({2, 200, 4, 2, 64}, rng, AttentionPath::kMma, /*rope=*/true,
        {{1, 30, 1, 1, 33, 64, 70}, {200}});
  check({2, 131, 2, 1, 128}, rng, AttentionPath::kMma, /*rope=*/false,
        {{64, 64, 3}, {5, 1, 1, 1, 120, 3}});
  check({1, 70, 3, 1, 64}, rng, AttentionPath::kMma, /*rope=*/false, {std::vector<int64_t>(70, 1)});
  check({2, 37, 4, 2, 8}, rng, AttentionPath::kMma, /*rope=*/true, {{1, 17, 19}, {37}});
  check({1, 45, 3, 1, 32}, rng, AttentionPath::kMma, /*rope=*/false, {{20, 1, 24}});
}

// Packed documents on the hopper path (tiles of 128 queries x 128 keys forward, 128 keys x 64 queries
// backward): odd lengths, one-token documents, a document filling the row, boundaries inside a tile and on its
// edge; a document starting after a whole key block, so that the forward's later tiles start past block 0 and the
// backward's first key block stops before the last query blocks, whose dQ additions then begin at key block 1;
// grouped-query heads, hd64 and hd128, RoPE restarted at each document.
TEST(AttentionGpu, DocumentMasksOnTheHopperPath) {
  TUNA_REQUIRE_SM90();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check({2, 300, 4, 2, 64}, rng, AttentionPath::kHopper, /*rope=*/true,
        {{1, 30, 1, 1, 100, 160, 7}, {300}});
  check({2, 201, 2, 1, 128}, rng, AttentionPath::kHopper, /*rope=*/true,
        {{128, 64, 9}, {5, 1, 1, 1, 150, 43}});
  check({1, 70, 3, 1, 64}, rng, AttentionPath::kHopper, /*rope=*/false, {std::vector<int64_t>(70, 1)});
  check({1, 140, 4, 4, 128}, rng, AttentionPath::kHopper, /*rope=*/false, {{63, 2, 1, 74}});
}

// Documents starting inside a consumer warpgroup's 64 rows of a forward tile, at rows that are not multiples of 64,
// two or more key blocks of 128 after the previous document's start (seq 1024: tiles with several key blocks
// before the diagonal). The warps of that warpgroup then see different numbers of document-masked key blocks; the
// choice between the forward step's masked and unmasked instances (each with its own wgmma instructions) must
// still be the same for all four (wgmma is .aligned over the warpgroup, which the emulator checks). Starts 300
// (rows 256-319 of tile 2: warps 0-1 before it, warp 2 holds it) and 720 (rows 704-767 of tile 5: warp 0 in the
// previous document, warp 1 holds it); a second sequence with starts 100, 612 and 900 (tiles 0, 4 and 7).
// scripts/gpu-check.sh runs this test first, alone, under a watchdog: on a GPU the divergent code hangs or
// computes garbage rather than failing cleanly.
TEST(AttentionGpu, HopperDocumentsStartingInsideAWarpgroup) {
  TUNA_REQUIRE_SM90();
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  check({2, 1024, 1, 1, 64}, rng, AttentionPath::kHopper, /*rope=*/false, {{300, 420, 304}, {100, 512, 288, 124}});
  check({1, 1024, 1, 1, 128}, rng, AttentionPath::kHopper, /*rope=*/false, {{300, 420, 304}});
}

// Key blocks outside a query block's documents are not read: NaN keys and values there stay out of the results
// of the later document (a kernel that loaded them and multiplied by a zero weight would make NaN). Two documents
// of 128: on either path (tiles of 64 or 128 keys) no block holds keys of both.
void expect_key_blocks_outside_documents_unread(AttentionPath path) {
  const AttentionShape s{1, 256, 2, 1, 64};
  TestRng rng;
  SCOPED_TRACE(rng.describe());
  std::vector<float> q = random_bf16_values(rng, s.q_count()), k = random_bf16_values(rng, s.kv_count()),
                     v = random_bf16_values(rng, s.kv_count()), dout = random_bf16_values(rng, s.q_count());
  const int64_t cut = 128;  // two documents of 128: the second one's blocks never need keys 0..127
  std::vector<int32_t> doc_start(s.seq);
  for (int64_t t = 0; t < s.seq; ++t) doc_start[t] = t < cut ? 0 : static_cast<int32_t>(cut);
  std::fill(k.begin(), k.begin() + cut * s.kv_heads * s.dim, NAN);
  std::fill(v.begin(), v.begin() + cut * s.kv_heads * s.dim, NAN);
  DeviceBf16 d_q(q), d_k(k), d_v(v), d_dout(dout), d_out(s.q_count()), d_dq(s.q_count()), d_dk(s.kv_count()),
      d_dv(s.kv_count());
  DeviceBuffer<float> d_lse(s.batch * s.heads * s.seq),
      d_scratch(cuda::attention_bwd_scratch_floats(s.batch, s.seq, s.heads, s.dim, path));
  DeviceBuffer<int32_t> d_docs(doc_start);
  cuda::attention_fwd(d_out.bf(), d_lse.get(), d_q.bf(), d_k.bf(), d_v.bf(), s.batch, s.seq, s.heads, s.kv_heads, s.dim,
                      d_docs.get(), nullptr, path);
  cuda::attention_bwd(d_dq.bf(), d_dk.bf(), d_dv.bf(), d_dout.bf(), d_out.bf(), d_lse.get(), d_q.bf(), d_k.bf(),
                      d_v.bf(), d_scratch.get(), s.batch, s.seq, s.heads, s.kv_heads, s.dim, d_docs.get(), nullptr,
                      path);
  const auto later_rows_finite = [&](const std::vector<double>& x, int64_t heads) {
    for (size_t i = cut * heads * s.dim; i < x.size(); ++i)
      if (!std::isfinite(x[i])) return false;
    return true;
  };
  EXPECT_TRUE(later_rows_finite(d_out.values(), s.heads));
  EXPECT_TRUE(later_rows_finite(d_dq.values(), s.heads));
  EXPECT_TRUE(later_rows_finite(d_dk.values(), s.kv_heads));
  EXPECT_TRUE(later_rows_finite(d_dv.values(), s.kv_heads));
}

TEST(AttentionGpu, DocumentMasksSkipKeyBlocksOutsideTheDocument) {
  TUNA_REQUIRE_GPU();
  expect_key_blocks_outside_documents_unread(AttentionPath::kMma);
}

TEST(AttentionGpu, HopperPathSkipsKeyBlocksOutsideTheDocument) {
  TUNA_REQUIRE_SM90();
  expect_key_blocks_outside_documents_unread(AttentionPath::kHopper);
}

}  // namespace
}  // namespace tuna::test
#endif  // TUNA_CUDA
