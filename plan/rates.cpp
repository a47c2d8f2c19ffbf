// The planner's measured rates (plan/planner.h): plan/plan_rates.json, and the same table refreshed from
// gpu-check's bench JSON.
#include "plan/planner.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <ctime>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <tuple>

#include "core/error.h"
#include "core/progress.h"
#include "comm/comm.h"  // shard_range
#include "model/optimizer.h"  // dp_unit_pieces
#include "model/layout.h"
#include "model/lora_shape.h"
#include "plan/text.h"

namespace tuna {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace plan_text;

// ---- rates ----

namespace {

const json& field(const json& j, const std::string& key, const std::string& where) {
  if (!j.is_object() || !j.contains(key)) fail(where, ": missing field '", key, "'");
  return j[key];
}

double positive(const json& j, const std::string& key, const std::string& where) {
  const json& v = field(j, key, where);
  if (!v.is_number() || v.get<double>() <= 0)
    fail(where, ": field '", key, "': expected a positive number, found ", v.dump());
  return v.get<double>();
}

// A JSON file; null when it does not exist, an error naming it when it does not parse.
json read_json_file(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return json();
  try {
    return json::parse(in);
  } catch (const json::parse_error& e) {
    fail(path.string(), ": not valid JSON: ", e.what());
  }
}

std::string source_of(const json& section) {
  return section.is_object() && section.contains("source") && section["source"].is_string()
             ? section["source"].get<std::string>()
             : "(no source given)";
}

// One measured GEMM shape of a gemm or gemm_fp8 section.
Rates::GemmShape parse_shape(const json& s, const std::string& sw) {
  const json& pass = field(s, "pass", sw);
  const int p = pass == "fwd" ? 0 : pass == "dinp" ? 1 : pass == "dweight" ? 2 : -1;
  if (p < 0) fail(sw, ": field 'pass': expected fwd, dinp or dweight, found ", pass.dump());
  return {static_cast<int64_t>(positive(s, "tokens", sw)), static_cast<int64_t>(positive(s, "in", sw)),
          static_cast<int64_t>(positive(s, "out", sw)), p, positive(s, "tflops", sw) * 1e12};
}

// The rate of the nearest shape of the same pass in `shapes`, by log distance in tokens and in weight size; `fallback`
// when none has that pass.
double nearest_shape_rate(const std::vector<Rates::GemmShape>& shapes, int64_t tokens, int64_t in, int64_t out, int pass,
                          double fallback) {
  double best = INFINITY, rate = fallback;
  for (const Rates::GemmShape& s : shapes) {
    if (s.pass != pass) continue;
    const double d = std::abs(std::log(double(s.tokens) / tokens)) + std::abs(std::log(double(s.in * s.out) / double(in * out)));
    if (d < best) best = d, rate = s.flops;
  }
  return rate;
}

}  // namespace

Rates parse_rates(const json& j, const std::string& where) {
  Rates r;
  const json& device = field(j, "device", where);
  if (!device.is_string()) fail(where, ": field 'device': expected a GPU kind, found ", device.dump());
  r.device = device.get<std::string>();
  find_gpu(r.device);  // a table of an unknown card cannot be scaled to another
  const json& gemm = field(j, "gemm", where);
  const std::string gw = where + ": gemm";
  r.gemm_fwd = positive(gemm, "layer_fwd_tflops", gw) * 1e12;
  r.gemm_bwd = positive(gemm, "layer_bwd_tflops", gw) * 1e12;
  r.lm_head = positive(gemm, "lm_head_tflops", gw) * 1e12;
  if (gemm.contains("shapes"))
    for (const json& s : gemm["shapes"]) r.gemm_shapes.push_back(parse_shape(s, gw + ": shapes"));
  r.sources["gemm"] = source_of(gemm);
  // Optional (a table from before FP8 plans without it; --fp8 then asks for it).
  if (j.contains("gemm_fp8")) {
    const json& fp8 = j["gemm_fp8"];
    const std::string fw = where + ": gemm_fp8";
    const json& measured = field(fp8, "measured", fw);
    if (!measured.is_boolean()) fail(fw, ": field 'measured': expected true or false, found ", measured.dump());
    r.fp8_measured = measured.get<bool>();
    r.fp8_ratio = positive(fp8, "ratio_to_bf16", fw);
    if (fp8.contains("shapes"))
      for (const json& s : fp8["shapes"]) r.fp8_shapes.push_back(parse_shape(s, fw + ": shapes"));
    if (r.fp8_measured && r.fp8_shapes.empty()) fail(fw, ": measured, but no shapes");
    r.sources["gemm_fp8"] = source_of(fp8);
  }
  // Optional: the adapters' skinny GEMMs, once gpu-check has measured them.
  if (j.contains("gemm_adapter")) {
    const json& ad = j["gemm_adapter"];
    const std::string aw = where + ": gemm_adapter";
    for (const json& s : field(ad, "shapes", aw)) r.adapter_shapes.push_back(parse_shape(s, aw + ": shapes"));
    if (r.adapter_shapes.empty()) fail(aw, ": shapes: expected at least one measured shape");
    r.sources["gemm_adapter"] = source_of(ad);
  }
  const json& att = field(j, "attention", where);
  for (const json& a : field(att, "rates", where + ": attention")) {
    const std::string aw = where + ": attention: rates";
    r.attention.push_back({static_cast<int64_t>(positive(a, "head_dim", aw)), static_cast<int64_t>(positive(a, "seq", aw)),
                           positive(a, "fwd_tflops", aw) * 1e12, positive(a, "bwd_tflops", aw) * 1e12});
  }
  if (r.attention.empty()) fail(where, ": attention: rates: expected at least one measured shape");
  r.sources["attention"] = source_of(att);
  const json& mem = field(j, "memory", where);
  r.copy_bytes_per_s = positive(mem, "copy_gbps", where + ": memory") * 1e9;
  for (const char* k : {"rmsnorm_fwd", "rmsnorm_bwd", "rope", "swiglu_fwd", "swiglu_bwd", "classifier", "grad_norm",
                        "adamw_fp32", "adamw_bf16"})
    r.of_copy[k] = positive(field(mem, "of_copy", where + ": memory"), k, where + ": memory: of_copy");
  if (field(mem, "of_copy", where + ": memory").contains("fp8_cast"))  // with gemm_fp8
    r.of_copy["fp8_cast"] = positive(mem["of_copy"], "fp8_cast", where + ": memory: of_copy");
  if (r.fp8_ratio > 0 && !r.of_copy.count("fp8_cast"))
    fail(where, ": memory: of_copy: missing field 'fp8_cast' (the FP8 casts' rate, which gemm_fp8 needs)");
  r.sources["memory"] = source_of(mem);
  const json& over = field(j, "step_overhead", where);
  const json& fraction = field(over, "fraction", where + ": step_overhead");
  if (!fraction.is_number() || fraction.get<double>() < 0)
    fail(where, ": step_overhead: field 'fraction': expected a number >= 0, found ", fraction.dump());
  r.overhead = fraction.get<double>();
  r.sources["step_overhead"] = source_of(over);
  return r;
}

Rates load_rates(const fs::path& path) {
  const json j = read_json_file(path);
  if (j.is_null()) fail(path.string(), ": cannot open the rates table (plan/plan_rates.json of the checkout; --rates FILE)");
  return parse_rates(j, path.string());
}

fs::path default_rates_path() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {  // build/plan -> build/../plan/plan_rates.json; build/gpu-check/bin/plan -> ../../../plan/...
    for (fs::path dir = exe.parent_path(); !dir.empty() && dir != dir.root_path(); dir = dir.parent_path())
      if (fs::is_regular_file(dir / "plan" / "plan_rates.json")) return dir / "plan" / "plan_rates.json";
  }
  return fs::path("plan") / "plan_rates.json";
}

double Rates::gemm(int64_t tokens, int64_t in, int64_t out, int pass) const {
  return nearest_shape_rate(gemm_shapes, tokens, in, out, pass, pass == 0 ? gemm_fwd : gemm_bwd);
}

double Rates::gemm_adapter(int64_t tokens, int64_t in, int64_t out, int pass) const {
  TUNA_CHECK(!adapter_shapes.empty(), "no measured adapter GEMM shapes");
  // By input and output apart: a down-projection (in -> r) and an up-projection (r -> out) of the same size are not
  // the same product.
  double best = INFINITY, rate = 0;
  for (const GemmShape& s : adapter_shapes) {
    if (s.pass != pass) continue;
    const double d = std::abs(std::log(double(s.tokens) / double(tokens))) + std::abs(std::log(double(s.in) / double(in))) +
                     std::abs(std::log(double(s.out) / double(out)));
    if (d < best) best = d, rate = s.flops;
  }
  TUNA_CHECK(rate > 0, "no measured adapter GEMM shape of pass ", pass);
  return rate;
}

double Rates::gemm_fp8(int64_t tokens, int64_t in, int64_t out, int pass) const {
  if (fp8_measured)
    return nearest_shape_rate(fp8_shapes, tokens, in, out, pass, fp8_ratio * gemm(tokens, in, out, pass));
  return fp8_ratio * gemm(tokens, in, out, pass);
}

double Rates::attention_rate(int64_t head_dim, int64_t seq, bool backward) const {
  const Attention* best = nullptr;
  double best_d = INFINITY;
  for (const Attention& a : attention) {
    const double d = std::abs(std::log(double(a.head_dim) / head_dim)) * 4 + std::abs(std::log(double(a.seq) / seq));
    if (d < best_d) best_d = d, best = &a;
  }
  return backward ? best->bwd : best->fwd;
}

double Rates::memory_rate(const std::string& kernel) const {
  auto it = of_copy.find(kernel);
  TUNA_CHECK(it != of_copy.end(), "no rate for kernel ", kernel);
  return it->second * copy_bytes_per_s;
}

namespace {

// One bench's Google Benchmark JSON from a gpu-check run: OUTDIR/benches.json (what comes back from the GPU
// machine: {"gemm": ..., "attention": ..., ...}) or that file itself, or a directory of one file per bench
// (NAME.json or bench_NAME.json, as gpu-check writes them while it runs). Null when absent.
json read_bench(const fs::path& where, const std::string& name) {
  const fs::path merged = fs::is_directory(where) ? where / "benches.json" : where;
  if (fs::is_regular_file(merged)) {
    const json all = read_json_file(merged);
    return all.contains(name) ? all[name] : json();
  }
  for (const fs::path& p : {where / (name + ".json"), where / ("bench_" + name + ".json")})
    if (fs::is_regular_file(p)) return read_json_file(p);
  return json();
}

// "BM_Gemm/ic:2048/oc:512/pass:1/manual_time" -> the value of `arg`, -1 when absent.
int64_t bench_arg(const std::string& name, const std::string& arg) {
  const size_t at = name.find("/" + arg + ":");
  if (at == std::string::npos) return -1;
  return std::stoll(name.substr(at + arg.size() + 2));
}

std::string today_utc() {
  char buf[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&now));
  return buf;
}

}  // namespace

json rates_from_bench(const json& base, const fs::path& dir) {
  parse_rates(base, "the rates table to refresh");
  json out = base;
  const std::string stamp = str("gpu-check in ", dir.string(), " (", today_utc(), ")");
  bool any = false;
  const json gemm = read_bench(dir, "gemm");
  if (gemm.contains("benchmarks")) {
    json shapes = json::array();
    double fwd_sum = 0, bwd_sum = 0;
    int fwd_n = 0, bwd_n = 0;
    json fp8_shapes = json::array(), adapter_shapes = json::array();
    double fp8_ratio_sum = 0;
    int fp8_n = 0;
    std::map<std::tuple<int64_t, int64_t, int64_t>, double> bf16_first;  // the trainer's algorithm's rate per shape
    for (const json& b : gemm["benchmarks"]) {
      const std::string name = b.value("name", "");
      const int64_t in = bench_arg(name, "ic"), oc = bench_arg(name, "oc"), pass = bench_arg(name, "pass");
      if (in < 0 || oc < 0 || pass < 0 || !b.contains("TFLOP/s")) continue;
      const double tf = b["TFLOP/s"].get<double>();
      const json shape = {{"tokens", 8192}, {"in", in}, {"out", oc}, {"pass", pass == 0 ? "fwd" : pass == 1 ? "dinp" : "dweight"},
                          {"tflops", tf}};
      if (name.rfind("BM_GemmFp8/", 0) == 0) {
        fp8_shapes.push_back(shape);
        continue;
      }
      if (name.rfind("BM_GemmAdapter/", 0) == 0) {  // skinny: not a layer GEMM, kept out of the layer means
        adapter_shapes.push_back(shape);
        continue;
      }
      if (bench_arg(name, "timed") <= 0) bf16_first[{in, oc, pass}] = tf;
      shapes.push_back(shape);
      (pass == 0 ? fwd_sum : bwd_sum) += tf;
      (pass == 0 ? fwd_n : bwd_n)++;
    }
    for (const json& s : fp8_shapes) {
      const auto bf16 = bf16_first.find({s["in"].get<int64_t>(), s["out"].get<int64_t>(),
                                         s["pass"] == "fwd" ? 0 : s["pass"] == "dinp" ? 1 : 2});
      if (bf16 != bf16_first.end()) fp8_ratio_sum += s["tflops"].get<double>() / bf16->second, fp8_n++;
    }
    if (!fp8_shapes.empty()) {
      out["gemm_fp8"]["shapes"] = fp8_shapes;
      out["gemm_fp8"]["measured"] = true;
      if (fp8_n) out["gemm_fp8"]["ratio_to_bf16"] = fp8_ratio_sum / fp8_n;
      out["gemm_fp8"]["source"] = "bench_gemm_gpu's BM_GemmFp8 of " + stamp +
                                  " (per shape; ratio_to_bf16: the mean over its shapes of FP8 over the bf16 rate, for "
                                  "other shapes)";
      any = true;
    }
    if (!adapter_shapes.empty()) {
      out["gemm_adapter"] = {{"shapes", adapter_shapes},
                             {"source", "bench_gemm_gpu's BM_GemmAdapter of " + stamp + " (the nearest shape per product)"}};
      any = true;
    }
    if (!shapes.empty()) {
      out["gemm"]["shapes"] = shapes;
      if (fwd_n) out["gemm"]["layer_fwd_tflops"] = fwd_sum / fwd_n;
      if (bwd_n) out["gemm"]["layer_bwd_tflops"] = bwd_sum / bwd_n;
      out["gemm"]["source"] = "layer GEMMs: bench_gemm_gpu of " + stamp + " (per shape; the means for other shapes); lm_head: " +
                              base["gemm"].value("source", "");
      any = true;
    }
  }
  const json att = read_bench(dir, "attention");
  if (att.contains("benchmarks")) {
    std::map<std::pair<int64_t, int64_t>, json> rates;
    for (const json& b : att["benchmarks"]) {
      const std::string name = b.value("name", "");
      const int64_t seq = bench_arg(name, "seq"), hd = bench_arg(name, "hd"), bwd = bench_arg(name, "bwd");
      if (seq < 0 || hd < 0 || bwd < 0 || !b.contains("TFLOP/s")) continue;
      json& r = rates[{hd, seq}];
      r["head_dim"] = hd, r["seq"] = seq;
      r[bwd ? "bwd_tflops" : "fwd_tflops"] = b["TFLOP/s"].get<double>();
    }
    json list = json::array();
    for (auto& [key, r] : rates)
      if (r.contains("fwd_tflops") && r.contains("bwd_tflops")) list.push_back(r);
    if (!list.empty()) {
      out["attention"] = {{"source", "bench_attention_gpu of " + stamp}, {"rates", list}};
      any = true;
    }
  }
  const json mem = read_bench(dir, "memory");
  if (mem.contains("benchmarks")) {
    const std::map<std::string, std::string> kernels = {{"BM_RmsNormFwd", "rmsnorm_fwd"}, {"BM_RmsNormBwd", "rmsnorm_bwd"},
                                                        {"BM_Rope", "rope"},           {"BM_SwigluFwd", "swiglu_fwd"},
                                                        {"BM_SwigluBwd", "swiglu_bwd"}, {"BM_AdamW/0", "adamw_fp32"},
                                                        {"BM_AdamW/1", "adamw_bf16"}};
    int found = 0;
    for (const json& b : mem["benchmarks"]) {
      const std::string name = b.value("name", "");
      if (name.rfind("BM_Copy", 0) == 0 && b.contains("GB/s")) out["memory"]["copy_gbps"] = b["GB/s"].get<double>(), found++;
      for (const auto& [prefix, key] : kernels)
        if ((name == prefix || name.rfind(prefix + "/", 0) == 0) && b.contains("of_copy"))
          out["memory"]["of_copy"][key] = b["of_copy"].get<double>(), found++;
    }
    if (found) {
      out["memory"]["source"] = "bench_memory_gpu of " + stamp + "; kernels it does not bench (classifier, gradient norm): " +
                                base["memory"].value("source", "");
      any = true;
    }
  }
  // The FP8 casts, from the GEMM bench (BM_Fp8Cast: GB/s), as a share of the copy bandwidth: this run's, else the
  // table's (a run with the GEMM bench alone).
  double cast_gbps = 0;
  int casts = 0;
  for (const json& b : gemm.contains("benchmarks") ? gemm["benchmarks"] : json::array())
    if (b.value("name", "").rfind("BM_Fp8Cast/", 0) == 0 && b.contains("GB/s")) cast_gbps += b["GB/s"].get<double>(), casts++;
  if (casts > 0 && out["memory"].contains("copy_gbps")) {
    out["memory"]["of_copy"]["fp8_cast"] = cast_gbps / casts / out["memory"]["copy_gbps"].get<double>();
    out["memory"]["source"] = str("fp8_cast: bench_gemm_gpu's BM_Fp8Cast of ", stamp, " (", casts, " shapes, their mean GB/s",
                                  mem.contains("benchmarks") ? "" : " over the table's copy bandwidth", "); ",
                                  out["memory"].value("source", ""));
    any = true;
  }
  if (!any)
    fail(dir.string(), ": no GEMM, attention or memory bench results (gpu-check's OUTDIR/benches.json, or a "
         "directory of gemm.json, attention.json, memory.json)");
  parse_rates(out, "the refreshed rates table");
  return out;
}

}  // namespace tuna
