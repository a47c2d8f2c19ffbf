// The GPU model with LoRA adapters (model/llama_gpu.h, MemoryLayout::lora) against PEFT + transformers in float64
// (the fixtures tests/fixtures/lora_*: every target on the untied model, q, v and down on the tied one) and against
// the CPU model (model/llama.h) with dropout, gradient accumulation and each recompute mode. Skipped without a
// device; on the emulator in CI.
//
// Tolerances: those of tests/model/test_llama_gpu.cpp, where they are derived for a bf16 model against float64
// (3e-2 on the logits, 1e-2 on the loss, 0.1 per gradient tensor). The adapters add a few roundings per target
// (A x, its scale, the B product added into the output): far below those bounds, while a wrong sign, scale, split
// or mask moves a tensor's gradient by O(1).
#if TUNA_CUDA
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ckpt/checkpoint.h"
#include "ckpt/safetensors.h"
#include "kernels/cpu/nf4.h"
#include "model/llama.h"
#include "model/llama_gpu.h"
#include "model/lora.h"
#include "model/memory_plan.h"
#include "tests/kernels/gpu_test_util.h"
#include "tests/model/fixture.h"

namespace tuna {
namespace {

using testing_util::Fixture;
using testing_util::rel_err_norm;

// A PEFT fixture: its base, batch, adapter config and starting adapters (in the adapter layout's order).
struct LoraFixture {
  std::filesystem::path dir;
  nlohmann::json meta;
  Fixture base;
  LoraConfig lora;
  explicit LoraFixture(const std::string& name)
      : dir(std::filesystem::path("tests/fixtures") / name), meta(read_meta(dir)),
        base(meta.at("base").get<std::string>()), lora(read_peft_adapter_config(dir)) {
    SafetensorsFile ref(dir / "reference.safetensors");
    ref.read_i32("input_ids", {base.batch, base.seq}, base.inputs.data());
    ref.read_i32("targets", {base.batch, base.seq}, base.targets.data());
  }
  static nlohmann::json read_meta(const std::filesystem::path& d) {
    std::ifstream in(d / "reference.json");
    return nlohmann::json::parse(in);
  }
  std::vector<float> adapters(const ParamLayout& layout) const {
    const SafetensorsFile file(dir / "adapter_model.safetensors");
    std::vector<float> out(layout.total());
    for (const ParamTensor& t : layout.tensors()) file.read_f32(t.name, t.shape, out.data() + t.offset);
    return out;
  }
};

MemoryLayout lora_run(const Fixture& f, const LoraConfig& lora, Recompute recompute = Recompute::None) {
  MemoryLayout run = single_rank_layout(f.batch, f.seq);
  static_cast<LoraConfig&>(run.lora) = lora;
  run.recompute = recompute;
  return run;
}

class LlamaLoraGpuPeft : public testing::TestWithParam<std::string> {};

TEST_P(LlamaLoraGpuPeft, LogitsLossAndAdapterGradientsMatchPeft) {
  TUNA_REQUIRE_GPU();
  LoraFixture lf(GetParam());
  const Fixture& f = lf.base;
  std::vector<float> weights(ParamLayout(f.config).total());
  load_weights(f.dir, ParamLayout(f.config), weights.data());
  LlamaGpu model(f.config, lora_run(f, lf.lora), f.optimizer());
  model.set_params(weights.data());
  const std::vector<float> adapters = lf.adapters(model.trained_layout());
  model.set_adapters_piece(Segment{0, model.trained_layout().total()}, adapters.data());
  SafetensorsFile ref(lf.dir / "reference.safetensors");
  const int64_t V = f.config.vocab_size;

  std::vector<float> logits(f.batch * f.seq * V, NAN);
  model.forward_logits(f.inputs.data(), f.batch, f.seq, logits.data());
  std::vector<double> ref_logits(logits.size());
  ref.read_f64("logits", {f.batch, f.seq, V}, ref_logits.data());
  const double logits_err = rel_err_norm(logits.data(), ref_logits.data(), logits.size());
  std::printf("  %s logits rel err %.3e\n", GetParam().c_str(), logits_err);
  EXPECT_LE(logits_err, 3e-2);

  model.zero_grads();
  const LossSum loss = model.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq);
  const double ref_loss = lf.meta.at("loss");
  ASSERT_GT(loss.count, 0);
  std::printf("  %s loss %.6f (PEFT %.6f)\n", GetParam().c_str(), loss.sum / loss.count, ref_loss);
  EXPECT_NEAR(loss.sum / loss.count, ref_loss, 1e-2 * ref_loss);
  std::vector<float> grads(model.trained_layout().total());
  model.get_grads(grads.data());
  for (const ParamTensor& t : model.trained_layout().tensors()) {
    std::vector<double> ref_grad(t.numel);
    ref.read_f64("grad." + t.name, t.shape, ref_grad.data());
    const double err = rel_err_norm(grads.data() + t.offset, ref_grad.data(), t.numel, 1.0 / loss.count);
    EXPECT_LE(err, 0.1) << t.name;
  }
  // Deterministic: the same batch again gives the same gradient bits.
  model.zero_grads();
  model.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq);
  std::vector<float> again(grads.size());
  model.get_grads(again.data());
  EXPECT_TRUE(test::bitwise_equal(grads, again)) << "the adapters' backward is not deterministic";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, LlamaLoraGpuPeft, testing::Values("lora_llama2_tiny", "lora_llama32_tiny"));

// Against the CPU model with dropout (the masks bit-equal by construction, so a mismatch there is O(1)), over two
// micro-batches of different keys accumulated, in each recompute mode, which must all give the same bits.
TEST(LlamaLoraGpu, DropoutAndRecomputeFollowTheCpuModel) {
  TUNA_REQUIRE_GPU();
  LoraFixture lf("lora_llama2_tiny");
  const Fixture& f = lf.base;
  LoraConfig lora = lf.lora;
  lora.dropout = 0.2;
  Llama cpu(f.config, f.batch, f.seq, {}, lora);
  load_weights(f.dir, cpu.layout(), cpu.params.data());
  cpu.lora_params = lf.adapters(cpu.lora_layout().params);
  cpu.zero_grads();
  LossSum want;
  for (int64_t mb = 0; mb < 2; mb++) {
    cpu.set_lora_dropout_key(lora_dropout_key(9, 4, mb, 0));
    const LossSum l = cpu.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq);
    want.sum += l.sum, want.count += l.count;
  }
  // The masks act: without dropout the loss differs.
  Llama plain(f.config, f.batch, f.seq, {}, lf.lora);
  plain.params = cpu.params, plain.lora_params = cpu.lora_params;
  const LossSum undropped = plain.forward_loss(f.inputs.data(), f.targets.data(), f.batch, f.seq);
  EXPECT_GT(std::abs(2 * undropped.sum - want.sum), 1e-3 * want.sum);

  std::vector<float> first;
  for (Recompute rc : {Recompute::None, Recompute::Selective, Recompute::Full}) {
    SCOPED_TRACE(recompute_name(rc));
    LlamaGpu gpu(f.config, lora_run(f, lora, rc), f.optimizer());
    gpu.set_params(cpu.params.data());
    gpu.set_adapters_piece(Segment{0, gpu.trained_layout().total()}, cpu.lora_params.data());
    gpu.zero_grads();
    LossSum got;
    for (int64_t mb = 0; mb < 2; mb++) {
      gpu.set_lora_dropout_key(lora_dropout_key(9, 4, mb, 0));
      const LossSum l = gpu.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq);
      got.sum += l.sum, got.count += l.count;
    }
    EXPECT_EQ(got.count, want.count);
    EXPECT_NEAR(got.sum / got.count, want.sum / want.count, 1e-2 * want.sum / want.count);
    std::vector<float> grads(gpu.trained_layout().total());
    gpu.get_grads(grads.data());
    for (const ParamTensor& t : gpu.trained_layout().tensors()) {
      const std::vector<double> ref(cpu.lora_grads.begin() + t.offset, cpu.lora_grads.begin() + t.offset + t.numel);
      EXPECT_LE(rel_err_norm(grads.data() + t.offset, ref.data(), t.numel), 0.1) << t.name;  // both sums
    }
    if (first.empty()) first = grads;
    else EXPECT_TRUE(test::bitwise_equal(first, grads)) << "recompute changed the gradient bits";
  }
}

// The base is frozen: its state is the bf16 weights alone, and an AdamW step moves the adapters only.
TEST(LlamaLoraGpu, AStepMovesTheAdaptersOnly) {
  TUNA_REQUIRE_GPU();
  LoraFixture lf("lora_llama32_tiny");
  const Fixture& f = lf.base;
  LlamaGpu gpu(f.config, lora_run(f, lf.lora), f.optimizer());
  EXPECT_EQ(gpu.memory_plan().bytes(MemoryKind::Master), device_arena_bytes(4 * gpu.trained_layout().total()));
  std::vector<float> weights(gpu.layout().total());
  load_weights(f.dir, gpu.layout(), weights.data());
  gpu.set_params(weights.data());
  const std::vector<float> adapters = lf.adapters(gpu.trained_layout());
  gpu.set_adapters_piece(Segment{0, gpu.trained_layout().total()}, adapters.data());
  std::vector<uint16_t> base_before(gpu.layout().total()), base_after(gpu.layout().total());
  TUNA_CUDA_CHECK(cudaMemcpy(base_before.data(), gpu.params(), base_before.size() * 2, cudaMemcpyDeviceToHost));
  gpu.zero_grads();
  const LossSum l = gpu.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq);
  const OptimizerStats stats = gpu.adamw_step(1.0 / l.count, 1e-3);
  EXPECT_TRUE(stats.applied);
  TUNA_CUDA_CHECK(cudaMemcpy(base_after.data(), gpu.params(), base_after.size() * 2, cudaMemcpyDeviceToHost));
  EXPECT_EQ(base_before, base_after);
  std::vector<float> moved(adapters.size());
  gpu.get_params(moved.data());
  EXPECT_NE(moved, adapters);
  EXPECT_LT(gpu.flops_per_token(f.seq), model_flops_per_token(f.config, f.seq));
}

// QLoRA: the base's projections held in NF4 and dequantized a layer at a time on the device follow the CPU model
// run on the same NF4 values dequantized on the host (kernels/cpu/nf4.h), at the bf16 tolerances above; the
// quantized base takes about a quarter of the bf16 one's bytes.
TEST(LlamaLoraGpu, QloraFollowsTheCpuModelOnTheDequantizedBase) {
  TUNA_REQUIRE_GPU();
  LoraFixture lf("lora_llama2_tiny");
  const Fixture& f = lf.base;
  Llama cpu(f.config, f.batch, f.seq, {}, lf.lora);
  std::vector<float> weights(cpu.layout().total());
  load_weights(f.dir, cpu.layout(), weights.data());
  cpu.params = weights;
  for (const ParamTensor& t : cpu.layout().tensors()) {  // what the device dequantizes, in fp32
    if (!base_tensor_quantized(t)) continue;
    const cpu::Nf4Sizes z = cpu::nf4_sizes(t.numel);
    std::vector<uint8_t> packed(z.packed_bytes), qabsmax(z.blocks);
    std::vector<float> absmax2(z.stat_blocks), scratch(z.blocks);
    float mean = 0;
    cpu::nf4_quantize(weights.data() + t.offset, t.numel, packed.data(), qabsmax.data(), absmax2.data(), &mean,
                      scratch.data(), t.name.c_str());
    cpu::nf4_dequantize(cpu::Nf4Tensor{t.numel, packed.data(), qabsmax.data(), absmax2.data(), mean},
                        cpu.params.data() + t.offset);
  }
  EXPECT_GT(rel_err_norm(cpu.params.data(), std::vector<double>(weights.begin(), weights.end()).data(),
                         static_cast<int64_t>(weights.size())), 1e-3);  // NF4 moved the base
  cpu.lora_params = lf.adapters(cpu.lora_layout().params);

  MemoryLayout run = lora_run(f, lf.lora);
  run.lora.base_quant = BaseQuant::Nf4;
  LlamaGpu gpu(f.config, run, f.optimizer());
  gpu.set_params(weights.data());  // quantized on the way in
  gpu.set_adapters_piece(Segment{0, gpu.trained_layout().total()}, cpu.lora_params.data());
  const MemoryPlan bf16_plan = plan_gpu_memory(f.config, lora_run(f, lf.lora));
  std::printf("  base weights: nf4 %lld bytes, bf16 %lld bytes\n",
              static_cast<long long>(gpu.memory_plan().bytes(MemoryKind::Weights)),
              static_cast<long long>(bf16_plan.bytes(MemoryKind::Weights)));
  EXPECT_LT(gpu.memory_plan().bytes(MemoryKind::Weights), bf16_plan.bytes(MemoryKind::Weights));

  const int64_t V = f.config.vocab_size;
  std::vector<float> logits(f.batch * f.seq * V), want_logits(logits.size());
  gpu.forward_logits(f.inputs.data(), f.batch, f.seq, logits.data());
  cpu.forward_logits(f.inputs.data(), f.batch, f.seq, want_logits.data());
  const std::vector<double> want_d(want_logits.begin(), want_logits.end());
  const double logits_err = rel_err_norm(logits.data(), want_d.data(), static_cast<int64_t>(logits.size()));
  std::printf("  QLoRA logits rel err %.3e\n", logits_err);
  EXPECT_LE(logits_err, 3e-2);
  cpu.zero_grads();
  const LossSum want = cpu.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq);
  gpu.zero_grads();
  const LossSum got = gpu.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq);
  EXPECT_EQ(got.count, want.count);
  EXPECT_NEAR(got.sum / got.count, want.sum / want.count, 1e-2 * want.sum / want.count);
  std::vector<float> grads(gpu.trained_layout().total());
  gpu.get_grads(grads.data());
  for (const ParamTensor& t : gpu.trained_layout().tensors()) {
    const std::vector<double> ref(cpu.lora_grads.begin() + t.offset, cpu.lora_grads.begin() + t.offset + t.numel);
    EXPECT_LE(rel_err_norm(grads.data() + t.offset, ref.data(), t.numel), 0.1) << t.name;
  }
  // And a step trains the adapters on it.
  EXPECT_TRUE(gpu.adamw_step(1.0 / got.count, 1e-3).applied);
}

}  // namespace
}  // namespace tuna
#endif  // TUNA_CUDA
