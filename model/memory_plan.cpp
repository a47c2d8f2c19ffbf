// The parts of the memory model that both backends share (model/memory_plan.h). The backends' plans live in
// model/memory_plan_cpu.cpp and model/memory_plan_gpu.cpp.
#include "model/memory_plan.h"

#include <algorithm>
#include <cstdio>

#include "core/error.h"
#include "core/progress.h"

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

std::string format_memory_plan(const MemoryPlan& plan, const std::string& indent) {
  size_t name_width = 0;
  for (const MemoryItem& i : plan.items) name_width = std::max(name_width, i.name.size());
  std::string out;
  const MemoryItem* largest = nullptr;
  for (const MemoryItem& i : plan.items) {
    char line[512];
    std::snprintf(line, sizeof line, "%s%-*s %10s  %s\n", indent.c_str(), static_cast<int>(name_width), i.name.c_str(),
                  human_bytes(static_cast<double>(i.bytes)).c_str(), memory_kind_name(i.kind));
    out += line;
    if (i.kind == MemoryKind::Transient && (!largest || i.bytes > largest->bytes)) largest = &i;
  }
  out += str(indent, "total ", human_bytes(static_cast<double>(plan.total())), "; peak ",
             human_bytes(static_cast<double>(plan.peak())));
  if (largest) out += str(" (with ", largest->name, ")");
  return out + "\n";
}

nlohmann::json memory_plan_json(const MemoryPlan& plan) {
  nlohmann::json items = nlohmann::json::array();
  for (const MemoryItem& i : plan.items)
    items.push_back({{"name", i.name}, {"kind", memory_kind_name(i.kind)}, {"bytes", i.bytes}});
  return {{"items", items}, {"total", plan.total()}, {"peak", plan.peak()}};
}

}  // namespace tuna
