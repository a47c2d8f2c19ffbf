// model/quantized_weights: the CPU model over a quantized base (NF4, int8) computes exactly what the same model
// computes with the dequantized weights in its own params (logits and loss, untied and tied embeddings, GQA); the
// base takes ~0.52 (NF4) or ~1 (int8) bytes a quantized parameter; it refuses gradients, fp16 bases and unknown
// option values.
#include <gtest/gtest.h>

#include <bit>
#include <cstring>

#include "kernels/cpu/int8_rowwise.h"
#include "kernels/cpu/nf4.h"
#include "model/llama.h"
#include "model/quantized_weights.h"
#include "tests/kernels/op_test_util.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

LlamaConfig small_config(bool tied) {
  LlamaConfig c;
  c.hidden_size = 128, c.intermediate_size = 352, c.num_hidden_layers = 3;
  c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 32;
  c.vocab_size = 96, c.rms_norm_eps = 1e-5, c.tie_word_embeddings = tied;
  return c;
}

// The fill a run would pass (engine.h's random_weights), counting the largest piece asked for.
BaseFill random_fill(uint64_t seed, int64_t* largest_piece) {
  return [seed, largest_piece](const ParamLayout& layout, const Segment& piece, float* out) {
    *largest_piece = std::max(*largest_piece, piece.size);
    init_random_weights_piece(layout, seed, 0.05, piece, out);
  };
}

void check_model_over_quantized_base(BaseQuant quant, bool tied) {
  test::TestRng rng;
  SCOPED_TRACE(rng.describe());
  const LlamaConfig config = small_config(tied);
  const int64_t batch = 2, seq = 24;
  const uint64_t seed = static_cast<uint64_t>(rng.integer(1, 1 << 30));
  int64_t largest_piece = 0;

  Llama quantized(config, batch, seq, LlamaParallel{.external_weights = true});
  QuantizedWeights store(quantized.layout(), quant, random_fill(seed, &largest_piece));
  quantized.set_weight_store(&store);
  const ParamLayout& layout = quantized.layout();
  // Filled a unit at a time: never more than the largest unit in one piece.
  int64_t largest_unit = 0;
  for (int u = 0; u < layout.num_units(); ++u)
    largest_unit = std::max(largest_unit, layout.unit_range(u).second - layout.unit_range(u).first);
  EXPECT_LE(largest_piece, largest_unit);
  EXPECT_LT(largest_piece, layout.total());

  // The reference: the same weights, each projection quantized and dequantized here, held in params.
  Llama reference(config, batch, seq);
  init_random_weights(layout, seed, 0.05, reference.params.data());
  const std::vector<float> original = reference.params;
  int64_t projections = 0;
  for (const ParamTensor& t : layout.tensors()) {
    if (t.layer < 0 || t.shape.size() != 2) continue;
    ++projections;
    float* w = reference.params.data() + t.offset;
    if (quant == BaseQuant::Nf4) {
      const cpu::Nf4Sizes s = cpu::nf4_sizes(t.numel);
      std::vector<uint8_t> packed(s.packed_bytes), q(s.blocks);
      std::vector<float> a2(s.stat_blocks), scratch(s.blocks);
      float offset = 0;
      cpu::nf4_quantize(w, t.numel, packed.data(), q.data(), a2.data(), &offset, scratch.data(), t.name.c_str());
      cpu::nf4_dequantize(cpu::Nf4Tensor{t.numel, packed.data(), q.data(), a2.data(), offset}, w);
      ASSERT_EQ(std::memcmp(store.nf4(t.name).packed, packed.data(), packed.size()), 0) << t.name;
    } else {
      std::vector<int8_t> q(t.numel);
      std::vector<float> scale(t.shape[0]);
      cpu::int8_rowwise_quantize(w, t.shape[0], t.shape[1], q.data(), scale.data(), t.name.c_str());
      cpu::int8_rowwise_dequantize(q.data(), scale.data(), t.shape[0], t.shape[1], w);
      ASSERT_EQ(std::memcmp(store.int8(t.name).q, q.data(), q.size()), 0) << t.name;
    }
  }
  EXPECT_EQ(projections, 7 * config.num_hidden_layers);
  EXPECT_GT(test::rel_error_norm(reference.params, original), 1e-3);  // the projections did change

  std::vector<int32_t> inputs(batch * seq), targets(batch * seq);
  for (int64_t i = 0; i < batch * seq; ++i)
    inputs[i] = static_cast<int32_t>(rng.integer(0, config.vocab_size - 1)),
    targets[i] = static_cast<int32_t>(rng.integer(0, config.vocab_size - 1));
  std::vector<float> logits_q(batch * seq * config.vocab_size), logits_ref(logits_q.size());
  for (int pass = 0; pass < 2; ++pass) {  // twice: the second pass starts from the buffer the first left
    quantized.forward_logits(inputs.data(), batch, seq, logits_q.data());
    reference.forward_logits(inputs.data(), batch, seq, logits_ref.data());
    ASSERT_EQ(std::memcmp(logits_q.data(), logits_ref.data(), logits_q.size() * sizeof(float)), 0) << "pass " << pass;
  }
  const LossSum loss_q = quantized.forward_loss(inputs.data(), targets.data(), batch, seq);
  const LossSum loss_ref = reference.forward_loss(inputs.data(), targets.data(), batch, seq);
  EXPECT_EQ(std::bit_cast<uint64_t>(loss_q.sum), std::bit_cast<uint64_t>(loss_ref.sum));
  EXPECT_EQ(loss_q.count, loss_ref.count);

  // Memory: NF4 ~0.52 bytes a quantized parameter (0.5 + 1/64 + 4/16384, and 4 bytes a tensor), int8 1 + 4/cols
  // (cols 128 or 352 here); the rest fp32.
  const QuantizedBaseBytes& b = store.bytes();
  EXPECT_EQ(b.quantized_params + b.fp32_params, layout.total());
  const double per_param = static_cast<double>(b.quantized) / static_cast<double>(b.quantized_params);
  const double least = quant == BaseQuant::Nf4 ? 0.5 + 1.0 / 64 : 1 + 4.0 / 352;
  EXPECT_GT(per_param, least);
  EXPECT_LT(per_param, quant == BaseQuant::Nf4 ? least + 0.002 : 1 + 4.0 / 128);
  const QuantizedBaseBytes planned = quantized_base_bytes(layout, quant);
  EXPECT_EQ(planned.total(), b.total());
  EXPECT_EQ(b.buffer, 4 * (layout.layer_range(0).second - layout.layer_range(0).first));

  // A frozen base has no gradient.
  const std::string e = testing_util::error_of([&] { store.grads(1); });
  EXPECT_NE(e.find("no gradient"), std::string::npos) << e;
  const std::string e2 = testing_util::error_of(
      [&] { quantized.forward_backward(inputs.data(), targets.data(), batch, seq); });
  EXPECT_NE(e2.find("frozen"), std::string::npos) << e2;
}

TEST(QuantizedWeights, ModelOverNf4BaseEqualsDequantizedParams) { check_model_over_quantized_base(BaseQuant::Nf4, false); }
TEST(QuantizedWeights, ModelOverNf4BaseEqualsDequantizedParamsTied) { check_model_over_quantized_base(BaseQuant::Nf4, true); }
TEST(QuantizedWeights, ModelOverInt8BaseEqualsDequantizedParams) { check_model_over_quantized_base(BaseQuant::Int8, false); }

// dequantized_base_fill (what eval, sample and the exports read a QLoRA checkpoint's base through) gives what the store
// dequantizes, bit for bit, whatever the pieces: whole units, or cuts through the middle of a projection (that tensor is
// read whole and quantized whole, as the store did).
TEST(QuantizedWeights, DequantizedFillIsTheStoresWeightsInAnyPieces) {
  for (BaseQuant quant : {BaseQuant::Nf4, BaseQuant::Int8}) {
    const LlamaConfig config = small_config(false);
    const ParamLayout layout(config);
    int64_t unused = 0;
    const BaseFill base = random_fill(5, &unused);
    QuantizedWeights store(layout, quant, base);
    std::vector<float> expected(layout.total());
    for (int u = 0; u < layout.num_units(); ++u) {
      const auto [begin, end] = layout.unit_range(u);
      std::copy_n(store.acquire(u), end - begin, expected.data() + begin);
      store.release(u);
    }
    const BaseFill fill = dequantized_base_fill(base, quant);
    for (int64_t piece : {layout.total(), int64_t{1000}, int64_t{4093}}) {
      std::vector<float> got(layout.total());
      for (int64_t at = 0; at < layout.total(); at += piece)
        fill(layout, Segment{at, std::min(piece, layout.total() - at)}, got.data() + at);
      EXPECT_EQ(std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)), 0)
          << base_quant_name(quant) << ", pieces of " << piece;
    }
  }
}

// Under tp each rank's base dequantizes to its block of one rank's, bit for bit, with splits that do not align with
// the 64-element blocks (down_proj: 176 columns a rank, o_proj at tp 4: 32) or the 256-block statistics (gate_proj's
// second half starts at block 352), and the fill is asked for the whole model's layout only. The quantized bytes are
// the block's share plus the blocks a split shares and the whole tensor's second-level statistics.
TEST(QuantizedWeights, TensorParallelBlocksDequantizeToOneRanksValues) {
  for (bool tied : {false, true})
  for (BaseQuant quant : {BaseQuant::Nf4, BaseQuant::Int8}) {
    LlamaConfig config = small_config(tied);
    config.num_key_value_heads = 4;  // tp 4 divides them
    const ParamLayout whole(config);
    int64_t unused = 0;
    const BaseFill base = random_fill(9, &unused);
    QuantizedWeights one(whole, quant, base);
    std::vector<float> want(whole.total());
    for (int u = 0; u < whole.num_units(); ++u) {
      const auto [begin, end] = whole.unit_range(u);
      std::copy_n(one.acquire(u), end - begin, want.data() + begin);
      one.release(u);
    }
    for (int tp : {2, 4}) {
      int64_t quantized = 0;
      for (int rank = 0; rank < tp; ++rank) {
        SCOPED_TRACE(std::string(base_quant_name(quant)) + (tied ? " tied" : "") + " tp " + std::to_string(tp) +
                     " rank " + std::to_string(rank));
        const ParamLayout local(config, rank, tp);
        bool only_whole = true;
        QuantizedWeights store(local, quant, [&](const ParamLayout& l, const Segment& piece, float* out) {
          only_whole = only_whole && l.tp().tp_size == 1 && l.total() == whole.total();
          base(l, piece, out);
        }, &whole);
        EXPECT_TRUE(only_whole);
        for (int u = 0; u < local.num_units(); ++u) {
          const float* got = store.acquire(u);
          const int64_t begin = local.unit_range(u).first;
          for (const ParamTensor& t : local.tensors()) {
            if (t.offset < begin || t.offset >= local.unit_range(u).second) continue;
            std::vector<float> block(t.numel);
            copy_block(t, want.data() + whole.find(t.name)->offset, block.data());
            ASSERT_EQ(std::memcmp(got + (t.offset - begin), block.data(), t.numel * sizeof(float)), 0) << t.name;
          }
          store.release(u);
        }
        EXPECT_EQ(quantized_base_bytes(local, quant).total(), store.bytes().total());
        quantized += store.bytes().quantized;
        if (quant == BaseQuant::Nf4) {
          const std::string e = testing_util::error_of([&] { store.nf4("model.layers.0.self_attn.q_proj.weight"); });
          EXPECT_NE(e.find("is a tp block"), std::string::npos) << e;
        }
      }
      // The ranks together hold one rank's bytes and what they repeat: int8 the row-parallel blocks' scales (each
      // rank keeps every row's), NF4 the whole tensors' second-level statistics and, for a split that does not
      // align, one shared 64-element absmax per row; a few percent at these widths (of 128 and 352).
      EXPECT_GE(quantized, one.bytes().quantized);
      EXPECT_LT(quantized, one.bytes().quantized * (1 + 0.02 * tp)) << tp;
    }
  }
}

TEST(QuantizedWeights, BadInputIsAClearError) {
  EXPECT_EQ(parse_base_quant("nf4", "option 'base_quant'"), BaseQuant::Nf4);
  EXPECT_EQ(parse_base_quant("none", "option 'base_quant'"), BaseQuant::None);
  EXPECT_EQ(parse_base_quant("int8", "option 'base_quant'"), BaseQuant::Int8);
  std::string e = testing_util::error_of([] { parse_base_quant("nf8", "option 'base_quant'"); });
  EXPECT_NE(e.find("option 'base_quant': expected none, nf4 or int8, found 'nf8'"), std::string::npos) << e;
  e = testing_util::error_of(
      [] { check_base_dtype_for_quant(BaseQuant::Nf4, DType::F16, "base/model.safetensors"); });
  EXPECT_NE(e.find("base/model.safetensors: --base_quant nf4 quantizes a base stored in BF16 or F32, found F16"),
            std::string::npos)
      << e;
  EXPECT_EQ(testing_util::error_of([] { check_base_dtype_for_quant(BaseQuant::Nf4, DType::BF16, "x"); }), "");
  EXPECT_EQ(testing_util::error_of([] { check_base_dtype_for_quant(BaseQuant::Nf4, DType::F32, "x"); }), "");
  EXPECT_EQ(testing_util::error_of([] { check_base_dtype_for_quant(BaseQuant::None, DType::F16, "x"); }), "");

  // A non-finite weight names its tensor.
  const LlamaConfig config = small_config(false);
  const ParamLayout layout(config);
  const ParamTensor* up = layout.find("model.layers.1.mlp.up_proj.weight");
  ASSERT_NE(up, nullptr);
  e = testing_util::error_of([&] {
    QuantizedWeights store(layout, BaseQuant::Nf4, [&](const ParamLayout& l, const Segment& piece, float* out) {
      init_random_weights_piece(l, 1, 0.05, piece, out);
      const int64_t bad = up->offset + 5;
      if (bad >= piece.begin && bad < piece.begin + piece.size) out[bad - piece.begin] = INFINITY;
    });
  });
  EXPECT_NE(e.find("model.layers.1.mlp.up_proj.weight: element 5 is inf"), std::string::npos) << e;
}

}  // namespace
}  // namespace tuna
