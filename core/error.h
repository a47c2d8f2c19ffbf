// core/error.h — the one error idiom of tuna.
//
// Two kinds of failure, one exception type:
//   * bad user input (a file, a field, a flag): tuna::fail("file.json: field 'x': expected ..., found ...").
//     The message is for the user; it names what was read, what was expected and what was found.
//   * a broken internal precondition: TUNA_CHECK(cond, "what") adds the source location, because the
//     reader of that message is a developer.
// Mains run through guarded_main (or call describe_current_exception in their own catch-all), which prints
// "error: <message>" and exits 1 for every exception, not only tuna::Error: a std::bad_alloc, a JSON type
// error or a filesystem error deep in a library must never end a tool with SIGABRT and no message. Nothing
// calls abort() on user input.
#pragma once

#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>

namespace tuna {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Concatenates anything that streams into one string: str("layer ", 3, " of ", 8).
template <typename... Parts>
std::string str(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  throw Error(str(parts...));
}

// Inside a catch block: the message of the exception being handled. tuna::Error's own text; the rest
// translated for the user: std::bad_alloc as "out of memory", nlohmann's JSON errors as a malformed value, a
// filesystem error with its path, anything else with its what() or as "unknown exception".
std::string describe_current_exception();

// A tool's main: runs body and returns its exit code; any exception becomes "error: <message>" on stderr
// and exit code 1.
int guarded_main(const std::function<int()>& body);

}  // namespace tuna

#define TUNA_CHECK(cond, ...)                                                                  \
  do {                                                                                         \
    if (!(cond))                                                                               \
      ::tuna::fail("internal check failed: ", #cond, " (", ::tuna::str(__VA_ARGS__), ") at ",  \
                   __FILE__, ":", __LINE__);                                                   \
  } while (0)
