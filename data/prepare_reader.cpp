// prepare's input side: data/prepare_reader.h.
#include "data/prepare_reader.h"

#include <algorithm>

namespace tuna {

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
  });
}

// Rank r of `ranks` reads files [first, last): contiguous in input order (so that global document order is
// rank order), balanced by bytes on disk. A file goes to the rank whose byte range holds its middle.
std::pair<size_t, size_t> share_of(const std::vector<InputFile>& files, int rank, int ranks) {
  uint64_t total = 0;
  for (const InputFile& f : files) total += f.bytes;
  size_t first = files.size(), last = 0;
  uint64_t start = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    const long double middle = static_cast<long double>(start) + files[i].bytes / 2.0L;
    int owner = total == 0 ? static_cast<int>(i * static_cast<size_t>(ranks) / files.size())
                           : static_cast<int>(middle * ranks / static_cast<long double>(total));
    owner = std::clamp(owner, 0, ranks - 1);
    if (owner == rank) first = std::min(first, i), last = i + 1;
    start += files[i].bytes;
  }
  return first < last ? std::make_pair(first, last) : std::make_pair(size_t{0}, size_t{0});
}

}  // namespace tuna
