#include "core/memory.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "core/error.h"

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

namespace {

// A number from a one-line sysfs file; nullopt-like UINT64_MAX for "max", missing or unreadable.
uint64_t read_limit(const char* path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return UINT64_MAX;
  try {
    return std::stoull(text);
  } catch (const std::exception&) {
    return UINT64_MAX;
  }
}

std::string gigabytes(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GB", double(bytes) / 1e9);
  return buf;
}

}  // namespace

uint64_t host_memory_available() {
  uint64_t available = UINT64_MAX;
  if (std::FILE* f = std::fopen("/proc/meminfo", "r")) {
    char key[64];
    unsigned long long kib = 0;
    uint64_t mem = 0, swap = 0;
    bool found = false;
    while (std::fscanf(f, "%63s %llu kB", key, &kib) == 2) {
      if (std::strcmp(key, "MemAvailable:") == 0) mem = kib * 1024, found = true;
      if (std::strcmp(key, "SwapFree:") == 0) swap = kib * 1024;
    }
    std::fclose(f);
    if (found) available = mem + swap;
  }
  const uint64_t limit = read_limit("/sys/fs/cgroup/memory.max"), used = read_limit("/sys/fs/cgroup/memory.current");
  if (limit != UINT64_MAX && used != UINT64_MAX) available = std::min(available, limit > used ? limit - used : 0);
  return available;
}

void fail_out_of_memory(const std::string& what, uint64_t bytes) {
  const uint64_t available = host_memory_available();
  fail("out of memory: allocating ", what, " needs ", gigabytes(bytes),
       available == UINT64_MAX ? std::string() : ", " + gigabytes(available) + " of host memory is available");
}

void check_host_allocation(const std::string& what, uint64_t bytes) {
  if (bytes > host_memory_available()) fail_out_of_memory(what, bytes);
}

}  // namespace tuna
