// The parts of the memory model that both backends share (model/memory_plan.h). The backends' plans live in
// model/memory_plan_cpu.cpp and model/memory_plan_gpu.cpp.
#include "model/memory_plan.h"

#include <algorithm>

#include "core/error.h"

namespace tuna {

Recompute parse_recompute(const std::string& text, const std::string& source) {
  if (text == "none") return Recompute::None;
  if (text == "selective") return Recompute::Selective;
  if (text == "full") return Recompute::Full;
  fail(source, ": expected none, selective or full, found '", text, "'");
}

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::None: return "none";
    case Recompute::Selective: return "selective";
    case Recompute::Full: return "full";
  }
  return "?";
}

const char* memory_kind_name(MemoryKind k) {
  switch (k) {
    case MemoryKind::Weights: return "weights";
    case MemoryKind::Gradients: return "gradients";
    case MemoryKind::Master: return "master weights";
    case MemoryKind::Moments: return "AdamW moments";
    case MemoryKind::Activations: return "activations";
    case MemoryKind::Communication: return "communication buffers";
    case MemoryKind::Workspace: return "workspace";
    case MemoryKind::Transient: return "transient";
  }
  return "?";
}

int64_t MemoryPlan::total() const {
  int64_t sum = 0;
  for (const MemoryItem& i : items)
    if (i.kind != MemoryKind::Transient) sum += i.bytes;
  return sum;
}

int64_t MemoryPlan::peak() const {
  int64_t largest = 0;
  for (const MemoryItem& i : items)
    if (i.kind == MemoryKind::Transient) largest = std::max(largest, i.bytes);
  return total() + largest;
}

int64_t MemoryPlan::bytes(MemoryKind kind) const {
  int64_t sum = 0;
  for (const MemoryItem& i : items)
    if (i.kind == kind) sum += i.bytes;
  return sum;
}

}  // namespace tuna
