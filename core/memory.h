// Host memory of this process, for the trainer's log line: what is resident now and the peak so far; and the
// guard every large host allocation goes through, so that running out of memory is a message that names
// what was being allocated and its size, not a std::bad_alloc without one or the kernel's OOM killer.
#pragma once

#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>

namespace tuna {

struct HostMemory {
  double resident_mb = 0;  // resident set size now (/proc/self/statm)
  double peak_mb = 0;      // largest resident set so far (getrusage ru_maxrss)
};

HostMemory host_memory();

// Bytes this process could still allocate: MemAvailable + SwapFree (/proc/meminfo), lowered to the room
// left under a cgroup v2 memory limit (a container's or a Slurm job's). UINT64_MAX when unknown.
uint64_t host_memory_available();

// Fails, naming `what` and both sizes, when `bytes` exceed host_memory_available(): with Linux's overcommit
// a too-large allocation succeeds and is killed later (SIGKILL, no message) as its pages are touched.
void check_host_allocation(const std::string& what, uint64_t bytes);
[[noreturn]] void fail_out_of_memory(const std::string& what, uint64_t bytes);

// Runs alloc() (which sizes the buffers that hold `what`, `bytes` in all) after check_host_allocation, turning
// a std::bad_alloc or std::length_error of it into the same named error.
template <typename Alloc>
void allocate_host(const std::string& what, uint64_t bytes, Alloc&& alloc) {
  check_host_allocation(what, bytes);
  try {
    alloc();
  } catch (const std::bad_alloc&) {
    fail_out_of_memory(what, bytes);
  } catch (const std::length_error&) {
    fail_out_of_memory(what, bytes);
  }
}

}  // namespace tuna
