#include "core/memory.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>

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

}  // namespace tuna
