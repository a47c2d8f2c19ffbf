// Which implementation serves attention's head dims 64 and 128 on the GPU (kernels/attention.cuh), in plain
// C++: the launchers choose by it, and the scratch sizes of kernels/scratch.h (which the memory plan uses in
// every build) follow it, so the plan and the allocation agree on either path.
//   mma:    FlashAttention-2 style (mma.sync, cp.async; sm_80 and later). What auto picks today.
//   hopper: FlashAttention-3 style (wgmma, TMA, warp specialisation; sm_90a only).
// The trainer's --attention option chooses (saved with the run like every option, so a resume runs the kernels
// the checkpoint's run used); no environment variable does.
#pragma once

#include <string>

#include "core/error.h"

namespace tuna {

enum class AttentionPath {
  kDefault,  // auto: hopper on sm_90 devices once kHopperByDefault is set, mma elsewhere
  kMma,
  kHopper,
};

// The one switch to flip once a GPU run of scripts/gpu-check.sh has passed the hopper path's tests (and its
// speed is right): then auto means hopper on sm_90 devices, mma elsewhere.
constexpr bool kHopperByDefault = false;

// The --attention option's words: auto, mma, hopper; anything else is an error naming `source`.
inline AttentionPath parse_attention_path(const std::string& name, const std::string& source) {
  if (name == "auto") return AttentionPath::kDefault;
  if (name == "mma") return AttentionPath::kMma;
  if (name == "hopper") return AttentionPath::kHopper;
  fail(source, ": expected auto, mma or hopper, found '", name, "'");
}
inline const char* attention_path_option(AttentionPath path) {
  return path == AttentionPath::kMma ? "mma" : path == AttentionPath::kHopper ? "hopper" : "auto";
}

// Whether `path` may turn out to be hopper, before the device is known.
inline bool attention_hopper_possible(AttentionPath path) {
  return path == AttentionPath::kHopper || (path == AttentionPath::kDefault && kHopperByDefault);
}

}  // namespace tuna
