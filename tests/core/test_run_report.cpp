// The run report: every plot's lines, read back through the frame the report writes on it, are the metrics;
// a killed run's cut last line and a bad line in the middle are skipped and reported; several runs overlay;
// the page fetches nothing. (Rendering in a browser: tests/tools/test_report.cpp.)
#include <gtest/gtest.h>

#include "core/error.h"
#include "core/run_report.h"
#include "tests/core/report_test_util.h"
#include "tests/test_util.h"

namespace tuna {
namespace {

using testing_util::drawn_plots;
using testing_util::plot_titled;
using testing_util::TempDir;
using testing_util::write_known_run;

// One pixel of the 500-pixel-wide plot area in data units: the drawing rounds to 0.1 px.
void expect_curve(const testing_util::DrawnPlot& plot, const std::string& series, int steps, double (*f)(int),
                  double scale = 1.0) {
  auto it = plot.lines.find(series);
  ASSERT_NE(it, plot.lines.end()) << plot.title << " has no line '" << series << "'";
  const auto& pts = it->second;
  ASSERT_EQ(static_cast<int>(pts.size()), steps) << plot.title << " / " << series;
  const PlotFrame& fr = plot.frame;
  const double dx = (fr.x1 - fr.x0) / (fr.right - fr.left) * 0.1, dy = (fr.y1 - fr.y0) / (fr.bottom - fr.top) * 0.1;
  for (int s = 1; s <= steps; s++) {
    EXPECT_NEAR(pts[s - 1].first, s, dx) << series;
    const double want = f(s) * scale;
    if (fr.log_y) EXPECT_NEAR(std::log10(pts[s - 1].second), std::log10(want), dy) << series << " step " << s;
    else EXPECT_NEAR(pts[s - 1].second, want, dy) << series << " step " << s;
  }
}

TEST(RunReport, PlotsAreDrawnFromTheMetrics) {
  TempDir tmp("report");
  write_known_run(tmp / "run", 100);
  const std::string html = render_run_report({read_run_metrics(tmp / "run")});
  const auto plots = drawn_plots(html);
  const auto* loss = plot_titled(plots, "Loss");
  const auto* lr = plot_titled(plots, "Learning rate");
  const auto* norm = plot_titled(plots, "Gradient norm (before clipping)");
  ASSERT_TRUE(loss && lr && norm) << html.substr(0, 2000);
  expect_curve(*loss, "train", 100, testing_util::known_loss);
  expect_curve(*lr, "lr", 100, testing_util::known_lr);
  EXPECT_TRUE(norm->frame.log_y);
  expect_curve(*norm, "grad norm", 100, testing_util::known_norm);
  // Validation every 10 steps, 0.1 above the training curve.
  ASSERT_EQ(loss->lines.at("validation").size(), 10u);
  EXPECT_NEAR(loss->lines.at("validation")[4].second, testing_util::known_loss(50) + 0.1, 0.02);
  // The clipped steps (every 7th) are marked at their norm, and nothing else is.
  const auto& clipped = norm->marks.at("clipped steps");
  ASSERT_EQ(clipped.size(), 14u);
  for (const auto& [x, y] : clipped) EXPECT_EQ(static_cast<int>(std::lround(x)) % 7, 0) << x;
  // MFU in percent, memory against the planned peak line, cost from elapsed x 2 GPUs x $4.34.
  expect_curve(*plot_titled(plots, "MFU"), "MFU", 100, [](int) { return 30.0; });
  const auto* cost = plot_titled(plots, "Cost");
  ASSERT_TRUE(cost);
  expect_curve(*cost, "cost so far", 100, [](int s) { return 2.0 * s / 3600 * 2 * 4.34; });
  EXPECT_NE(html.find("planned peak (host)"), std::string::npos);
  EXPECT_NE(html.find("$0.48"), std::string::npos) << "cost so far: 200 s x 2 GPUs x $4.34/h";
}

TEST(RunReport, FetchesNothing) {
  TempDir tmp("report");
  write_known_run(tmp / "run", 20);
  const std::string html = render_run_report({read_run_metrics(tmp / "run")});
  for (const char* remote : {"http:", "https:", "src=", "<link", "@import", "url("})
    EXPECT_EQ(html.find(remote), std::string::npos) << remote;
  EXPECT_NE(html.find("<svg class=\"plot\""), std::string::npos);
}

TEST(RunReport, AKilledRunsCutLastLineStillMakesAReport) {
  TempDir tmp("report");
  // A bad record in the middle (a disk hiccup), then the last line cut mid-write, without its newline.
  write_known_run(tmp / "run", 30, 1.0, "{not json}\n{\"step\": 31, \"loss\": 1.2, \"lr\": 0.00");
  const RunMetrics run = read_run_metrics(tmp / "run");
  EXPECT_EQ(run.skipped_lines, 2);
  EXPECT_TRUE(run.last_line_cut);
  EXPECT_NE(run.first_skipped.find("metrics.jsonl:"), std::string::npos) << run.first_skipped;
  EXPECT_EQ(run.series.at("loss").size(), 30u);
  const std::string html = render_run_report({run});
  EXPECT_NE(html.find("2 line(s) of metrics.jsonl skipped"), std::string::npos);
  expect_curve(*plot_titled(drawn_plots(html), "Loss"), "train", 30, testing_util::known_loss);
  // A cut last line alone: the run reads as killed (or still writing).
  write_known_run(tmp / "cut", 30, 1.0, "{\"step\": 31, \"lo");
  const RunMetrics cut = read_run_metrics(tmp / "cut");
  EXPECT_EQ(cut.skipped_lines, 1);
  EXPECT_NE(cut.first_skipped.find("cut short"), std::string::npos) << cut.first_skipped;
  EXPECT_NE(render_run_report({cut}).find("killed"), std::string::npos);
}

TEST(RunReport, AResumedStepKeepsItsLastRecord) {
  TempDir tmp("report");
  write_known_run(tmp / "run", 20, 1.0,
                  "{\"step\": 10, \"event\": \"start\", \"config\": {\"steps\": 20}}\n"
                  "{\"step\": 11, \"loss\": 0.5, \"elapsed_s\": 1.0}\n");
  const RunMetrics run = read_run_metrics(tmp / "run");
  EXPECT_EQ(run.starts, 2);
  const auto& loss = run.series.at("loss");
  ASSERT_EQ(loss.size(), 20u);
  EXPECT_DOUBLE_EQ(loss[10].second, 0.5);  // step 11, logged again after the resume
}

TEST(RunReport, SeveralRunsOverlayWithTheirConfigsSideBySide) {
  TempDir tmp("report");
  write_known_run(tmp / "lr1e-3", 40);
  write_known_run(tmp / "lr3e-3", 40, 3.0);
  const std::string html = render_run_report({read_run_metrics(tmp / "lr1e-3"), read_run_metrics(tmp / "lr3e-3")});
  const auto plots = drawn_plots(html);
  const auto* lr = plot_titled(plots, "Learning rate");
  ASSERT_TRUE(lr);
  expect_curve(*lr, "lr1e-3 lr", 40, testing_util::known_lr);
  expect_curve(*lr, "lr3e-3 lr", 40, testing_util::known_lr, 3.0);
  // The option that differs comes first and is marked.
  const size_t differs = html.find("<tr class=\"differs\"><td>lr</td>");
  ASSERT_NE(differs, std::string::npos);
  EXPECT_LT(differs, html.find("<td>grad_clip</td>"));
}

TEST(RunReport, LongRunsKeepEachPixelColumnsExtremes) {
  TempDir tmp("report");
  const std::filesystem::path dir = tmp / "long";
  std::filesystem::create_directories(dir);
  std::ofstream out(dir / "metrics.jsonl");
  for (int s = 1; s <= 20000; s++)
    out << nlohmann::json{{"step", s}, {"loss", s == 12345 ? 9.0 : 2.0 + 0.1 * std::sin(s * 0.01)}}.dump() << "\n";
  out.close();
  const auto plots = drawn_plots(render_run_report({read_run_metrics(dir)}));
  const auto* loss = plot_titled(plots, "Loss");
  ASSERT_TRUE(loss);
  const auto& pts = loss->lines.at("train");
  EXPECT_LT(pts.size(), 2500u);  // at most 4 points per pixel column
  double highest = 0;
  for (const auto& p : pts) highest = std::max(highest, p.second);
  EXPECT_NEAR(highest, 9.0, 0.05) << "the one spike survives decimation";
}

TEST(RunReport, MissingMetricsIsAnErrorNamingTheFile) {
  TempDir tmp("report");
  try {
    read_run_metrics(tmp / "nowhere");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("metrics.jsonl"), std::string::npos) << e.what();
  }
}

TEST(RunReport, WritesTheFileAndListsTheCheckpoints) {
  TempDir tmp("report");
  write_known_run(tmp / "run", 10);
  std::filesystem::create_directories(tmp / "run" / "ckpt" / "step_00000010");
  std::ofstream(tmp / "run" / "ckpt" / "step_00000010" / "model.safetensors") << std::string(1234, 'x');
  std::filesystem::create_directories(tmp / "run" / "ckpt" / ".tmp-step_00000020");  // unfinished: not listed
  write_run_report({tmp / "run"}, tmp / "run" / "report.html");
  const std::string html = testing_util::read_file(tmp / "run" / "report.html");
  EXPECT_NE(html.find("step_00000010"), std::string::npos);
  EXPECT_NE(html.find("1.2 KB"), std::string::npos);
  EXPECT_EQ(html.find("step_00000020"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(tmp / "run" / "report.html.tmp"));
}

}  // namespace
}  // namespace tuna
