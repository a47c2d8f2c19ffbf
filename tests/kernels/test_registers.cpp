// kernels/registers.tsv against this build: every kernel of the sm_90a image, its registers, spills, static shared
// memory and barriers as ptxas reported them when the build compiled it (the .cu rule of the Makefile keeps each
// file's `ptxas -v` beside its object, build/obj/kernels/NAME.ptxas), and the blocks per SM those give with the
// block size and dynamic shared memory its launcher uses (the table's columns), by the CUDA occupancy calculator
// (cuda_occupancy.h) for an H100/H200 SM.
//
// Why: a kernel's blocks per SM move with its register count in steps (registers are allocated per warp in units
// of 256), and nothing else shows it before a GPU measures the kernel slower. A change of the table is a change
// made on purpose, with its reason in the commit: the test writes what this build measured to
// build/registers.tsv, and its message says which rows differ.
//
// The table records the compiler that produced it: another nvcc may allocate differently, so with another
// version only the spills are checked (none is allowed) and the rest is skipped, saying why. A build without
// nvcc (CUDA=0) has nothing to compare: skipped, saying so.
#include <cxxabi.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#if TUNA_CUDA
#include <cuda_occupancy.h>
#endif

#include "tests/test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;

// One kernel as ptxas reported it.
struct Measured {
  std::string file, kernel;
  int registers = 0, barriers = 0;
  long static_smem = 0, stack = 0, spill_stores = 0, spill_loads = 0;
};

// `_ZN4tuna4cuda9attention10fwd_kernelILi128ELb0EEEvNS0_15AttentionParamsE` -> `attention::fwd_kernel<128, false>`:
// demangled, without the return type, the parameters, tuna::cuda:: and anonymous namespaces (whose mangled names
// carry a hash of the file).
std::string short_name(const std::string& mangled) {
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> demangled(abi::__cxa_demangle(mangled.c_str(), nullptr, nullptr, &status),
                                                        &std::free);
  std::string name = status == 0 && demangled ? demangled.get() : mangled;
  for (const std::string cut : {"(anonymous namespace)::", "tuna::cuda::"})
    for (size_t at; (at = name.find(cut)) != std::string::npos;) name.erase(at, cut.size());
  int depth = 0;
  for (size_t i = 0; i < name.size(); ++i) {
    if (name[i] == '<')
      ++depth;
    else if (name[i] == '>')
      --depth;
    else if (name[i] == '(' && depth == 0) {
      name.resize(i);
      break;
    }
  }
  if (name.rfind("void ", 0) == 0) name.erase(0, 5);  // a template's return type
  return name;
}

// The sm_90a kernels of one ptxas log, and the compiler's version (its first line).
std::vector<Measured> read_log(const fs::path& path, std::string& version) {
  std::ifstream in(path);
  std::getline(in, version);
  const std::regex entry(R"(Compiling entry function '(\S+)' for '(sm_\w+)')"),
      properties(R"(Function properties for (\S+))"),
      frame(R"((\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads)"),
      used(R"(Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?)");
  std::vector<Measured> out;
  bool in_entry = false;      // the lines since the last "Compiling entry function" belong to an sm_90a entry
  std::string properties_of;  // the function the next stack-frame line describes
  std::string current;        // the entry being reported
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (std::regex_search(line, m, entry)) {
      in_entry = m[2] == "sm_90a";
      current = m[1];
      if (in_entry) out.push_back({path.stem().string(), short_name(current)});
    } else if (std::regex_search(line, m, properties)) {
      properties_of = m[1];
    } else if (in_entry && std::regex_search(line, m, frame) && properties_of == current) {
      out.back().stack = std::stol(m[1]), out.back().spill_stores = std::stol(m[2]),
      out.back().spill_loads = std::stol(m[3]);
    } else if (in_entry && std::regex_search(line, m, used)) {
      out.back().registers = std::stoi(m[1]);
      out.back().barriers = m[2].matched ? std::stoi(m[2]) : 0;
      out.back().static_smem = m[3].matched ? std::stol(m[3]) : 0;
    }
  }
  return out;
}

// A row of kernels/registers.tsv.
struct Row {
  std::string file, kernel;
  int threads = 0;
  long dynamic_smem = 0;
  int registers = 0;
  long static_smem = 0, spills = 0;
  int blocks_per_sm = 0;
};

constexpr const char* kColumns = "file\tkernel\tthreads\tdynamic_smem\tregisters\tstatic_smem\tspills\tblocks_per_sm";

std::string row_text(const Row& r) {
  std::ostringstream s;
  s << r.file << '\t' << r.kernel << '\t' << r.threads << '\t' << r.dynamic_smem << '\t' << r.registers << '\t'
    << r.static_smem << '\t' << r.spills << '\t' << r.blocks_per_sm;
  return s.str();
}

// The table's rows by (file, kernel), its header comment lines, and the compiler it names ("# nvcc: VERSION").
std::map<std::pair<std::string, std::string>, Row> read_table(const fs::path& path, std::vector<std::string>& header,
                                                              std::string& version) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path << " not found";
  std::map<std::pair<std::string, std::string>, Row> rows;
  int number = 0;
  for (std::string line; std::getline(in, line);) {
    ++number;
    if (line.empty()) continue;
    if (line[0] == '#') {
      if (line.rfind("# nvcc: ", 0) == 0)
        version = line.substr(8);
      else if (line != std::string("# ") + kColumns)
        header.push_back(line);
      continue;
    }
    std::vector<std::string> f;
    std::istringstream fields(line);
    for (std::string x; std::getline(fields, x, '\t');) f.push_back(x);
    EXPECT_EQ(f.size(), 8u) << path << ":" << number << ": expected the 8 columns " << kColumns << ", found: " << line;
    if (f.size() != 8) continue;
    Row r{f[0],           f[1], std::stoi(f[2]), std::stol(f[3]), std::stoi(f[4]), std::stol(f[5]), std::stol(f[6]),
          std::stoi(f[7])};
    EXPECT_TRUE(rows.emplace(std::pair{r.file, r.kernel}, r).second)
        << path << ":" << number << ": a second row for " << r.file << " " << r.kernel;
  }
  return rows;
}

#if TUNA_CUDA
// Blocks of `threads` threads per SM of compute capability 9.0 (H100, H200: 64K registers, 228 KiB of shared
// memory of which 227 KiB per block, 1 KiB reserved per block, 2048 threads), as the CUDA runtime's occupancy
// calculator computes them.
int blocks_per_sm(const Measured& k, int threads, long dynamic_smem) {
  cudaOccDeviceProp sm90;
  sm90.computeMajor = 9, sm90.computeMinor = 0;
  sm90.maxThreadsPerBlock = 1024, sm90.maxThreadsPerMultiprocessor = 2048;
  sm90.regsPerBlock = 65536, sm90.regsPerMultiprocessor = 65536, sm90.warpSize = 32;
  sm90.sharedMemPerBlock = 48 * 1024, sm90.sharedMemPerMultiprocessor = 228 * 1024;
  sm90.sharedMemPerBlockOptin = 227 * 1024, sm90.reservedSharedMemPerBlock = 1024, sm90.numSms = 132;
  cudaOccFuncAttributes f;
  f.maxThreadsPerBlock = 1024;
  f.numRegs = k.registers;
  f.sharedSizeBytes = static_cast<size_t>(k.static_smem);
  f.partitionedGCConfig = PARTITIONED_GC_OFF;
  f.shmemLimitConfig = FUNC_SHMEM_LIMIT_OPTIN;  // the launchers raise the dynamic limit where they need more
  f.maxDynamicSharedSizeBytes = static_cast<size_t>(dynamic_smem);
  f.numBlockBarriers = std::max(k.barriers, 1);
  cudaOccDeviceState state;
  cudaOccResult result{};
  EXPECT_EQ(
      cudaOccMaxActiveBlocksPerMultiprocessor(&result, &sm90, &f, &state, threads, static_cast<size_t>(dynamic_smem)),
      CUDA_OCC_SUCCESS)
      << k.file << " " << k.kernel << ": " << threads << " threads, " << dynamic_smem
      << " bytes of dynamic shared memory";
  return result.activeBlocksPerMultiprocessor;
}
#endif

// The arithmetic itself, on the steps the mma forward once took: at 128 threads and 48 KiB of shared memory, 168
// registers give 3 blocks per SM and 169 give 2; at 24 KiB, 127 and 128 give 4 and 130 give 3.
TEST(KernelRegisters, OccupancyStepsWithRegistersPerWarp) {
#if !TUNA_CUDA
  GTEST_SKIP() << "this build compiled no CUDA (no nvcc found, or CUDA=0): cuda_occupancy.h is not on its path";
#else
  const auto blocks = [](int registers, long smem) {
    Measured k;
    k.registers = registers, k.barriers = 1;
    return blocks_per_sm(k, 128, smem);
  };
  EXPECT_EQ(blocks(168, 49152), 3);
  EXPECT_EQ(blocks(169, 49152), 2);
  EXPECT_EQ(blocks(127, 24576), 4);
  EXPECT_EQ(blocks(128, 24576), 4);
  EXPECT_EQ(blocks(130, 24576), 3);
#endif
}

TEST(KernelRegisters, EveryKernelMatchesTheTable) {
#if !TUNA_CUDA
  GTEST_SKIP() << "this build compiled no CUDA (no nvcc found, or CUDA=0): there is no ptxas report to hold "
                  "kernels/registers.tsv against";
#else
  const fs::path logs = fs::path(testing_util::build_dir()) / "obj" / "kernels";
  std::vector<Measured> measured;
  std::map<std::string, std::string> versions;  // log -> compiler
  for (const auto& e : fs::directory_iterator(logs))
    if (e.path().extension() == ".ptxas") {
      std::string version;
      for (Measured& m : read_log(e.path(), version)) measured.push_back(std::move(m));
      versions[e.path().filename().string()] = version;
    }
  ASSERT_FALSE(versions.empty()) << "no ptxas report (*.ptxas) in " << logs << ": build the kernels with this "
                                 << "Makefile (make), whose .cu rule writes them";
  if (measured.empty()) GTEST_SKIP() << "this build has no sm_90a image (SM without 90a): the table is sm_90a's";
  std::sort(measured.begin(), measured.end(), [](const Measured& a, const Measured& b) {
    return std::tie(a.file, a.kernel) < std::tie(b.file, b.kernel);
  });

  // No spills, whatever the compiler.
  for (const Measured& k : measured)
    EXPECT_EQ(k.spill_stores + k.spill_loads, 0)
        << k.file << " " << k.kernel << " spills " << k.spill_stores << " bytes and reloads " << k.spill_loads;

  std::vector<std::string> header;
  std::string table_version;
  const auto table = read_table("kernels/registers.tsv", header, table_version);
  const std::string build_version = versions.begin()->second;
  for (const auto& [log, version] : versions)
    ASSERT_EQ(version, build_version) << log << " was compiled by another nvcc than " << versions.begin()->first;

  // What this build measured, as a table (the committed one's threads and dynamic shared memory; 0 for a kernel
  // it lacks): build/registers.tsv.
  std::vector<Row> rows;
  for (const Measured& k : measured) {
    const auto it = table.find({k.file, k.kernel});
    Row r{k.file, k.kernel};
    if (it != table.end()) r.threads = it->second.threads, r.dynamic_smem = it->second.dynamic_smem;
    r.registers = k.registers, r.static_smem = k.static_smem, r.spills = k.spill_stores + k.spill_loads;
    r.blocks_per_sm = r.threads > 0 ? blocks_per_sm(k, r.threads, r.dynamic_smem) : 0;
    rows.push_back(r);
  }
  const fs::path written = fs::path(testing_util::build_dir()) / "registers.tsv";
  {
    std::ofstream out(written);
    for (const std::string& line : header) out << line << '\n';
    out << "# nvcc: " << build_version << '\n' << "# " << kColumns << '\n';
    for (const Row& r : rows) out << row_text(r) << '\n';
  }
  const std::string how = "; this build's table is " + written.string() +
                          " (diff it with kernels/registers.tsv; copy it over when the change is intended, and say why "
                          "in the commit)";

  if (table_version != build_version)
    GTEST_SKIP() << "kernels/registers.tsv was made by nvcc '" << table_version << "', this build's is '"
                 << build_version
                 << "': registers and blocks per SM are not compared (another compiler allocates differently); "
                 << "spills were" << how;

  for (const Row& r : rows) {
    const auto it = table.find({r.file, r.kernel});
    if (it == table.end()) {
      ADD_FAILURE() << r.file << " " << r.kernel << " (" << r.registers << " registers) has no row in "
                    << "kernels/registers.tsv: add one with the block size and dynamic shared memory its launcher uses"
                    << how;
      continue;
    }
    const Row& want = it->second;
    EXPECT_EQ(r.blocks_per_sm, want.blocks_per_sm)
        << r.file << " " << r.kernel << ": " << r.blocks_per_sm << " blocks per SM, the table says "
        << want.blocks_per_sm << " (" << r.registers << " registers, the table " << want.registers << ")" << how;
    EXPECT_TRUE(r.registers == want.registers && r.static_smem == want.static_smem && r.spills == want.spills)
        << r.file << " " << r.kernel << ": " << r.registers << " registers, " << r.static_smem
        << " bytes of static shared memory, " << r.spills << " bytes spilled; the table says " << want.registers << ", "
        << want.static_smem << ", " << want.spills << how;
  }
  for (const auto& [key, want] : table)
    EXPECT_TRUE(std::any_of(rows.begin(), rows.end(),
                            [&](const Row& r) { return r.file == key.first && r.kernel == key.second; }))
        << "kernels/registers.tsv lists " << key.first << " " << key.second
        << ", which this build's sm_90a image does not have" << how;
#endif
}

}  // namespace
}  // namespace tuna
