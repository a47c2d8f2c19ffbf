// Every exception a tool's main meets becomes a message, never SIGABRT.
#include "core/error.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <new>
#include <vector>

namespace tuna {
namespace {

template <typename F>
std::string message_of(F f) {
  try {
    f();
  } catch (...) {
    return describe_current_exception();
  }
  return "";
}

TEST(Error, EveryExceptionHasAMessage) {
  EXPECT_EQ(message_of([] { fail("file.json: field 'x': expected 1, found 2"); }), "file.json: field 'x': expected 1, found 2");
  EXPECT_NE(message_of([] { throw std::bad_alloc(); }).find("out of memory"), std::string::npos);
  EXPECT_NE(message_of([] { std::vector<double> v; v.resize(v.max_size() + 1); }).find("out of memory"),
            std::string::npos);
  EXPECT_NE(message_of([] { (void)nlohmann::json("text").get<int>(); }).find("malformed JSON value"), std::string::npos);
  EXPECT_NE(message_of([] { (void)std::filesystem::file_size("/nonexistent/tuna"); }).find("/nonexistent/tuna"),
            std::string::npos);
  EXPECT_EQ(message_of([] { throw 42; }), "unknown exception");
}

TEST(Error, GuardedMainReturnsOne) {
  EXPECT_EQ(guarded_main([] { return 0; }), 0);
  EXPECT_EQ(guarded_main([]() -> int { throw std::bad_alloc(); }), 1);
  EXPECT_EQ(guarded_main([]() -> int { throw std::runtime_error("x"); }), 1);
}

}  // namespace
}  // namespace tuna
