// The catch-all of every main (core/error.h): no exception leaves a tool as SIGABRT.
#include "core/error.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <exception>
#include <filesystem>
#include <new>

namespace tuna {

std::string describe_current_exception() {
  try {
    throw;
  } catch (const Error& e) {
    return e.what();
  } catch (const std::bad_array_new_length&) {
    return "out of memory: an allocation of an impossible size was requested (std::bad_array_new_length)";
  } catch (const std::bad_alloc&) {
    // The large allocations of tuna name themselves (core/memory.h: allocate_host); this one did not.
    return "out of memory: an allocation failed (std::bad_alloc); lower the batch, the sequence length or the "
           "model size, or run on more ranks";
  } catch (const std::length_error& e) {
    return str("out of memory: a buffer larger than the address space was requested (", e.what(), ")");
  } catch (const nlohmann::json::exception& e) {
    // Readers check types and name the field; this is one that slipped through, still a clean error.
    return str("malformed JSON value: ", e.what());
  } catch (const std::filesystem::filesystem_error& e) {
    return e.what();  // names the operation and the path(s)
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

int guarded_main(const std::function<int()>& body) {
  try {
    return body();
  } catch (...) {
    std::fprintf(stderr, "error: %s\n", describe_current_exception().c_str());
    std::fflush(stderr);
    return 1;
  }
}

}  // namespace tuna
