// core/options.h: flags and TOML keys, dashes and underscores alike; a choice option with a bare form
// (`--resume` = `--resume true`, `--resume auto`).
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/options.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

using testing_util::error_of;

struct Parsed {
  std::string resume = "false";
  int64_t micro_batch = 1;
  bool overwrite = false;
  std::vector<std::string> positional;
};

Parsed parse(std::vector<std::string> args) {
  Parsed p;
  Options o("prog", "test");
  o.add_choice("resume", &p.resume, {"false", "true", "auto"}, "true", "resume");
  o.add("micro_batch", &p.micro_batch, "batch");
  o.add("overwrite", &p.overwrite, "overwrite");
  args.insert(args.begin(), "prog");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  p.positional = o.parse(static_cast<int>(argv.size()), argv.data());
  return p;
}

TEST(Options, DashesAndUnderscoresAlike) {
  EXPECT_EQ(parse({"--micro-batch", "3"}).micro_batch, 3);
  EXPECT_EQ(parse({"--micro_batch=4"}).micro_batch, 4);
  EXPECT_EQ(parse({"--micro-batch=5"}).micro_batch, 5);
}

TEST(Options, ChoiceWithABareForm) {
  EXPECT_EQ(parse({}).resume, "false");
  EXPECT_EQ(parse({"--resume"}).resume, "true");
  EXPECT_EQ(parse({"--resume", "--micro_batch", "2"}).resume, "true");
  EXPECT_EQ(parse({"--resume", "auto"}).resume, "auto");
  EXPECT_EQ(parse({"--resume=auto"}).resume, "auto");
  EXPECT_EQ(parse({"--resume", "false"}).resume, "false");
  // A bare choice does not swallow a positional argument.
  const Parsed p = parse({"--resume", "dir"});
  EXPECT_EQ(p.resume, "true");
  EXPECT_EQ(p.positional, std::vector<std::string>{"dir"});
  const std::string e = error_of([] { parse({"--resume=sometimes"}); });
  EXPECT_NE(e.find("option 'resume': expected one of false, true, auto, found 'sometimes'"), std::string::npos) << e;
}

TEST(Options, ChoiceFromToml) {
  testing_util::TempDir tmp("options");
  std::ofstream(tmp / "a.toml") << "resume = \"auto\"\n";
  std::ofstream(tmp / "b.toml") << "resume = true\n";
  EXPECT_EQ(parse({"--config", (tmp / "a.toml").string()}).resume, "auto");
  EXPECT_EQ(parse({"--config", (tmp / "b.toml").string()}).resume, "true");
  EXPECT_EQ(parse({"--config", (tmp / "b.toml").string(), "--resume", "false"}).resume, "false");
}

}  // namespace
}  // namespace tuna
