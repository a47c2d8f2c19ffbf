// Parsing JSON that comes from a file a user (or a damaged disk) supplied: config.json, state.json, an
// index.json, a safetensors header, checkpoint metadata.
//
// nlohmann's parser recurses once per nesting level, so a few hundred thousand '[' overflow the stack: the
// text is scanned for its nesting depth first, and anything deeper than max_depth is refused. Every other
// failure of the parser (syntax, a number like 1e400 that overflows a double, invalid UTF-8) and a key that
// repeats within one object (JSON would silently keep one of the two values) is a tuna::Error naming `what`.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace tuna {

inline constexpr int kMaxJsonDepth = 64;
inline constexpr uint64_t kMaxJsonFileBytes = uint64_t{64} << 20;

// `what` starts every message ("runs/x/state.json", "model.safetensors: header").
nlohmann::json parse_json(std::string_view text, const std::string& what, int max_depth = kMaxJsonDepth);
nlohmann::ordered_json parse_ordered_json(std::string_view text, const std::string& what,
                                          int max_depth = kMaxJsonDepth);

// A whole JSON file (a regular file of at most max_bytes, core/file.h), parsed as above.
nlohmann::json read_json_file(const std::filesystem::path& path, const std::string& what,
                              uint64_t max_bytes = kMaxJsonFileBytes);

// Fails naming `what` when the deepest nesting of arrays and objects in text exceeds max_depth.
void check_json_depth(std::string_view text, const std::string& what, int max_depth);

// A field of a parsed object as an integer in [min, max] (a float, string, bool or null is refused), naming
// `what` and the key; as a finite number in [min, max] (int or float).
int64_t json_int(const nlohmann::json& object, const char* key, const std::string& what, int64_t min, int64_t max);
double json_number(const nlohmann::json& object, const char* key, const std::string& what, double min, double max);

}  // namespace tuna
