// The run report: one self-contained HTML file drawn from a run directory's metrics.jsonl (and its ckpt/), which
// build/train rewrites at every validation and build/report makes on demand, for one run or several overlaid
// (a learning-rate sweep).
//
// Self-contained: inline SVG drawn here, inline CSS, a few lines of inline script for the hover read-out; no
// network, no fetched library, so the file can be copied off a cluster and opened anywhere. Plots: training and
// validation loss; learning rate; gradient norm with the clipped steps marked and the clip threshold; tokens/s;
// MFU; host and GPU memory against the memory plan; elapsed time and ETA; cost. Tables: a summary per run, the
// effective config (the keys that differ between runs first), the memory plan, the checkpoints on disk.
//
// metrics.jsonl records (train.cu writes them; every field is optional to the reader):
//   {"step", "event": "start", "config", "world", "model", "memory_plan", ...}   at every (re)start
//   {"step", "loss", "lr", "grad_norm", "clip_scale", "tokens_per_s", "mfu", "mem_mb", "peak_mem_mb",
//    "gpu_mem_mb", "gpu_peak_mem_mb", "elapsed_s", "eta_s", "cost", ...}            every step
//   {"step", "val_loss", ...}                                                        every validation
//   {"step", "event": "end", ...}                                                    at the end of a segment
// A line that does not parse (the last line of a killed run, cut mid-write) is skipped and counted, never fatal.
// A step logged twice (a run resumed from an earlier checkpoint) keeps its last record.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace tuna {

struct CheckpointOnDisk {
  std::string name;  // step_00001000
  int64_t step = 0;
  int64_t bytes = 0;
  int files = 0;
  int64_t written_unix = 0;  // its last modification, in seconds since 1970 (a page is read later: a time, not an age)
};

struct RunMetrics {
  std::string name;  // the run directory's name
  std::filesystem::path dir;
  nlohmann::json start;  // the last "start" record, or null
  nlohmann::json end;    // the last "end" record after it, or null
  int starts = 0;        // segments (1 + resumes)
  // Every numeric field of the step records, by name: (step, value) in step order.
  std::map<std::string, std::vector<std::pair<double, double>>> series;
  std::vector<std::pair<double, double>> val_loss;
  std::vector<CheckpointOnDisk> checkpoints;
  int64_t skipped_lines = 0;   // lines that did not parse
  bool last_line_cut = false;  // the last of them is the file's last line (a killed run)
  std::string first_skipped;   // "metrics.jsonl:LINE: why"
};

// Reads RUN_DIR/metrics.jsonl and RUN_DIR/ckpt. A missing metrics.jsonl is an error naming the file.
RunMetrics read_run_metrics(const std::filesystem::path& run_dir);

struct ReportOptions {
  std::string title;         // default: the runs' names
  bool auto_refresh = true;  // a run still going reloads itself every minute in the browser
};

std::string render_run_report(const std::vector<RunMetrics>& runs, const ReportOptions& options = {});

// Reads the runs and writes `out_html` atomically (a browser reloading it never sees half a file).
void write_run_report(const std::vector<std::filesystem::path>& run_dirs, const std::filesystem::path& out_html,
                      const ReportOptions& options = {});

// For the trainer: RUN_DIR/report.html from RUN_DIR; a failure is printed as a note and never stops a run.
void refresh_run_report(const std::filesystem::path& run_dir) noexcept;

// A plot's mapping from data to the SVG's pixels, as the report writes it on each <svg class="plot">
// (data-x0, data-x1, data-y0, data-y1, data-left, data-right, data-top, data-bottom, data-log-y): tests read
// the drawn points back into data coordinates with it.
struct PlotFrame {
  double x0 = 0, x1 = 1, y0 = 0, y1 = 1;           // data range (y in log10 when log_y)
  double left = 0, right = 1, top = 0, bottom = 1;  // pixels
  bool log_y = false;
  double px(double x) const { return left + (x - x0) / (x1 - x0) * (right - left); }
  double py(double y) const;  // y in data units (not log10)
  double data_x(double px) const { return x0 + (px - left) / (right - left) * (x1 - x0); }
  double data_y(double py) const;
};

}  // namespace tuna
