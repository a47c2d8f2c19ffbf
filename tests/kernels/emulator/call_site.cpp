// tests/kernels/emulator/call_site.cpp — ptx_sm90.h's CallSite: the walk of a fiber's frames and the source of
// the addresses it finds (see the header for why).
#include <dlfcn.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <unordered_map>
#include <vector>

#include "tests/kernels/emulator/runtime.h"  // ptx_sm90.h, with what it declares from the runtime

namespace tuna::emulator {
namespace {

// "function (file:line)" of the call before return address `pc`, and of each call inlined there (innermost first,
// joined by " < "), from addr2line over the binary that holds it; cached per address. Empty when unknown.
const std::string& source_of(uintptr_t pc) {
  static std::unordered_map<uintptr_t, std::string> cache;
  if (const auto it = cache.find(pc); it != cache.end()) return it->second;
  std::string& out = cache[pc];
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(pc), &info) == 0 || info.dli_fbase == nullptr || info.dli_fname == nullptr)
    return out;
  Dl_info self{};
  const bool in_executable =
      dladdr(reinterpret_cast<void*>(&CallSite::here), &self) != 0 && self.dli_fbase == info.dli_fbase;
  // The executable by its /proc link (its name in dladdr is argv[0], relative to a directory the process may have
  // left); pc - 1: the call instruction itself (a return address may already be the next line's).
  const std::string binary =
      in_executable ? "/proc/" + std::to_string(static_cast<long>(getpid())) + "/exe" : std::string(info.dli_fname);
  char command[4096];
  std::snprintf(command, sizeof(command), "addr2line -f -i -C -e '%s' 0x%lx 2>/dev/null", binary.c_str(),
                static_cast<unsigned long>(pc - 1 - reinterpret_cast<uintptr_t>(info.dli_fbase)));
  FILE* pipe = popen(command, "r");
  if (pipe == nullptr) return out;
  std::vector<std::string> lines;
  char line[8192];
  while (std::fgets(line, sizeof(line), pipe) != nullptr) {
    std::string text(line);
    while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
    // A discriminator tells apart basic blocks of one line, which a copy of the code may renumber.
    if (const size_t d = text.find(" (discriminator "); d != std::string::npos) text.resize(d);
    lines.push_back(text);
  }
  if (pclose(pipe) != 0 || lines.empty() || lines.size() % 2 != 0) return out;
  std::string resolved;
  for (size_t i = 0; i < lines.size(); i += 2) {
    if (lines[i + 1].rfind("??", 0) == 0) return out;  // no line information: unknown
    resolved += (i == 0 ? "" : " < ") + lines[i] + " (" + lines[i + 1] + ")";
  }
  out = resolved;
  return out;
}

}  // namespace

std::string CallSite::source() const {
  std::string out;
  for (int f = 0; f < frames; ++f) {
    const std::string& frame = source_of(pc[f]);
    if (frame.empty()) return "";
    out += (f == 0 ? "" : " <- ") + frame;
  }
  return out;
}

std::string CallSite::addresses() const {
  std::string out;
  for (int f = 0; f < frames; ++f) {
    Dl_info info{};
    const bool known = dladdr(reinterpret_cast<void*>(pc[f]), &info) != 0 && info.dli_fbase != nullptr;
    char text[64];
    std::snprintf(text, sizeof(text), "%s%s0x%lx", f == 0 ? "" : " <- ", known ? "+" : "",
                  static_cast<unsigned long>(known ? pc[f] - reinterpret_cast<uintptr_t>(info.dli_fbase) : pc[f]));
    out += text;
  }
  return out;
}

CallSite CallSite::here() {
  CallSite site;
#if defined(__x86_64__)
  const auto [low, high] = block().current_stack();
  // A frame record: the caller's frame pointer, then the return address into the caller.
  auto* frame = static_cast<const uintptr_t*>(__builtin_frame_address(0));
  for (;;) {
    const auto at = reinterpret_cast<uintptr_t>(frame);
    TUNA_CHECK(at >= low && at + 2 * sizeof(uintptr_t) <= high && at % sizeof(uintptr_t) == 0,
               "the emulator's walk of a thread's frames left its stack: the emulated build must keep frame ",
               "pointers (-fno-omit-frame-pointer) in every function between a kernel and the emulator");
    const uintptr_t return_address = frame[1];
    if (return_address == 0) break;  // the fiber's entry (prepare_stack)
    TUNA_CHECK(site.frames < kMaxFrames, "a warpgroup instruction more than ", kMaxFrames, " calls deep in its thread");
    site.pc[site.frames++] = return_address;
    const auto* caller = reinterpret_cast<const uintptr_t*>(frame[0]);
    TUNA_CHECK(caller > frame, "the emulator's walk of a thread's frames found a frame pointer that does not lead ",
               "up the stack: the emulated build must keep frame pointers (-fno-omit-frame-pointer)");
    frame = caller;
  }
#else
  // Elsewhere (ucontext fibers) only the helper's immediate call site: a weaker check.
  site.pc[site.frames++] = reinterpret_cast<uintptr_t>(__builtin_return_address(0));
#endif
  return site;
}

}  // namespace tuna::emulator
