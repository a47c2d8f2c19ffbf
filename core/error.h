// core/error.h — the one error idiom of tuna.
//
// Two kinds of failure, one exception type:
//   * bad user input (a file, a field, a flag): tuna::fail("file.json: field 'x': expected ..., found ...").
//     The message is for the user; it names what was read, what was expected and what was found.
//   * a broken internal precondition: TUNA_CHECK(cond, "what") adds the source location, because the
//     reader of that message is a developer.
// Mains catch tuna::Error, print "error: <message>" and exit 1. Nothing calls abort() on user input.
#pragma once

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

}  // namespace tuna

#define TUNA_CHECK(cond, ...)                                                                  \
  do {                                                                                         \
    if (!(cond))                                                                               \
      ::tuna::fail("internal check failed: ", #cond, " (", ::tuna::str(__VA_ARGS__), ") at ",  \
                   __FILE__, ":", __LINE__);                                                   \
  } while (0)
