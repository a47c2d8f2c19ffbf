// Which implementation serves attention's head dims 64 and 128 on the GPU (kernels/attention.cuh), in plain
// C++: the launchers choose by it, and the scratch sizes of kernels/scratch.h (which the memory plan uses in
// every build) follow it, so the plan and the allocation agree on either path.
//   mma:    FlashAttention-2 style (mma.sync, cp.async; sm_80 and later). The default.
//   hopper: FlashAttention-3 style (wgmma, TMA, warp specialisation; sm_90a only).
// The process default comes from the environment, TUNA_ATTENTION=mma|hopper, read once.
#pragma once

#include <cstdlib>
#include <string>

#include "core/error.h"

namespace tuna {

enum class AttentionPath {
  kDefault,  // the process default (TUNA_ATTENTION; unset: mma, or hopper on sm_90 once kHopperByDefault is set)
  kMma,
  kHopper,
};

// The one switch to flip once a GPU run of scripts/gpu-check.sh has passed the hopper path's tests (and its
// speed is right): then TUNA_ATTENTION unset means hopper on sm_90 devices, mma elsewhere.
constexpr bool kHopperByDefault = false;

// What TUNA_ATTENTION asks for: kMma, kHopper, or kDefault when unset or empty; any other value is an error.
inline AttentionPath attention_path_requested() {
  static const AttentionPath requested = [] {
    const char* value = std::getenv("TUNA_ATTENTION");
    if (value == nullptr || *value == '\0') return AttentionPath::kDefault;
    const std::string name = value;
    if (name == "mma") return AttentionPath::kMma;
    if (name == "hopper") return AttentionPath::kHopper;
    fail("environment variable TUNA_ATTENTION: expected 'mma' or 'hopper', found '", name, "'");
  }();
  return requested;
}

// Whether `path` may turn out to be hopper, before the device is known (kDefault: what TUNA_ATTENTION asks, or
// kHopperByDefault when it asks nothing).
inline bool attention_hopper_possible(AttentionPath path) {
  if (path == AttentionPath::kDefault) path = attention_path_requested();
  return path == AttentionPath::kHopper || (path == AttentionPath::kDefault && kHopperByDefault);
}

}  // namespace tuna
