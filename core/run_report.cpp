// The run report (core/run_report.h): metrics.jsonl -> one HTML file with inline SVG plots.
#include "core/run_report.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/progress.h"

namespace tuna {

namespace fs = std::filesystem;
using nlohmann::json;

double PlotFrame::py(double y) const {
  const double v = log_y ? std::log10(y) : y;
  return bottom - (v - y0) / (y1 - y0) * (bottom - top);
}

double PlotFrame::data_y(double py) const {
  const double v = y0 + (bottom - py) / (bottom - top) * (y1 - y0);
  return log_y ? std::pow(10.0, v) : v;
}

// ---- reading a run ----

namespace {

using Points = std::vector<std::pair<double, double>>;

std::string utc_time(int64_t unix_seconds) {
  const std::time_t t = static_cast<std::time_t>(unix_seconds);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return stamp;
}

std::vector<CheckpointOnDisk> checkpoints_on_disk(const fs::path& ckpt_root) {
  std::vector<CheckpointOnDisk> out;
  std::error_code ec;
  if (!fs::is_directory(ckpt_root, ec)) return out;
  for (const fs::directory_entry& e : fs::directory_iterator(ckpt_root, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory() || name.rfind("step_", 0) != 0) continue;  // .tmp-step_* are unfinished writes
    CheckpointOnDisk c;
    c.name = name;
    try {
      c.step = std::stoll(name.substr(5));
    } catch (const std::exception&) {
      continue;
    }
    for (const fs::directory_entry& f : fs::directory_iterator(e.path(), ec))
      if (f.is_regular_file(ec)) c.bytes += static_cast<int64_t>(f.file_size(ec)), c.files++;
    const auto written = std::chrono::file_clock::to_sys(fs::last_write_time(e.path(), ec));
    c.written_unix = std::chrono::duration_cast<std::chrono::seconds>(written.time_since_epoch()).count();
    out.push_back(c);
  }
  std::sort(out.begin(), out.end(), [](const CheckpointOnDisk& a, const CheckpointOnDisk& b) { return a.step < b.step; });
  return out;
}

}  // namespace

// A validation row that carries --eval_tasks metrics only (a run without validation data).
static bool has_task_metrics(const json& j) {
  for (const auto& [key, value] : j.items())
    if (key.starts_with("eval_acc/")) return true;
  return false;
}

RunMetrics read_run_metrics(const fs::path& run_dir) {
  RunMetrics run;
  run.dir = run_dir;
  run.name = fs::absolute(run_dir).lexically_normal().filename().string();
  if (run.name.empty()) run.name = fs::absolute(run_dir).lexically_normal().parent_path().filename().string();
  const fs::path path = run_dir / "metrics.jsonl";
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path.string(), ": cannot open (a run directory of build/train has metrics.jsonl)");

  std::map<int64_t, json> steps;  // a step logged again after a resume replaces the earlier record
  std::map<int64_t, double> val;
  std::string line;
  int64_t line_no = 0;
  bool skipped_last = false;
  while (std::getline(in, line)) {
    line_no++;
    const bool has_newline = !in.eof();
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j;
    std::string why;
    try {
      j = json::parse(line);
      if (!j.is_object()) why = "not a JSON object";
      else if (!j.contains("step") || !j["step"].is_number()) why = "no numeric 'step'";
    } catch (const json::parse_error& e) {
      why = has_newline ? str("not valid JSON (", e.what(), ")") : "cut short (no newline: the run was killed mid-write)";
    }
    skipped_last = !why.empty();
    if (!why.empty()) {
      if (run.skipped_lines++ == 0) run.first_skipped = str(path.string(), ":", line_no, ": ", why);
      continue;
    }
    const int64_t step = j["step"].get<int64_t>();
    const std::string event = j.value("event", "");
    if (event == "start") {
      run.start = j, run.end = json(), run.starts++;
    } else if (event == "end") {
      run.end = j;
    } else if (j.contains("val_loss") || has_task_metrics(j)) {
      if (j.contains("val_loss") && j["val_loss"].is_number()) val[step] = j["val_loss"].get<double>();
      // --eval_tasks: each task's accuracy at the validation (engine/validator.h).
      for (const auto& [key, value] : j.items())
        if ((key.starts_with("eval_acc/") || key.starts_with("eval_acc_norm/")) && value.is_number())
          run.series[key].emplace_back(double(step), value.get<double>());
      // A preference objective's held-out metrics (engine/preference.h): curves beside the training ones.
      for (const char* key : {"val_rewards/accuracies", "val_rewards/margins"})
        if (j.contains(key) && j[key].is_number()) run.series[key].emplace_back(double(step), j[key].get<double>());
    } else {
      steps[step] = std::move(j);
    }
  }
  run.last_line_cut = skipped_last;

  for (const auto& [step, record] : steps)
    for (const auto& [key, value] : record.items())
      if (value.is_number() && key != "step") run.series[key].emplace_back(double(step), value.get<double>());
  for (const auto& [step, loss] : val) run.val_loss.emplace_back(double(step), loss);
  run.checkpoints = checkpoints_on_disk(run_dir / "ckpt");
  return run;
}

// ---- drawing ----

namespace {

std::string html_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string fixed(double x, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, x);
  return buf;
}

// A number as an axis or a table shows it: 3 significant digits, k/M/G for large values.
std::string compact(double v) {
  if (!std::isfinite(v)) return "-";
  const double a = std::abs(v);
  char buf[32];
  if (a >= 1e9) std::snprintf(buf, sizeof buf, "%.3gG", v / 1e9);
  else if (a >= 1e6) std::snprintf(buf, sizeof buf, "%.3gM", v / 1e6);
  else if (a >= 1e4) std::snprintf(buf, sizeof buf, "%.3gk", v / 1e3);
  else std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

// Ticks at 1, 2 or 5 x 10^k covering [lo, hi], about `target` of them; the range widens to the outer ticks.
std::vector<double> nice_ticks(double& lo, double& hi, int target) {
  if (!(hi > lo)) {
    const double pad = lo == 0 ? 1 : std::abs(lo) * 0.1;
    lo -= pad, hi += pad;
  }
  const double raw = (hi - lo) / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  lo = std::floor(lo / step + 1e-9) * step;
  hi = std::ceil(hi / step - 1e-9) * step;
  std::vector<double> ticks;
  for (double t = lo; t <= hi + step * 1e-6; t += step) ticks.push_back(std::abs(t) < step * 1e-9 ? 0.0 : t);
  return ticks;
}

struct Series {
  enum class Style { Line, LineDots, Marks };
  std::string name, color;
  Points points;
  Style style = Style::Line;
  bool dashed = false;
};

struct HLine {
  double y;
  std::string label, color;
};

class Plot {
 public:
  Plot(std::string title, std::string y_label, bool log_y = false)
      : title_(std::move(title)), y_label_(std::move(y_label)), log_y_(log_y) {}
  void add(Series s) {
    Points kept;
    for (const auto& p : s.points)
      if (std::isfinite(p.first) && std::isfinite(p.second) && (!log_y_ || p.second > 0)) kept.push_back(p);
    s.points = std::move(kept);
    if (!s.points.empty()) series_.push_back(std::move(s));
  }
  void hline(HLine h) {
    if (std::isfinite(h.y) && (!log_y_ || h.y > 0)) hlines_.push_back(std::move(h));
  }
  bool empty() const { return series_.empty(); }
  std::string svg() const;

 private:
  static constexpr double kWidth = 560, kHeight = 260;
  // More points than pixel columns say nothing more: keep each column's first, lowest, highest and last.
  static Points decimate(const Points& p, const PlotFrame& f);
  std::string title_, y_label_;
  bool log_y_;
  std::vector<Series> series_;
  std::vector<HLine> hlines_;
};

Points Plot::decimate(const Points& p, const PlotFrame& f) {
  const size_t columns = static_cast<size_t>(f.right - f.left);
  if (p.size() <= 2 * columns) return p;
  Points out;
  size_t i = 0;
  while (i < p.size()) {
    const long column = std::lround(f.px(p[i].first));
    size_t j = i, lo = i, hi = i;
    while (j < p.size() && std::lround(f.px(p[j].first)) == column) {
      if (p[j].second < p[lo].second) lo = j;
      if (p[j].second > p[hi].second) hi = j;
      j++;
    }
    std::set<size_t> keep{i, lo, hi, j - 1};
    for (size_t k : keep) out.push_back(p[k]);
    i = j;
  }
  return out;
}

std::string Plot::svg() const {
  PlotFrame f;
  f.left = 62, f.right = kWidth - 14, f.top = 30, f.bottom = kHeight - 34, f.log_y = log_y_;
  double xlo = INFINITY, xhi = -INFINITY, ylo = INFINITY, yhi = -INFINITY;
  auto y_of = [&](double y) { return log_y_ ? std::log10(y) : y; };
  for (const Series& s : series_)
    for (const auto& [x, y] : s.points) {
      xlo = std::min(xlo, x), xhi = std::max(xhi, x);
      ylo = std::min(ylo, y_of(y)), yhi = std::max(yhi, y_of(y));
    }
  for (const HLine& h : hlines_) ylo = std::min(ylo, y_of(h.y)), yhi = std::max(yhi, y_of(h.y));
  std::vector<double> xticks = nice_ticks(xlo, xhi, 6);
  std::vector<double> yticks;
  if (log_y_) {
    ylo = std::floor(ylo), yhi = std::ceil(yhi);
    if (yhi <= ylo) yhi = ylo + 1;
    for (double t = ylo; t <= yhi + 1e-9; t += 1) yticks.push_back(t);
  } else {
    yticks = nice_ticks(ylo, yhi, 5);
  }
  f.x0 = xlo, f.x1 = xhi, f.y0 = ylo, f.y1 = yhi;
  auto ypx = [&](double v_axis) { return f.bottom - (v_axis - f.y0) / (f.y1 - f.y0) * (f.bottom - f.top); };

  std::ostringstream o;
  o << "<svg class=\"plot\" width=\"" << kWidth << "\" height=\"" << kHeight << "\" viewBox=\"0 0 " << kWidth << " "
    << kHeight << "\" data-x0=\"" << f.x0 << "\" data-x1=\"" << f.x1 << "\" data-y0=\"" << f.y0 << "\" data-y1=\""
    << f.y1 << "\" data-left=\"" << f.left << "\" data-right=\"" << f.right << "\" data-top=\"" << f.top
    << "\" data-bottom=\"" << f.bottom << "\" data-log-y=\"" << (log_y_ ? 1 : 0) << "\">\n";
  o << "<text class=\"title\" x=\"" << f.left << "\" y=\"18\">" << html_escape(title_) << "</text>\n";
  o << "<rect class=\"frame\" x=\"" << f.left << "\" y=\"" << f.top << "\" width=\"" << f.right - f.left
    << "\" height=\"" << f.bottom - f.top << "\"/>\n";
  for (double t : yticks) {
    const double y = ypx(t);
    o << "<line class=\"grid\" x1=\"" << f.left << "\" x2=\"" << f.right << "\" y1=\"" << fixed(y, 1) << "\" y2=\""
      << fixed(y, 1) << "\"/><text class=\"tick\" x=\"" << f.left - 5 << "\" y=\"" << fixed(y + 4, 1)
      << "\" text-anchor=\"end\">" << (log_y_ ? compact(std::pow(10.0, t)) : compact(t)) << "</text>\n";
  }
  for (double t : xticks) {
    const double x = f.px(t);
    o << "<line class=\"grid\" x1=\"" << fixed(x, 1) << "\" x2=\"" << fixed(x, 1) << "\" y1=\"" << f.top << "\" y2=\""
      << f.bottom << "\"/><text class=\"tick\" x=\"" << fixed(x, 1) << "\" y=\"" << f.bottom + 15
      << "\" text-anchor=\"middle\">" << compact(t) << "</text>\n";
  }
  o << "<text class=\"axis\" x=\"" << (f.left + f.right) / 2 << "\" y=\"" << kHeight - 4
    << "\" text-anchor=\"middle\">step</text>\n";
  o << "<text class=\"axis\" transform=\"translate(13," << (f.top + f.bottom) / 2 << ") rotate(-90)\" "
    << "text-anchor=\"middle\">" << html_escape(y_label_) << "</text>\n";
  for (const HLine& h : hlines_) {
    const double y = f.py(h.y);
    o << "<line class=\"hline\" stroke=\"" << h.color << "\" x1=\"" << f.left << "\" x2=\"" << f.right << "\" y1=\""
      << fixed(y, 1) << "\" y2=\"" << fixed(y, 1) << "\"/><text class=\"hlabel\" fill=\"" << h.color << "\" x=\""
      << f.right - 4 << "\" y=\"" << fixed(y - 4, 1) << "\" text-anchor=\"end\">" << html_escape(h.label) << "</text>\n";
  }
  for (const Series& s : series_) {
    const Points drawn = s.style == Series::Style::Marks ? s.points : decimate(s.points, f);
    std::ostringstream pts;
    for (const auto& [x, y] : drawn) pts << fixed(f.px(x), 1) << "," << fixed(f.py(y), 1) << " ";
    const std::string name = html_escape(s.name);
    if (s.style == Series::Style::Marks) {
      o << "<g class=\"marks\" data-series=\"" << name << "\" fill=\"" << s.color << "\">";
      for (const auto& [x, y] : drawn)
        o << "<circle cx=\"" << fixed(f.px(x), 1) << "\" cy=\"" << fixed(f.py(y), 1) << "\" r=\"3\"/>";
      o << "</g>\n";
      continue;
    }
    o << "<polyline data-series=\"" << name << "\" stroke=\"" << s.color << "\""
      << (s.dashed ? " stroke-dasharray=\"5,3\"" : "") << " points=\"" << pts.str() << "\"/>\n";
    if (s.style == Series::Style::LineDots) {
      o << "<g class=\"dots\" fill=\"" << s.color << "\">";
      for (const auto& [x, y] : drawn)
        o << "<circle cx=\"" << fixed(f.px(x), 1) << "\" cy=\"" << fixed(f.py(y), 1) << "\" r=\"2.5\"/>";
      o << "</g>\n";
    }
  }
  // Legend on the title's line, right-aligned; rows below it inside the frame when it would reach the title.
  const double title_end = f.left + 7.5 * static_cast<double>(title_.size()) + 16;
  double lx = f.right, ly = 18;
  for (auto s = series_.rbegin(); s != series_.rend(); ++s) {
    const double width = 26 + 6.2 * static_cast<double>(s->name.size());
    if (lx - width < (ly == 18 ? title_end : f.left + 8)) lx = f.right, ly = ly == 18 ? f.top + 14 : ly + 14;
    lx -= width;
    o << "<g class=\"legend\"><line x1=\"" << lx << "\" x2=\"" << lx + 16 << "\" y1=\"" << ly - 4 << "\" y2=\""
      << ly - 4 << "\" stroke=\"" << s->color << "\"" << (s->dashed ? " stroke-dasharray=\"4,2\"" : "")
      << (s->style == Series::Style::Marks ? " stroke-width=\"5\" stroke-linecap=\"round\"" : "") << "/><text x=\""
      << lx + 20 << "\" y=\"" << ly << "\">" << html_escape(s->name) << "</text></g>\n";
  }
  o << "<text class=\"readout\" x=\"" << f.left + 6 << "\" y=\"" << f.top + 14 << "\"></text>\n";
  o << "</svg>\n";
  return o.str();
}

// ---- the page ----

const char* kRunColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};

const Points& series_of(const RunMetrics& r, const std::string& key) {
  static const Points none;
  auto it = r.series.find(key);
  return it == r.series.end() ? none : it->second;
}

Points scaled(const Points& p, double factor) {
  Points out = p;
  for (auto& [x, y] : out) y *= factor;
  return out;
}

double last_value(const Points& p) { return p.empty() ? NAN : p.back().second; }

// Wall time since the run's first segment started, per step: elapsed_s restarts at a resume, so each restart
// continues from where the previous segment stopped. Older logs without elapsed_s add up ms_per_step.
Points cumulative_elapsed(const RunMetrics& r) {
  Points out;
  const Points& elapsed = series_of(r, "elapsed_s");
  if (!elapsed.empty()) {
    double offset = 0, previous = 0;
    for (const auto& [step, e] : elapsed) {
      if (e < previous) offset += previous;
      previous = e;
      out.emplace_back(step, offset + e);
    }
    return out;
  }
  double sum = 0;
  for (const auto& [step, ms] : series_of(r, "ms_per_step")) out.emplace_back(step, sum += ms / 1e3);
  return out;
}

double median_of_last(const Points& p, double share) {
  if (p.empty()) return NAN;
  std::vector<double> v;
  for (size_t i = static_cast<size_t>(p.size() * (1 - share)); i < p.size(); i++) v.push_back(p[i].second);
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

int64_t world_size(const RunMetrics& r) {
  if (r.start.is_object() && r.start.contains("world") && r.start["world"].contains("size"))
    return r.start["world"]["size"].get<int64_t>();
  return 1;
}

double config_number(const RunMetrics& r, const char* key) {
  if (r.start.is_object() && r.start.contains("config") && r.start["config"].contains(key) &&
      r.start["config"][key].is_number())
    return r.start["config"][key].get<double>();
  return NAN;
}

bool is_running(const RunMetrics& r) { return r.start.is_object() && r.end.is_null(); }

std::string status_of(const RunMetrics& r) {
  const double steps = config_number(r, "steps"), last = series_of(r, "loss").empty() ? 0 : series_of(r, "loss").back().first;
  if (r.end.is_object()) {
    if (r.end.contains("status")) return r.end["status"].get<std::string>();
    return last >= steps ? "finished" : "stopped";
  }
  if (r.last_line_cut) return "killed (last line cut) or running";
  return r.start.is_object() ? "running (or killed)" : "unknown";
}

std::string table_row(const std::vector<std::string>& cells, bool header = false) {
  std::string out = "<tr>";
  for (const std::string& c : cells) out += header ? "<th>" + c + "</th>" : "<td>" + c + "</td>";
  return out + "</tr>\n";
}

std::string value_text(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  return v.dump();
}

constexpr const char* kStyle = R"css(
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 16px 24px; color: #222; background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 22px 0 8px; }
.sub { color: #666; margin-bottom: 12px; } .warn { color: #a33; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, 560px); gap: 10px 18px; }
svg.plot { background: #fff; }
svg.plot .frame { fill: none; stroke: #999; stroke-width: 1; }
svg.plot .grid { stroke: #eee; stroke-width: 1; }
svg.plot .tick, svg.plot .legend text, svg.plot .hlabel { font-size: 11px; fill: #555; }
svg.plot .axis { font-size: 12px; fill: #444; } svg.plot .title { font-size: 13px; font-weight: 600; fill: #222; }
svg.plot polyline { fill: none; stroke-width: 1.6; stroke-linejoin: round; }
svg.plot .legend line { stroke-width: 2; } svg.plot .hline { stroke-width: 1.2; stroke-dasharray: 6,4; }
svg.plot .readout { font-size: 11px; fill: #222; }
table { border-collapse: collapse; margin: 4px 0 8px; } th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
th { background: #f4f4f4; font-weight: 600; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.differs td { background: #fff7e0; }
.config { columns: 3 300px; column-gap: 24px; font-size: 13px; } .config div { break-inside: avoid; padding: 1px 0; }
.config .key { color: #666; display: inline-block; min-width: 150px; }
)css";

// Hover read-out: the nearest drawn point of each line at the pointer's step, inverted through the plot's frame.
constexpr const char* kScript = R"js(
document.querySelectorAll('svg.plot').forEach(function (svg) {
  var d = svg.dataset, out = svg.querySelector('.readout');
  var f = function (k) { return parseFloat(d[k]); };
  var lines = Array.prototype.map.call(svg.querySelectorAll('polyline'), function (p) {
    return { name: p.dataset.series, pts: p.getAttribute('points').trim().split(/\s+/).map(function (s) {
      var xy = s.split(','); return [parseFloat(xy[0]), parseFloat(xy[1])]; }) };
  });
  var toY = function (py) { var v = f('y0') + (f('bottom') - py) / (f('bottom') - f('top')) * (f('y1') - f('y0'));
    return d.logY === '1' ? Math.pow(10, v) : v; };
  svg.addEventListener('mousemove', function (e) {
    var r = svg.getBoundingClientRect(), px = e.clientX - r.left;
    if (px < f('left') || px > f('right')) { out.textContent = ''; return; }
    var step = f('x0') + (px - f('left')) / (f('right') - f('left')) * (f('x1') - f('x0'));
    var parts = ['step ' + Math.round(step)];
    lines.forEach(function (l) {
      var best = null; l.pts.forEach(function (p) { if (!best || Math.abs(p[0] - px) < Math.abs(best[0] - px)) best = p; });
      if (best) parts.push(l.name + ' ' + toY(best[1]).toPrecision(4));
    });
    out.textContent = parts.join('   ');
  });
  svg.addEventListener('mouseleave', function () { out.textContent = ''; });
});
)js";

}  // namespace

namespace {

// The curves, one plot per figure of the step record; each run adds its series (an overlay colours them by run).
struct Plots {
  Plot loss{"Loss", "cross-entropy"}, lr{"Learning rate", "lr"}, norm{"Gradient norm (before clipping)", "norm", true},
      tokens{"Throughput", "tokens/s"}, mfu{"MFU", "% of peak bf16"}, memory{"Memory", "MB"},
      time{"Elapsed and ETA", "hours"}, cost{"Cost", "$"}, rewards{"Preference rewards", "reward"},
      tasks{"Task accuracy (--eval_tasks)", "accuracy"};
  std::vector<const Plot*> all() const {
    return {&loss, &tasks, &rewards, &lr, &norm, &tokens, &mfu, &memory, &time, &cost};
  }
};

Plots plot_runs(const std::vector<RunMetrics>& runs) {
  const bool overlay = runs.size() > 1;
  auto color = [&](size_t run, const char* own) { return overlay ? kRunColors[run % 8] : own; };
  auto label = [&](size_t run, const std::string& what) { return overlay ? runs[run].name + " " + what : what; };
  Plots plots;
  auto& [loss, lr, norm, tokens, mfu, memory, time, cost, rewards, tasks] = plots;
  for (size_t i = 0; i < runs.size(); i++) {
    const RunMetrics& r = runs[i];
    loss.add({label(i, "train"), color(i, "#1f77b4"), series_of(r, "loss")});
    loss.add({label(i, "validation"), color(i, "#ff7f0e"), r.val_loss, Series::Style::LineDots, overlay});
    lr.add({label(i, "lr"), color(i, "#2ca02c"), series_of(r, "lr")});
    // Preference objectives: TRL's reward margin and accuracy, on the steps' pairs and on the held-out ones.
    rewards.add({label(i, "rewards/margins"), color(i, "#1f77b4"), series_of(r, "rewards/margins")});
    rewards.add({label(i, "rewards/accuracies"), color(i, "#2ca02c"), series_of(r, "rewards/accuracies")});
    rewards.add({label(i, "validation margins"), color(i, "#ff7f0e"), series_of(r, "val_rewards/margins"),
                 Series::Style::LineDots, overlay});
    rewards.add({label(i, "validation accuracies"), color(i, "#d62728"), series_of(r, "val_rewards/accuracies"),
                 Series::Style::LineDots, overlay});
    // Each task's acc (and acc_norm dashed), the aggregate "all" among them.
    size_t task_colour = 0;
    for (const auto& [key, points] : r.series) {
      if (!key.starts_with("eval_acc/")) continue;
      const std::string task = key.substr(9);
      const char* c = overlay ? kRunColors[i % 8] : kRunColors[task_colour++ % 8];
      tasks.add({label(i, task + " acc"), c, points, Series::Style::LineDots});
      tasks.add({label(i, task + " acc_norm"), c, series_of(r, "eval_acc_norm/" + task), Series::Style::Line, true});
    }
    norm.add({label(i, "grad norm"), color(i, "#9467bd"), series_of(r, "grad_norm")});
    Points clipped;
    const Points& scale = series_of(r, "clip_scale");
    const Points& gn = series_of(r, "grad_norm");
    for (size_t k = 0; k < scale.size() && k < gn.size(); k++)
      if (scale[k].second < 1.0 && scale[k].first == gn[k].first) clipped.push_back(gn[k]);
    norm.add({label(i, "clipped steps"), overlay ? kRunColors[i % 8] : "#d62728", clipped, Series::Style::Marks});
    const double clip = config_number(r, "grad_clip");
    if (clip > 0 && (!overlay || i == 0)) norm.hline({clip, str("clip at ", compact(clip)), "#d62728"});
    tokens.add({label(i, "tokens/s"), color(i, "#17becf"), series_of(r, "tokens_per_s")});
    mfu.add({label(i, "MFU"), color(i, "#8c564b"), scaled(series_of(r, "mfu"), 100.0)});
    memory.add({label(i, "host resident"), color(i, "#1f77b4"), series_of(r, "mem_mb")});
    memory.add({label(i, "host peak"), color(i, "#aec7e8"), series_of(r, "peak_mem_mb"), Series::Style::Line, true});
    memory.add({label(i, "GPU in use"), color(i, "#2ca02c"), series_of(r, "gpu_mem_mb")});
    memory.add({label(i, "GPU peak"), color(i, "#98df8a"), series_of(r, "gpu_peak_mem_mb"), Series::Style::Line, true});
    if (r.start.is_object() && r.start.contains("memory_plan") && !overlay) {
      const json& plan = r.start["memory_plan"];
      const bool host = plan.value("device", "cpu") == "cpu";
      const double base = host ? r.start.value("host_mb_at_start", 0.0) : 0.0;
      memory.hline({base + plan.value("peak", 0.0) / 1e6,
                    host ? "planned peak (host)" : "planned (GPU; the CUDA context comes on top)", "#555"});
    }
    const Points elapsed = cumulative_elapsed(r);
    time.add({label(i, "elapsed"), color(i, "#1f77b4"), scaled(elapsed, 1.0 / 3600)});
    time.add({label(i, "ETA"), color(i, "#ff7f0e"), scaled(series_of(r, "eta_s"), 1.0 / 3600), Series::Style::Line, true});
    const double price = config_number(r, "gpu_hour_cost");
    if (price > 0) cost.add({label(i, "cost so far"), color(i, "#d62728"), scaled(elapsed, price * world_size(r) / 3600)});
  }
  return plots;
}

// Summary, one row per run.
void write_summary(std::ostringstream& o, const std::vector<RunMetrics>& runs) {
  o << "<h2>Summary</h2>\n<table>\n"
    << table_row({"run", "status", "step", "train loss", "val loss (best)", "tokens/s", "MFU", "elapsed", "ETA",
                  "cost so far", "cost at the end"},
                 true);
  for (size_t i = 0; i < runs.size(); i++) {
    const RunMetrics& r = runs[i];
    const Points& l = series_of(r, "loss");
    const double steps = config_number(r, "steps"), step = l.empty() ? 0 : l.back().first;
    double best_val = NAN;
    for (const auto& [s, v] : r.val_loss) best_val = std::isnan(best_val) ? v : std::min(best_val, v);
    const Points elapsed = cumulative_elapsed(r);
    const double elapsed_s = last_value(elapsed), eta = last_value(series_of(r, "eta_s"));
    const double price = config_number(r, "gpu_hour_cost");
    const double gpus = double(world_size(r));
    const double mfu_now = median_of_last(series_of(r, "mfu"), 0.2);
    o << "<tr><td><span style=\"color:" << kRunColors[i % 8] << "\">&#9632;</span> " << html_escape(r.name) << "</td><td>"
      << html_escape(status_of(r)) << "</td><td class=\"num\">" << static_cast<int64_t>(step)
      << (std::isfinite(steps) ? str(" / ", static_cast<int64_t>(steps)) : "") << "</td><td class=\"num\">"
      << compact(last_value(l)) << "</td><td class=\"num\">" << compact(r.val_loss.empty() ? NAN : r.val_loss.back().second)
      << " (" << compact(best_val) << ")</td><td class=\"num\">" << compact(median_of_last(series_of(r, "tokens_per_s"), 0.2))
      << "</td><td class=\"num\">" << (std::isfinite(mfu_now) ? fixed(100 * mfu_now, 1) + "%" : "-")
      << "</td><td class=\"num\">" << human_duration(elapsed_s) << "</td><td class=\"num\">"
      << (is_running(r) ? human_duration(eta) : "-") << "</td><td class=\"num\">"
      << (price > 0 ? "$" + fixed(elapsed_s / 3600 * gpus * price, 2) : "-") << "</td><td class=\"num\">"
      << (price > 0 && std::isfinite(eta) ? "$" + fixed((elapsed_s + (is_running(r) ? eta : 0)) / 3600 * gpus * price, 2)
                                          : "-")
      << "</td></tr>\n";
  }
  o << "</table>\n";

}

// Effective config: the keys that differ between runs first.
void write_config(std::ostringstream& o, const std::vector<RunMetrics>& runs) {
  const bool overlay = runs.size() > 1;
  o << "<h2>Effective config</h2>\n";
  std::set<std::string> keys;
  for (const RunMetrics& r : runs)
    if (r.start.is_object() && r.start.contains("config"))
      for (const auto& [k, v] : r.start["config"].items()) keys.insert(k);
  if (keys.empty()) {
    o << "<p>No start record in metrics.jsonl (a run of an older build/train): the config is in the checkpoints' "
         "state.json.</p>\n";
  } else if (!overlay) {  // one run: a compact list in columns
    o << "<div class=\"config\">\n";
    for (const std::string& k : keys)
      o << "<div><span class=\"key\">" << html_escape(k) << "</span> " << html_escape(value_text(runs[0].start["config"][k]))
        << "</div>\n";
    o << "</div>\n";
  } else {
    std::vector<std::string> head{"option"};
    for (const RunMetrics& r : runs) head.push_back(html_escape(r.name));
    std::vector<std::pair<bool, std::string>> rows;
    for (const std::string& k : keys) {
      std::vector<std::string> cells{html_escape(k)};
      std::set<std::string> distinct;
      for (const RunMetrics& r : runs) {
        const bool has = r.start.is_object() && r.start.contains("config") && r.start["config"].contains(k);
        const std::string v = has ? value_text(r.start["config"][k]) : "-";
        distinct.insert(v);
        cells.push_back(html_escape(v));
      }
      const bool differs = distinct.size() > 1;
      std::string row = table_row(cells);
      if (differs) row.insert(3, " class=\"differs\"");
      rows.emplace_back(!differs, row);
    }
    std::stable_sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    o << "<table>\n" << table_row(head, true);
    for (const auto& [same, row] : rows) o << row;
    o << "</table>\n";
  }
}

// Each run's model, world and memory plan per rank (with the measured peak at its end).
void write_shapes_and_plans(std::ostringstream& o, const std::vector<RunMetrics>& runs) {
  const bool overlay = runs.size() > 1;
  for (const RunMetrics& r : runs) {
    if (!r.start.is_object()) continue;
    const std::string who = overlay ? " of " + html_escape(r.name) : "";
    if (r.start.contains("world") || r.start.contains("model")) {
      o << "<p>" << (overlay ? html_escape(r.name) + ": " : "");
      if (r.start.contains("model")) o << "model " << html_escape(r.start["model"].dump()) << "; ";
      if (r.start.contains("world")) o << "world " << html_escape(r.start["world"].dump());
      o << (r.starts > 1 ? str("; ", r.starts - 1, " resume(s)") : "") << "</p>\n";
    }
    if (r.start.contains("memory_plan") && r.start["memory_plan"].contains("items")) {
      const json& plan = r.start["memory_plan"];
      o << "<h2>Memory plan per rank" << who << " (" << html_escape(plan.value("device", "cpu")) << ")</h2>\n<table>\n"
        << table_row({"item", "kind", "bytes"}, true);
      for (const json& item : plan["items"])
        o << "<tr><td>" << html_escape(item.value("name", "")) << "</td><td>" << html_escape(item.value("kind", ""))
          << "</td><td class=\"num\">" << human_bytes(item.value("bytes", 0.0)) << "</td></tr>\n";
      o << "<tr><th>total (peak with the largest transient)</th><th></th><th class=\"num\">"
        << human_bytes(plan.value("total", 0.0)) << " (" << human_bytes(plan.value("peak", 0.0)) << ")</th></tr>\n";
      if (r.end.is_object() && r.end.contains("host_peak_above_start_mb"))
        o << "<tr><td>measured: peak resident memory above the start-up's (the largest rank)</td><td></td>"
             "<td class=\"num\">"
          << human_bytes(r.end["host_peak_above_start_mb"].get<double>() * 1e6) << "</td></tr>\n";
      o << "</table>\n";
    }
  }

}

void write_checkpoints(std::ostringstream& o, const std::vector<RunMetrics>& runs) {
  const bool overlay = runs.size() > 1;
  o << "<h2>Checkpoints on disk</h2>\n";
  for (const RunMetrics& r : runs) {
    if (overlay) o << "<p>" << html_escape(r.name) << "</p>\n";
    if (r.checkpoints.empty()) {
      o << "<p>none in " << html_escape((r.dir / "ckpt").string()) << "</p>\n";
      continue;
    }
    o << "<table>\n" << table_row({"checkpoint", "step", "size", "files", "written"}, true);
    for (const CheckpointOnDisk& c : r.checkpoints)
      o << "<tr><td>" << html_escape((r.dir / "ckpt" / c.name).string()) << "</td><td class=\"num\">" << c.step
        << "</td><td class=\"num\">" << human_bytes(double(c.bytes)) << "</td><td class=\"num\">" << c.files
        << "</td><td>" << utc_time(c.written_unix) << "</td></tr>\n";
    o << "</table>\n";
  }
}

}  // namespace

std::string render_run_report(const std::vector<RunMetrics>& runs, const ReportOptions& options) {
  TUNA_CHECK(!runs.empty(), "a report needs at least one run");
  const Plots plots = plot_runs(runs);
  std::ostringstream o;
  std::string names;
  for (const RunMetrics& r : runs) names += (names.empty() ? "" : ", ") + r.name;
  const std::string title = options.title.empty() ? "tuna run " + names : options.title;
  bool running = false;
  for (const RunMetrics& r : runs) running |= is_running(r);
  o << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n";
  if (options.auto_refresh && running) o << "<meta http-equiv=\"refresh\" content=\"60\">\n";
  o << "<title>" << html_escape(title) << "</title>\n<style>" << kStyle << "</style></head>\n<body>\n";
  const std::time_t now = std::time(nullptr);
  char stamp[64];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&now));
  o << "<h1>" << html_escape(title) << "</h1>\n<div class=\"sub\">written " << stamp
    << (running && options.auto_refresh ? "; reloads every minute while the run goes on" : "") << "</div>\n";
  for (const RunMetrics& r : runs)
    if (r.skipped_lines)
      o << "<div class=\"warn\">" << html_escape(r.name) << ": " << r.skipped_lines
        << " line(s) of metrics.jsonl skipped; first: " << html_escape(r.first_skipped) << "</div>\n";

  write_summary(o, runs);
  o << "<h2>Curves</h2>\n<div class=\"plots\">\n";
  for (const Plot* p : plots.all())
    if (!p->empty()) o << p->svg();
  o << "</div>\n";
  write_config(o, runs);
  write_shapes_and_plans(o, runs);
  write_checkpoints(o, runs);
  o << "<script>" << kScript << "</script>\n</body></html>\n";
  return o.str();
}

void write_run_report(const std::vector<fs::path>& run_dirs, const fs::path& out_html, const ReportOptions& options) {
  std::vector<RunMetrics> runs;
  for (const fs::path& d : run_dirs) runs.push_back(read_run_metrics(d));
  const std::string html = render_run_report(runs, options);
  const fs::path tmp = out_html.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) fail(tmp.string(), ": cannot create the report");
    out << html;
    out.flush();
    if (!out) fail(tmp.string(), ": write failed (disk full?)");
  }
  std::error_code ec;
  fs::rename(tmp, out_html, ec);
  if (ec) fail(out_html.string(), ": cannot rename the finished report into place: ", ec.message());
}

void refresh_run_report(const fs::path& run_dir) noexcept {
  try {
    write_run_report({run_dir}, run_dir / "report.html");
  } catch (const std::exception& e) {
    std::printf("note: %s not updated: %s\n", (run_dir / "report.html").c_str(), e.what());
  }
}

}  // namespace tuna
