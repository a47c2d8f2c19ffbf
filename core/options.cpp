#include "core/options.h"

#include <toml++/toml.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "core/error.h"

namespace tuna {
namespace {

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

}  // namespace

Options::Options(std::string program, std::string summary)
    : program_(std::move(program)), summary_(std::move(summary)) {}

void Options::add(const std::string& n, std::string* t, const std::string& h) { entries_.push_back({canonical(n), h, t, false, {}, {}}); }
void Options::add(const std::string& n, int64_t* t, const std::string& h) { entries_.push_back({canonical(n), h, t, false, {}, {}}); }
void Options::add(const std::string& n, double* t, const std::string& h) { entries_.push_back({canonical(n), h, t, false, {}, {}}); }
void Options::add(const std::string& n, bool* t, const std::string& h) { entries_.push_back({canonical(n), h, t, false, {}, {}}); }
void Options::add_choice(const std::string& n, std::string* t, std::vector<std::string> choices, std::string bare,
                         const std::string& h) {
  entries_.push_back({canonical(n), h, t, false, std::move(choices), std::move(bare)});
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

void Options::set(const std::string& name, const std::string& value, const std::string& source) {
  Entry& e = find(name, source);
  const std::string where = str(source, ": option '", e.name, "'");
  std::visit(
      [&](auto* target) {
        using T = std::remove_pointer_t<decltype(target)>;
        if constexpr (std::is_same_v<T, std::string>) {
          if (!e.choices.empty() && std::find(e.choices.begin(), e.choices.end(), value) == e.choices.end()) {
            std::string list;
            for (const std::string& c : e.choices) list += (list.empty() ? "" : ", ") + c;
            fail(where, ": expected one of ", list, ", found '", value, "'");
          }
          *target = value;
        } else if constexpr (std::is_same_v<T, bool>) {
          if (value == "true" || value == "1" || value == "yes") *target = true;
          else if (value == "false" || value == "0" || value == "no") *target = false;
          else fail(where, ": expected true or false, found '", value, "'");
        } else if constexpr (std::is_same_v<T, int64_t>) {
          int64_t x = 0;
          auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), x);
          if (ec != std::errc() || end != value.data() + value.size())
            fail(where, ": expected an integer, found '", value, "'");
          *target = x;
        } else {
          char* end = nullptr;
          double x = std::strtod(value.c_str(), &end);
          if (value.empty() || end != value.c_str() + value.size())
            fail(where, ": expected a number, found '", value, "'");
          *target = x;
        }
      },
      e.target);
  e.set = true;
}

void Options::load_toml(const std::string& path) {
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& err) {
    std::ostringstream msg;
    msg << err.description() << " (line " << err.source().begin.line << ", column " << err.source().begin.column
        << ")";
    fail(path, ": not valid TOML: ", msg.str());
  } catch (const std::exception& err) {
    fail(path, ": cannot read the config file: ", err.what());
  }
  for (auto&& [key, node] : table) {
    const std::string name(key.str());
    const std::string where = str(path, ":", key.source().begin.line);
    std::string text;
    if (auto s = node.value_exact<std::string>()) text = *s;
    else if (auto i = node.value_exact<int64_t>()) text = std::to_string(*i);
    else if (auto d = node.value_exact<double>()) {
      std::ostringstream o;
      o.precision(17);
      o << *d;
      text = o.str();
    } else if (auto b = node.value_exact<bool>()) text = *b ? "true" : "false";
    else fail(where, ": option '", name, "': expected a string, number or boolean");
    // An integer written as 3e-4 style float for an int option is caught by set().
    set(name, text, where);
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
  for (auto& [key, value] : j.items()) {
    if (value.is_string()) set(key, value.get<std::string>(), source);
    else if (value.is_boolean()) set(key, value.get<bool>() ? "true" : "false", source);
    else if (value.is_number_integer()) set(key, std::to_string(value.get<int64_t>()), source);
    else if (value.is_number()) {
      std::ostringstream o;
      o.precision(17);
      o << value.get<double>();
      set(key, o.str(), source);
    } else fail(source, ": option '", key, "': expected a string, number or boolean");
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
    out << "  --" << e.name << " (default " << current << ")\n      " << e.help << "\n";
  }
  return out.str();
}

}  // namespace tuna
