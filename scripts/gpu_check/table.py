#!/usr/bin/env python3
# Part of scripts/gpu-check.sh (which runs it): see there.
# The summary table: the steps' verdicts by tier, then what each step measured.
import json, os, re, sys, traceback
out, steps_tsv, tiers_tsv, runs, emulated = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1"
rows = []
def add(section, what, value, note=""):
    # An emulated run measures nothing: its values say so in the row itself.
    if emulated and section not in ("tiers", "steps"):
        value = f"emulated: {value}"
    rows.append((section, str(what), str(value), str(note)))
steps = [l.rstrip("\n").split("\t") for l in open(steps_tsv) if l.strip()]
verdict = {s[1]: s[2] for s in steps}
def status(name, default="not run"):
    return verdict.get(name, default)
def fine(v):
    return v.startswith("ok")

def section(fn):  # a section that fails prints its error as a row; the rest of the table still comes out
    try:
        fn()
    except Exception as e:
        add(fn.__name__, "table error", f"{type(e).__name__}: {e}", traceback.format_exc().strip().splitlines()[-2][:100])

def tiers():
    for t, title, secs, end in (l.rstrip("\n").split("\t") for l in open(tiers_tsv) if l.strip()):
        mine = [s for s in steps if s[0] == t]
        ok = sum(1 for s in mine if fine(s[2]))
        add("tiers", f"{t}. {title}", f"{ok} of {len(mine)} steps ok", f"{secs} s (until second {end})")
        for _, name, v, s, fails in mine:
            if not fine(v):
                add("tiers", f"  {name}", v, f"{s} s" + ("" if fails == "1" else ", not a failure"))
section(tiers)

# The sanitizer's runs are appended to tests.log after the suites: count the suites' results only.
log = open(os.path.join(out, "tests.log"), errors="replace").read().split("\n==== sanitizer/")[0]
log = re.sub(r"==== tests/list .*?(?=\n==== |\Z)", "", log, flags=re.S)  # a listing's closing line counts nothing
try:
    benches = json.load(open(os.path.join(out, "benches.json")))
except Exception:
    benches = {}
def bench(name):
    b = benches.get(name, {})
    return b.get("benchmarks", []) if isinstance(b, dict) else []
def listed_only(name, section_name):  # an emulated bench lists its benchmarks and runs none
    b = bench(name)
    if b and all(x.get("emulated") for x in b):
        add(section_name, f"bench_{name}_gpu", f"{len(b)} benchmarks listed, none run", status(f"bench/{name}"))
        return True
    return False
peers = [p for p in benches.get("peers", []) if "error" not in p and not p.get("emulated")]

def tests():
    counts = [tuple(map(int, m)) for m in re.findall(r"tests: (\d+) passed, (\d+) failed, (\d+) skipped", log)]
    total = [sum(c[i] for c in counts) for i in range(3)]
    add("tests", "gpu_tests", f"{total[0]} passed, {total[1]} failed, {total[2]} skipped" if counts else "no result line",
        f"{sum(1 for s in steps if s[1].startswith('tests/') and s[1] != 'tests/list')} suites and filters")
    failed = [n for n in dict.fromkeys(re.findall(r"^\[  FAILED  \] (\S+)", log, re.M)) if "." in n]
    for name in failed[:12]:
        add("tests", "  failed", name)
    checks = [(float(g) / float(b), name.strip()) for name, g, b in
              re.findall(r"^  (.{28}) gpu err (\S+)\s+naive bf16 err \S+\s+bound (\S+)", log, re.M) if float(b) > 0]
    if checks:
        worst = max(checks)
        add("tests", "error vs bound", f"{len(checks)} checks, worst {worst[0]:.2f} of its bound", worst[1])
    add("tests", "sanitizer", status("sanitizer/memcheck"), "racecheck: " + status("sanitizer/racecheck"))

# Each attention row: a shape, tuna's two paths side by side (mma, the default; hopper, sm_90a), the best
# peer's rate at the same shape and direction, and each path / best. First, whether the hopper path's tests
# passed: the condition, with its speed, for flipping its default (kHopperByDefault, kernels/attention_path.h).
def best_peer(**want):
    rows = [p for p in peers if all(p.get(k) == v for k, v in want.items())]
    return max(rows, key=lambda p: p.get("tflops", p.get("tokens_per_s", 0)), default=None)
def attention():
    hopper_tests = re.findall(r"^\[\s+(OK|FAILED)\s+\] (AttentionGpu\.\S*Hopper\S*|AttentionGpu\.BackwardAppliesRope\S*)",
                              log, re.M)
    bad = [n for r, n in hopper_tests if r != "OK"]
    add("attention", "hopper path tests", f"{len(hopper_tests) - len(bad)} of {len(hopper_tests)} passed" if hopper_tests
        else "not run", ("FAILED: " + ", ".join(bad)) if bad else "")
    if listed_only("attention", "attention"): return
    shapes = {}
    for b in bench("attention_mma") + bench("attention"):  # tier 3's full run after tier 1's mma rows
        m = re.match(r"(.*) (mma|hopper)$", b.get("label", ""))
        if m: shapes.setdefault(m.group(1), {})[m.group(2)] = b
    def tflops(b):
        return None if b is None or b.get("error_occurred") or b.get("skipped") else b.get("TFLOP/s")
    for shape, by in shapes.items():
        rate = {path: tflops(by.get(path)) for path in ("mma", "hopper")}
        value = " | ".join(f"{path} {'n/a' if x is None else f'{x:.0f}'}" for path, x in rate.items()) + " TFLOP/s"
        notes = []
        if rate["mma"] and rate["hopper"]: notes.append(f"hopper/mma {rate['hopper'] / rate['mma']:.2f}")
        elif by.get("hopper", {}).get("error_message"): notes.append(by["hopper"]["error_message"])
        m = re.search(r"(fwd|bwd) causal hd(\d+) seq (\d+)", shape)
        p = best_peer(what="attention", direction=m.group(1), hd=int(m.group(2)), seq=int(m.group(3))) if m else None
        if p:
            notes.append(f"best peer {p['peer']} {p['tflops']:.0f}: " +
                         ", ".join(f"{path} x{x / p['tflops']:.2f}" for path, x in rate.items() if x))
        add("attention", shape, value, "; ".join(notes))
    if not shapes: add("attention", "bench_attention_gpu", "no results", status("bench/attention"))

# Packed documents (BM_AttentionDocuments: 4,096-token windows of documents of 256, 1,024 or 4,096 tokens): per
# path and direction, the masked run's time over the unmasked one's beside the useful FLOPs' ratio (doc / 4096:
# causal attention inside each document against across the whole window). Skipping the key blocks outside the
# documents brings the time ratio near the FLOP ratio; a masked kernel that only masked would stay near 1.
def attention_documents():
    docs = [b for b in bench("attention") if b.get("name", "").startswith("BM_AttentionDocuments")]
    if docs and all(b.get("emulated") for b in docs):
        paths = sorted({m.group(1) for b in docs for m in [re.search(r"/hopper:(\d)", b["name"])] if m})
        add("attention documents", "BM_AttentionDocuments", f"{len(docs)} benchmarks listed, none run",
            "paths " + ", ".join({"0": "mma", "1": "hopper"}[p] for p in paths))
        return
    runs = {}
    for b in docs:
        m = re.match(r"(fwd|bwd) hd128 seq (\d+) documents of (\d+) (masked|unmasked) (mma|hopper) batch \d+$",
                     b.get("label", ""))
        if m: runs[(m.group(1), int(m.group(2)), int(m.group(3)), m.group(5), m.group(4))] = b
    def time_of(b):
        return None if b is None or b.get("error_occurred") or b.get("skipped") else b.get("real_time")
    keys = sorted({k[:4] for k in runs}, key=lambda k: (k[3] != "mma", k[0] == "bwd", k[2]))
    for direction, seq, doc, path in keys:
        masked, unmasked = (runs.get((direction, seq, doc, path, w)) for w in ("masked", "unmasked"))
        tm, tu = time_of(masked), time_of(unmasked)
        what = f"{direction} documents of {doc} in {seq} {path}"
        if tm and tu:
            useful = masked.get("useful TFLOP/s", 0)
            add("attention documents", what, f"masked/unmasked time x{tm / tu:.3f}, useful FLOPs x{doc / seq:.3f}",
                f"time / FLOP ratio {tm / tu / (doc / seq):.2f}; masked {tm:.2f} ms, {useful:.0f} useful TFLOP/s")
        else:
            why = next((b.get("error_message") for b in (masked, unmasked) if b and b.get("error_message")), "no result")
            add("attention documents", what, "n/a", why)
    if not docs: add("attention documents", "BM_AttentionDocuments", "no results", status("bench/attention"))

# Each GEMM shape: the trainer's algorithm (the heuristic's first) and the fastest of its first 8 timed in place,
# side by side: what a timed choice would gain.
def gemm():
    if listed_only("gemm", "gemm"): return
    gemm_rows, fp8_rows, cast_rows = {}, [], []
    for b in bench("gemm"):
        if b.get("label", "").startswith("fp8 amax"): cast_rows.append(b); continue
        if b.get("label", "").startswith("fp8 "): fp8_rows.append(b); continue
        m = re.match(r"(.*) (first|best of \d+)$", b.get("label", ""))
        shape, kind = (m.group(1), m.group(2)) if m else (b.get("label", b["name"]), "first")
        gemm_rows.setdefault(shape, {})[kind] = b
    for shape, by in gemm_rows.items():
        first = by.get("first", {})
        timed = next((v for k, v in by.items() if k != "first"), {})
        value = f"{first.get('TFLOP/s', 0):.0f} TFLOP/s ({100*first.get('of_peak', 0):.0f}% of peak)"
        note = f"best of 8 timed: {timed.get('TFLOP/s', 0):.0f}" if timed else ""
        if timed and first.get("TFLOP/s"): note += f", x{timed['TFLOP/s'] / first['TFLOP/s']:.2f}"
        add("gemm", shape, value, note)
    # --fp8 tensorwise's products beside the bf16 ones of the same shape (the planner's FP8 rates), and its casts.
    for b in fp8_rows:
        bf16 = gemm_rows.get(b["label"][len("fp8 "):], {}).get("first", {})
        note = f"x{b['TFLOP/s'] / bf16['TFLOP/s']:.2f} of bf16's {bf16['TFLOP/s']:.0f}" if bf16.get("TFLOP/s") and b.get("TFLOP/s") else ""
        add("gemm", b["label"], f"{b.get('TFLOP/s', 0):.0f} TFLOP/s ({100*b.get('of_peak', 0):.0f}% of the FP8 peak)", note)
    for b in cast_rows: add("gemm", b["label"], f"{b.get('GB/s', 0):.0f} GB/s", "")
    if not bench("gemm"): add("gemm", "bench_gemm_gpu", "no results", status("bench/gemm"))

def memory():
    if listed_only("memory", "memory"): return
    for b in bench("memory"):
        label = b["name"].split("/")[0].replace("BM_", "") + (" " + b["label"] if b.get("label") else "")
        note = f"{100*b['of_copy']:.0f}% of copy" if "of_copy" in b else ""
        add("memory", label, f"{b.get('GB/s', 0):.0f} GB/s", note)
    if not bench("memory"): add("memory", "bench_memory_gpu", "no results", status("bench/memory"))

def train_step():
    if not listed_only("train_step", "train step"):
        for b in bench("train_step"):
            value = f"{b['tokens/s']:.0f} tokens/s" if "tokens/s" in b else f"{b.get('real_time', 0):.1f} {b.get('time_unit', '')}"
            note = f"MFU {100*b['MFU']:.1f}%, " if "MFU" in b else ""
            add("train step", b.get("label", b["name"]), value,
                note + f"{b.get('GiB', 0):.1f} GiB, {b.get('real_time', 0):.0f} {b.get('time_unit', '')}/iteration")
            m = re.search(r"^step, .* batch (\d+) x seq (\d+)", b.get("label", ""))
            if m and "tokens/s" in b and "--fp8" not in b.get("label", ""):  # the peers run bf16
                for p in sorted((p for p in peers if p.get("what") == "step" and p.get("batch") == int(m.group(1))
                                 and p.get("seq") == int(m.group(2))), key=lambda p: p["peer"]):
                    add("train step", f"  peer {p['peer']}, batch {p['batch']} x seq {p['seq']}", f"{p['tokens_per_s']:.0f} tokens/s",
                        f"MFU {100*p['mfu']:.1f}%, {p['gib']:.1f} GiB; tuna x{b['tokens/s'] / p['tokens_per_s']:.2f}")
        # The engine's overheads (bench BM_EngineStep, one GPU): ZeRO-3's code path and recompute against ZeRO-0 / none.
        engine = {m.group(1, 2): b for b in bench("train_step")
                  for m in [re.search(r"^engine step, ZeRO-(\d), recompute (\w+),", b.get("label", ""))] if m}
        if ("0", "none") in engine:
            base = engine[("0", "none")]["real_time"]
            for key, what, aim in ((("3", "none"), "ZeRO-3 at world 1 / ZeRO-0", "aim <= 1.05"),
                                   (("0", "selective"), "selective recompute / none", ""),
                                   (("0", "full"), "full recompute / none", "aim <= 1.35")):
                if key in engine:
                    e = engine[key]
                    add("train step", what, f"x{e['real_time'] / base:.3f} step time",
                        f"{aim}{'; ' if aim else ''}activations {e.get('activations_GiB', 0):.2f} GiB planned, "
                        f"device {e.get('GiB', 0):.2f} GiB used of a {e.get('plan_GiB', 0):.2f} GiB plan")
            # LoRA r16 on all targets (the base frozen) against the full fine-tune's step, the same engine and shape.
            lora = next((b for b in bench("train_step")
                         if re.search(r"^engine step, LoRA r16 on all 7 modules, ZeRO-0, recompute none,", b.get("label", ""))), None)
            if lora and "tokens/s" in lora and "tokens/s" in engine[("0", "none")]:
                add("train step", "LoRA r16 step / full step (tokens/s)",
                    f"x{lora['tokens/s'] / engine[('0', 'none')]['tokens/s']:.2f}",
                    f"aim >= 1.4; LoRA {lora['tokens/s']:.0f} tokens/s, MFU {100 * lora.get('MFU', 0):.1f}%, "
                    f"device {lora.get('GiB', 0):.2f} GiB used of a {lora.get('plan_GiB', 0):.2f} GiB plan")
        # QLoRA against LoRA, the model's adapter step on the same harness (bench BM_AdapterStep).
        adapter = {m.group(1): b for b in bench("train_step")
                   for m in [re.search(r"^adapter step, (LoRA|QLoRA)", b.get("label", ""))] if m and "tokens/s" in b}
        if "LoRA" in adapter and "QLoRA" in adapter:
            add("train step", "QLoRA r16 step / LoRA r16 step (tokens/s)",
                f"x{adapter['QLoRA']['tokens/s'] / adapter['LoRA']['tokens/s']:.2f}",
                f"aim >= 0.85; QLoRA {adapter['QLoRA']['tokens/s']:.0f}, LoRA {adapter['LoRA']['tokens/s']:.0f} tokens/s; "
                f"device {adapter['QLoRA'].get('GiB', 0):.2f} vs {adapter['LoRA'].get('GiB', 0):.2f} GiB")
        # --fp8 tensorwise against bf16: the same 1B step and shape (BM_TrainStep's fp8 rows beside the bf16 ones).
        by_precision = {(m.group(1), bool(m.group(2))): b for b in bench("train_step")
                        for m in [re.search(r"^step, .* batch (\d+) x seq 4096, mma attention(, --fp8 tensorwise)?$",
                                            b.get("label", ""))] if m and "tokens/s" in b}
        for batch in ("2", "4"):
            if (batch, False) in by_precision and (batch, True) in by_precision:
                f8, b16 = by_precision[(batch, True)], by_precision[(batch, False)]
                add("train step", f"--fp8 tensorwise step / bf16 step, batch {batch} x 4096 (tokens/s)",
                    f"x{f8['tokens/s'] / b16['tokens/s']:.2f}",
                    f"FP8 {f8['tokens/s']:.0f}, bf16 {b16['tokens/s']:.0f} tokens/s; device {f8.get('GiB', 0):.1f} "
                    f"vs {b16.get('GiB', 0):.1f} GiB")
        if not bench("train_step"): add("train step", "bench_train_step_gpu", "no results", status("bench/train_step"))
    if not listed_only("train_step_hopper", "train step"):
        for b in bench("train_step_hopper"):
            if "tokens/s" in b:
                add("train step", "  --attention hopper: " + b.get("label", b["name"]), f"{b['tokens/s']:.0f} tokens/s",
                    f"MFU {100*b.get('MFU', 0):.1f}%, {b.get('GiB', 0):.1f} GiB")
        if not bench("train_step_hopper"):
            add("train step", "  --attention hopper", "no results", status("bench/train_step_hopper"))

def generation():
    if listed_only("decode", "generation"): return
    for b in bench("decode"):
        add("generation", b.get("label", b["name"]), f"{b.get('tokens/s', 0):.0f} tokens/s", "")
    if not bench("decode"): add("generation", "bench_decode_gpu", "no results", status("bench/decode"))

def peers_and_profile():
    records = benches.get("peers", [])
    add("peers", "tools/reference/peers_gpu.py", f"{status('peers/step')}; {status('peers')}",
        f"{len(records)} records" + (", all emulated (no torch run)" if records and all(p.get("emulated") for p in records) else ""))
    for p in records:
        if "version" in p: add("peers", "torch", p["version"], p.get("device", ""))
        if "error" in p: add("peers", f"  {p.get('peer')} {p.get('what', '')} {p.get('seq', '')} {p.get('hd', p.get('batch', ''))}", "error", p["error"][:90])
    prof = benches.get("profile") or {}
    add("profile", "1B step, batch 2 (ncu)", status("profile"),
        f"{prof['launches']} launches, {prof['kernel_ms']:.1f} ms of kernels" if "launches" in prof
        else f"{prof.get('csv_rows', 0)} CSV rows" + (f"; {prof['error']}" if prof.get("error") else ""))
    for op, n, ms in (prof.get("by_op") or [])[:14]:
        add("profile", f"  {op}", f"{ms:.2f} ms", f"{100 * ms / prof['kernel_ms']:.1f}%, {n} launches")

def add_rows(section_name, path):  # a step's rows, tab-separated: what, value, note
    try:
        for line in open(path):
            what, value, note = (line.rstrip("\n").split("\t") + ["", ""])[:3]
            add(section_name, what, value, note)
    except OSError:
        pass
def train_e2e():
    runs_ok = [s for s in steps if s[1].startswith("train/") and s[1] != "train/summary"]
    add("train e2e", "build/train --device cuda", status("train/summary"),
        f"{sum(1 for s in runs_ok if fine(s[2]))} of {len(runs_ok)} runs ok")
    add_rows("train e2e", os.path.join(runs, "train_summary.tsv"))
def plan():
    add("plan", "build/plan vs measured", status("plan/summary"))
    add_rows("plan", os.path.join(runs, "plan_summary.tsv"))

for fn in (tests, attention, attention_documents, gemm, memory, train_step, generation, peers_and_profile, train_e2e, plan):
    section(fn)

# The first answers as lines for a benchmarks/ file's table: the GPU tests, the demo on cuda, the mma attention
# against its 2026-11-30 rates, the 1B step against PyTorch's. Emulated, every value says so.
answers = []
def answer(text):
    answers.append(("emulated: " if emulated else "") + text)
def first_answers():
    counts = [tuple(map(int, m)) for m in re.findall(r"tests: (\d+) passed, (\d+) failed, (\d+) skipped", log)]
    total = [sum(c[i] for c in counts) for i in range(3)]
    answer(f"GPU tests: {total[0]} passed, {total[1]} failed, {total[2]} skipped; the hopper forward's documents "
           f"inside a warpgroup: {status('tests/hopper-documents-in-a-warpgroup')}")
    def run(name):
        try:
            return [json.loads(l) for l in open(os.path.join(runs, name, "metrics.jsonl"))]
        except OSError:
            return []
    for name, what in (("straight", "demo on cuda, 300 steps"), ("lora", "demo on cuda, LoRA r8 on the straight run")):
        rs = run(name)
        losses = [r["loss"] for r in rs if "loss" in r]
        val = [r["val_loss"] for r in rs if "val_loss" in r]
        answer(f"{what}: " + (f"loss {losses[0]:.3f} -> {losses[-1]:.3f}" + (f", val loss {val[-1]:.3f}" if val else "")
                              if losses else "no loss logged") + f" ({status('train/' + name)})")
    then = {("fwd", 128): 214, ("bwd", 128): 139, ("fwd", 64): 179, ("bwd", 64): 112}  # TFLOP/s, 2026-11-30
    rates = {}
    for b in bench("attention_mma"):
        m = re.match(r"(fwd|bwd) causal hd(\d+) seq 4096 batch 4 mma$", b.get("label", ""))
        if m and b.get("TFLOP/s") and not b.get("error_occurred"): rates[(m.group(1), int(m.group(2)))] = b["TFLOP/s"]
    answer("mma attention, b4 x s4096, 32 q / 8 kv heads: " + "; ".join(
        f"{d} hd{hd} {rates[(d, hd)]:.0f} TFLOP/s (2026-11-30: {was}, x{rates[(d, hd)] / was:.2f})" if (d, hd) in rates
        else f"{d} hd{hd} n/a (2026-11-30: {was})" for (d, hd), was in then.items()) +
        ("" if rates else f" ({status('bench/attention_mma')})"))
    step = next((b for b in bench("train_step_1b") if "tokens/s" in b), None)
    eager = best_peer(what="step", batch=4, seq=4096, peer="hf-eager")
    text = "1B step, batch 4 x 4096: "
    text += (f"tuna {step['tokens/s']:.0f} tokens/s, MFU {100 * step.get('MFU', 0):.1f}%, {step.get('GiB', 0):.1f} GiB"
             if step else f"tuna n/a ({status('bench/train_step_1b')})")
    text += (f"; PyTorch (transformers eager) {eager['tokens_per_s']:.0f} tokens/s, {eager['gib']:.1f} GiB" +
             (f", tuna x{step['tokens/s'] / eager['tokens_per_s']:.2f}" if step else "") if eager
             else f"; PyTorch n/a ({status('peers/step')})")
    answer(text + " (2026-11-30: tuna 43,892, eager 43,971 tokens/s)")
try:
    first_answers()
except Exception as e:
    answers.append(f"first answers: table error {type(e).__name__}: {e}")

w = [max(len(r[i]) for r in rows) for i in range(4)]
print("\n" + "=" * (sum(w) + 9))
print("gpu-check summary (full logs in %s)" % out)
if emulated:
    print("EMULATED RUN: the GPU tests on the host emulator, stand-ins for the benches, the device, nvidia-smi,")
    print("ncu, compute-sanitizer and the peers. It checks the plumbing; no value below is a measurement.")
print("=" * (sum(w) + 9))
last = None
for r in rows:
    s = r[0] if r[0] != last else ""
    last = r[0]
    print(f"{s:<{w[0]}} | {r[1]:<{w[1]}} | {r[2]:<{w[2]}} | {r[3]}")
with open(os.path.join(runs, "answers.txt"), "w") as f:  # finish() prints them last
    f.write("".join(a + "\n" for a in answers))