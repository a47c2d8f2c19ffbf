#!/usr/bin/env python3
# Part of scripts/gpu-check.sh (which runs it): see there.
import json, sys
runs, out, too_big_rc, emulated = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
def records(name):
    try:
        return [json.loads(l) for l in open(f"{runs}/{name}/metrics.jsonl")]
    except OSError:
        return []
straight, split, cpu, zero1 = records("straight"), records("split"), records("cpu"), records("zero1")
loss = lambda rs: {r["step"]: r["loss"] for r in rs if "loss" in r}
val = [r["val_loss"] for r in straight if "val_loss" in r]
steps = [r for r in straight if "loss" in r]
ok = True
rows = []
failed = []
def check(name, passed):  # a check that decides the run
    global ok
    ok &= passed
    if not passed: failed.append(name)
# A measurement's bar decides a GPU run only: emulated, the CPU backend runs a few steps in the device's place.
def bar(name, passed):
    if not emulated:
        check(name, passed)
if val:
    rows.append((f"val loss (step 0 -> {steps[-1]['step'] if steps else '?'})", f"{val[0]:.3f} -> {val[-1]:.3f}",
                 "bar: < 4.8 at 300 (cpu run: 4.45)"))
    bar("val loss", val[-1] < 4.8)
else:
    rows.append(("val loss", "none", "")); check("val loss", False)
if steps:
    last = steps[-1]
    tail = steps[len(steps) // 2:]
    median = lambda xs: sorted(xs)[len(xs) // 2]
    rows.append(("tokens/s (median, 2nd half)", f"{median([r['tokens_per_s'] for r in tail]):.0f}",
                 f"MFU {100 * median([r.get('mfu', float('nan')) for r in tail]):.2f}% (a 1M-parameter model: launch-bound)"))
    rows.append(("gpu memory (in use, peak)", f"{last.get('gpu_mem_mb', float('nan')):.0f} / {last.get('gpu_peak_mem_mb', float('nan')):.0f} MB",
                 f"util {last.get('gpu_util', 'n/a')}"))
    bar("mfu and gpu memory logged", all(k in last for k in ("mfu", "gpu_mem_mb", "gpu_peak_mem_mb")))
else:
    check("straight run's loss rows", False)
a, b = loss(straight), loss(split)
same = bool(a) and a == b
rows.append(("resume vs straight", "bit-identical losses" if same else "DIFFERENT", f"{len(b)} of {len(a)} steps compared"))
check("resume vs straight", same)
# ZeRO-1 on one GPU: the shard is the whole model, so the sharded update must give ZeRO-0's run exactly.
for name, what in (("zero1", "--zero 1"), ("zero3", "--zero 3 --recompute full"), ("zero2", "--zero 2 --recompute selective")):
    z = loss(records(name))
    same_z = bool(a) and a == z
    rows.append((f"{what} vs --zero 0 (1 GPU)", "bit-identical losses" if same_z else "DIFFERENT",
                 f"{len(z)} of {len(a)} steps compared"))
    check(f"{what} vs --zero 0", same_z)
try:
    too_big = open(f"{runs}/too-big.log").read()
except OSError:
    too_big = ""
refused = too_big_rc == 1 and "does not fit" in too_big and ("would fit with" in too_big or "no option" in too_big)
rows.append(("70B on one GPU", "refused before allocating" if refused else f"NOT REFUSED (rc {too_big_rc})",
             next((l for l in too_big.splitlines() if l.startswith("does not fit")), "")))
check("70B refused", refused)
# The first step from the same initial weights: its loss (near ln 1024 at any init, so a weak check alone)
# and its gradient norm, which a wrong forward or backward moves by O(1).
c = loss(cpu)
norm = lambda rs: {r["step"]: r["grad_norm"] for r in rs if "grad_norm" in r}
na, nc = norm(straight), norm(cpu)
if 1 in a and 1 in c and 1 in na and 1 in nc:
    rel = abs(a[1] - c[1]) / abs(c[1])
    rows.append(("first step loss cuda vs cpu", f"{a[1]:.5f} vs {c[1]:.5f}", f"rel diff {rel:.1e} (bar 1e-2)"))
    rel_norm = abs(na[1] - nc[1]) / abs(nc[1])
    rows.append(("first step grad norm cuda vs cpu", f"{na[1]:.4f} vs {nc[1]:.4f}", f"rel diff {rel_norm:.1e} (bar 5e-2)"))
    bar("first step cuda vs cpu", rel < 1e-2 and rel_norm < 5e-2)
else:
    rows.append(("first step cuda vs cpu", "missing", "")); check("first step cuda vs cpu", False)
# LoRA on the CUDA engine: the adapters train on the frozen base, and a stopped run resumes bit for bit.
la, lb = loss(records("lora")), loss(records("lora-split"))
same_lora = bool(la) and la == lb
rows.append(("LoRA r8 resume vs straight", "bit-identical losses" if same_lora else "DIFFERENT",
             f"{len(lb)} of {len(la)} steps compared"))
check("LoRA resume vs straight", same_lora)
lz = loss(records("lora-zero2"))
same_zero2 = bool(la) and la == lz
rows.append(("LoRA r8 ZeRO-2 vs ZeRO-0 (one GPU)", "bit-identical losses" if same_zero2 else "DIFFERENT",
             f"{len(lz)} of {len(la)} steps compared"))
bar("LoRA ZeRO-2 vs ZeRO-0", same_zero2)  # emulated, the CPU backend stands in for both
if la:
    ordered = [la[k] for k in sorted(la)]
    tenth = max(1, len(ordered) // 10)  # means over a tenth of the steps each: batch-to-batch noise averages out
    first, last = sum(ordered[:tenth]) / tenth, sum(ordered[-tenth:]) / tenth
    rows.append(("LoRA r8 loss (first -> last tenth of steps)", f"{first:.3f} -> {last:.3f}",
                 "bar: falls (the adapters train, the base is frozen)"))
    bar("LoRA loss falls", last < first)
else:
    rows.append(("LoRA r8 run", "no loss rows", "")); check("LoRA run", False)
# QLoRA: the adapters train over the NF4 base, and its checkpoint records the quantization (eval, merge, resume read it).
lq = loss(records("qlora"))
if lq:
    ordered = [lq[k] for k in sorted(lq)]
    tenth = max(1, len(ordered) // 10)
    first, last = sum(ordered[:tenth]) / tenth, sum(ordered[-tenth:]) / tenth
    lora_last = sum(la[k] for k in sorted(la)[-tenth:]) / tenth if len(la) >= tenth else float("nan")
    rows.append(("QLoRA r8 nf4 loss (first -> last tenth of steps)", f"{first:.3f} -> {last:.3f}",
                 f"bar: falls; LoRA's last tenth {lora_last:.3f}"))
    bar("QLoRA loss falls", last < first)
else:
    rows.append(("QLoRA r8 nf4 run", "no loss rows", "")); check("QLoRA run", False)
try:
    recorded = json.load(open(f"{runs}/qlora/ckpt/latest/base_model.json")).get("quantization", "")
except (OSError, ValueError):
    recorded = "unreadable"
rows.append(("QLoRA checkpoint's base quantization", recorded or "none", "expected nf4 (base_model.json)"))
check("QLoRA checkpoint records nf4", recorded == "nf4")
# --fp8 tensorwise on cuda: 40 steps of the demo from scratch; the loss falls.
lf = loss(records("fp8"))
if lf:
    ordered = [lf[k] for k in sorted(lf)]
    tenth = max(1, len(ordered) // 10)
    first, last = sum(ordered[:tenth]) / tenth, sum(ordered[-tenth:]) / tenth
    rows.append(("--fp8 tensorwise loss (first -> last tenth of steps)", f"{first:.3f} -> {last:.3f}",
                 f"bar: falls ({len(ordered)} steps from scratch)"))
    check("FP8 loss falls", last < first)
else:
    rows.append(("--fp8 tensorwise run", "no loss rows", "")); check("FP8 run", False)
# FP8 with LoRA (the frozen base's GEMMs in FP8, --fp8_weight_codes forward): from the LoRA run's start on its data, so
# its first step's loss is the bf16 LoRA run's within FP8's rounding of one pass (2%, tests/model/test_fp8.cpp's bar),
# and the adapters train.
lfl = loss(records("fp8-lora"))
if lfl and 1 in lfl and 1 in la:
    rel = abs(lfl[1] - la[1]) / abs(la[1])
    ordered = [lfl[k] for k in sorted(lfl)]
    tenth = max(1, len(ordered) // 10)
    first, last = sum(ordered[:tenth]) / tenth, sum(ordered[-tenth:]) / tenth
    rows.append(("--fp8 tensorwise LoRA r8: first step vs bf16 LoRA", f"{lfl[1]:.5f} vs {la[1]:.5f}",
                 f"rel diff {rel:.1e} (bar 2e-2)"))
    rows.append(("--fp8 tensorwise LoRA r8 loss (first -> last tenth of steps)", f"{first:.3f} -> {last:.3f}",
                 "bar: falls"))
    check("FP8 LoRA first step", rel < 2e-2)
    bar("FP8 LoRA loss falls", last < first)  # emulated, a few steps of the CPU backend
else:
    rows.append(("--fp8 tensorwise LoRA run", "no loss rows", "")); check("FP8 LoRA run", False)
with open(out, "w") as f:
    for r in rows:
        f.write("\t".join(r) + "\n")
        print("\t".join(r))
if not ok:
    print("error: failed: " + ", ".join(failed))
sys.exit(0 if ok else 1)