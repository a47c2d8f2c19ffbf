#include "core/json.h"

#include <cmath>
#include <set>
#include <vector>

#include "core/error.h"
#include "core/file.h"

namespace tuna {

void check_json_depth(std::string_view text, const std::string& what, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); i++) {
    const char c = text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    else if (c == '[' || c == '{') {
      if (++depth > max_depth)
        fail(what, ": JSON nested deeper than ", max_depth, " levels (at byte ", i, "); no file tuna reads needs that");
    } else if (c == ']' || c == '}') {
      depth--;  // unbalanced text is the parser's to report
    }
  }
}

namespace {

template <typename Json>
Json parse_checked(std::string_view text, const std::string& what, int max_depth) {
  check_json_depth(text, what, max_depth);
  // One set of keys per open object (at most max_depth of them): a repeated key fails instead of replacing.
  std::vector<std::set<std::string, std::less<>>> keys;
  std::string duplicate;
  auto callback = [&](int, nlohmann::json::parse_event_t event, Json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) keys.emplace_back();
    else if (event == Event::object_end && !keys.empty()) keys.pop_back();
    else if (event == Event::key && !keys.empty() && duplicate.empty()) {
      const std::string& key = parsed.template get_ref<const std::string&>();
      if (!keys.back().insert(key).second) duplicate = key;
    }
    return true;
  };
  Json json;
  try {
    json = Json::parse(text.begin(), text.end(), callback);
  } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range for 1e400
    fail(what, ": not valid JSON: ", e.what());
  }
  if (!duplicate.empty()) fail(what, ": key '", duplicate, "' appears more than once in one object");
  return json;
}

std::string shown(const nlohmann::json& v) {
  std::string s = v.dump();
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

}  // namespace

nlohmann::json parse_json(std::string_view text, const std::string& what, int max_depth) {
  return parse_checked<nlohmann::json>(text, what, max_depth);
}

nlohmann::ordered_json parse_ordered_json(std::string_view text, const std::string& what, int max_depth) {
  return parse_checked<nlohmann::ordered_json>(text, what, max_depth);
}

nlohmann::json read_json_file(const std::filesystem::path& path, const std::string& what, uint64_t max_bytes) {
  return parse_json(read_regular_file(path, what, max_bytes), path.string(), kMaxJsonDepth);
}

int64_t json_int(const nlohmann::json& object, const char* key, const std::string& what, int64_t min, int64_t max) {
  auto it = object.find(key);
  if (it == object.end()) fail(what, ": field '", key, "' is missing (expected an integer)");
  int64_t x = 0;
  if (it->is_number_unsigned()) {
    const uint64_t u = it->get<uint64_t>();
    if (u > static_cast<uint64_t>(max)) fail(what, ": field '", key, "': expected an integer in [", min, ", ", max, "], found ", u);
    x = static_cast<int64_t>(u);
  } else if (it->is_number_integer()) {
    x = it->get<int64_t>();
  } else {
    fail(what, ": field '", key, "': expected an integer, found ", shown(*it));
  }
  if (x < min || x > max) fail(what, ": field '", key, "': expected an integer in [", min, ", ", max, "], found ", x);
  return x;
}

double json_number(const nlohmann::json& object, const char* key, const std::string& what, double min, double max) {
  auto it = object.find(key);
  if (it == object.end()) fail(what, ": field '", key, "' is missing (expected a number)");
  if (!it->is_number()) fail(what, ": field '", key, "': expected a number, found ", shown(*it));
  const double x = it->get<double>();
  if (!std::isfinite(x) || x < min || x > max)
    fail(what, ": field '", key, "': expected a number in [", min, ", ", max, "], found ", x);
  return x;
}

}  // namespace tuna
