// Host memory of this process, for the trainer's log line: what is resident now and the peak so far.
#pragma once

#include <cstdint>
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

}  // namespace tuna
