// build/report — the run report (core/run_report.h) on demand: one self-contained HTML file with the curves of
// one run, or of several overlaid (a learning-rate sweep).
//
//   build/report RUN_DIR                       -> RUN_DIR/report.html (what build/train writes at every validation)
//   build/report RUN_A RUN_B ... --out sweep.html
#include <cstdio>

#include "core/error.h"
#include "core/options.h"
#include "core/run_report.h"

int main(int argc, char** argv) {
  using namespace tuna;
  try {
    std::string out, title;
    bool no_refresh = false;
    Options options("build/report RUN_DIR [RUN_DIR ...]",
                    "Draws build/train's metrics.jsonl as one self-contained HTML page (several runs overlaid).");
    options.add("out", &out, "the HTML file to write; default: RUN_DIR/report.html for one run, report.html for several");
    options.add("title", &title, "the page's title; default: the runs' names");
    options.add("no_refresh", &no_refresh, "never reload the page in the browser (default: every minute while a run goes on)");
    std::vector<std::string> args = options.parse(argc, argv);
    if (args.empty()) fail("expected one or more run directories (build/train's --out_dir); see --help");
    std::vector<std::filesystem::path> runs(args.begin(), args.end());
    if (out.empty()) out = runs.size() == 1 ? (runs[0] / "report.html").string() : "report.html";
    write_run_report(runs, out, ReportOptions{title, !no_refresh});
    std::printf("%s (%zu run%s)\n", out.c_str(), runs.size(), runs.size() == 1 ? "" : "s");
    return 0;
  } catch (const tuna::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
