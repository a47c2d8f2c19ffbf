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

// Makes every allocation of `bytes` or more a mapping of its own, returned to the system when freed. glibc's
// default raises that threshold to the size of the last large block freed (up to 32 MB), after which the
// transients of a run (a checkpoint's copies, a collective's temporary) stay resident in the heap once freed:
// the trainer calls this first, so that its resident memory is what its memory plan says.
void return_large_frees_to_system(int64_t bytes = int64_t(1) << 20);

// What the kernel says a new allocation can take without swapping (MemAvailable of /proc/meminfo); -1 when unknown.
int64_t host_available_bytes();

// Refuses, before anything is allocated, a job whose `bytes_per_process` times the processes of this node exceed
// the memory available: the message names `what` (e.g. "the memory plan's peak per rank"), both figures, and the
// processes counted.
void require_host_memory(int64_t bytes_per_process, int processes_on_node, const std::string& what);

// Refuses (naming `what`, its size and what is available) an allocation of `bytes` that exceeds
// host_available_bytes(): with Linux's overcommit a too-large allocation succeeds and is killed later (SIGKILL, no
// message) as its pages are touched.
void check_host_allocation(const std::string& what, uint64_t bytes);
[[noreturn]] void fail_out_of_memory(const std::string& what, uint64_t bytes);

// Runs alloc() (which sizes the buffers that hold `what`, `bytes` in all) after check_host_allocation, turning
// a std::bad_alloc or std::length_error of it into the same named error. Every large host allocation of tuna goes
// through it, so that running out of memory names what was being allocated and how much.
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
