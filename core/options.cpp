#include "core/options.h"

#include <toml++/toml.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "core/error.h"
#include "core/file.h"

namespace tuna {
namespace {

constexpr uint64_t kMaxTomlBytes = uint64_t{16} << 20;

std::string canonical(std::string name) {
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); j++) prev[j] = j;
  for (size_t i = 1; i <= a.size(); i++) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); j++)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1] ? 1 : 0)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// Shortest text that reads back as the same double.
std::string format_number(double x) {
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, x);
  return ec == std::errc() ? std::string(buf, end) : std::to_string(x);
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); i++) out += (i ? (i + 1 == items.size() ? " or " : ", ") : "") + items[i];
  return out;
}

}  // namespace

bool Bounds::contains(double x) const {
  if (!std::isfinite(x)) return false;
  if (exclusive_min ? !(x > min) : !(x >= min)) return false;
  if (exclusive_max ? !(x < max) : !(x <= max)) return false;
  return true;
}

std::string Bounds::describe() const {
  const bool low = std::isfinite(min), high = std::isfinite(max);
  if (low && high)
    return str(exclusive_min ? "(" : "[", format_number(min), ", ", format_number(max), exclusive_max ? ")" : "]");
  if (low) return str(exclusive_min ? "> " : ">= ", format_number(min));
  if (high) return str(exclusive_max ? "< " : "<= ", format_number(max));
  return "any finite number";
}

Options::Options(std::string program, std::string summary)
    : program_(std::move(program)), summary_(std::move(summary)) {}

void Options::add(const std::string& n, std::string* t, const std::string& h, std::vector<std::string> choices) {
  entries_.push_back({canonical(n), h, t, {}, std::move(choices), false, {}});
}
void Options::add(const std::string& n, int64_t* t, const std::string& h, Bounds bounds) {
  entries_.push_back({canonical(n), h, t, bounds, {}, false, {}});
}
void Options::add(const std::string& n, double* t, const std::string& h, Bounds bounds) {
  entries_.push_back({canonical(n), h, t, bounds, {}, false, {}});
}
void Options::add(const std::string& n, bool* t, const std::string& h) { entries_.push_back({canonical(n), h, t, {}, {}, false, {}}); }
void Options::add_choice(const std::string& n, std::string* t, std::vector<std::string> choices, std::string bare,
                         const std::string& h) {
  add(n, t, h, std::move(choices));
  entries_.back().bare_value = std::move(bare);
}

Options::Entry& Options::find(const std::string& raw, const std::string& source) {
  const std::string name = canonical(raw);
  for (Entry& e : entries_)
    if (e.name == name) return e;
  const Entry* best = nullptr;
  size_t best_d = 4;
  for (const Entry& e : entries_) {
    size_t d = edit_distance(name, e.name);
    if (d < best_d) best_d = d, best = &e;
  }
  fail(source, ": unknown option '", raw, "'", best ? str(" (did you mean '", best->name, "'?)") : std::string(),
       "; run ", program_, " --help for the list");
}

bool Options::was_set(const std::string& name) const {
  for (const Entry& e : entries_)
    if (e.name == canonical(name)) return e.set;
  return false;
}

void Options::assign(Entry& e, const Value& value, const std::string& source) {
  using Kind = Value::Kind;
  const std::string where = str(source, ": option '", e.name, "'");
  auto found = [&]() -> std::string {
    switch (value.kind) {
      case Kind::Text: return "'" + value.text + "'";
      case Kind::String: return "the string \"" + value.text + "\"";
      case Kind::Integer: return "the integer " + std::to_string(value.integer);
      case Kind::Float: return "the number " + format_number(value.number);
      case Kind::Bool: return value.boolean ? "true" : "false";
    }
    return "?";
  };
  auto check_range = [&](double x) {
    if (!e.bounds.contains(x)) fail(where, ": expected ", e.bounds.describe(), ", found ", found());
  };
  std::visit(
      [&](auto* target) {
        using T = std::remove_pointer_t<decltype(target)>;
        if constexpr (std::is_same_v<T, std::string>) {
          // A choice among "true", "false", ... (--resume true|false|auto) takes a TOML/JSON boolean as its text.
          const bool boolean_choice = value.kind == Kind::Bool && !e.choices.empty();
          if (value.kind != Kind::Text && value.kind != Kind::String && !boolean_choice)
            fail(where, ": expected a string, found ", found());
          const std::string text = boolean_choice ? (value.boolean ? "true" : "false") : value.text;
          if (!e.choices.empty() && std::find(e.choices.begin(), e.choices.end(), text) == e.choices.end())
            fail(where, ": expected ", join(e.choices), ", found '", text, "'");
          *target = text;
        } else if constexpr (std::is_same_v<T, bool>) {
          if (value.kind == Kind::Bool) *target = value.boolean;
          else if (value.kind == Kind::Text && (value.text == "true" || value.text == "1" || value.text == "yes")) *target = true;
          else if (value.kind == Kind::Text && (value.text == "false" || value.text == "0" || value.text == "no")) *target = false;
          else fail(where, ": expected true or false, found ", found());
        } else {
          // A number: an int64 option takes only integers, a double option integers and floats. Text is parsed
          // whole with from_chars (no leading spaces, no hex); "inf" and "nan" parse and are refused by the bounds.
          constexpr bool integer = std::is_same_v<T, int64_t>;
          const char* expected = integer ? "an integer" : "a number";
          T x = 0;
          if (value.kind == Kind::Integer) {
            x = static_cast<T>(value.integer);
          } else if (value.kind == Kind::Float && !integer) {
            x = static_cast<T>(value.number);
          } else if (value.kind == Kind::Text) {
            auto [end, ec] = std::from_chars(value.text.data(), value.text.data() + value.text.size(), x);
            if (ec == std::errc::result_out_of_range) fail(where, ": expected ", e.bounds.describe(), ", found ", found());
            if (ec != std::errc() || end != value.text.data() + value.text.size())
              fail(where, ": expected ", expected, ", found ", found());
          } else {
            fail(where, ": expected ", expected, ", found ", found());
          }
          check_range(static_cast<double>(x));
          *target = x;
        }
      },
      e.target);
  e.set = true;
}

void Options::set(const std::string& name, const std::string& value, const std::string& source) {
  assign(find(name, source), Value{Value::Kind::Text, value}, source);
}

void Options::load_toml(const std::string& path) {
  const std::string text = read_regular_file(path, "config file (TOML)", kMaxTomlBytes);
  toml::table table;
  try {
    table = toml::parse(text, path);
  } catch (const toml::parse_error& err) {
    std::ostringstream msg;
    msg << err.description() << " (line " << err.source().begin.line << ", column " << err.source().begin.column
        << ")";
    fail(path, ": not valid TOML: ", msg.str());
  }
  for (auto&& [key, node] : table) {
    const std::string name(key.str());
    const std::string where = str(path, ":", key.source().begin.line);
    Entry& e = find(name, where);
    Value v{Value::Kind::String, {}};
    if (auto s = node.value_exact<std::string>()) v.text = *s;
    else if (auto i = node.value_exact<int64_t>()) v.kind = Value::Kind::Integer, v.integer = *i;
    else if (auto d = node.value_exact<double>()) v.kind = Value::Kind::Float, v.number = *d;
    else if (auto b = node.value_exact<bool>()) v.kind = Value::Kind::Bool, v.boolean = *b;
    else fail(where, ": option '", name, "': expected a string, number or boolean, found a TOML ", node.type());
    assign(e, v, where);
  }
}

std::vector<std::string> Options::parse(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  std::vector<std::string> positional;
  // The config file first, so that flags override it wherever they appear.
  for (size_t i = 0; i < args.size(); i++) {
    if (args[i] == "--config") {
      if (i + 1 >= args.size()) fail("--config needs a file name");
      load_toml(args[i + 1]);
    } else if (args[i].rfind("--config=", 0) == 0) {
      load_toml(args[i].substr(9));
    }
  }
  for (size_t i = 0; i < args.size(); i++) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(usage().c_str(), stdout);
      std::exit(0);
    }
    if (a == "--config") { i++; continue; }
    if (a.rfind("--config=", 0) == 0) continue;
    if (a.rfind("--", 0) != 0) {
      positional.push_back(a);
      continue;
    }
    std::string name = a.substr(2), value;
    size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else {
      Entry& e = find(name, "command line");
      const bool is_bool = std::holds_alternative<bool*>(e.target);
      const bool next_is_value = i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0;
      const bool next_is_choice =
          next_is_value && std::find(e.choices.begin(), e.choices.end(), args[i + 1]) != e.choices.end();
      if (is_bool && (!next_is_value || (args[i + 1] != "true" && args[i + 1] != "false"))) {
        value = "true";
      } else if (!e.bare_value.empty() && !next_is_choice) {
        value = e.bare_value;
      } else {
        if (!next_is_value) fail("command line: option '--", name, "' needs a value");
        value = args[++i];
      }
    }
    set(name, value, "command line");
  }
  return positional;
}

nlohmann::json Options::to_json() const {
  nlohmann::json j = nlohmann::json::object();
  for (const Entry& e : entries_) std::visit([&](auto* t) { j[e.name] = *t; }, e.target);
  return j;
}

void Options::from_json(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) fail(source, ": expected an object of options, found ", j.type_name());
  for (auto& [key, value] : j.items()) {
    Entry& e = find(key, source);
    Value v{Value::Kind::String, {}};
    if (value.is_string()) v.text = value.get<std::string>();
    else if (value.is_boolean()) v.kind = Value::Kind::Bool, v.boolean = value.get<bool>();
    else if (value.is_number_integer() && !(value.is_number_unsigned() && value.get<uint64_t>() > INT64_MAX))
      v.kind = Value::Kind::Integer, v.integer = value.get<int64_t>();
    else if (value.is_number()) v.kind = Value::Kind::Float, v.number = value.get<double>();
    else fail(source, ": option '", key, "': expected a string, number or boolean, found ", value.type_name());
    assign(e, v, source);
  }
}

std::string Options::usage() const {
  std::ostringstream out;
  out << "usage: " << program_ << " [--config FILE.toml] [--option value ...]\n" << summary_ << "\n\noptions:\n";
  for (const Entry& e : entries_) {
    std::string current = std::visit(
        [](auto* t) -> std::string {
          using T = std::remove_pointer_t<decltype(t)>;
          if constexpr (std::is_same_v<T, std::string>) return "\"" + *t + "\"";
          else if constexpr (std::is_same_v<T, bool>) return *t ? "true" : "false";
          else {
            std::ostringstream o;
            o << *t;
            return o.str();
          }
        },
        e.target);
    std::string accepts;
    if (!e.choices.empty()) accepts = "; one of " + join(e.choices);
    else if (!std::holds_alternative<std::string*>(e.target) && !std::holds_alternative<bool*>(e.target) &&
             (std::isfinite(e.bounds.min) || std::isfinite(e.bounds.max)))
      accepts = "; " + e.bounds.describe();
    out << "  --" << e.name << " (default " << current << accepts << ")\n      " << e.help << "\n";
  }
  return out.str();
}

}  // namespace tuna
