// Helpers of the engine tests (tests/engine/test_engine.cpp on the CPU, test_engine_gpu.cpp on a GPU): a
// single-rank mesh, engine options and starting weights from a transformers fixture, and one training step.
#pragma once

#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "comm/comm.h"
#include "ckpt/checkpoint.h"
#include "ckpt/safetensors.h"
#include "engine/engine.h"
#include "tests/model/fixture.h"

namespace tuna::testing_util {

// One rank: the world, and the mesh over it (dp = tp = 1).
struct SingleRank {
  std::unique_ptr<Comm> world = make_single_comm();
  Mesh mesh = make_mesh(*world, 1);
};

// The fixture's batch and optimizer on `device`, ZeRO stage `zero`.
inline EngineOptions engine_options(const Fixture& f, Device device, int zero = 0) {
  EngineOptions o;
  o.device = device;
  o.micro_batch = f.batch, o.seq_len = f.seq, o.opt = f.optimizer(), o.zero = zero;
  return o;
}

// The fixture's starting adapters (PEFT names), a piece at a time as the engine asks; under tensor parallelism each
// tensor's block of this rank (the layout's tp split of the file's whole tensor).
inline WeightFill adapters_from(const std::filesystem::path& file) {
  return [file](const ParamLayout& layout, const Segment& piece, float* out) {
    const SafetensorsFile adapters(file);
    for (const ParamTensor& t : layout.tensors()) {
      const int64_t lo = std::max(piece.begin, t.offset), hi = std::min(piece.begin + piece.size, t.offset + t.numel);
      if (lo >= hi) continue;
      int64_t global = 1;
      for (int64_t d : t.global_shape) global *= d;
      std::vector<float> whole(global), block(t.numel);
      adapters.read_f32(t.name, t.global_shape, whole.data());
      copy_block(t, whole.data(), block.data());
      std::copy(block.begin() + (lo - t.offset), block.begin() + (hi - t.offset), out + (lo - piece.begin));
    }
  };
}

// The fixture's weights (the transformers model it was made from).
inline WeightFill fixture_weights(const Fixture& f) {
  return weights_from_directory(f.dir);
}

// Step s of `steps` on the fixture's batch, at the schedule's learning rate.
inline StepResult train_step(Engine& e, const Fixture& f, int64_t s, int64_t steps) {
  e.begin_step();
  return e.finish_step(e.forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq),
                       learning_rate(f.optimizer(), s, steps));
}
// The same step with each row of the batch as a micro-batch of its own (accumulation).
inline StepResult train_step_by_rows(Engine& e, const Fixture& f, int64_t s, int64_t steps) {
  e.begin_step();
  LossSum sum;
  for (int64_t row = 0; row < f.batch; row++) {
    const LossSum l = e.forward_backward(f.inputs.data() + row * f.seq, f.targets.data() + row * f.seq, 1, f.seq);
    sum.sum += l.sum, sum.count += l.count;
  }
  return e.finish_step(sum, learning_rate(f.optimizer(), s, steps));
}

// On `device` at ZeRO stage `zero`: a step whose loss is NaN or infinite changes nothing (weights, moments, update
// count), and the next finite step equals that of an engine that never saw the bad one.
inline void expect_non_finite_steps_skipped(const Fixture& f, Device device, int zero) {
  SingleRank ra, rb;
  std::unique_ptr<Engine> a = make_engine(f.config, engine_options(f, device, zero), ra.mesh, fixture_weights(f));
  std::unique_ptr<Engine> b = make_engine(f.config, engine_options(f, device, zero), rb.mesh, fixture_weights(f));
  train_step(*a, f, 0, 10), train_step(*b, f, 0, 10);
  std::vector<float> p0, m0, v0, p1, m1, v1;
  a->export_shard(p0, m0, v0);
  for (double poison : {double(NAN), double(INFINITY)}) {
    a->begin_step();
    LossSum local = a->forward_backward(f.inputs.data(), f.targets.data(), f.batch, f.seq);
    local.sum = poison;
    EXPECT_FALSE(a->finish_step(local, 1e-3).stats.applied);
    EXPECT_EQ(a->steps_taken(), 1);
    a->export_shard(p1, m1, v1);
    EXPECT_EQ(p0, p1);
    EXPECT_EQ(m0, m1);
    EXPECT_EQ(v0, v1);
  }
  const StepResult sa = train_step(*a, f, 1, 10), sb = train_step(*b, f, 1, 10);
  EXPECT_TRUE(sa.stats.applied);
  EXPECT_EQ(sa.loss, sb.loss);
  a->export_shard(p0, m0, v0);
  b->export_shard(p1, m1, v1);
  EXPECT_EQ(p0, p1);
  EXPECT_EQ(m0, m1);
}

// Ranks as threads of this process (comm/comm_local.cpp): body(world) on `ranks` threads, each with its own
// world comm of one group. A rank's exception becomes a test failure naming the rank (the others then stop at
// their next collective within `timeout_s`).
inline void run_thread_ranks(int ranks, const std::function<void(Comm& world)>& body, double timeout_s = 120) {
  std::vector<std::unique_ptr<Comm>> worlds = make_local_comms(ranks, timeout_s);
  std::vector<std::string> errors(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; r++)
    threads.emplace_back([&, r] {
      try {
        body(*worlds[r]);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < ranks; r++)
    if (!errors[r].empty()) ADD_FAILURE() << "rank " << r << ": " << errors[r];
}

// Bytes of the host heap in use now (glibc: chunks of every arena and mmapped blocks): what a std::vector copy
// of a shard would add.
inline int64_t host_heap_in_use() {
  const struct mallinfo2 info = mallinfo2();
  return static_cast<int64_t>(info.uordblks + info.hblkhd);
}

// The relative L2 error of this rank's exported master weights against a one-rank run's: `whole` laid out by
// whole_layout, cut to this rank's tensor-parallel blocks (copy_block) and then to its ZeRO segments.
inline double shard_error_against_whole(const Engine& e, const ParamLayout& whole_layout, const float* whole) {
  std::vector<float> p, m, v, local(e.layout().total()), mine;
  e.export_shard(p, m, v);
  for (const ParamTensor& t : e.layout().tensors())
    copy_block(t, whole + whole_layout.find(t.name)->offset, local.data() + t.offset);
  for (const Segment& seg : e.segments())
    mine.insert(mine.end(), local.begin() + seg.begin, local.begin() + seg.begin + seg.size);
  EXPECT_EQ(p.size(), mine.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(p.size(), mine.size()); i++) {
    num += (double(p[i]) - mine[i]) * (double(p[i]) - mine[i]);
    den += double(mine[i]) * mine[i];
  }
  return std::sqrt(num / den);
}

// A checkpoint exchange of `from`'s state into `to` a piece at a time (Engine::export_state -> import_state), with
// the most host heap either engine held above its start while it handed out or asked for a piece: a whole-shard
// copy held meanwhile shows up there. The pieces must come in segment order, each of its segment's size; the
// state arrives bit for bit (`to` exports what `from` did).
struct StateExchange {
  int64_t shard_elements = 0, largest_piece = 0;
  int64_t export_heap_growth = 0, import_heap_growth = 0;  // bytes
};
inline StateExchange exchange_state_piecewise(const Engine& from, Engine& to) {
  StateExchange x;
  const std::vector<Segment>& segments = from.segments();
  std::vector<int64_t> at;
  for (const Segment& s : segments) at.push_back(x.shard_elements), x.shard_elements += s.size;
  for (const Segment& s : segments) x.largest_piece = std::max(x.largest_piece, s.size);
  // The test's own copy, made before the measurement starts.
  std::vector<float> p(x.shard_elements), m(x.shard_elements), v(x.shard_elements);
  size_t next = 0;
  int64_t base = host_heap_in_use();
  from.export_state([&](size_t i, const float* pi, const float* mi, const float* vi) {
    x.export_heap_growth = std::max(x.export_heap_growth, host_heap_in_use() - base);
    EXPECT_EQ(i, next++) << "pieces out of order";
    std::copy_n(pi, segments[i].size, p.data() + at[i]);
    std::copy_n(mi, segments[i].size, m.data() + at[i]);
    std::copy_n(vi, segments[i].size, v.data() + at[i]);
  });
  EXPECT_EQ(next, segments.size());
  next = 0;
  base = host_heap_in_use();
  to.import_state([&](size_t i, float* pi, float* mi, float* vi) {
    x.import_heap_growth = std::max(x.import_heap_growth, host_heap_in_use() - base);
    EXPECT_EQ(i, next++) << "pieces out of order";
    std::copy_n(p.data() + at[i], segments[i].size, pi);
    std::copy_n(m.data() + at[i], segments[i].size, mi);
    std::copy_n(v.data() + at[i], segments[i].size, vi);
  });
  EXPECT_EQ(next, segments.size());
  to.set_steps_taken(from.steps_taken());
  std::vector<float> p2, m2, v2;
  to.export_shard(p2, m2, v2);
  EXPECT_EQ(p2, p);
  EXPECT_EQ(m2, m);
  EXPECT_EQ(v2, v);
  return x;
}

// `e` step by step against `ref` (the same run at another ZeRO stage, or without one): two steps of equal losses and
// norms, then equal exported state and validation loss on the fixture's first row, then a third step of both and of
// `restored` (a fresh engine of e's layout given e's state first) with equal losses and norms: all bit for bit.
inline void expect_steps_and_restore_bit_equal(Engine& ref, Engine& e, Engine& restored, const Fixture& f,
                                               const std::function<StepResult(Engine&, int64_t)>& step) {
  for (int64_t s = 0; s < 2; s++) {
    const StepResult a = step(ref, s), b = step(e, s);
    EXPECT_EQ(a.loss, b.loss) << "step " << s;
    EXPECT_EQ(a.stats.grad_norm, b.stats.grad_norm) << "step " << s;
  }
  std::vector<float> pa, ma, va, pb, mb, vb;
  ref.export_shard(pa, ma, va);
  e.export_shard(pb, mb, vb);
  EXPECT_EQ(pa, pb);
  EXPECT_EQ(ma, mb);
  EXPECT_EQ(va, vb);
  // Validation between steps reads the same weights.
  EXPECT_EQ(ref.forward_loss(f.inputs.data(), f.targets.data(), 1, f.seq).sum,
            e.forward_loss(f.inputs.data(), f.targets.data(), 1, f.seq).sum);
  restored.import_shard(pb, mb, vb);
  restored.set_steps_taken(e.steps_taken());
  const StepResult a = step(ref, 2), b = step(e, 2), c = step(restored, 2);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(b.loss, c.loss);
  EXPECT_EQ(b.stats.grad_norm, c.stats.grad_norm);
}

// A model of many small units (16 layers of the fixture's shape), so that one piece is a small part of a shard.
inline LlamaConfig many_layers(const Fixture& f) {
  LlamaConfig c = f.config;
  c.num_hidden_layers = 16;
  return c;
}

}  // namespace tuna::testing_util
