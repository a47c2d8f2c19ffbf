#include "core/memory.h"

#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "core/error.h"
#include "core/progress.h"

namespace tuna {

HostMemory host_memory() {
  HostMemory m;
  // statm's second field is the resident size in pages; a failed read leaves 0 rather than stopping a run.
  if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
    long total_pages = 0, resident_pages = 0;
    if (std::fscanf(f, "%ld %ld", &total_pages, &resident_pages) == 2)
      m.resident_mb = double(resident_pages) * double(sysconf(_SC_PAGESIZE)) / 1e6;
    std::fclose(f);
  }
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) == 0) m.peak_mb = double(usage.ru_maxrss) * 1024.0 / 1e6;  // ru_maxrss is KiB
  // The two are read at different moments and in different units: never report a peak below the present.
  if (m.peak_mb < m.resident_mb) m.peak_mb = m.resident_mb;
  return m;
}

void return_large_frees_to_system(int64_t bytes) { mallopt(M_MMAP_THRESHOLD, static_cast<int>(bytes)); }

int64_t host_available_bytes() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (!f) return -1;
  char line[256];
  int64_t kib = -1;
  while (std::fgets(line, sizeof line, f))
    if (std::strncmp(line, "MemAvailable:", 13) == 0) {
      long long v = 0;
      if (std::sscanf(line + 13, "%lld", &v) == 1) kib = v;
      break;
    }
  std::fclose(f);
  return kib < 0 ? -1 : kib * 1024;
}

void require_host_memory(int64_t bytes_per_process, int processes_on_node, const std::string& what) {
  const int64_t available = host_available_bytes();
  const int64_t needed = bytes_per_process * processes_on_node;
  if (available < 0 || needed <= available) return;
  fail(what, " is ", human_bytes(double(bytes_per_process)),
       processes_on_node > 1 ? str(" x ", processes_on_node, " processes on this node = ", human_bytes(double(needed)))
                             : std::string(),
       ", but this node has ", human_bytes(double(available)),
       " available (MemAvailable of /proc/meminfo): the job would be killed or swap. Use fewer ranks per node, a "
       "smaller micro_batch or seq_len, or a higher ZeRO stage");
}

void fail_out_of_memory(const std::string& what, uint64_t bytes) {
  const int64_t available = host_available_bytes();
  fail("out of memory: allocating ", what, " needs ", human_bytes(double(bytes)),
       available < 0 ? std::string() : ", this node has " + human_bytes(double(available)) + " available");
}

void check_host_allocation(const std::string& what, uint64_t bytes) {
  const int64_t available = host_available_bytes();
  if (available >= 0 && bytes > static_cast<uint64_t>(available)) fail_out_of_memory(what, bytes);
}

}  // namespace tuna
