// Options: one table of named settings, filled from a TOML file and then from command-line flags.
//
// Every option of a tool is settable both ways (`--config run.toml` then `--key value` overrides), and
// the effective values can be printed and saved with a checkpoint. The table is declared next to the
// struct it fills, so adding an option is one line. Dashes and underscores are interchangeable in
// names (--micro-batch == --micro_batch), and an unknown name is an error that suggests the nearest.
//
// Each option declares the values it accepts (a Bounds for numbers, the choices for a string), and every value
// is checked against its declaration wherever it comes from: a flag, the TOML file or a checkpoint's saved
// config. Numbers must be finite (inf and nan are refused for every option), and a TOML or JSON value must
// have the option's type: a number for a string option, a string for a number option or a float for an
// integer option is an error naming the option, not a conversion. (One exception: a choice among "true",
// "false", ... such as --resume true|false|auto takes a TOML/JSON boolean as its text.)
#pragma once

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <variant>
#include <vector>

namespace tuna {

// The numbers an option accepts (its bounds): [min, max], either end exclusive when asked.
struct Bounds {
  double min = -HUGE_VAL, max = HUGE_VAL;
  bool exclusive_min = false, exclusive_max = false;

  static Bounds at_least(double lo) { return {lo, HUGE_VAL}; }
  static Bounds above(double lo) { return {lo, HUGE_VAL, true}; }              // (lo, inf)
  static Bounds closed(double lo, double hi) { return {lo, hi}; }               // [lo, hi]
  static Bounds half_open(double lo, double hi) { return {lo, hi, false, true}; }  // [lo, hi)
  static Bounds open_closed(double lo, double hi) { return {lo, hi, true, false}; }  // (lo, hi]
  bool contains(double x) const;
  std::string describe() const;  // "(0, 1]", ">= 1", "any finite number"
};

class Options {
 public:
  explicit Options(std::string program, std::string summary);

  // choices: the accepted strings (empty: any string).
  void add(const std::string& name, std::string* target, const std::string& help,
           std::vector<std::string> choices = {});
  void add(const std::string& name, int64_t* target, const std::string& help, Bounds bounds = {});
  void add(const std::string& name, double* target, const std::string& help, Bounds bounds = {});
  void add(const std::string& name, bool* target, const std::string& help);
  // A string that must be one of `choices`; a bare `--name` (no value, or one that is not a choice) means
  // `bare_value`, as for a bool (`--resume` = `--resume true`, and `--resume auto`).
  void add_choice(const std::string& name, std::string* target, std::vector<std::string> choices,
                  std::string bare_value, const std::string& help);

  // Parses argv: `--config FILE` (TOML, flat keys or tables whose keys are joined with '_' is NOT done:
  // keys must match option names), then `--name value`, `--name=value`, and a bare `--flag` for bools.
  // Returns the positional arguments. `--help` prints usage and exits 0.
  std::vector<std::string> parse(int argc, char** argv);
  void load_toml(const std::string& path);
  // Sets one option from text, as a flag would; `source` names where the text came from in errors.
  void set(const std::string& name, const std::string& value, const std::string& source);
  bool was_set(const std::string& name) const;

  nlohmann::json to_json() const;
  // Sets every option present in j (e.g. a checkpoint's saved config); unknown keys and values of the wrong
  // JSON type are errors.
  void from_json(const nlohmann::json& j, const std::string& source);
  std::string usage() const;

 private:
  // A value as it arrived: text from a flag (parsed by the option's type), or a typed TOML/JSON value.
  struct Value {
    enum class Kind { Text, String, Integer, Float, Bool } kind;
    std::string text;
    int64_t integer = 0;
    double number = 0;
    bool boolean = false;
  };
  struct Entry {
    std::string name, help;
    std::variant<std::string*, int64_t*, double*, bool*> target;
    Bounds bounds;
    std::vector<std::string> choices;
    bool set = false;
    std::string bare_value;  // add_choice: the value of a bare --name
  };
  Entry& find(const std::string& name, const std::string& source);
  void assign(Entry& e, const Value& value, const std::string& source);

  std::string program_, summary_;
  std::vector<Entry> entries_;
};

}  // namespace tuna
