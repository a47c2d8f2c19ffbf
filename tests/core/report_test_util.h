// Reading a run report back: its plots (title, frame, each line's points in data coordinates) and a run
// directory with known metrics to draw. Shared by tests/core/test_run_report.cpp and the headless-browser test
// of build/report (tests/tools/test_report.cpp).
#pragma once

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/run_report.h"

namespace tuna::testing_util {

struct DrawnPlot {
  std::string title;
  PlotFrame frame;
  std::map<std::string, std::vector<std::pair<double, double>>> lines;  // data-series -> points in data units
  std::map<std::string, std::vector<std::pair<double, double>>> marks;  // marked points (clipped steps)
};

inline double attribute(const std::string& tag, const std::string& name) {
  std::smatch m;
  if (!std::regex_search(tag, m, std::regex(" " + name + "=\"([-0-9.e+]+)\""))) return NAN;
  return std::stod(m[1]);
}

// Every <svg class="plot"> of the page, read back through its frame.
inline std::vector<DrawnPlot> drawn_plots(const std::string& html) {
  std::vector<DrawnPlot> out;
  size_t at = 0;
  while ((at = html.find("<svg class=\"plot\"", at)) != std::string::npos) {
    const size_t end = html.find("</svg>", at);
    const std::string svg = html.substr(at, end - at);
    const std::string tag = svg.substr(0, svg.find('>'));
    DrawnPlot p;
    PlotFrame& f = p.frame;
    f.x0 = attribute(tag, "data-x0"), f.x1 = attribute(tag, "data-x1"), f.y0 = attribute(tag, "data-y0");
    f.y1 = attribute(tag, "data-y1"), f.left = attribute(tag, "data-left"), f.right = attribute(tag, "data-right");
    f.top = attribute(tag, "data-top"), f.bottom = attribute(tag, "data-bottom");
    f.log_y = attribute(tag, "data-log-y") == 1;
    std::smatch m;
    if (std::regex_search(svg, m, std::regex("<text class=\"title\"[^>]*>([^<]*)</text>"))) p.title = m[1];
    const std::regex line("<polyline data-series=\"([^\"]*)\"[^>]* points=\"([^\"]*)\""), point("([-0-9.]+),([-0-9.]+)");
    for (auto it = std::sregex_iterator(svg.begin(), svg.end(), line); it != std::sregex_iterator(); ++it) {
      const std::string pts = (*it)[2];
      auto& dst = p.lines[(*it)[1]];
      for (auto q = std::sregex_iterator(pts.begin(), pts.end(), point); q != std::sregex_iterator(); ++q)
        dst.emplace_back(f.data_x(std::stod((*q)[1])), f.data_y(std::stod((*q)[2])));
    }
    const std::regex group("<g class=\"marks\" data-series=\"([^\"]*)\"[^>]*>(.*?)</g>"),
        circle("cx=\"([-0-9.]+)\" cy=\"([-0-9.]+)\"");
    for (auto it = std::sregex_iterator(svg.begin(), svg.end(), group); it != std::sregex_iterator(); ++it) {
      const std::string body = (*it)[2];
      auto& dst = p.marks[(*it)[1]];
      for (auto q = std::sregex_iterator(body.begin(), body.end(), circle); q != std::sregex_iterator(); ++q)
        dst.emplace_back(f.data_x(std::stod((*q)[1])), f.data_y(std::stod((*q)[2])));
    }
    out.push_back(std::move(p));
    at = end;
  }
  return out;
}

inline const DrawnPlot* plot_titled(const std::vector<DrawnPlot>& plots, const std::string& title) {
  for (const DrawnPlot& p : plots)
    if (p.title == title) return &p;
  return nullptr;
}

// The metrics of a run of `steps` steps with known curves: loss 5 * 0.98^step, lr warming up over 10 steps then
// decaying, gradient norm above the clip of 1.0 on every 7th step, validation every 10 steps.
inline double known_loss(int step) { return 5.0 * std::pow(0.98, step); }
inline double known_lr(int step) { return step <= 10 ? 1e-3 * step / 10 : 1e-3 * (1.0 - 0.5 * (step - 10) / 90.0); }
inline double known_norm(int step) { return step % 7 == 0 ? 2.5 + 0.01 * step : 0.3 + 0.002 * step; }

inline void write_known_run(const std::filesystem::path& dir, int steps, double lr_scale = 1.0,
                            const std::string& tail = "") {
  std::filesystem::create_directories(dir);
  std::ofstream out(dir / "metrics.jsonl");
  nlohmann::json config = {{"steps", steps}, {"lr", 1e-3 * lr_scale}, {"grad_clip", 1.0}, {"gpu_hour_cost", 4.34},
                           {"micro_batch", 4}};
  out << nlohmann::json{{"step", 0}, {"event", "start"}, {"config", config}, {"world", {{"size", 2}, {"dp", 2}, {"tp", 1}}},
                        {"memory_plan", {{"items", nlohmann::json::array({{{"name", "weights"}, {"kind", "weights"}, {"bytes", 1000000}}})},
                                         {"total", 1000000}, {"peak", 1500000}, {"device", "cpu"}}},
                        {"host_mb_at_start", 100.0}}
             .dump()
      << "\n";
  for (int s = 1; s <= steps; s++) {
    const double norm = known_norm(s);
    out << nlohmann::json{{"step", s}, {"loss", known_loss(s)}, {"lr", known_lr(s) * lr_scale}, {"grad_norm", norm},
                          {"clip_scale", norm > 1.0 ? 1.0 / norm : 1.0}, {"tokens_per_s", 1000.0 + s},
                          {"mfu", 0.3}, {"mem_mb", 101.0}, {"peak_mem_mb", 101.5}, {"elapsed_s", 2.0 * s},
                          {"eta_s", 2.0 * (steps - s)}}
               .dump()
        << "\n";
    if (s % 10 == 0) out << nlohmann::json{{"step", s}, {"val_loss", known_loss(s) + 0.1}}.dump() << "\n";
  }
  out << tail;
}

}  // namespace tuna::testing_util
