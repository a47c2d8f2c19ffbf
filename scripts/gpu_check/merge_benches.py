#!/usr/bin/env python3
# Part of scripts/gpu-check.sh (which runs it): see there.
# benches.json: every bench's JSON, the peers' records and the profile's rows by op, one file.
import csv, glob, json, os, re, sys
src, dst = sys.argv[1:3]
merged = {}
for path in sorted(glob.glob(os.path.join(src, "*.json"))):
    try:
        merged[os.path.basename(path)[:-5]] = json.load(open(path))
    except Exception as e:
        merged[os.path.basename(path)[:-5]] = {"error": str(e)}
try:
    merged["peers"] = [json.loads(l) for path in sorted(glob.glob(os.path.join(src, "peers*.jsonl")))
                       for l in open(path) if l.strip()]
except OSError:
    merged["peers"] = []
# The profile: kernels of the last complete step (between the last two AdamW launches), by op.
def op_of(kernel):
    k = kernel.lower()
    for op, pattern in (("attention bwd", r"bwd_dkdv|bwd_dq|bwd_delta|attention.*bwd"), ("attention fwd", r"fwd_kernel|attention.*fwd"),
                        ("GEMM", r"gemm|nvjet|xmma|cutlass|splitk|cublas"), ("AdamW", r"adamw"),
                        ("grad norm", r"sum_of_squares|sum_partials"), ("RMSNorm", r"rmsnorm"), ("SwiGLU", r"swiglu"),
                        ("RoPE", r"rope"), ("classifier", r"classifier"), ("embedding", r"embedding"),
                        ("memset/copy", r"memset|memcpy|fill|convert|f32_to_bf16")):
        if re.search(pattern, k):
            return op
    return re.sub(r"[(<].*", "", kernel).split("::")[-1] or kernel
rows = []
profile = {}
try:
    lines = [l for l in open(os.path.join(src, "ncu.csv")) if l.startswith('"')]
    profile["csv_rows"] = max(len(lines) - 1, 0)
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            to_ms = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}
            rows.append((r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * to_ms[r["Metric Unit"]]))
except FileNotFoundError:
    pass  # no profile step ran
except (OSError, KeyError, ValueError) as e:
    profile["error"] = f"{type(e).__name__}: {e}"
adamw = [i for i, (k, _) in enumerate(rows) if "adamw" in k.lower()]
if len(adamw) >= 2:
    step = rows[adamw[-2] + 1: adamw[-1] + 1]
    total = sum(ms for _, ms in step)
    by_op = {}
    for k, ms in step:
        op = op_of(k)
        n, t = by_op.get(op, (0, 0.0))
        by_op[op] = (n + 1, t + ms)
    profile.update({"launches": len(step), "kernel_ms": total,
                    "by_op": sorted(([op, n, t] for op, (n, t) in by_op.items()), key=lambda x: -x[2])})
merged["profile"] = profile
json.dump(merged, open(dst, "w"), indent=1)