// Every test leaves the process as it found it. A GoogleTest listener that every test runner registers
// (tests/main.cpp, the emulator's and the MPI runner's mains): it reads the process-wide state a test can change
// before each test (the BLAS kernels in use, OpenMP's and OpenBLAS's thread counts, the environment, the working
// directory, the umask, the signal handlers and the main thread's signal mask) and compares after it. A test that
// changed any of it fails the run, named with what it changed, and the state is put back, so the tests after it run
// as they would alone: one test once left OpenBLAS on other kernels and a later comparison failed on machines whose
// CPU differed from ours, far from the cause.
#pragma once

#include <gtest/gtest.h>
#include <omp.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include "core/blas.h"

extern "C" int openblas_get_num_threads() __attribute__((weak));
extern "C" void openblas_set_num_threads(int) __attribute__((weak));
extern char** environ;

namespace tuna::testing_util {

class ProcessStateGuard : public ::testing::EmptyTestEventListener {
 public:
  // How many tests changed the process's state; the runner fails when any did.
  int tests_that_changed_state() const { return leaks_; }

  void OnTestStart(const ::testing::TestInfo&) override { before_ = State::read(); }

  void OnTestEnd(const ::testing::TestInfo& test) override {
    const State after = State::read();
    std::vector<std::string> changed;
    if (after.blas_core != before_.blas_core) {
      changed.push_back("BLAS kernels " + before_.blas_core + " -> " + after.blas_core);
      use_blas_core(before_.blas_core);
    }
    if (after.omp_threads != before_.omp_threads) {
      changed.push_back("OpenMP threads " + std::to_string(before_.omp_threads) + " -> " +
                        std::to_string(after.omp_threads));
      omp_set_num_threads(before_.omp_threads);
    }
    if (after.blas_threads != before_.blas_threads) {
      changed.push_back("OpenBLAS threads " + std::to_string(before_.blas_threads) + " -> " +
                        std::to_string(after.blas_threads));
      if (openblas_set_num_threads != nullptr) openblas_set_num_threads(before_.blas_threads);
    }
    if (after.environment != before_.environment) {
      std::vector<std::string> gone, added;
      std::set_difference(before_.environment.begin(), before_.environment.end(), after.environment.begin(),
                          after.environment.end(), std::back_inserter(gone));
      std::set_difference(after.environment.begin(), after.environment.end(), before_.environment.begin(),
                          before_.environment.end(), std::back_inserter(added));
      for (const std::string& v : added) {
        changed.push_back("environment +" + v);
        ::unsetenv(v.substr(0, v.find('=')).c_str());
      }
      for (const std::string& v : gone) {
        changed.push_back("environment -" + v);
        const size_t eq = v.find('=');
        ::setenv(v.substr(0, eq).c_str(), v.substr(eq + 1).c_str(), 1);
      }
    }
    if (after.cwd != before_.cwd) {
      changed.push_back("working directory " + before_.cwd + " -> " + after.cwd);
      if (::chdir(before_.cwd.c_str()) != 0) changed.push_back("(and it could not be restored)");
    }
    if (after.umask != before_.umask) {
      changed.push_back("umask");
      ::umask(before_.umask);
    }
    for (size_t i = 0; i < kSignals.size(); ++i)
      if (!same_action(after.actions[i], before_.actions[i])) {
        changed.push_back(std::string("handler of ") + strsignal(kSignals[i]));
        sigaction(kSignals[i], &before_.actions[i], nullptr);
      }
    for (int s : kSignals)
      if (sigismember(&after.mask, s) != sigismember(&before_.mask, s)) {
        changed.push_back(std::string("signal mask of ") + strsignal(s));
        pthread_sigmask(SIG_SETMASK, &before_.mask, nullptr);
      }
    if (changed.empty()) return;
    ++leaks_;
    std::fprintf(stderr, "PROCESS STATE: %s.%s left the process changed (restored for the tests after it):\n",
                 test.test_suite_name(), test.name());
    for (const std::string& c : changed) std::fprintf(stderr, "  %s\n", c.c_str());
  }

 private:
  static constexpr std::array<int, 10> kSignals = {SIGINT, SIGTERM, SIGUSR1, SIGUSR2, SIGHUP,
                                                   SIGPIPE, SIGCHLD, SIGALRM, SIGXFSZ, SIGQUIT};
  struct State {
    std::string blas_core;
    int omp_threads = 0, blas_threads = 0;
    std::vector<std::string> environment;
    std::string cwd;
    mode_t umask = 0;
    std::array<struct sigaction, kSignals.size()> actions{};
    sigset_t mask{};

    static State read() {
      State s;
      s.blas_core = tuna::blas_core();
      s.omp_threads = omp_get_max_threads();
      s.blas_threads = openblas_get_num_threads != nullptr ? openblas_get_num_threads() : 0;
      for (char** e = environ; *e != nullptr; ++e) s.environment.emplace_back(*e);
      std::sort(s.environment.begin(), s.environment.end());
      char buf[4096];
      s.cwd = ::getcwd(buf, sizeof buf) ? buf : "";
      s.umask = ::umask(0);
      ::umask(s.umask);
      for (size_t i = 0; i < kSignals.size(); ++i) sigaction(kSignals[i], nullptr, &s.actions[i]);
      pthread_sigmask(SIG_SETMASK, nullptr, &s.mask);
      return s;
    }
  };
  static bool same_action(const struct sigaction& a, const struct sigaction& b) {
    const bool info = a.sa_flags & SA_SIGINFO;
    if (info != static_cast<bool>(b.sa_flags & SA_SIGINFO)) return false;
    return info ? a.sa_sigaction == b.sa_sigaction : a.sa_handler == b.sa_handler;
  }

  State before_;
  int leaks_ = 0;
};

// Registers the guard with GoogleTest (which owns it) and returns it, for the runner's verdict.
inline ProcessStateGuard& guard_process_state() {
  auto* guard = new ProcessStateGuard();
  ::testing::UnitTest::GetInstance()->listeners().Append(guard);
  return *guard;
}

}  // namespace tuna::testing_util
