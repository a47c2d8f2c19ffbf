#!/usr/bin/env bash
# scripts/gpu-check.sh [--emulated] OUTDIR — the one command for a GPU machine: every GPU test, the trainer end
# to end, every GPU bench with its peers, the sanitizers and the step's profile; full logs under OUTDIR, ONE
# summary table printed last. Run on a GPU machine, from the repository root, with the binaries of
#
#   make -j2 gpu-check-build   # -> build/gpu-check/bin/{gpu_tests, bench_*_gpu, train, plan, data/, lib/}: sm_90a
#                              #    code (SM="90a 80" adds sm_80), ~35 MB, for a machine with the CUDA toolkit
#                              #    (libcublasLt.so.13, or PyTorch's wheel), glibc >= 2.34, torch and
#                              #    transformers, and none of the Debian -dev packages; data/ is the demo corpus
#                              #    tokenized, lib/ Google Benchmark's, Open MPI's and sentencepiece's libraries
#
# carried beside the repository as build/gpu-check/bin (TUNA_GPU_BIN names another place).
#
# The run stops at 440 s (TUNA_GPU_CHECK_SECONDS), inside a 480 s limit: the steps run in four tiers, most
# important first, each allowed until a fixed second of the run (TIER_END below: estimates until a GPU run
# prints the seconds each tier took), so a slow tier leaves the later ones their share:
#   1. correctness of the default paths: every GPU test suite (ops against their CPU twins, the GPU model against
#      the transformers fixtures and the CPU model, generation), one suite per process (a kernel fault poisons
#      its CUDA context only); build/train --device cuda on the demo (learns, resumes bit for bit, first step =
#      the CPU backend's, a 70B model refused before allocating);
#   2. the new paths: the hopper attention path's tests (a hang or fault keeps the path out of the later
#      steps), the multi-rank engine (ranks as threads on this GPU: dp, tp, sp, pp), ZeRO stages and recompute
#      modes, and the trainer at --zero 1/2/3 (losses bit for bit ZeRO-0's);
#   3. the benches (attention, with packed documents masked against unmasked on both paths, GEMM,
#      memory-bound kernels, the 1B step, generation), build/plan's planned step
#      time and memory against the measured ones, and the peers timed in the same run
#      (tools/reference/peers_gpu.py: torch SDPA flash/cuDNN, transformers eager and compiled);
#   4. compute-sanitizer (memcheck, racecheck) over the riskiest kernels and the step's kernel time by op (ncu).
# Each step has its own timeout, cut to what is left of its tier; a step with no time left is skipped and says
# so. Whatever fails or hangs, the table, benches.json and the seconds spent per tier come out (a trap prints
# them on exit, on a signal too).
#
# OUTDIR gets 5 files (what comes back from a GPU machine is limited to a few): summary.log (machine, toolkit,
# every step's verdict, the table), tests.log (the suites' and the sanitizer's output), train.log, benches.log
# (the benches', the peers', the planner's and the profiler's output) and benches.json: {"<bench>": its Google
# Benchmark JSON, ..., "peers": [the peers' records], "profile": the step's kernel time by op}.
#
# --emulated walks every step on a machine without a GPU, as `make test` does: the GPU tests built on the host
# emulator, and stand-ins (tests/gpu_check/) for the benches (the emulated bench binaries list what a filter
# selects; nothing is timed), the trainer's device (the CUDA engine's memory plan, then the CPU backend for a
# few steps), nvidia-smi, ncu, compute-sanitizer and the peers (peers_gpu.py --emulated). It checks the
# plumbing: paths, flags, filters, timeouts, the files and the table. Every row it prints is marked emulated.
#
# Adding a step: one line in its tier, e.g.
#   step bench/attention_long 90 benches.log "$BIN/bench_attention_gpu" --benchmark_filter='seq:8192' ...
# or, for a Google Benchmark binary writing its JSON into benches.json, `bench NAME LIMIT [flags]`.
# Exit status: 0 when every step of tiers 1-3 passed; 1 otherwise (the table says which).
set -u -o pipefail

EMULATED=0
if [ "${1:-}" = "--emulated" ]; then EMULATED=1; shift; fi
OUT=${1:?usage: scripts/gpu-check.sh [--emulated] OUTDIR}
mkdir -p "$OUT"
if [ $EMULATED -eq 1 ]; then
  BIN=${TUNA_GPU_BIN:-build/gpu-check-emulated/bin}
  PATH="$(pwd)/tests/gpu_check/path:$PATH"  # nvidia-smi, ncu and compute-sanitizer stand-ins
  PEERS_FLAGS=(--emulated)
else
  BIN=${TUNA_GPU_BIN:-build/gpu-check/bin}
  PEERS_FLAGS=()
fi
SUMMARY="$OUT/summary.log"
: >"$SUMMARY"
for f in tests.log train.log benches.log; do : >"$OUT/$f"; done
SCRATCH=$(mktemp -d /tmp/tuna-gpu-check.XXXXXX)  # per-step output, per-bench JSON, the runs: not returned
BENCH_JSON="$SCRATCH/json"
RUNS="$SCRATCH/runs"
mkdir -p "$BENCH_JSON" "$RUNS"
status=0

# ---- the tiers: the latest second of the run each may reach, and the run's own deadline (the table and
# benches.json take a few seconds after it; the device call's limit is 480 s).
DEADLINE=${TUNA_GPU_CHECK_SECONDS:-440}
TIER_END=(0 130 180 370 435)
TIER_TITLE=("" "correctness of the default paths" "the new paths (hopper attention, multi-rank engines, ZeRO)"
            "benches and their peers" "sanitizers and the profile")
TIER_SECS=(0 0 0 0 0)
TIER=0
TIER_T0=$SECONDS
MIN_STEP_SECONDS=5  # less than this left: the step is skipped, not started to be killed
# Emulated, the steps run on a CPU that other builds may share (10x slower here than a GPU is fine): every
# limit and tier end is scaled by TUNA_GPU_CHECK_TIME_SCALE (10 unless set), their plumbing unchanged.
TIME_SCALE=${TUNA_GPU_CHECK_TIME_SCALE:-$([ $EMULATED -eq 1 ] && echo 10 || echo 1)}
DEADLINE=$((DEADLINE * TIME_SCALE))
for t in 1 2 3 4; do TIER_END[$t]=$((TIER_END[t] * TIME_SCALE)); done

log() { echo "$*" | tee -a "$SUMMARY"; }

tier_close() { if [ $TIER -gt 0 ]; then TIER_SECS[$TIER]=$((TIER_SECS[$TIER] + SECONDS - TIER_T0)); fi; TIER_T0=$SECONDS; }
tier() {  # tier N: the steps below belong to tier N
  tier_close
  TIER=$1
  log "== tier $1: ${TIER_TITLE[$1]} (until second ${TIER_END[$1]}; now at $SECONDS)"
}

# Every step's verdict, in order, for the table: tier, name, verdict, seconds, whether it fails the run (1).
# A tool this machine lacks, or tier 4 out of time, does not; an advisory step fails an emulated run only.
STEPS_TSV="$SCRATCH/steps.tsv"
: >"$STEPS_TSV"
verdict() {  # name verdict seconds
  local fails=0 v=${2//$'\t'/ }
  case "$2" in
    "skipped (no time"*) [ $TIER -le 3 ] && fails=1 ;;
    ok*|unavailable*|skipped*) ;;
    *) if [ "${ADVISORY:-0}" -eq 0 ] || [ $EMULATED -eq 1 ]; then fails=1; fi ;;
  esac
  [ $fails -eq 1 ] && status=1
  printf '%s\t%s\t%s\t%s\t%s\n' "$TIER" "$1" "$v" "$3" "$fails" >>"$STEPS_TSV"
  log "  [$TIER] $1: $v (${3} s)"
}

# step NAME LIMIT LOG COMMAND...: runs COMMAND (a program, not a shell function) with a timeout of LIMIT
# seconds cut to what is left of the tier and the run, its output appended to OUTDIR/LOG under a header. ok
# when it exits EXPECT (0 unless set: EXPECT=75 step ...); ADVISORY=1 (a peer, the profile) reports a failure
# without failing a GPU run; UNAVAILABLE_IF=TEXT in its output means this machine cannot run it (no failure).
# Leaves STEP_RC (-1 when skipped) and STEP_OUT (its output) for further checks.
CHILD=""  # the step running now: its process, name and log, for finish() on a signal
CHILD_STEP=""
CHILD_LOG=""
step() {
  local name=$1 limit=$2 logfile=$3; shift 3
  local end=${TIER_END[$TIER]}; [ "$DEADLINE" -lt "$end" ] && end=$DEADLINE
  local left=$((end - SECONDS)) t=$((limit * TIME_SCALE))
  [ "$left" -lt "$t" ] && t=$left
  STEP_OUT="$SCRATCH/step.out"
  : >"$STEP_OUT"
  if [ "$left" -lt $MIN_STEP_SECONDS ]; then
    STEP_RC=-1
    echo "==== $name: skipped, no time left in tier $TIER (second $SECONDS of ${end})" >>"$OUT/$logfile"
    verdict "$name" "skipped (no time left in tier $TIER)" 0
    return
  fi
  local t0=$SECONDS
  # In the background with a wait, so that a signal to this script runs its trap at once (finish kills it).
  timeout -k 5 "$t" "$@" >"$STEP_OUT" 2>&1 </dev/null &
  CHILD=$!
  CHILD_STEP=$name
  CHILD_LOG=$logfile
  wait "$CHILD"
  STEP_RC=$?
  CHILD=""
  local secs=$((SECONDS - t0))
  { echo "==== $name (rc $STEP_RC, $secs s of its $t): $*"; cat "$STEP_OUT"; } >>"$OUT/$logfile"
  if [ -n "${UNAVAILABLE_IF:-}" ] && grep -q "$UNAVAILABLE_IF" "$STEP_OUT"; then
    verdict "$name" "unavailable here ($UNAVAILABLE_IF)" "$secs"
  elif [ "$STEP_RC" -eq "${EXPECT:-0}" ]; then
    verdict "$name" ok "$secs"
  elif [ "$STEP_RC" -eq 124 ] || [ "$STEP_RC" -eq 137 ]; then
    verdict "$name" "$( [ "${ADVISORY:-0}" -eq 1 ] && echo incomplete || echo FAILED ) (timed out after $t s: $logfile)" "$secs"
  else
    # The last line that reads like an error names the cause in the table (a misspelled flag, a missing file).
    local why
    why=$(grep -aiE "error|not found|no such|unknown|unrecognized|unexpected|invalid|matches no|failed" "$STEP_OUT" |
          grep -v '^\[  FAILED  \]' | tail -1 | cut -c1-150)
    [ -z "$why" ] && why=$(tail -1 "$STEP_OUT" | cut -c1-150)
    verdict "$name" "$( [ "${ADVISORY:-0}" -eq 1 ] && echo incomplete || echo FAILED ) (rc $STEP_RC, expected ${EXPECT:-0}: ${why:-no output}; $logfile)" "$secs"
  fi
}

# bench NAME LIMIT [FLAGS]: one Google Benchmark binary, its JSON kept for benches.json (key NAME).
bench() {
  local name=$1 limit=$2; shift 2
  step "bench/$name" "$limit" benches.log "$BIN/bench_${name}_gpu" --benchmark_out="$BENCH_JSON/$name.json" \
    --benchmark_out_format=json --benchmark_counters_tabular=true "$@"
}

# ---- the end, whatever happened: benches.json, the table, the seconds per tier, the exit status.
finish() {
  trap - EXIT
  trap '' INT TERM  # a second signal must not cut the table short
  # An exit before the last step that no signal caused is an error in this script (set -u, a typo): a failure.
  [ "$COMPLETED" -eq 0 ] && verdict gpu-check "FAILED (stopped early, at second $SECONDS: the script's error is above)" 0
  if [ -n "$CHILD" ]; then
    kill -TERM "$CHILD" 2>/dev/null
    wait "$CHILD" 2>/dev/null
    { echo "==== $CHILD_STEP (interrupted)"; cat "$STEP_OUT"; } >>"$OUT/$CHILD_LOG"
    verdict "$CHILD_STEP" "FAILED (interrupted while running)" 0
  fi
  tier_close
  timeout -k 5 60 python3 "$SCRATCH/merge_benches.py" "$BENCH_JSON" "$OUT/benches.json" >>"$OUT/benches.log" 2>&1 ||
    { echo "gpu-check: benches.json not written (benches.log)" | tee -a "$SUMMARY"; status=1; }
  local tiers="$SCRATCH/tiers.tsv"
  : >"$tiers"
  for t in 1 2 3 4; do printf '%s\t%s\t%s\t%s\n' "$t" "${TIER_TITLE[$t]}" "${TIER_SECS[$t]}" "${TIER_END[$t]}" >>"$tiers"; done
  timeout -k 5 60 python3 "$SCRATCH/table.py" "$OUT" "$STEPS_TSV" "$tiers" "$RUNS" "$EMULATED" 2>&1 | tee -a "$SUMMARY"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { log "gpu-check: the table failed (above)"; status=1; }
  log "seconds per tier: $(for t in 1 2 3 4; do printf '%s: %s s; ' "$t" "${TIER_SECS[$t]}"; done)total $SECONDS s of $((480 * TIME_SCALE))"
  if [ $status -ne 0 ]; then
    log "gpu-check: FAILED: $(awk -F'\t' '$5 == 1 {printf "%s%s: %s", sep, $2, $3; sep="; "}' "$STEPS_TSV")"
  else
    log "gpu-check: every step of tiers 1-3 passed$([ $EMULATED -eq 1 ] && echo ' (emulated: plumbing only, no measurement)')"
  fi
  rm -rf "$SCRATCH"
  exit $status
}
COMPLETED=0
trap finish EXIT
trap 'COMPLETED=2; verdict gpu-check "FAILED (interrupted by a signal at second $SECONDS)" 0; finish' INT TERM

# The scripts finish() runs are written first, so that they exist whatever happens next.
cat >"$SCRATCH/merge_benches.py" <<'PY'
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
    merged["peers"] = [json.loads(l) for l in open(os.path.join(src, "peers.jsonl")) if l.strip()]
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
PY

cat >"$SCRATCH/table.py" <<'PY'
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
    for b in bench("attention"):
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
            if m and "tokens/s" in b:
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
    add("peers", "tools/reference/peers_gpu.py", status("peers"),
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
PY

# ---- the machine
log "== gpu-check$([ $EMULATED -eq 1 ] && echo ' --emulated') $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(pwd), binaries from $BIN"
[ "$TIME_SCALE" -eq 1 ] || log "every limit x$TIME_SCALE (TUNA_GPU_CHECK_TIME_SCALE)"
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
BIN_LD="$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # Open MPI's and sentencepiece's libraries (libmpi's RUNPATH hides bin/lib)

# Every binary the steps below run, and its libraries: a missing one fails here, named, not as a step's timeout.
BENCH_NAMES=(memory attention gemm train_step decode)
missing=()
for b in gpu_tests train plan "${BENCH_NAMES[@]/#/bench_}"; do
  [[ $b == bench_* ]] && b=${b}_gpu
  if [ ! -x "$BIN/$b" ]; then missing+=("$b"); continue; fi
  libs=$(LD_LIBRARY_PATH="$BIN_LD" ldd "$BIN/$b" 2>/dev/null | grep "not found" | tr -s ' \t' ' ')
  [ -n "$libs" ] && log "ERROR: $BIN/$b: missing shared libraries:$libs" && missing+=("$b (libraries)")
done
[ -e "$BIN/data/tokenizer.model" ] || missing+=("data/tokenizer.model")
if [ ${#missing[@]} -gt 0 ]; then
  log "ERROR: not in $BIN or not loadable: ${missing[*]}. Build them on the development machine"
  log "       ($([ $EMULATED -eq 1 ] && echo 'make gpu-check-emulated' || echo 'make -j2 gpu-check-build, then carry build/gpu-check/bin'))."
  status=1
  COMPLETED=2
  exit 1
fi

# The attention kernels should be tensor-core code on this chip: count the SASS matrix and shared-matrix loads.
if command -v cuobjdump >/dev/null 2>&1 && [ $EMULATED -eq 0 ]; then
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')
  [ "$arch" = "90" ] && arch=90a
  log "SASS (sm_${arch:-?}) of gpu_tests: $(cuobjdump -sass -arch "sm_${arch:-90a}" "$BIN/gpu_tests" 2>/dev/null |
    grep -oE 'HMMA|HGMMA|LDSM|LDGSTS|UTMALDG|SYNCS' | sort | uniq -c | tr '\n' ' ')"
fi

# One GPU test suite (or filter) in a process of its own: a kernel fault poisons its CUDA context only. A run
# without a closing "tests:" line (hung, crashed) is counted as one failed test, named for the table.
test_step() {  # name limit filter
  step "$1" "$2" tests.log "$BIN/gpu_tests" --gtest_color=no --gtest_filter="$3"
  if [ "$STEP_RC" -ge 0 ] && ! grep -qE '^tests: ' "$STEP_OUT"; then
    local running
    running=$(grep -E '^\[ RUN      \] ' "$STEP_OUT" | tail -1 | sed 's/^\[ RUN      \] //')
    { echo "[  FAILED  ] ${running:-$1} (rc $STEP_RC: hung or crashed)"
      echo "tests: 0 passed, 1 failed, 0 skipped ($1: rc $STEP_RC)"; } >>"$OUT/tests.log"
  fi
}
HOPPER_TESTS='AttentionGpu.*Hopper*:AttentionGpu.BackwardAppliesRope*'
# The multi-rank engine (ranks as threads sharing this GPU; tp with and without sp, pipeline stages), and every
# ZeRO stage and recompute mode against ZeRO-0:
TIER2_SUITES=" EngineGpuThreadRanks. EngineGpuSequenceParallel. EngineGpuPipeline. EngineGpuStages. EngineGpuZeroOne. "

# The demo runs of build/train (demo/train.toml, the corpus tokenized in bin/data), each in its own directory.
D="$BIN/data"
TRAIN_ARGS=(--config demo/train.toml --train_data "$D/train-*.bin" --val_data "$D/val-*.bin"
            --tokenizer "$D/tokenizer.model" --log_every 50 --ckpt_every 0)
train_step() {  # name limit args...
  local name=$1 limit=$2; shift 2
  step "train/$name" "$limit" train.log env LD_LIBRARY_PATH="$BIN_LD" "$BIN/train" "${TRAIN_ARGS[@]}" "$@"
}

# ================================ tier 1: correctness of the default paths ================================
tier 1
step tests/list 30 tests.log "$BIN/gpu_tests" --gtest_list_tests
suites=$(grep -E '^[A-Za-z0-9_/]+\.$' "$STEP_OUT" || true)  # "Suite." and "Instance/Suite." lines
[ -z "$suites" ] && verdict tests/list "FAILED (no test suite listed: tests.log)" 0
for suite in $suites; do
  [[ $TIER2_SUITES == *" ${suite##*/} "* ]] && continue
  filter="${suite}*"
  [ "$suite" = "AttentionGpu." ] && filter="${suite}*:-$HOPPER_TESTS"  # tier 2 runs them
  test_step "tests/${suite%.}" 60 "$filter"
done
if grep -q "no CUDA device visible" "$OUT/tests.log"; then verdict tests "FAILED (no CUDA device visible to the tests)" 0; fi

# build/train --device cuda end to end on the demo: 300 steps learn, a run stopped at 150 (exit 75) and resumed
# logs the straight run's losses bit for bit, the first step equals the CPU backend's within bf16 error.
train_step straight 60 --device cuda --out_dir "$RUNS/straight"
EXPECT=75 train_step stopped 60 --device cuda --out_dir "$RUNS/split" --stop_at_step 150
train_step resumed 60 --device cuda --out_dir "$RUNS/split" --resume
train_step cpu-first-step 60 --device cpu --steps 1 --out_dir "$RUNS/cpu"
# A LLaMA-2-70B-shaped model on one GPU does not fit: refused before allocating (exit 1), with the table and a way out.
cat >"$RUNS/llama70b.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
 "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096,
 "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": false, "model_type": "llama"}
JSON
EXPECT=1 step train/too-big 60 train.log env LD_LIBRARY_PATH="$BIN_LD" "$BIN/train" --device cuda \
  --model_config "$RUNS/llama70b.json" --train_data "$D/train-*.bin" --seq_len 4096 --micro_batch 1 \
  --out_dir "$RUNS/too-big"
cp "$STEP_OUT" "$RUNS/too-big.log"
too_big_rc=$STEP_RC

# ================================ tier 2: the new paths ================================
tier 2
# The hopper attention path (sm_90a, mbarriers, setmaxnreg): a hang or a fault (which poisons the CUDA context)
# keeps the path out of the benches and the race checker below, which would hang or fail on it again.
test_step tests/hopper 60 "$HOPPER_TESTS"
HOPPER_OK=1
grep -qE '^tests: ' "$STEP_OUT" || HOPPER_OK=0
for name in $TIER2_SUITES; do
  listed=$(grep -E "^([A-Za-z0-9_]+/)?$name\$" <<<"$suites" || true)
  [ -n "$listed" ] || { verdict "tests/${name%.}" "FAILED (suite $name not in gpu_tests --gtest_list_tests)" 0; continue; }
  for suite in $listed; do test_step "tests/${suite%.}" 90 "${suite}*"; done
done
# The trainer at ZeRO-1, ZeRO-3 with full recompute and ZeRO-2 with selective recompute: on one GPU the same
# bits as ZeRO-0 without recompute (the tests hold it on the emulator).
train_step zero1 60 --device cuda --zero 1 --out_dir "$RUNS/zero1"
train_step zero3-full 60 --device cuda --zero 3 --recompute full --out_dir "$RUNS/zero3"
train_step zero2-selective 60 --device cuda --zero 2 --recompute selective --out_dir "$RUNS/zero2"
# LoRA on the CUDA engine (r 8 on all seven projections, dropout 0.05) over the straight run's model as the frozen
# base: the run trains; one stopped at 150 (exit 75) and resumed from its PEFT checkpoint logs the same losses.
LORA_ARGS=(--device cuda --model_config "" --init "$RUNS/straight/ckpt/latest" --lora_rank 8 --lora_alpha 16
           --lora_dropout 0.05)
train_step lora 60 "${LORA_ARGS[@]}" --out_dir "$RUNS/lora"
EXPECT=75 train_step lora-stopped 60 "${LORA_ARGS[@]}" --out_dir "$RUNS/lora-split" --stop_at_step 150
train_step lora-resumed 60 --device cuda --out_dir "$RUNS/lora-split" --resume
# QLoRA: the same adapters over the base held in NF4 (quantized as it is read, dequantized a layer at a time).
train_step qlora 60 "${LORA_ARGS[@]}" --base_quant nf4 --out_dir "$RUNS/qlora"
# The adapters at ZeRO-2 (their master, moments and gradients sharded, a layer's gradient reduce-scattered as its
# backward ends): on one GPU the same bits as ZeRO-0 (the tests hold it on the emulator).
train_step lora-zero2 60 "${LORA_ARGS[@]}" --zero 2 --out_dir "$RUNS/lora-zero2"
cat >"$SCRATCH/train_summary.py" <<'PY'
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
with open(out, "w") as f:
    for r in rows:
        f.write("\t".join(r) + "\n")
        print("\t".join(r))
if not ok:
    print("error: failed: " + ", ".join(failed))
sys.exit(0 if ok else 1)
PY
step train/summary 30 train.log python3 "$SCRATCH/train_summary.py" "$RUNS" "$RUNS/train_summary.tsv" "$too_big_rc" "$EMULATED"

# ================================ tier 3: benches and their peers ================================
tier 3
bench memory 60
if [ $HOPPER_OK -eq 1 ]; then bench attention 90; else bench attention 90 --benchmark_filter='hopper:0'; fi
# The attention backward at G = 1 against G = 4, equal FLOPs (32 query heads over 32 or 8 kv heads: the bench's
# "bwd G=1" rows beside its plain bwd rows). G=4 / G=1 well under 1 means the hopper path's ordered dQ additions
# stall under grouped-query attention. Lines into the summary log; decides nothing.
cat >"$SCRATCH/attention_gqa.py" <<'PY'
import json, re, sys
rates = {}
for b in json.load(open(sys.argv[1])).get("benchmarks", []):
    m = re.match(r"bwd( G=1)? causal hd(\d+) seq (\d+) batch \d+ (mma|hopper)$", b.get("label", ""))
    if m and b.get("TFLOP/s") and not b.get("error_occurred"):
        rates[(m.group(2), m.group(3), m.group(4), "G=1" if m.group(1) else "G=4")] = b["TFLOP/s"]
for (hd, seq, path, g), g1 in sorted(rates.items()):
    g4 = rates.get((hd, seq, path, "G=4"))
    if g == "G=1" and g4:
        print(f"attention bwd hd{hd} seq {seq} {path}: G=1 {g1:.0f}, G=4 {g4:.0f} TFLOP/s, G=4/G=1 {g4 / g1:.2f}")
PY
ADVISORY=1 step bench/attention_gqa 20 benches.log python3 "$SCRATCH/attention_gqa.py" "$BENCH_JSON/attention.json"
while IFS= read -r line; do log "$line"; done <"$STEP_OUT"
bench gemm 60
bench train_step 100 --benchmark_filter='-hopper:1'
# The 1B step at batch 4 x 4096 once more on the hopper attention path (--attention hopper), beside the default's.
if [ $HOPPER_OK -eq 1 ]; then
  step bench/train_step_hopper 40 benches.log "$BIN/bench_train_step_gpu" \
    --benchmark_filter='BM_TrainStep/batch:4/seq:4096/part:0/hopper:1' \
    --benchmark_out="$BENCH_JSON/train_step_hopper.json" --benchmark_out_format=json
else
  verdict bench/train_step_hopper "skipped (the hopper path hung or crashed in tier 2)" 0
fi
bench decode 30
# build/plan against measurement: the 1B step's time planned with the rates this run's benches measured (and
# with the committed plan/plan_rates.json) against bench_train_step's, within 15%; the planned arena against
# the bench model's device bytes; the demo run's GPU memory in use against its plan.
case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
  *H200*) PLAN_GPU=h200 ;; *H100*) PLAN_GPU=h100-80gb ;; *A100*) PLAN_GPU=a100-80gb ;; *) PLAN_GPU=h200 ;;
esac
if [ $EMULATED -eq 1 ]; then
  # The emulated benches measure nothing, so the refresh must refuse them; the committed rates stand in.
  EXPECT=1 step plan/refresh 20 benches.log "$BIN/plan" --refresh_rates "$BENCH_JSON" --rates plan/plan_rates.json \
    --rates_out "$RUNS/rates.json"
  grep -q "no GEMM, attention or memory bench results" "$STEP_OUT" ||
    verdict plan/refresh "FAILED (the refresh of emulated benches did not refuse them as expected: benches.log)" 0
  cp plan/plan_rates.json "$RUNS/rates.json"
else
  step plan/refresh 20 benches.log "$BIN/plan" --refresh_rates "$BENCH_JSON" --rates plan/plan_rates.json \
    --rates_out "$RUNS/rates.json"
fi
plan_step() {  # name args...: one plan as JSON into RUNS/name.json
  local name=$1; shift
  step "plan/$name" 20 benches.log "$BIN/plan" --gpu "$PLAN_GPU" --gpus_per_node 1 --tokens 1M --json "$@"
  cp "$STEP_OUT" "$RUNS/$name.json"
}
for b in 2 4; do
  plan_step "plan_b$b" --model llama-3.2-1b --micro_batch $b --seq_len 4096 --rates "$RUNS/rates.json"
  plan_step "plan_b${b}_committed" --model llama-3.2-1b --micro_batch $b --seq_len 4096 --rates plan/plan_rates.json
done
plan_step plan_demo --model demo/config.json --micro_batch 8 --seq_len 128 --rates plan/plan_rates.json
cat >"$SCRATCH/plan_summary.py" <<'PY'
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
    measured = next((x for x in benches if x["name"].startswith(f"BM_TrainStep/batch:{b}/seq:4096/part:0/hopper:0")), None)
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
PY
step plan/summary 30 benches.log python3 "$SCRATCH/plan_summary.py" "$BENCH_JSON" "$RUNS" "$RUNS/plan_summary.tsv" "$EMULATED"
# The peers on the same GPU (torch and transformers as the machine has them). A peer that cannot run here is
# reported, not a failure of tuna.
if [ $EMULATED -eq 1 ] || python3 -c "import torch, transformers" >/dev/null 2>&1; then
  ADVISORY=1 step peers 150 benches.log env PYTHONUNBUFFERED=1 python3 tools/reference/peers_gpu.py \
    --attention --step --compile --out "$BENCH_JSON/peers.jsonl" ${PEERS_FLAGS[@]+"${PEERS_FLAGS[@]}"}
else
  verdict peers "skipped (no torch and transformers in python3 here)" 0
fi

# ================================ tier 4: sanitizers and the profile ================================
tier 4
# Memory and race checker over the riskiest kernels (shared-memory tiling, double buffers, in-place rows). rc 9:
# the sanitizer found errors; 1: a test failed under it. gVisor machines refuse it ("Device not supported").
if command -v compute-sanitizer >/dev/null 2>&1; then
  sanitize() {  # name tool filter
    UNAVAILABLE_IF="Device not supported" step "sanitizer/$1" 60 tests.log compute-sanitizer --tool "$2" \
      --error-exitcode 9 "$BIN/gpu_tests" --gtest_color=no --gtest_filter="$3"
  }
  sanitize memcheck memcheck 'AttentionGpu.HeadDim64GroupedQuery:AttentionGpu.SmallHeadDimsOfTinyModels:RmsNormGpu.*:ClassifierGpu.*:EmbeddingGpu.*'
  race_filter='AttentionGpu.HeadDim*'
  [ $HOPPER_OK -eq 1 ] || race_filter="$race_filter:-$HOPPER_TESTS"
  sanitize racecheck racecheck "$race_filter"
else
  verdict sanitizer/memcheck "skipped (no compute-sanitizer)" 0
  verdict sanitizer/racecheck "skipped (no compute-sanitizer)" 0
fi
# Each kernel's duration in the 1B step at batch 2 (one metric, no replay, boost clocks; about 800 launches a
# step: the first 1700 cover the warmup step and a whole step after it).
if command -v ncu >/dev/null 2>&1; then
  ADVISORY=1 step profile 60 benches.log ncu --metrics gpu__time_duration.sum --clock-control none \
    --cache-control none --csv --print-units base --launch-count 1700 --log-file "$BENCH_JSON/ncu.csv" \
    "$BIN/bench_train_step_gpu" --benchmark_filter='BM_TrainStep/batch:2/seq:4096/part:0/hopper:0'
else
  verdict profile "skipped (no ncu)" 0
fi
COMPLETED=1
# finish (the EXIT trap) writes benches.json and the table.
