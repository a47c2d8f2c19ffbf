// ZeRO 0-3 on the GPU (ZeroGpu, at the end): the device state, the weight store and the update step that the CUDA
// engine (engine/engine_gpu.cpp) wires around LlamaGpu; the CPU's ZeRO is dist/zero.h. Only in CUDA builds
// (TUNA_CUDA).
//
// ZeRO-1 (OptimizerShard). The fp32 master weights and AdamW moments exist only for this rank's shard (its piece
// of every unit, dp_unit_pieces, in shard order), 12 bytes per parameter divided by dp instead of 12; the model
// keeps only its bf16 weights and fp32 gradients.
//
// ZeRO-2 and 3 (ShardedStore, the model's GpuWeightStore). No whole gradient exists: the backward writes each
// unit's gradient into one of a few unit-sized buffers (handed out fresh: the pass's first writes overwrite, so
// none is zeroed), and as soon as the unit's backward is done the buffer is reduce-scattered on a communication
// stream and this rank's piece written into the fp32 gradient shard on the step's first micro-batch, added to it
// on the others (sharded accumulation), while the compute stream goes on with the next unit. ZeRO-3 keeps
// only the bf16 weights of the shard: each unit is all-gathered into a rotating gather buffer on the
// communication stream just before the model uses it, the next unit of the pass gathered into the other buffer
// while this one computes (prefetch), in the forward and again in the backward. Events order the two streams
// (a buffer is regathered only after the compute that read it, and computed on only after its gather), so the
// host never waits inside the pass. The update runs over the shard and writes the shard's bf16 weights, which
// ZeRO-2 gathers whole after the step and ZeRO-3 gathers unit by unit in the next pass.
//
// With LoRA adapters both work over what trains, the adapters' layout (LlamaGpu::trained_layout(), a unit per
// layer), under the memory plan's "LoRA" names: ZeRO-1 and 2 as above, the frozen base whole in the model.
#pragma once

#if TUNA_CUDA

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "dist/zero.h"  // StepResult, sum_over_ranks
#include "kernels/adamw.cuh"  // AdamWSegments
#include "model/layout.h"
#include "model/gpu_options.h"
#include "model/llama_gpu.h"
#include "model/optimizer.h"  // Segment, ShardPiece, OptimizerConfig, StateSink

namespace tuna {

// ZeRO-1's state on the device: this rank's shard of the master weights, moments and reduced gradient, in
// shard order, and the fused AdamW's segment table for that order (which tensor, hence which decay, each
// element belongs to). One allocation, made at construction.
class OptimizerShard {
 public:
  // The buffers are the memory plan's "(shard)" items, in the model's arena; name_prefix "LoRA " takes the
  // adapters' (layout: LlamaGpu::trained_layout()).
  // with_bf16_weights (ZeRO-2 and 3): the update also writes the bf16 weights of the shard.
  OptimizerShard(DeviceArena& arena, const ParamLayout& layout, const std::vector<Segment>& segments,
                 bool bf16_moments, bool with_bf16_weights, const std::string& name_prefix = "");
  OptimizerShard(const OptimizerShard&) = delete;
  OptimizerShard& operator=(const OptimizerShard&) = delete;

  bool bf16_moments() const { return bf16_moments_; }
  cuda::AdamWSegments table() const { return {table_starts, table_decays, n_segments}; }

  std::vector<ShardPiece> pieces;  // the shard's pieces of each tensor (which are replicated over tp)
  int64_t size = 0, padded = 0;
  std::vector<int64_t> unit_offset;  // where unit u's piece starts in shard order
  float *master = nullptr, *grad = nullptr;
  void *m = nullptr, *v = nullptr;  // float, or __nv_bfloat16 with bf16 moments
  __nv_bfloat16* weights = nullptr;  // ZeRO-2 and 3: the bf16 weights of the shard
  int64_t* table_starts = nullptr;
  uint8_t* table_decays = nullptr;
  int n_segments = 0;
  double *norm_total = nullptr, *norm_scratch = nullptr, *replicated_norms = nullptr;

 private:
  bool bf16_moments_;
};

// ZeRO-3 with LoRA adapters: the frozen bf16 base's shard on the device, this rank's piece of every unit of the
// model's layout (dp_unit_pieces) in shard order, written once at the start (no gradient, no update); a
// ShardedStore gathers its units before use. The memory plan's "bf16 base weights (frozen, shard)".
struct FrozenShard {
  FrozenShard(DeviceArena& arena, const ParamLayout& layout, const std::vector<Segment>& segments);
  FrozenShard(const FrozenShard&) = delete;
  FrozenShard& operator=(const FrozenShard&) = delete;
  __nv_bfloat16* weights = nullptr;
  std::vector<int64_t> unit_offset;  // where unit u's piece starts
  int64_t size = 0;
};

// An event recorded on one stream and waited on by another: the only way the compute and communication streams
// order each other. Reusable: a wait takes the event's state at the time it is issued.
class StreamEvent {
 public:
  StreamEvent();
  ~StreamEvent();
  StreamEvent(StreamEvent&& other) noexcept : event_(other.event_) { other.event_ = nullptr; }
  StreamEvent(const StreamEvent&) = delete;
  StreamEvent& operator=(const StreamEvent&) = delete;
  void record(cudaStream_t on);
  void wait(cudaStream_t by) const;

 private:
  cudaEvent_t event_ = nullptr;
};

// `waiter` runs what it is given next only after what `producer` has been given so far.
void join(cudaStream_t waiter, cudaStream_t producer, StreamEvent& event);

// ZeRO-2 and 3's weights and gradients for the model, unit by unit (see the top of this file). Gathers,
// reduce-scatters and shard accumulation run on `comm_stream` (where the dp device comm enqueues; dp_device is
// null on one rank); the model computes on its own stream. Installs itself as the model's weight store.
// adapters (a model with LoRA adapters, ZeRO-2 only): the store of what trains, the adapters (trained_layout(), a
// unit per layer): their gradients a layer at a time and their whole bf16 copy gathered after each update, installed
// as the model's adapter gradient store; the frozen base stays the model's own.
class ShardedStore final : public GpuWeightStore {
 public:
  ShardedStore(LlamaGpu& model, OptimizerShard& shard, const std::vector<Segment>& segments, Comm* dp_device,
               cudaStream_t comm_stream, int stage, bool prefetch, bool adapters = false);
  // ZeRO-3 with adapters: the frozen base's units gathered from `base` as above (prefetch too), into the plan's
  // "base gather buffer"s; it has no gradient (grads() fails), and nothing updates it.
  ShardedStore(LlamaGpu& model, const FrozenShard& base, const std::vector<Segment>& segments, Comm* dp_device,
               cudaStream_t comm_stream, bool prefetch);

  // A step begins: the gradient shard holds nothing of it. Not zeroed: each unit's piece is written by the step's
  // first reduce-scatter of the unit (grads_done), on the comm stream, after what the compute stream did so far.
  void begin_step();
  // Every unit's gradient is in the shard: the compute stream may read it. A unit that no backward of the step
  // reached (a step without micro-batches) has a zero gradient.
  void gradients_ready();
  // The shard's bf16 weights were rewritten (an update, a restore) on the compute stream: ZeRO-2 gathers them
  // into the whole weights; ZeRO-3's gathered units are stale.
  void weights_updated();

  void plan(const std::vector<int>& order) override;
  const __nv_bfloat16* acquire(int unit) override;
  void release(int unit) override;
  // A buffer holds one unit for one pass, so it is always handed out fresh: the pass overwrites what an earlier
  // unit left in it (LlamaGpu::GradWrites), no memset.
  UnitGrads grads(int unit) override;
  void grads_done(int unit) override;

 private:
  struct Gathered {
    __nv_bfloat16* data = nullptr;
    int unit = -1;        // the unit it holds or receives (its gather is queued on the comm stream)
    bool in_use = false;  // acquired and not released
    StreamEvent ready, released;
  };
  struct Gradient {
    float* data = nullptr;
    int unit = -1;  // the unit whose gradient it collects; -1: free
    int64_t last_use = 0;
    StreamEvent filled, drained;
  };

  // The bf16 weights of `unit` from every rank's shard into dst, on the comm stream.
  void gather(int unit, __nv_bfloat16* dst, const char* what);
  void gather_into(Gathered& b, int unit);
  // Starts the gather of the unit the plan acquires next into a free buffer, unless it is there already.
  void prefetch_next();

  LlamaGpu& model_;
  const ParamLayout& layout_;
  __nv_bfloat16* whole_;  // ZeRO-2: the whole bf16 weights the shard's are gathered into
  OptimizerShard* shard_;  // null for the frozen base
  const __nv_bfloat16* shard_weights_;  // the bf16 shard ZeRO-3 gathers units from
  std::vector<int64_t> unit_offset_;    // where unit u's piece starts in shard order
  const std::vector<Segment>& segments_;
  Comm* dp_;
  cudaStream_t comm_, compute_;
  int stage_;
  bool prefetch_;
  int64_t max_unit_ = 0, uses_ = 0;
  float* scatter_out_ = nullptr;
  std::vector<Gathered> gathered_;
  std::vector<Gradient> gradients_;
  std::vector<bool> shard_written_;  // per unit: its piece of the shard holds this step's gradient
  StreamEvent compute_to_comm_, comm_to_compute_;
  std::vector<int> order_;
  size_t position_ = 0;
};

// ZeRO 0-3 of one rank on the GPU over the dp group: the CPU Zero's twin (dist/zero.h), around a LlamaGpu. It owns the
// shard (OptimizerShard), the stores (ShardedStore) and, with adapters at ZeRO-3, the frozen base's shard, and does the
// step's loss and gradient synchronization, the norm, the clip and the update, the first fill of the weights and the
// checkpoint exchange. The engine (engine/engine_gpu.cpp) makes the device comm over dp and hands it in.
//
// ZeRO-0. finish_step sums the loss over dp ranks (host comm), all-reduces the gradients on the device comm, then
// LlamaGpu::adamw_step takes the global norm, clips and updates. Every rank then holds the same gradients and applies
// the same update, so the weights stay identical without a broadcast. ZeRO 1-3: the update over the shard (see the top
// of this file). The clip norm is over the shards (squares summed over this rank's shard, then over dp, tp and the
// pipeline's stages). At one rank the shard is the whole layout in layout order, so every stage computes ZeRO-0's bits.
//
// Checkpoints: each dp rank writes its piece of every unit (segments(): dp_unit_pieces, as the CPU ZeRO-0 does), a
// piece at a time through one host buffer of the largest piece, so a rank never holds its shard on the host. Restoring
// uploads this rank's pieces into the (then unused) gradient buffer, all-gathers each unit on the device, and copies
// the result into the master weights and moments: no rank ever holds the whole state in host memory.
struct ZeroGpuOptions {
  int stage = 0;              // ZeRO stage, 0-3
  bool bf16_moments = false;  // AdamW moments in bf16
  bool prefetch = true;       // ZeRO-3: gather the next unit while this one computes
  OptimizerConfig opt;
  GpuOptions gpu;             // stochastic rounding and its seed
};

// Writes elements [piece.begin, piece.begin + piece.size) of `layout` into out (engine/engine.h WeightFill).
using LayoutFill = std::function<void(const ParamLayout& layout, const Segment& piece, float* out)>;

class ZeroGpu {
 public:
  // dp_device: the device comm over the dp group (null on one rank), enqueuing on comm_stream at ZeRO 2-3 (where the
  // shard accumulation runs too) and on the model's stream below. mesh: the host comms the loss and the norm are
  // summed over. Takes the shard's buffers from the model's arena.
  ZeroGpu(LlamaGpu& model, const ZeroGpuOptions& options, const Mesh& mesh, Comm* dp_device, cudaStream_t comm_stream);
  ZeroGpu(const ZeroGpu&) = delete;
  ZeroGpu& operator=(const ZeroGpu&) = delete;

  // This rank's piece of each unit of what trains (LlamaGpu::trained_layout()), in shard order.
  const std::vector<Segment>& segments() const { return segments_; }
  // Before a step's first micro-batch.
  void begin_step();
  // After its last: the loss over dp and the stages, gradient synchronization, norm, clip, AdamW, new bf16 weights.
  StepResult finish_step(const LossSum& local, double lr);
  // Over dp, then over the stages (the stages before the last add nothing), as Zero sums it on cpu.
  LossSum all_reduce_loss(const LossSum& local);
  // The starting weights a unit at a time (see fill_weights below); with adapters the frozen base from `initial` and
  // the adapters from `adapters`.
  void fill_weights(const LayoutFill& initial, const LayoutFill& adapters);
  // Checkpoint exchange a piece at a time, in segments() order (see above).
  void export_state(const StateSink& sink) const;
  void import_state(const StateSource& source);
  // AdamW updates so far; the bf16 weights are rewritten as the update at `steps` rounded them.
  void set_steps_taken(int64_t steps);

 private:
  OptimizerStats sharded_update(double loss_scale, double lr, bool loss_is_finite);
  void fill_base_and_adapters(const LayoutFill& base, const LayoutFill& adapters);
  void fill_base_shard(const LayoutFill& base);
  void refresh_shard_weights();
  void gather_master();

  LlamaGpu& model_;
  ZeroGpuOptions options_;
  const Mesh& mesh_;
  Comm* dp_device_;                        // null on one rank
  std::vector<Segment> segments_;
  std::unique_ptr<OptimizerShard> shard_;  // ZeRO 1-3's optimizer state; null for ZeRO-0
  std::unique_ptr<ShardedStore> store_;    // ZeRO-2/3's weights and gradients for the model (the adapters')
  std::vector<Segment> base_segments_;     // ZeRO-3 with adapters: this rank's piece of each unit of the base,
  std::unique_ptr<FrozenShard> base_shard_;  // their bf16 values,
  std::unique_ptr<ShardedStore> base_store_;  // and the store that gathers them for the model
};

}  // namespace tuna

#endif  // TUNA_CUDA
