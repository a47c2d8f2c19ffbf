// attention_span: the causal window length whose attention FLOPs equal those of documents under their masks.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "engine/step_record.h"
#include "model/config.h"

namespace tuna {
namespace {

std::vector<int32_t> documents(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> positions;
  for (int32_t length : lengths)
    for (int32_t p = 0; p < length; p++) positions.push_back(p);
  return positions;
}

TEST(AttentionSpan, AWholeWindowIsItsLength) {
  for (int32_t seq : {1, 7, 2048}) EXPECT_EQ(attention_span(documents({seq}).data(), seq), seq);
  EXPECT_EQ(attention_span(nullptr, 0), 0);
}

// The model FLOPs of the span, per token, times the tokens, equal the sum over documents of a causal window's
// each: attention is quadratic in a document's length, so the packed window costs less than one document would.
TEST(AttentionSpan, ModelFlopsEqualTheDocumentsOwn) {
  LlamaConfig c;
  c.hidden_size = 64, c.intermediate_size = 128, c.num_hidden_layers = 3, c.num_attention_heads = 4;
  c.num_key_value_heads = 2, c.head_dim = 16, c.vocab_size = 100, c.max_position_embeddings = 4096;
  const std::vector<int32_t> lengths = {512, 256, 1024, 256};  // 2048 tokens; spans whose mean 2p + 1 is exact
  const std::vector<int32_t> positions = documents(lengths);
  const int64_t n = int64_t(positions.size()), span = attention_span(positions.data(), n);
  EXPECT_EQ(span, (512 * 512 + 2 * 256 * 256 + 1024 * 1024) / 2048);  // the sum of L^2 over the tokens: 704
  double documents_flops = 0;
  for (int32_t length : lengths) documents_flops += double(length) * model_flops_per_token(c, length);
  EXPECT_DOUBLE_EQ(double(n) * model_flops_per_token(c, span), documents_flops);
  EXPECT_LT(span, n);
}

}  // namespace
}  // namespace tuna
