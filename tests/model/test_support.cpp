// The support table (model/support.h): each rule's verdict on each device and the words its reason names; what a
// placed layout carries (the split, this rank's stage, the micro-batches in flight, the tied table's stages).
#include <gtest/gtest.h>

#include "core/error.h"
#include "model/support.h"
#include "tests/model/memory_plan_test_util.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

using Verdict = Support::Verdict;
using testing_util::plan_test_config;

MemoryLayout layout(int64_t tp = 1, int64_t pp = 1, int zero = 0) {
  MemoryLayout l;
  l.dp = 2, l.tp = tp, l.pp = pp, l.zero = zero, l.micro_batch = 2, l.seq_len = 16;
  return l;
}

void expect_verdict(const LlamaConfig& c, const MemoryLayout& l, Device device, Verdict verdict,
                    const std::string& words) {
  const Support s = support(c, l, device);
  EXPECT_EQ(s.verdict, verdict) << device_name(device) << ": " << s.reason;
  EXPECT_NE(s.reason.find(words), std::string::npos) << device_name(device) << ": " << s.reason;
}

TEST(Support, InvalidLayoutsOnEveryDevice) {
  const LlamaConfig c = plan_test_config(4, false);
  for (Device d : {Device::Cpu, Device::Cuda}) {
    MemoryLayout l = layout();
    l.zero = 4;
    expect_verdict(c, l, d, Verdict::Invalid, "option 'zero': expected 0, 1, 2 or 3, found 4");
    expect_verdict(c, layout(1, 5), d, Verdict::Invalid, "option 'pp': expected 1 to 4 stages");
    l = layout(1, 2);
    l.pp_rank = 2;
    expect_verdict(c, l, d, Verdict::Invalid, "pipeline stage 2 of 2");
    l = layout();
    l.sp = true;
    expect_verdict(c, l, d, Verdict::Invalid, "option 'sp' splits each micro-batch's tokens");
    l = layout();
    l.lora.base_quant = BaseQuant::Nf4;
    expect_verdict(c, l, d, Verdict::Invalid, "option 'base_quant' is for LoRA runs: base_quant nf4");
    EXPECT_THROW(require_valid(c, l, d), Error);
  }
  // Uneven rows per tp rank: the CPU engine's sp splits them unevenly, the CUDA engine's needs whole rows.
  MemoryLayout odd = layout(2);
  odd.sp = true, odd.seq_len = 15;
  EXPECT_TRUE(support(c, odd, Device::Cpu).runs());
  expect_verdict(c, odd, Device::Cuda, Verdict::Invalid, "--seq_len 15 is not a multiple of 2");
}

TEST(Support, WhatEachEngineDoesNotRunYet) {
  const LlamaConfig untied = plan_test_config(4, false), tied = plan_test_config(4, true);
  // Pipeline stages: ZeRO 0-2 on cpu (0-1 with tied embeddings), 0-1 on cuda.
  expect_verdict(untied, layout(1, 2, 3), Device::Cpu, Verdict::NotImplemented, "--zero 3 with --pp 2: not implemented");
  EXPECT_TRUE(support(untied, layout(1, 2, 2), Device::Cpu).runs());
  expect_verdict(tied, layout(1, 2, 2), Device::Cpu, Verdict::NotImplemented,
                 "--zero 2 with --pp and tied embeddings: not implemented");
  expect_verdict(untied, layout(1, 2, 2), Device::Cuda, Verdict::NotImplemented, "--pp with --zero 2 or 3");
  EXPECT_TRUE(support(untied, layout(1, 2, 1), Device::Cuda).runs());
  // A forward alone keeps nothing of ZeRO's.
  MemoryLayout forward = layout(1, 2, 3);
  forward.training = false;
  EXPECT_TRUE(support(untied, forward, Device::Cpu).runs());
  // A quantized base: not sharded at ZeRO-3 on either; on cuda nf4 only, at tp 1.
  MemoryLayout q = layout(1, 1, 3);
  q.lora.rank = 4, q.lora.base_quant = BaseQuant::Nf4;
  expect_verdict(untied, q, Device::Cpu, Verdict::NotImplemented,
                 "option 'base_quant' nf4 with --zero 3: sharding a quantized base is not implemented");
  expect_verdict(untied, q, Device::Cuda, Verdict::NotImplemented,
                 "--base_quant nf4 with --device cuda and --zero 3: sharding a quantized base over dp is not");
  q.zero = 2;
  EXPECT_TRUE(support(untied, q, Device::Cpu).runs());
  q.tp = 2;
  EXPECT_TRUE(support(untied, q, Device::Cpu).runs());
  expect_verdict(untied, q, Device::Cuda, Verdict::NotImplemented, "option 'base_quant' nf4 with --tp 2 and --device cuda");
  q.tp = 1, q.lora.base_quant = BaseQuant::Int8;
  EXPECT_TRUE(support(untied, q, Device::Cpu).runs());
  expect_verdict(untied, q, Device::Cuda, Verdict::NotImplemented, "option 'base_quant' int8 with --device cuda");
  // The CUDA engine's options on cpu.
  MemoryLayout r = layout();
  r.recompute = Recompute::Full;
  expect_verdict(untied, r, Device::Cpu, Verdict::NotImplemented, "recompute");
  EXPECT_TRUE(support(untied, r, Device::Cuda).runs());
  EXPECT_THROW(require_support(untied, r, Device::Cpu), Error);
  EXPECT_NO_THROW(require_valid(untied, r, Device::Cpu));
}

// The option given without adapters is refused whatever its value; the layout's rule, only a quantized base.
// --fp8 tensorwise: the CPU engine trains with it on every layout, full fine-tune or adapters; the CUDA engine on every
// layout its bf16 step runs (dp at every ZeRO stage, tp with and without sp, pp, adapters on a bf16 or nf4 base), and
// refuses the shapes cuBLASLt's FP8 GEMMs do not take by name, saying what to change.
TEST(Support, Fp8RunsWhereItIsWired) {
  const LlamaConfig c = LlamaConfig::load("tests/fixtures/llama2_tiny/config.json");  // widths multiples of 16
  MemoryLayout one = single_rank_layout(2, 16);
  one.fp8 = Fp8Mode::Tensorwise;
  EXPECT_TRUE(support(c, one, Device::Cpu).runs()) << support(c, one, Device::Cpu).reason;
  EXPECT_TRUE(support(c, one, Device::Cuda).runs()) << support(c, one, Device::Cuda).reason;
  for (int zero : {0, 1, 2, 3}) {
    MemoryLayout l = layout(1, 1, zero);
    l.fp8 = Fp8Mode::Tensorwise;
    EXPECT_TRUE(support(c, l, Device::Cuda).runs()) << "zero " << zero << ": " << support(c, l, Device::Cuda).reason;
  }
  const auto refused = [&](MemoryLayout l, const std::string& words) {
    l.fp8 = Fp8Mode::Tensorwise;
    expect_verdict(c, l, Device::Cuda, Verdict::NotImplemented, words);
    EXPECT_TRUE(support(c, l, Device::Cpu).runs()) << support(c, l, Device::Cpu).reason;
  };
  for (MemoryLayout l : {layout(2), layout(2, 1, 3), layout(1, 2), layout(2, 2, 1)}) {
    l.fp8 = Fp8Mode::Tensorwise;
    EXPECT_TRUE(support(c, l, Device::Cuda).runs()) << support(c, l, Device::Cuda).reason;
    l.sp = l.tp > 1;
    EXPECT_TRUE(support(c, l, Device::Cuda).runs()) << "sp: " << support(c, l, Device::Cuda).reason;
  }
  MemoryLayout sp_rows = layout(4);  // 2 x 16 tokens over 4 tp ranks: 8 rows each
  sp_rows.sp = true;
  refused(sp_rows, "--fp8 tensorwise with --device cuda and --sp: micro_batch 2 x seq_len 16 = 32 tokens a pass give "
                   "each of the 4 tp ranks 8 rows, not a multiple of 16");
  MemoryLayout short_pass = one;
  short_pass.seq_len = 9;  // 2 x 9 tokens a pass
  refused(short_pass, "micro_batch 2 x seq_len 9 = 18 tokens a pass, not a multiple of 16");
  MemoryLayout fp8_one = one;
  fp8_one.fp8 = Fp8Mode::Tensorwise;
  expect_verdict(plan_test_config(4, false), fp8_one, Device::Cuda, Verdict::NotImplemented,
                 "intermediate_size 170 (config.json) is not a multiple of 16");
  one.lora.rank = 4, one.lora.alpha = 8;
  EXPECT_TRUE(support(c, one, Device::Cpu).runs()) << support(c, one, Device::Cpu).reason;
  EXPECT_TRUE(support(c, one, Device::Cuda).runs()) << support(c, one, Device::Cuda).reason;
  one.lora.base_quant = BaseQuant::Nf4;  // QLoRA: each layer cast from its dequantized bf16 at each use
  EXPECT_TRUE(support(c, one, Device::Cuda).runs()) << support(c, one, Device::Cuda).reason;
  one.lora.base_quant = BaseQuant::None;
  // Over ranks on cpu: dp with ZeRO-3, tp with sp, pipeline stages (each amax over the tp group where a tensor is split).
  for (MemoryLayout l : {layout(1, 1, 3), layout(2), layout(1, 2)}) {
    l.fp8 = Fp8Mode::Tensorwise, l.sp = l.tp > 1;
    EXPECT_TRUE(support(c, l, Device::Cpu).runs()) << support(c, l, Device::Cpu).reason;
  }
  // A forward pass alone (eval, sample) has no FP8: the option is a training one.
  one.training = false;
  EXPECT_TRUE(support(c, one, Device::Cuda).runs());
}

TEST(Support, BaseQuantNeedsAdapters) {
  LoraPlan none;
  EXPECT_TRUE(base_quant_support(none).runs());
  EXPECT_EQ(base_quant_support(none, /*option_given=*/true).verdict, Verdict::Invalid);
  none.base_quant = BaseQuant::Int8;
  EXPECT_NE(base_quant_support(none).reason.find("option 'base_quant' is for LoRA runs"), std::string::npos);
  LoraPlan adapters = none;
  adapters.rank = 8;
  EXPECT_TRUE(base_quant_support(adapters, true).runs());
}

// --eval_tasks scores on the training engine: the CPU engine's on every layout, the CUDA engine's on dp and every ZeRO
// stage (whole-vocabulary logits of the whole model); tp and pp there are refused by name.
TEST(Support, EvalTasksOnEachEngine) {
  for (MemoryLayout l : {layout(), layout(1, 1, 3), layout(2), layout(1, 2)})
    EXPECT_TRUE(eval_tasks_support(l, Device::Cpu).runs()) << eval_tasks_support(l, Device::Cpu).reason;
  for (int zero : {0, 1, 2, 3}) {
    const MemoryLayout l = layout(1, 1, zero);  // dp 2
    EXPECT_TRUE(eval_tasks_support(l, Device::Cuda).runs()) << eval_tasks_support(l, Device::Cuda).reason;
  }
  for (MemoryLayout l : {layout(2), layout(1, 2)}) {
    const Support s = eval_tasks_support(l, Device::Cuda);
    EXPECT_EQ(s.verdict, Verdict::NotImplemented);
    EXPECT_NE(s.reason.find(l.tp > 1 ? "--eval_tasks with --device cuda and --tp 2" : "--device cuda and --pp 2"),
              std::string::npos) << s.reason;
    EXPECT_NE(s.reason.find("build/eval --tasks"), std::string::npos) << s.reason;
  }
}

// A placed layout carries the split once: this rank's stage, the first and last, the micro-batches in flight (1F1B:
// pp - stage; a forward alone one), and whether its stage holds a tied table the other end also holds.
TEST(Support, APlacedLayoutCarriesItsStage) {
  const LlamaConfig c = plan_test_config(4, true);
  MemoryLayout l = layout(1, 3);
  EXPECT_FALSE(l.placed());
  l = place_layout(c, l);
  ASSERT_TRUE(l.placed());
  ASSERT_EQ(l.stages.size(), 3u);
  const std::vector<PipelineStage> split = pipeline_stages(c, 3, l.seq_len);
  for (size_t s = 0; s < 3; s++) {
    EXPECT_EQ(l.stages[s].layer_begin, split[s].layer_begin);
    EXPECT_EQ(l.stages[s].layer_end, split[s].layer_end);
  }
  for (int64_t s = 0; s < 3; s++) {
    l.pp_rank = s;
    EXPECT_EQ(&l.stage(), &l.stages[s]);
    EXPECT_EQ(l.first_stage(), s == 0);
    EXPECT_EQ(l.last_stage(), s == 2);
    EXPECT_EQ(l.in_flight(), 3 - s);
    EXPECT_EQ(l.tied_across_stages(c), s != 1);
  }
  l.training = false;
  EXPECT_EQ(l.in_flight(), 1);
  EXPECT_FALSE(l.tied_across_stages(c));
  // pp 1: the whole model, one stage.
  const MemoryLayout whole = place_layout(c, layout());
  EXPECT_EQ(whole.stage().layers(), 4);
  EXPECT_TRUE(whole.stage().embedding && whole.stage().head);
  EXPECT_FALSE(whole.tied_across_stages(c));
  EXPECT_NE(testing_util::error_of([&] { place_layout(c, layout(1, 5)); }).find("option 'pp'"), std::string::npos);
}

}  // namespace
}  // namespace tuna
