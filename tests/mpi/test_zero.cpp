// ZeRO-3's memory at 4 ranks: each rank's parameter + gradient + optimizer bytes, measured as what malloc
// handed out while the model and Zero were built (mallinfo2), are about a quarter of the single rank's.
//
// The single-rank figure is 16 bytes per parameter (weights, gradients, two moments). A ZeRO-3 rank holds
// a quarter of each plus the gather buffers: two units of weights (the prefetch pair) and one unit of
// gradient. With 32 layers those are ~3% of the model, so the rank's share is 0.25-0.28 of the single rank.
// ZeRO-2 keeps whole weights (which are its master weights) and a quarter of the gradient and moments:
// (4 + 4/4 + 8/4) / 16 = 0.44. ZeRO-1 also keeps the whole gradient, reduced in place: (8 + 8/4) / 16 = 0.625
// (it was 0.75 with a second copy of the shard's weights and gradient, and the same as ZeRO-0 at 2 ranks).
#include <gtest/gtest.h>
#include <malloc.h>

#include <nlohmann/json.hpp>
#include <fstream>

#include "dist/zero.h"
#include "model/config.h"
#include "model/llama.h"
#include "tests/mpi/mpi_test_util.h"

namespace tuna {
namespace {

// Small blocks (uordblks) and blocks malloc mapped on their own (hblkhd: every large buffer).
int64_t heap_in_use() {
  const struct mallinfo2 m = mallinfo2();
  return static_cast<int64_t>(m.uordblks + m.hblkhd);
}

LlamaConfig deep_tiny_config() {
  std::ifstream in("tests/fixtures/llama2_tiny/config.json");
  nlohmann::json j = nlohmann::json::parse(in);
  j["num_hidden_layers"] = 32;
  return LlamaConfig::from_json(j, "llama2_tiny with 32 layers");
}

// Bytes malloc handed out for a model and its Zero state, less the model's activations.
struct Measured {
  int64_t heap, reported;
};
Measured measure(const LlamaConfig& config, int stage, Comm& dp) {
  const int64_t before = heap_in_use();
  Llama model(config, 1, 8, LlamaParallel{nullptr, /*external_weights=*/stage == 3, /*external_grads=*/stage == 2});
  Zero zero(model, OptimizerConfig{}, stage, dp, nullptr);
  const int64_t after = heap_in_use();
  return {after - before - model.activation_bytes(), zero.state_bytes()};
}

TEST(Zero, EachStageHoldsItsShareOfTheStateAtFourRanks) {
  Comm& world = test::world();
  if (world.size() != 4) GTEST_SKIP() << "runs at 4 ranks";
  const LlamaConfig config = deep_tiny_config();
  std::unique_ptr<Comm> alone = make_single_comm();
  const Measured single = measure(config, 0, *alone);
  const Measured sharded = measure(config, 3, world), stage2 = measure(config, 2, world), stage1 = measure(config, 1, world);
  const double ratio = double(sharded.heap) / double(single.heap);
  if (world.rank() == 0)
    std::printf("single rank %.2f MB, ZeRO-3 rank %.2f MB: %.3f of it, ZeRO-2 %.3f, ZeRO-1 %.3f (%lld parameters)\n",
                single.heap / 1e6, sharded.heap / 1e6, ratio, double(stage2.heap) / single.heap,
                double(stage1.heap) / single.heap, (long long)config.n_params());
  EXPECT_NEAR(double(single.heap), 16.0 * config.n_params(), 0.02 * single.heap);
  EXPECT_GT(ratio, 0.24);
  EXPECT_LT(ratio, 0.28);
  EXPECT_GT(double(stage2.heap) / single.heap, 0.43);
  EXPECT_LT(double(stage2.heap) / single.heap, 0.46);
  EXPECT_GT(double(stage1.heap) / single.heap, 0.62);
  EXPECT_LT(double(stage1.heap) / single.heap, 0.64);
  EXPECT_NEAR(double(stage1.reported), double(stage1.heap), 0.02 * stage1.heap);
  EXPECT_NEAR(double(stage2.reported), double(stage2.heap), 0.02 * stage2.heap);
  // Zero's own accounting agrees with malloc's.
  EXPECT_NEAR(double(sharded.reported), double(sharded.heap), 0.02 * sharded.heap);
  EXPECT_NEAR(double(single.reported), double(single.heap), 0.02 * single.heap);
}

}  // namespace
}  // namespace tuna
