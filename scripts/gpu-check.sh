#!/usr/bin/env bash
# scripts/gpu-check.sh OUTDIR — the one command for a GPU machine: runs every GPU test, a memory checker
# over the riskiest kernels, and every GPU bench; full logs under OUTDIR; ONE summary table printed last.
# Finishes in about 4-5 minutes on an H100/H200; each step has its own timeout, cut to what is left of a
# 450 s deadline (TUNA_GPU_CHECK_SECONDS), so the table prints in under 8 minutes even when something hangs.
#
# The GPU machine has the CUDA toolkit and Python but no GoogleTest, Google Benchmark, BLAS, MPI or
# sentencepiece, so the binaries are built HERE (the development machine, Debian 12, nvcc 13.0) and carried:
#
#   make -j2 gpu-check-build        # -> build/gpu-check/bin/{gpu_tests, bench_*_gpu, train, data/, lib/}
#                                   #    sm_90a + sm_80 machine code, ~35 MB, needs glibc >= 2.34 and
#                                   #    libcublasLt.so.13 on the GPU machine (CUDA 13 toolkit or PyTorch's wheel);
#                                   #    lib/ holds Google Benchmark and Open MPI's libraries, data/ the demo corpus
#                                   #    tokenized
#   then, with the device tool:
#   run(command="scripts/gpu-check.sh $OUT/check", carry=["build/gpu-check/bin"], timeout_s=600)
#
# What comes back from $OUT is limited to 8 files two folders deep: this script writes exactly these 8 into
# OUTDIR: summary.log (machine, toolkit, the table), tests.log (and the sanitizer's output), train.log,
# benches.log and bench_{attention,gemm,memory,train_step}.json (Google Benchmark JSON).
#
# Checks, in order:
#   1. gpu_tests: every op against its CPU twin on fresh random inputs (poisoned outputs, shapes off the tile
#      sizes, bf16 error within 2x of a naive same-precision version; determinism of the backward passes);
#      attention fwd/bwd for head dims 64/128 (tensor cores) on both paths (mma; hopper, sm_90a: verified on
#      hardware by this script only, the table says whether its tests passed) and 8/16/32; the GPU model against the
#      transformers fixtures (logits, loss, every gradient) and 10 AdamW steps against the CPU model.
#   2. benches: attention fwd/bwd TFLOP/s (causal, hd128 seq 2k/4k/8k, hd64 seq 4k; mma and hopper side by
#      side, with the best of torch SDPA's flash and cuDNN backends at the same shapes, timed in the same run
#      by tools/reference/bench_attention_peers.py, and tuna's ratio to it), GEMM TFLOP/s at LLaMA 1B/8B/70B
#      shapes, RMSNorm/RoPE/SwiGLU/AdamW GB/s against a device copy, the 1B-shaped training step's tokens/s and
#      MFU (and its forward-only and AdamW-only parts).
#   3. build/train --device cuda end to end on the demo model and corpus (demo/train.toml): 300 steps learn
#      (validation loss under 4.8; the CPU run reaches 4.45), the first step's loss and gradient norm equal the
#      CPU backend's within bf16 error (1e-2 and 5e-2 relative), a run stopped at step 150 and resumed logs
#      bit-for-bit the losses of the straight run, so does a --zero 1 run, and the log has MFU and GPU memory.
#   4. compute-sanitizer memcheck (attention, rmsnorm, classifier, embedding tests) and racecheck (attention);
#      skipped if absent, reported as unavailable where the machine refuses it (gVisor).
# Exit status: 0 when every test passed and every step ran; 1 otherwise (the table says which).
set -u -o pipefail

OUT=${1:?usage: scripts/gpu-check.sh OUTDIR}
mkdir -p "$OUT"
BIN=${TUNA_GPU_BIN:-build/gpu-check/bin}
SUMMARY="$OUT/summary.log"
: >"$SUMMARY"
status=0
declare -A STEP  # step -> "ok" / "FAILED (...)" / "skipped (...)"
# A deadline for the whole run, so that one hang cannot push the summary table past the device call's limit:
# every step's timeout is cut to what is left of it (at least 1 s).
DEADLINE=${TUNA_GPU_CHECK_SECONDS:-450}
within() { local left=$((DEADLINE - SECONDS)); [ "$left" -lt 1 ] && left=1; [ "$1" -lt "$left" ] && echo "$1" || echo "$left"; }

log() { echo "$*" | tee -a "$SUMMARY"; }

log "== gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(pwd)"
log "git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown) $(git status --porcelain 2>/dev/null | wc -l) changed files"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 || true; } | tee -a "$SUMMARY"
{ nvcc --version 2>&1 | tail -1 || true; } | tee -a "$SUMMARY"

# cuBLASLt: the toolkit's, else PyTorch's nvidia-cublas wheel.
for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
           "$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null)" \
           "$(python3 -c 'import nvidia.cublas, os; print(os.path.join(os.path.dirname(nvidia.cublas.__file__), "lib"))' 2>/dev/null)"; do
  if [ -n "$dir" ] && [ -e "$dir/libcublasLt.so.13" ]; then
    export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    log "libcublasLt.so.13 from $dir"
    break
  fi
done

if [ ! -x "$BIN/gpu_tests" ]; then
  log "ERROR: $BIN/gpu_tests not found. Build it on the development machine (make -j2 gpu-check-build) and"
  log "       carry build/gpu-check/bin (see this script's header)."
  exit 1
fi
if ldd "$BIN/gpu_tests" | grep -q "not found"; then
  log "ERROR: missing shared libraries:"; ldd "$BIN/gpu_tests" | grep "not found" | tee -a "$SUMMARY"; exit 1
fi

# The attention kernels should be tensor-core code on this chip: count the SASS matrix and shared-matrix loads.
if command -v cuobjdump >/dev/null 2>&1; then
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')
  [ "$arch" = "90" ] && arch=90a
  log "SASS (sm_${arch:-?}) of gpu_tests: $(cuobjdump -sass -arch "sm_${arch:-90a}" "$BIN/gpu_tests" 2>/dev/null |
    grep -oE 'HMMA|HGMMA|LDSM|LDGSTS|UTMALDG|SYNCS' | sort | uniq -c | tr '\n' ' ')"
fi

# ---- 1. tests, one process per suite: a kernel fault (which poisons the CUDA context) then costs one suite only.
log "== 1. GPU tests ($BIN/gpu_tests, one process per suite)"
: >"$OUT/tests.log"
suites=$("$BIN/gpu_tests" --gtest_list_tests | grep -v '^ ' | grep '\.$' || true)
STEP[tests]="ok"
for suite in $suites; do
  timeout "$(within 150)" "$BIN/gpu_tests" --gtest_color=no --gtest_filter="${suite}*" >"$OUT/suite.tmp" 2>&1
  rc=$?
  { echo "==== $suite (rc $rc)"; cat "$OUT/suite.tmp"; } >>"$OUT/tests.log"
  line=$(grep -E '^tests: ' "$OUT/suite.tmp" | tail -1)
  log "  ${suite%.} rc $rc: ${line:-no result line (crashed or timed out)}"
  if [ $rc -ne 0 ]; then STEP[tests]="FAILED"; status=1; fi
  if [ -z "$line" ]; then echo "tests: 0 passed, 1 failed, 0 skipped (suite $suite: rc $rc)" >>"$OUT/tests.log"; fi
done
rm -f "$OUT/suite.tmp"
if grep -q "no CUDA device visible" "$OUT/tests.log"; then
  STEP[tests]="FAILED (no CUDA device visible to the tests)"; status=1
fi

# ---- 2. benches (before the sanitizer: the numbers matter more than its slow second opinion)
: >"$OUT/benches.log"
run_bench() {  # name timeout
  local name=$1 limit=$2
  log "== bench $name"
  echo "==== bench_${name}_gpu" >>"$OUT/benches.log"
  timeout "$(within "$limit")" "$BIN/bench_${name}_gpu" --benchmark_out="$OUT/bench_${name}.json" --benchmark_out_format=json \
    --benchmark_counters_tabular=true >>"$OUT/benches.log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then STEP[bench_$name]="ok"; else STEP[bench_$name]="FAILED (rc $rc)"; status=1; fi
}
run_bench memory 90
run_bench attention 90
run_bench gemm 90
run_bench train_step 120

# The attention peers, torch SDPA's flash and cuDNN backends at the attention bench's shapes, in this same run
# (tools/reference/bench_attention_peers.py; torch is on the GPU machine). Their rows go to benches.log and,
# outside OUTDIR (which brings back at most 8 files), to a JSON the table reads.
PEERS_JSON=$(mktemp /tmp/tuna-peers.XXXXXX.json)
log "== attention peers (torch SDPA flash, cuDNN)"
echo "==== tools/reference/bench_attention_peers.py" >>"$OUT/benches.log"
if timeout "$(within 90)" python3 tools/reference/bench_attention_peers.py --json "$PEERS_JSON" >>"$OUT/benches.log" 2>&1; then
  STEP[peers]="ok"
else
  STEP[peers]="FAILED (benches.log)"  # a missing peer does not fail the check: tuna's own numbers stand
fi

# ---- 3. the trainer end to end (single GPU; Open MPI's libraries from bin/lib: libmpi's RUNPATH needs this)
log "== train end to end ($BIN/train, demo model)"
RUNS=$(mktemp -d /tmp/tuna-gpu-check.XXXXXX)
D="$BIN/data"
TRAIN_ARGS=(--config demo/train.toml --train_data "$D/train-*.bin" --val_data "$D/val-*.bin"
            --tokenizer "$D/tokenizer.model" --log_every 50 --ckpt_every 0)
: >"$OUT/train.log"
train_run() {  # name args...: one run, its output appended to train.log; returns its exit status
  local name=$1; shift
  echo "==== $name: train ${TRAIN_ARGS[*]} $*" >>"$OUT/train.log"
  LD_LIBRARY_PATH="$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout "$(within 120)" "$BIN/train" "${TRAIN_ARGS[@]}" "$@" \
    >>"$OUT/train.log" 2>&1
}
train_rc=0
train_run straight --device cuda --out_dir "$RUNS/straight" || train_rc=1
train_run stopped --device cuda --out_dir "$RUNS/split" --stop_at_step 150 || train_rc=1
train_run resumed --device cuda --out_dir "$RUNS/split" --resume || train_rc=1
train_run cpu-first-step --device cpu --steps 1 --out_dir "$RUNS/cpu" || train_rc=1
train_run zero1 --device cuda --zero 1 --out_dir "$RUNS/zero1" || train_rc=1
if [ $train_rc -eq 0 ]; then STEP[train]="ok"; else STEP[train]="FAILED (a run exited non-zero: train.log)"; status=1; fi
TRAIN_SUMMARY="$RUNS.summary"  # rows for the table; outside OUTDIR, which brings back at most 8 files
python3 - "$RUNS" "$TRAIN_SUMMARY" <<'PY' || { STEP[train]="FAILED (train.log, table)"; status=1; }
import json, sys
runs, out = sys.argv[1], sys.argv[2]
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
if val:
    rows.append(("val loss (step 0 -> 300)", f"{val[0]:.3f} -> {val[-1]:.3f}", "bar: < 4.8 (cpu run: 4.45)"))
    ok &= val[-1] < 4.8
else:
    rows.append(("val loss", "none", "")); ok = False
if steps:
    last = steps[-1]
    tail = steps[len(steps) // 2:]
    median = lambda xs: sorted(xs)[len(xs) // 2]
    rows.append(("tokens/s (median, 2nd half)", f"{median([r['tokens_per_s'] for r in tail]):.0f}",
                 f"MFU {100 * median([r.get('mfu', float('nan')) for r in tail]):.2f}% (a 1M-parameter model: launch-bound)"))
    rows.append(("gpu memory (in use, peak)", f"{last.get('gpu_mem_mb', float('nan')):.0f} / {last.get('gpu_peak_mem_mb', float('nan')):.0f} MB",
                 f"util {last.get('gpu_util', 'n/a')}"))
    ok &= all(k in last for k in ("mfu", "gpu_mem_mb", "gpu_peak_mem_mb"))
a, b = loss(straight), loss(split)
same = bool(a) and a == b
rows.append(("resume at 150 vs straight", "bit-identical losses" if same else "DIFFERENT", f"{len(b)} of {len(a)} steps compared"))
ok &= same
# ZeRO-1 on one GPU: the shard is the whole model, so the sharded update must give ZeRO-0's run exactly.
z = loss(zero1)
same_z = bool(a) and a == z
rows.append(("--zero 1 vs --zero 0 (1 GPU)", "bit-identical losses" if same_z else "DIFFERENT", f"{len(z)} of {len(a)} steps compared"))
ok &= same_z
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
    ok &= rel < 1e-2 and rel_norm < 5e-2
else:
    rows.append(("first step cuda vs cpu", "missing", "")); ok = False
with open(out, "w") as f:
    for r in rows:
        f.write("\t".join(r) + "\n")
sys.exit(0 if ok else 1)
PY
cat "$TRAIN_SUMMARY" >>"$OUT/train.log" 2>/dev/null
rm -rf "$RUNS"

# ---- 4. memory and race checker over the riskiest kernels (shared-memory tiling, double buffers, in-place rows);
# last and optional: skipped when the steps above took so long that it could push the table past 8 minutes.
SANITIZER_LOG="$OUT/sanitizer.tmp"
: >"$SANITIZER_LOG"
if [ "$SECONDS" -gt 280 ]; then
  STEP[sanitizer]="skipped (the steps before it took ${SECONDS} s; the table must print within 8 minutes)"
elif command -v compute-sanitizer >/dev/null 2>&1; then
  log "== compute-sanitizer"
  filter='AttentionGpu.HeadDim64GroupedQuery:AttentionGpu.SmallHeadDimsOfTinyModels:RmsNormGpu.*:ClassifierGpu.*:EmbeddingGpu.*'
  timeout "$(within 100)" compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/gpu_tests" --gtest_filter="$filter" \
    >>"$SANITIZER_LOG" 2>&1
  rc_mem=$?
  timeout "$(within 100)" compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/gpu_tests" \
    --gtest_filter='AttentionGpu.HeadDim*' >>"$SANITIZER_LOG" 2>&1
  rc_race=$?
  # rc 9: the sanitizer found errors; 1: a test failed under it; 124: timeout. gVisor machines refuse it.
  if grep -q "Device not supported" "$SANITIZER_LOG"; then STEP[sanitizer]="unavailable here (Device not supported)"
  elif [ $rc_mem -eq 0 ] && [ $rc_race -eq 0 ]; then STEP[sanitizer]="ok (memcheck, racecheck)"
  elif [ $rc_mem -eq 124 ] || [ $rc_race -eq 124 ]; then STEP[sanitizer]="timed out (memcheck rc $rc_mem, racecheck rc $rc_race)"
  else STEP[sanitizer]="FAILED (memcheck rc $rc_mem, racecheck rc $rc_race)"; status=1; fi
else
  STEP[sanitizer]="skipped (no compute-sanitizer)"
fi
{ echo "==== compute-sanitizer"; cat "$SANITIZER_LOG"; } >>"$OUT/tests.log"
rm -f "$SANITIZER_LOG"

# ---- summary table (last)
python3 - "$OUT" "$SUMMARY" "${STEP[tests]}" "${STEP[sanitizer]}" "${STEP[bench_memory]}" "${STEP[bench_attention]}" \
  "${STEP[bench_gemm]}" "${STEP[bench_train_step]}" "${STEP[train]}" "$TRAIN_SUMMARY" "$PEERS_JSON" "${STEP[peers]}" \
  <<'PY' | tee -a "$SUMMARY"
import json, os, re, sys
out, _, tests, sanitizer, b_mem, b_att, b_gemm, b_train, train, train_summary, peers_json, peers_step = sys.argv[1:13]
rows = []
def add(section, what, value, note=""):
    rows.append((section, what, value, note))

# The sanitizer's runs are appended to tests.log after the suites: count the suites' results only.
log = open(os.path.join(out, "tests.log"), errors="replace").read().split("\n==== compute-sanitizer")[0]
counts = [tuple(map(int, m)) for m in re.findall(r"tests: (\d+) passed, (\d+) failed, (\d+) skipped", log)]
total = [sum(c[i] for c in counts) for i in range(3)]
add("tests", "gpu_tests", f"{total[0]} passed, {total[1]} failed, {total[2]} skipped" if counts else "no result line", tests)
failed = [n for n in dict.fromkeys(re.findall(r"^\[  FAILED  \] (\S+)", log, re.M)) if "." in n]
for name in failed[:12]:
    add("tests", "  failed", name)
checks = [(float(g) / float(b), name.strip()) for name, g, b in
          re.findall(r"^  (.{28}) gpu err (\S+)\s+naive bf16 err \S+\s+bound (\S+)", log, re.M) if float(b) > 0]
if checks:
    worst = max(checks)
    add("tests", "error vs bound", f"{len(checks)} checks, worst {worst[0]:.2f} of its bound", worst[1])
add("tests", "sanitizer", sanitizer)

def bench(name):
    path = os.path.join(out, f"bench_{name}.json")
    try:
        return json.load(open(path)).get("benchmarks", [])
    except Exception:
        return []

# Attention: the two paths of kernels/attention.cuh side by side, mma (the default) and hopper (sm_90a), each
# row a shape; and whether the hopper path's tests passed (the condition for flipping its default).
hopper_tests = re.findall(r"^\[\s+(OK|FAILED)\s+\] (AttentionGpu\.\S*Hopper\S*|AttentionGpu\.BackwardAppliesRope\S*)", log, re.M)
if hopper_tests:
    bad = [n for r, n in hopper_tests if r != "OK"]
    add("attention", "hopper path tests", f"{len(hopper_tests) - len(bad)} of {len(hopper_tests)} passed",
        ("FAILED: " + ", ".join(bad)) if bad else "flip kHopperByDefault (kernels/attention.cu) once its speed is right")
else:
    add("attention", "hopper path tests", "not run", "")
shapes = {}
for b in bench("attention"):
    m = re.match(r"(.*) (mma|hopper)$", b.get("label", ""))
    if m: shapes.setdefault(m.group(1), {})[m.group(2)] = b
def tflops(b):
    if b is None: return None
    if b.get("error_occurred") or b.get("skipped"): return None
    return b.get("TFLOP/s")
# The best peer of each shape (torch SDPA flash / cuDNN, same run, same FLOP convention).
peers = {}
try:
    for r in json.load(open(peers_json)).get("rows", []):
        if "TFLOP/s" in r and r["TFLOP/s"] > peers.get(r["label"], (0, ""))[0]:
            peers[r["label"]] = (r["TFLOP/s"], r["backend"] + (" gqa expanded" if r.get("gqa") == "expanded" else ""))
except Exception:
    pass
for shape, by in shapes.items():
    mma, hopper = tflops(by.get("mma")), tflops(by.get("hopper"))
    fmt = lambda x: "n/a" if x is None else f"{x:.0f}"
    value = f"mma {fmt(mma)} | hopper {fmt(hopper)}"
    peer, peer_name = peers.get(shape, (None, ""))
    if peer:
        value += f" | peer {peer:.0f} ({peer_name})"
    value += " TFLOP/s"
    notes = []
    if mma and hopper: notes.append(f"hopper/mma {hopper / mma:.2f}")
    elif by.get("hopper", {}).get("error_message"): notes.append(by["hopper"]["error_message"])
    if peer:
        notes.append("vs best peer: " + ", ".join(f"{n} {x / peer:.2f}" for n, x in (("mma", mma), ("hopper", hopper)) if x))
    add("attention", shape, value, "; ".join(notes))
if not shapes: add("attention", "bench_attention_gpu", "no results", b_att)
if not peers: add("attention", "peers (torch SDPA)", "no results", peers_step or "not run")
for b in bench("gemm"):
    add("gemm", b.get("label", b["name"]), f"{b.get('TFLOP/s', 0):.0f} TFLOP/s", f"{100*b.get('of_peak', 0):.0f}% of peak")
if not bench("gemm"): add("gemm", "bench_gemm_gpu", "no results", b_gemm)
for b in bench("memory"):
    label = b["name"].split("/")[0].replace("BM_", "") + (" " + b["label"] if b.get("label") else "")
    note = f"{100*b['of_copy']:.0f}% of copy" if "of_copy" in b else ""
    add("memory", label, f"{b.get('GB/s', 0):.0f} GB/s", note)
if not bench("memory"): add("memory", "bench_memory_gpu", "no results", b_mem)
for b in bench("train_step"):
    value = f"{b['tokens/s']:.0f} tokens/s" if "tokens/s" in b else f"{b.get('real_time', 0):.1f} {b.get('time_unit', '')}"
    note = f"MFU {100*b['MFU']:.1f}%, " if "MFU" in b else ""
    add("train step", b.get("label", b["name"]), value,
        note + f"{b.get('GiB', 0):.1f} GiB, {b.get('real_time', 0):.0f} {b.get('time_unit', '')}/iteration")
if not bench("train_step"): add("train step", "bench_train_step_gpu", "no results", b_train)
add("train e2e", "build/train --device cuda", train)
try:
    for line in open(train_summary):
        what, value, note = (line.rstrip("\n").split("\t") + ["", ""])[:3]
        add("train e2e", what, value, note)
except OSError:
    pass

w = [max(len(str(r[i])) for r in rows) for i in range(4)]
print("\n" + "=" * (sum(w) + 9))
print("gpu-check summary (full logs in %s)" % out)
print("=" * (sum(w) + 9))
section = None
for r in rows:
    s = r[0] if r[0] != section else ""
    section = r[0]
    print(f"{s:<{w[0]}} | {r[1]:<{w[1]}} | {r[2]:<{w[2]}} | {r[3]}")
PY
rm -f "$TRAIN_SUMMARY" "$PEERS_JSON"
exit $status
