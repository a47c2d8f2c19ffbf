// scripts/gpu-check.sh --emulated: every step of the GPU machine's check walked without a GPU (the GPU tests on
// the host emulator, stand-ins for the benches, the device, nvidia-smi, ncu, compute-sanitizer and the peers:
// tests/gpu_check/), so that a wrong path, a misspelled flag, a filter that selects nothing or a table that
// cannot be read fails here, not on a GPU. And the same run with two steps broken on purpose must fail, name
// both, and still print its table and return its files.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "tests/test_util.h"

namespace tuna {
namespace {

namespace fs = std::filesystem;
using testing_util::read_file;
using testing_util::run_command;
using testing_util::TempDir;

// The files a GPU run returns; all five must come out, failed steps or not.
const char* const kReturned[] = {"summary.log", "tests.log", "train.log", "benches.log", "benches.json"};

testing_util::RunResult run_check(const std::string& script, const fs::path& out) {
  return run_command("TUNA_GPU_BIN=" + testing_util::build_dir() + "/gpu-check-emulated/bin " + script +
                         " --emulated '" + out.string() + "'",
                     out.parent_path() / "check.log");
}

void expect_returned_files(const fs::path& out) {
  for (const char* f : kReturned) EXPECT_TRUE(fs::is_regular_file(out / f)) << f;
  const std::string summary = read_file(out / "summary.log");
  EXPECT_NE(summary.find("gpu-check summary"), std::string::npos) << "no table in summary.log";
  EXPECT_NE(summary.find("EMULATED RUN"), std::string::npos);
  EXPECT_TRUE(std::regex_search(summary, std::regex("seconds per tier: 1: \\d+ s; 2: \\d+ s; 3: \\d+ s; 4: \\d+ s;")))
      << summary;
}

TEST(GpuCheckEmulated, WalksEveryStep) {
  TempDir tmp("gpu_check");
  const fs::path out = tmp / "out";
  const auto r = run_check("scripts/gpu-check.sh", out);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  expect_returned_files(out);
  const std::string summary = read_file(out / "summary.log");
  EXPECT_NE(summary.find("gpu-check: every step of tiers 1-3 passed (emulated"), std::string::npos) << summary;
  // Every tier ran steps, and every step passed (tier 4's sanitizers and profile too: their stand-ins are on PATH).
  for (int t = 1; t <= 4; t++)
    EXPECT_TRUE(std::regex_search(summary, std::regex("\\n  \\[" + std::to_string(t) + "\\] \\S+: ok"))) << "tier " << t;
  EXPECT_EQ(summary.find(": FAILED"), std::string::npos) << summary;
  EXPECT_EQ(summary.find(": skipped"), std::string::npos) << summary;
  // The loopback device comm's suite, the pipeline over it, and the jittered pipeline run, the last with the
  // emulator's streams out of order.
  for (const char* name : {"tests/CommLoopbackGpu", "tests/Stages/EngineGpuPipelineLoopback", "tests/pipeline-jitter"})
    EXPECT_TRUE(std::regex_search(summary, std::regex(std::string("\\n  \\[\\d\\] ") + name + ": ok"))) << name;
  const std::string tests_log = read_file(out / "tests.log");
  EXPECT_NE(tests_log.find("streams concurrent, jitter seed 1"), std::string::npos);
  EXPECT_NE(tests_log.find("EngineGpuPipelineLoopback.EqualsOneStageOverTheSameMicroBatches/pp2_jitter1"),
            std::string::npos);
  // No value in the table passes for a measurement: every row past the tiers says it is emulated.
  const std::string table = summary.substr(summary.find("gpu-check summary"));
  std::istringstream lines(table);
  std::string section;
  int rows = 0;
  for (std::string line; std::getline(lines, line);) {
    const size_t bar = line.find(" | "), value = bar == std::string::npos ? bar : line.find(" | ", bar + 3);
    if (value == std::string::npos) continue;
    const std::string first = line.substr(0, line.find_last_not_of(' ', bar) + 1);
    if (!first.empty() && first.find_first_not_of(' ') != std::string::npos) section = first;
    if (section == "tiers") continue;
    rows++;
    EXPECT_EQ(line.substr(value + 3, 10), "emulated: ") << line;
  }
  EXPECT_GT(rows, 10);
  // The packed-documents bench lists both attention paths (its masked/unmasked rows on a GPU).
  EXPECT_TRUE(std::regex_search(table, std::regex("BM_AttentionDocuments +\\| emulated: 24 benchmarks listed, none "
                                                  "run +\\| paths mma, hopper")))
      << table;
  // benches.json: each bench's benchmarks listed (none run), the peers' records, the profile's CSV read.
  const auto benches = nlohmann::json::parse(read_file(out / "benches.json"));
  for (const char* b :
       {"attention_mma", "train_step_1b", "memory", "attention", "gemm", "train_step", "train_step_hopper", "decode"}) {
    ASSERT_TRUE(benches.contains(b)) << b;
    ASSERT_FALSE(benches[b]["benchmarks"].empty()) << b;
    for (const auto& x : benches[b]["benchmarks"]) {
      EXPECT_TRUE(x.value("emulated", false)) << x.dump();
      EXPECT_FALSE(x.contains("real_time") || x.contains("TFLOP/s") || x.contains("tokens/s")) << x.dump();
    }
  }
  // The peers' records: the eager step in tier 1 (torch, step), attention and the compiled step in tier 3.
  EXPECT_EQ(benches["peers"].size(), 6u) << benches["peers"].dump();
  EXPECT_FALSE(benches["profile"].contains("error")) << benches["profile"].dump();
  // The first tier answers, in order: the GPU tests (the hopper documents-in-a-warpgroup shapes first, alone), the
  // demo on cuda with and without adapters, the mma attention, the 1B step and PyTorch's.
  const size_t a1 = summary.find("[1] tests/hopper-documents-in-a-warpgroup: ok"),
               list = summary.find("[1] tests/list: ok"), straight = summary.find("[1] train/straight: ok"),
               lora = summary.find("[1] train/lora: ok"), attention = summary.find("[1] bench/attention_mma: ok"),
               step = summary.find("[1] bench/train_step_1b: ok"), peers = summary.find("[1] peers/step: ok"),
               tier2 = summary.find("== tier 2");
  EXPECT_TRUE(a1 < list && list < straight && straight < lora && lora < attention && attention < step && step < peers &&
              peers < tier2 && tier2 != std::string::npos)
      << summary;
  // Then, last, the lines for a measurement table, each marked emulated.
  const std::string heading = "\n== for the table:\n";
  const size_t answers = summary.find(heading);
  ASSERT_NE(answers, std::string::npos) << summary;
  std::istringstream lines_after(summary.substr(answers + heading.size()));
  int answer_lines = 0;
  for (std::string line; std::getline(lines_after, line); ++answer_lines)
    EXPECT_EQ(line.rfind("  emulated: ", 0), 0u) << line;
  EXPECT_EQ(answer_lines, 5) << summary.substr(answers);
}

// A step broken on purpose, as a typo would break it: a misspelled trainer flag and a bench that does not
// exist. The run fails, names both steps and why, and still returns its table and files; the other steps pass.
TEST(GpuCheckEmulated, FailsOnABrokenStepAndNamesIt) {
  TempDir tmp("gpu_check_broken");
  std::string script = read_file("scripts/gpu-check.sh");
  for (const auto& [from, to] : {std::pair<std::string, std::string>{"--stop_at_step 150", "--stop_at_stepp 150"},
                                 {"bench gemm 75", "bench gemmm 75"}}) {
    const size_t at = script.find(from);
    ASSERT_NE(at, std::string::npos) << "gpu-check.sh no longer has '" << from << "': update this test";
    script.replace(at, from.size(), to);
  }
  const fs::path broken = tmp / "gpu-check.sh";
  std::ofstream(broken) << script;
  fs::permissions(broken, fs::perms::owner_all);
  const fs::path out = tmp / "out";
  const auto r = run_check(broken.string(), out);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  expect_returned_files(out);
  const std::string summary = read_file(out / "summary.log");
  std::smatch failed;
  ASSERT_TRUE(std::regex_search(summary, failed, std::regex("gpu-check: FAILED: (.*)"))) << summary;
  const std::string why = failed[1];
  EXPECT_NE(why.find("train/stopped: FAILED (rc 1, expected 75"), std::string::npos) << why;
  EXPECT_NE(why.find("stop_at_stepp"), std::string::npos) << why;
  EXPECT_NE(why.find("bench/gemmm: FAILED (rc 127"), std::string::npos) << why;
  // Those two, and what reads their results (the resumed run and the runs' comparison): nothing else.
  EXPECT_TRUE(std::regex_search(summary, std::regex("\\[1\\] train/straight: ok")));
  EXPECT_TRUE(std::regex_search(summary, std::regex("\\[3\\] bench/train_step: ok")));
}

// A short lease's selection (TUNA_GPU_CHECK_ONLY): the matching steps run, every other is "skipped (not selected)"
// and fails nothing, the hopper path is not taken for broken by its test's absence, and tests/list still finds the
// suites.
TEST(GpuCheckEmulated, RunsOnlyTheSelectedSteps) {
  TempDir tmp("gpu_check_only");
  const fs::path out = tmp / "out";
  const auto r = run_command("TUNA_GPU_CHECK_ONLY='^tests/Fp8GpuGroup$|^bench/gemm$' TUNA_GPU_BIN=" +
                                 testing_util::build_dir() + "/gpu-check-emulated/bin scripts/gpu-check.sh --emulated '" +
                                 out.string() + "'",
                             tmp / "check.log");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  expect_returned_files(out);
  const std::string summary = read_file(out / "summary.log");
  EXPECT_NE(summary.find("only the steps matching TUNA_GPU_CHECK_ONLY="), std::string::npos) << summary;
  for (const char* ran : {"[1] tests/list: ok", "[1] tests/Fp8GpuGroup: ok", "[3] bench/gemm: ok"})
    EXPECT_NE(summary.find(ran), std::string::npos) << ran << "\n" << summary;
  for (const char* skipped : {"[1] train/straight: skipped (not selected)", "[1] tests/hopper: skipped (not selected)",
                              "[2] train/zero1: skipped (not selected)", "[3] plan/refresh: skipped (not selected)"})
    EXPECT_NE(summary.find(skipped), std::string::npos) << skipped << "\n" << summary;
  EXPECT_EQ(summary.find(": FAILED"), std::string::npos) << summary;
}

// What the GPU machine is sent: `make gpu-check-build`'s bin/, carried as one folder of at most 64 MiB with the
// repository. The build keeps it under 40 MB (compressed device code, one copy of the library for the tests and
// benches); past 48 MB it is time to look at what grew, before it stops fitting. Symbolic links count as the links.
TEST(GpuCheckBuild, BinFolderStaysSmall) {
  const fs::path bin = fs::path(testing_util::build_dir()) / "gpu-check" / "bin";
  if (!fs::is_directory(bin))
    GTEST_SKIP() << bin << " has not been built (make gpu-check-build, on a machine with nvcc)";
  uintmax_t bytes = 0;
  std::vector<std::pair<uintmax_t, std::string>> files;
  for (auto it = fs::recursive_directory_iterator(bin); it != fs::recursive_directory_iterator(); ++it)
    if (it->is_regular_file() && !it->is_symlink()) {
      bytes += it->file_size();
      files.emplace_back(it->file_size(), fs::relative(it->path(), bin).string());
    }
  std::sort(files.rbegin(), files.rend());
  std::ostringstream largest;
  for (size_t i = 0; i < files.size() && i < 8; ++i)
    largest << "\n  " << files[i].first / 1000 << " kB " << files[i].second;
  std::printf("%s: %.1f MB%s\n", bin.c_str(), bytes / 1e6, largest.str().c_str());
  EXPECT_LE(bytes, uintmax_t{48} * 1000 * 1000) << bin << " holds " << bytes / 1e6 << " MB, past 48 MB (the device "
                                                << "machine takes 64 MiB at most); the largest files:" << largest.str();
}

// The bench_NAME_gpu of the gpu-check build are scripts running one binary of every GPU bench (gpu_benches NAME):
// each lists exactly the benchmarks of the bench it stands for (the regular build's build/bench_NAME_gpu), none of
// the others'. Listing needs no GPU.
TEST(GpuCheckBuild, EachBenchScriptRunsItsOwnBenchmarks) {
  const fs::path bin = fs::path(testing_util::build_dir()) / "gpu-check" / "bin";
  if (!fs::is_regular_file(bin / "gpu_benches"))
    GTEST_SKIP() << bin / "gpu_benches" << " has not been built (make gpu-check-build, on a machine with nvcc)";
  TempDir tmp("gpu_benches");
  int benches = 0;
  for (const auto& entry : fs::directory_iterator(bin)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("bench_", 0) != 0) continue;
    SCOPED_TRACE(name);
    ++benches;
    const fs::path regular = fs::path(testing_util::build_dir()) / name;
    ASSERT_TRUE(fs::is_regular_file(regular)) << regular << " not built (make)";
    const auto listed = run_command(entry.path().string() + " --benchmark_list_tests", tmp / "combined.log");
    const auto expected = run_command(regular.string() + " --benchmark_list_tests", tmp / "regular.log");
    EXPECT_EQ(listed.exit_code, 0) << listed.output;
    EXPECT_EQ(expected.exit_code, 0) << expected.output;
    EXPECT_NE(listed.output.find("BM_"), std::string::npos) << listed.output;
    EXPECT_EQ(listed.output, expected.output);
  }
  int sources = 0;
  for (const auto& entry : fs::directory_iterator("bench"))
    sources += entry.path().filename().string().size() > 8 && entry.path().string().ends_with("_gpu.cpp");
  EXPECT_EQ(benches, sources) << "bench/*_gpu.cpp against " << bin << "/bench_*_gpu";
}

}  // namespace
}  // namespace tuna
