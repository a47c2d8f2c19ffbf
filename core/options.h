// Options: one table of named settings, filled from a TOML file and then from command-line flags.
//
// Every option of a tool is settable both ways (`--config run.toml` then `--key value` overrides), and
// the effective values can be printed and saved with a checkpoint. The table is declared next to the
// struct it fills, so adding an option is one line. Dashes and underscores are interchangeable in
// names (--micro-batch == --micro_batch), and an unknown name is an error that suggests the nearest.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace tuna {

class Options {
 public:
  explicit Options(std::string program, std::string summary);

  void add(const std::string& name, std::string* target, const std::string& help);
  void add(const std::string& name, int64_t* target, const std::string& help);
  void add(const std::string& name, double* target, const std::string& help);
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
  // Sets every option present in j (e.g. a checkpoint's saved config); unknown keys are errors.
  void from_json(const nlohmann::json& j, const std::string& source);
  std::string usage() const;

 private:
  struct Entry {
    std::string name, help;
    std::variant<std::string*, int64_t*, double*, bool*> target;
    bool set = false;
    std::vector<std::string> choices;  // add_choice: the accepted values
    std::string bare_value;            // add_choice: the value of a bare --name
  };
  Entry& find(const std::string& name, const std::string& source);

  std::string program_, summary_;
  std::vector<Entry> entries_;
};

}  // namespace tuna
