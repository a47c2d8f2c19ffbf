// Options: every value is checked against its option's declaration, from flags, TOML and saved JSON alike.
#include "core/options.h"

#include <gtest/gtest.h>

#include <sys/stat.h>

#include <fstream>
#include <functional>

#include "core/error.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

using testing_util::TempDir;

struct Settings {
  std::string name = "x", device = "cpu";
  int64_t steps = 10;
  double lr = 1e-3, clip = 1.0;
  bool flag = false;
};

Options declare(Settings& s) {
  Options o("test", "options under test");
  o.add("name", &s.name, "any string");
  o.add("device", &s.device, "one of three", {"auto", "cpu", "cuda"});
  o.add("steps", &s.steps, "positive", Bounds::closed(1, 1000));
  o.add("lr", &s.lr, "in (0, 1]", Bounds::open_closed(0, 1));
  o.add("grad_clip", &s.clip, "unbounded but finite");
  o.add("flag", &s.flag, "a bool");
  return o;
}

using testing_util::error_of;

TEST(Options, FlagsAreParsedByTypeAndChecked) {
  Settings s;
  Options o = declare(s);
  o.set("steps", "20", "command line");
  o.set("lr", "3e-4", "command line");
  o.set("device", "cuda", "command line");
  EXPECT_EQ(s.steps, 20);
  EXPECT_DOUBLE_EQ(s.lr, 3e-4);
  EXPECT_EQ(s.device, "cuda");
  for (const char* bad : {"inf", "nan", "-inf", "1e400", "0", "2", " 0.1", "0x1p-3", ""}) {
    const std::string e = error_of([&] { o.set("lr", bad, "command line"); });
    EXPECT_NE(e.find("option 'lr'"), std::string::npos) << bad << ": " << e;
  }
  EXPECT_NE(error_of([&] { o.set("grad_clip", "nan", "command line"); }).find("any finite number"), std::string::npos);
  EXPECT_NE(error_of([&] { o.set("steps", "0", "command line"); }).find("expected [1, 1000], found '0'"), std::string::npos);
  EXPECT_NE(error_of([&] { o.set("steps", "99999999999999999999", "command line"); }).find("option 'steps'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { o.set("steps", "1.5", "command line"); }).find("expected an integer"), std::string::npos);
  EXPECT_NE(error_of([&] { o.set("device", "tpu", "command line"); }).find("expected auto, cpu or cuda"),
            std::string::npos);
  EXPECT_DOUBLE_EQ(s.lr, 3e-4);  // a refused value leaves the setting as it was
}

TEST(Options, TomlValuesMustHaveTheOptionsType) {
  TempDir tmp("options");
  auto toml = [&](const std::string& text) {
    std::ofstream(tmp / "run.toml") << text;
    Settings s;
    Options o = declare(s);
    return error_of([&] { o.load_toml((tmp / "run.toml").string()); });
  };
  EXPECT_EQ(toml("steps = 5\nlr = 1\nname = \"a\"\nflag = true\n"), "");  // an integer is a number
  EXPECT_NE(toml("name = 5\n").find("option 'name': expected a string, found the integer 5"), std::string::npos);
  EXPECT_NE(toml("lr = \"3e-4\"\n").find("option 'lr': expected a number, found the string"), std::string::npos);
  EXPECT_NE(toml("steps = 5.0\n").find("option 'steps': expected an integer, found the number 5"), std::string::npos);
  EXPECT_NE(toml("flag = 1\n").find("expected true or false"), std::string::npos);
  EXPECT_NE(toml("lr = inf\n").find("option 'lr': expected (0, 1]"), std::string::npos);
  EXPECT_NE(toml("grad_clip = nan\n").find("option 'grad_clip'"), std::string::npos);
  EXPECT_NE(toml("lr = [1, 2]\n").find("expected a string, number or boolean"), std::string::npos);
  EXPECT_NE(toml("steps = 5\nsteps = 6\n").find("not valid TOML"), std::string::npos);
  EXPECT_NE(toml("device = \"gpu\"\n").find("expected auto, cpu or cuda"), std::string::npos);
  // Where a file is expected, a FIFO or a directory is refused by name instead of blocking or failing later.
  Settings s;
  Options o = declare(s);
  EXPECT_NE(error_of([&] { o.load_toml(tmp.path.string()); }).find("is a directory, not a regular file"),
            std::string::npos);
  ASSERT_EQ(::mkfifo((tmp / "fifo.toml").c_str(), 0600), 0);
  EXPECT_NE(error_of([&] { o.load_toml((tmp / "fifo.toml").string()); }).find("is a FIFO (named pipe)"),
            std::string::npos);
}

TEST(Options, SavedJsonIsCheckedLikeAnyOtherSource) {
  Settings s;
  Options o = declare(s);
  o.from_json({{"steps", 7}, {"lr", 0.5}, {"name", "b"}}, "state.json");
  EXPECT_EQ(s.steps, 7);
  EXPECT_NE(error_of([&] { o.from_json({{"name", 3}}, "state.json"); }).find("expected a string"), std::string::npos);
  EXPECT_NE(error_of([&] { o.from_json({{"steps", 1e30}}, "state.json"); }).find("expected an integer"),
            std::string::npos);
  EXPECT_NE(error_of([&] { o.from_json({{"steps", uint64_t{1} << 63}}, "state.json"); }).find("option 'steps'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { o.from_json(nlohmann::json::array(), "state.json"); }).find("expected an object"),
            std::string::npos);
  // The round trip of the declared values passes its own checks.
  Settings t;
  Options back = declare(t);
  back.from_json(o.to_json(), "round trip");
  EXPECT_EQ(t.steps, 7);
}

TEST(Options, UsageShowsWhatEachOptionAccepts) {
  Settings s;
  const std::string u = declare(s).usage();
  EXPECT_NE(u.find("--lr (default 0.001; (0, 1])"), std::string::npos) << u;
  EXPECT_NE(u.find("one of auto, cpu or cuda"), std::string::npos) << u;
}

// ---- a choice option with a bare form (--resume = --resume true, --resume auto) ----

struct Parsed {
  std::string resume = "false";
  int64_t micro_batch = 1;
  bool overwrite = false;
  std::vector<std::string> positional;
};

Parsed parse_choice(std::vector<std::string> args) {
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
  EXPECT_EQ(parse_choice({"--micro-batch", "3"}).micro_batch, 3);
  EXPECT_EQ(parse_choice({"--micro_batch=4"}).micro_batch, 4);
  EXPECT_EQ(parse_choice({"--micro-batch=5"}).micro_batch, 5);
}

TEST(Options, ChoiceWithABareForm) {
  EXPECT_EQ(parse_choice({}).resume, "false");
  EXPECT_EQ(parse_choice({"--resume"}).resume, "true");
  EXPECT_EQ(parse_choice({"--resume", "--micro_batch", "2"}).resume, "true");
  EXPECT_EQ(parse_choice({"--resume", "auto"}).resume, "auto");
  EXPECT_EQ(parse_choice({"--resume=auto"}).resume, "auto");
  EXPECT_EQ(parse_choice({"--resume", "false"}).resume, "false");
  // A bare choice does not swallow a positional argument.
  const Parsed p = parse_choice({"--resume", "dir"});
  EXPECT_EQ(p.resume, "true");
  EXPECT_EQ(p.positional, std::vector<std::string>{"dir"});
  const std::string e = error_of([] { parse_choice({"--resume=sometimes"}); });
  EXPECT_NE(e.find("option 'resume': expected false, true or auto, found 'sometimes'"), std::string::npos) << e;
}

TEST(Options, ChoiceFromToml) {
  testing_util::TempDir tmp("options");
  std::ofstream(tmp / "a.toml") << "resume = \"auto\"\n";
  std::ofstream(tmp / "b.toml") << "resume = true\n";
  EXPECT_EQ(parse_choice({"--config", (tmp / "a.toml").string()}).resume, "auto");
  EXPECT_EQ(parse_choice({"--config", (tmp / "b.toml").string()}).resume, "true");
  EXPECT_EQ(parse_choice({"--config", (tmp / "b.toml").string(), "--resume", "false"}).resume, "false");
}

}  // namespace
}  // namespace tuna
