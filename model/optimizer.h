// AdamW over the flat parameter buffer, global gradient-norm clipping, and learning-rate schedules.
//
// The update is torch.optim.AdamW's, with weight decay only on tensors ParamLayout marks as decaying
// (2-D weights), and clipping as torch.nn.utils.clip_grad_norm_ (coefficient max_norm / (norm + 1e-6),
// capped at 1). Moments are fp32, in the same layout as the parameters, so ZeRO can shard all three
// buffers with the same ranges.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/layout.h"

namespace tuna {

struct OptimizerConfig {
  double lr = 3e-4;                // peak learning rate
  double min_lr = 3e-5;            // floor of the decaying schedules
  int64_t warmup_steps = 0;        // linear from lr/warmup to lr over these steps
  std::string schedule = "cosine";  // cosine | linear | constant | wsd
  double decay_fraction = 0.2;     // wsd: the last fraction of steps decays linearly to min_lr
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;          // max global gradient norm; 0 disables clipping
};

// Learning rate of the update with 0-based index `step` out of `total_steps`.
// Warmup: lr * (step + 1) / warmup_steps. Then, with progress p from 0 to 1 over the remaining steps:
// cosine: min_lr + (lr - min_lr) (1 + cos(pi p)) / 2;  linear: lr + (min_lr - lr) p;  constant: lr;
// wsd (warmup-stable-decay): lr until the last decay_fraction of steps, then linear to min_lr.
double learning_rate(const OptimizerConfig& config, int64_t step, int64_t total_steps);

// Refuses an unknown schedule or nonsensical values, naming the option.
void validate(const OptimizerConfig& config);
// What a run of total_steps does with a schedule that cannot complete in it (warmup_steps >= total_steps: the
// learning rate never reaches lr and never decays), as a warning with the peak it does reach; empty when fine.
std::string schedule_warning(const OptimizerConfig& config, int64_t total_steps);

struct OptimizerStats {
  double grad_norm = 0;    // global L2 norm of the (loss-scaled) gradient, before clipping
  double clip_scale = 1;   // factor applied by clipping (1 when not clipped)
  bool applied = true;     // false: the step's loss or gradient norm was not finite, so nothing was updated
};

// Whether a step may update the weights: its loss (when it trained any token) and its global gradient norm are
// finite. A NaN or inf update would poison every weight and every later step; such a step is skipped instead
// (AdamW's update count does not advance), and the trainer counts the skips (--max_bad_steps). Every rank
// decides alike: the loss and the norm are global.
bool step_is_finite(double loss, int64_t tokens, double grad_norm);

// A run [begin, begin + size) of the flat layout. A sharded optimizer (ZeRO) owns a list of them and keeps
// its state for their concatenation ("shard order").
struct Segment {
  int64_t begin = 0, size = 0;
};

// One piece of a rank's checkpoint state: piece `index` of its segments, the fp32 master weights and AdamW
// moments (segments[index].size elements each). Engines hand them out (export) or take them in (import) a piece
// at a time, in segment order, so that no rank holds its whole shard twice on the host (engine/engine.h).
using StateSink = std::function<void(size_t index, const float* params, const float* m, const float* v)>;
using StateSource = std::function<void(size_t index, float* params, float* m, float* v)>;
// Runs an export: calls the sink once per segment, in order (Engine::export_state bound to its engine).
using StateExport = std::function<void(const StateSink& sink)>;
using StateImport = std::function<void(const StateSource& source)>;

// The intersection of one owned segment with one tensor: where it sits in shard order and in the flat layout.
struct ShardPiece {
  int64_t shard_offset, flat_offset, size;
  const ParamTensor* tensor;
};
// Every non-empty intersection of `segments` (shard order) with the tensors of `layout`, in shard order: what a
// sharded optimizer needs to know which decay and which tp split applies to each element it owns.
std::vector<ShardPiece> shard_pieces(const ParamLayout& layout, const std::vector<Segment>& segments);

// This rank's piece of every unit (shard_range of the unit over dp_size), in unit order: the segments every
// stage shards state by (and stage 0 spreads checkpoint writes by).
std::vector<Segment> dp_unit_pieces(const ParamLayout& layout, int dp_rank, int dp_size);

// How a sharded optimizer's caller lays out params or grads: Shard, the owned elements concatenated (shard
// order); Flat, the whole flat layout, of which the owned elements are read and written in place (a CPU ZeRO-1
// or -2 rank's fp32 model weights are its master weights, so it keeps no second copy of its shard).
enum class BufferOrder { Shard, Flat };

// Clipping's factor for a global gradient norm: min(1, grad_clip / (norm + 1e-6)); 1 when clipping is off.
double clip_scale(const OptimizerConfig& config, double grad_norm);

class AdamW {
 public:
  // Owns the whole layout (single rank, ZeRO-0).
  AdamW(const ParamLayout& layout, const OptimizerConfig& config);
  // Owns these segments (ZeRO-1/2/3): m and v hold their concatenation.
  AdamW(const ParamLayout& layout, const OptimizerConfig& config, std::vector<Segment> segments);

  // Whole layout: grads hold gradients of the summed loss; loss_scale (1 / trained tokens) turns them into
  // the mean's; the norm, the clip and the update in one call (no update when the norm is not finite).
  OptimizerStats step(float* params, const float* grads, double loss_scale, double lr);

  // Sharded use, params and grads in shard order; the caller reduces the norm across ranks.
  // Sum of squares of the owned gradient; tensors replicated across tensor-parallel ranks (norm weights)
  // count only when count_replicated (on tp rank 0), so the tp sum counts them once.
  double grad_sum_of_squares(const float* grads, bool count_replicated, BufferOrder grads_order = BufferOrder::Shard) const;
  // One AdamW update of the owned elements with gradient grads * grad_scale.
  void update(float* params, const float* grads, double grad_scale, double lr,
              BufferOrder params_order = BufferOrder::Shard, BufferOrder grads_order = BufferOrder::Shard);

  const OptimizerConfig& config() const { return config_; }
  const std::vector<Segment>& segments() const { return segments_; }
  int64_t size() const { return static_cast<int64_t>(m.size()); }  // owned elements
  std::vector<float> m, v;  // first and second moments, shard order (ParamLayout order when unsharded)
  int64_t steps_taken = 0;  // updates applied so far (AdamW's t after the update)

 private:
  const ParamLayout& layout_;
  OptimizerConfig config_;
  std::vector<Segment> segments_;
  std::vector<ShardPiece> pieces_;
};

}  // namespace tuna
