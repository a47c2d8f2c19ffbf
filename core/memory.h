// Host memory of this process, for the trainer's log line: what is resident now and the peak so far.
#pragma once

namespace tuna {

struct HostMemory {
  double resident_mb = 0;  // resident set size now (/proc/self/statm)
  double peak_mb = 0;      // largest resident set so far (getrusage ru_maxrss)
};

HostMemory host_memory();

}  // namespace tuna
