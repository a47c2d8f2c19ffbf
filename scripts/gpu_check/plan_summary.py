#!/usr/bin/env python3
# Part of scripts/gpu-check.sh (which runs it): see there.
import json, sys
bench_dir, runs, summary, emulated = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
def load(path):  # build/plan's --json output (its step's log, stderr included: the object alone)
    try:
        text = open(path).read()
        return json.loads(text[text.index("{"):text.rindex("}") + 1])
    except Exception:
        return None
rows, ok = [], True
benches = (load(f"{bench_dir}/train_step.json") or {}).get("benchmarks", [])
for b in (2, 4):
    measured = next((x for x in benches if x["name"].startswith(f"BM_TrainStep/batch:{b}/seq:4096/part:0/hopper:0/fp8:0")), None)
    for tag, note in (("", "rates of this run's benches"), ("_committed", "rates of plan/plan_rates.json")):
        plan = load(f"{runs}/plan_b{b}{tag}.json")
        if not plan:
            rows.append((f"1B step {b}x4096 ({note})", "missing", "build/plan's JSON absent")); ok = False
            continue
        if emulated:  # the plan is real; the bench beside it listed its benchmark and ran none
            listed = measured is not None and measured.get("emulated")
            rows.append((f"1B step {b}x4096 planned", f"{plan['step_s'] * 1e3:.1f} ms",
                         f"{note}; {'listed by' if listed else 'MISSING from'} the emulated bench_train_step"))
            ok &= bool(listed)
            continue
        if not measured:
            rows.append((f"1B step {b}x4096 ({note})", "missing", "bench_train_step result absent")); ok = False
            continue
        ms, planned = measured["real_time"], plan["step_s"] * 1e3
        err = planned / ms - 1
        rows.append((f"1B step {b}x4096 planned vs measured", f"{planned:.1f} vs {ms:.1f} ms ({100 * err:+.1f}%)",
                     f"{note}; aim within 15%"))
        if tag == "":
            ok &= abs(err) <= 0.15
    plan = load(f"{runs}/plan_b{b}.json")
    if plan and measured and "GiB" in measured:
        arena = plan["memory_plan"]["total"] / 2**30
        rows.append((f"1B {b}x4096 GPU memory planned vs model", f"{arena:.2f} vs {measured['GiB']:.2f} GiB",
                     "plan_gpu_memory against LlamaGpu's device bytes"))
        ok &= abs(arena - measured["GiB"]) <= 0.01 * measured["GiB"] + 0.01
demo = load(f"{runs}/plan_demo.json")
if not demo:
    rows.append(("demo plan", "missing", "build/plan's JSON absent")); ok = False
try:
    steps = [json.loads(l) for l in open(f"{runs}/straight/metrics.jsonl")]
    used = max(r.get("gpu_peak_mem_mb", 0) for r in steps if "loss" in r)
except Exception:
    used = None
if demo and used:
    plan_mb = demo["memory_plan"]["peak"] / 1e6
    rows.append(("demo run GPU memory: in use vs plan", f"{used:.0f} vs {plan_mb:.0f} MB",
                 f"the reserve outside the plan measures {(used - plan_mb) / 1024:.2f} GiB (build/plan assumes 1.5)"))
with open(summary, "w") as f:
    for r in rows:
        f.write("\t".join(r) + "\n")
        print("\t".join(r))
if not ok:
    print("error: failed: " + ", ".join(r[0] for r in rows if "missing" in r[1] or "MISSING" in r[2]) + " (or a bar above)")
sys.exit(0 if ok else 1)