// The parts of the memory model that both backends share (model/memory_plan.h). The backends' plans live in
// model/memory_plan_cpu.cpp and model/memory_plan_gpu.cpp.
#include "model/memory_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include "core/error.h"

namespace tuna {

MemoryLayout single_rank_layout(int64_t micro_batch, int64_t seq_len, bool training) {
  MemoryLayout l;
  l.micro_batch = micro_batch, l.seq_len = seq_len, l.training = training;
  return l;
}

const PipelineStage& MemoryLayout::stage() const {
  TUNA_CHECK(static_cast<int64_t>(stages.size()) == pp && pp_rank >= 0 && pp_rank < pp,
             "a layout placed for ", stages.size(), " pipeline stages (place_layout) asked for stage ", pp_rank, " of ", pp);
  return stages[static_cast<size_t>(pp_rank)];
}

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

int64_t device_arena_bytes(int64_t bytes) { return (bytes + 255) / 256 * 256; }

std::string format_bytes(int64_t bytes) {
  char buf[32];
  if (std::abs(bytes) >= 1000000000) std::snprintf(buf, sizeof buf, "%.2f GB", bytes / 1e9);
  else std::snprintf(buf, sizeof buf, "%.1f MB", bytes / 1e6);
  return buf;
}

std::string format_memory_table(const MemoryPlan& plan, int64_t capacity_bytes, const std::string& title,
                                int64_t headroom_bytes) {
  // Per kind: the sum, how many buffers, and the largest one (what to shrink first).
  struct Row {
    int64_t bytes = 0, count = 0;
    const MemoryItem* largest = nullptr;
  };
  std::map<MemoryKind, Row> rows;
  for (const MemoryItem& i : plan.items) {
    Row& r = rows[i.kind];
    r.bytes += i.bytes, r.count++;
    if (!r.largest || i.bytes > r.largest->bytes) r.largest = &i;
  }
  std::string out = title + "\n";
  char line[256];
  for (const auto& [kind, r] : rows) {
    std::snprintf(line, sizeof line, "  %-22s %12s  (%lld buffer%s; largest: %s, %s)\n", memory_kind_name(kind),
                  format_bytes(r.bytes).c_str(), static_cast<long long>(r.count), r.count == 1 ? "" : "s",
                  r.largest->name.c_str(), format_bytes(r.largest->bytes).c_str());
    out += line;
  }
  std::snprintf(line, sizeof line, "  %-22s %12s\n", "total", format_bytes(plan.total()).c_str());
  out += line;
  if (plan.peak() != plan.total()) {
    std::snprintf(line, sizeof line, "  %-22s %12s  (total + the largest transient)\n", "peak",
                  format_bytes(plan.peak()).c_str());
    out += line;
  }
  if (capacity_bytes > 0) {
    if (headroom_bytes > 0) {
      std::snprintf(line, sizeof line, "  %-22s %12s  (CUDA context, cuBLASLt, NCCL: an allowance)\n", "headroom",
                    format_bytes(headroom_bytes).c_str());
      out += line;
    }
    std::snprintf(line, sizeof line, "  %-22s %12s  (%s left)\n", "device capacity", format_bytes(capacity_bytes).c_str(),
                  format_bytes(capacity_bytes - plan.peak() - headroom_bytes).c_str());
    out += line;
  }
  return out;
}

nlohmann::json memory_plan_json(const MemoryPlan& plan) {
  nlohmann::json items = nlohmann::json::array();
  for (const MemoryItem& i : plan.items)
    items.push_back({{"name", i.name}, {"kind", memory_kind_name(i.kind)}, {"bytes", i.bytes}});
  return {{"items", items}, {"total", plan.total()}, {"peak", plan.peak()}};
}

}  // namespace tuna
