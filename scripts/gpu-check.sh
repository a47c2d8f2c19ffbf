#!/usr/bin/env bash
# scripts/gpu-check.sh OUTDIR — the one command for a GPU machine: runs every GPU test, a memory checker
# over the riskiest kernels, and every GPU bench; full logs under OUTDIR; ONE summary table printed last.
# Finishes in about 3-4 minutes on an H100/H200 (each step has its own timeout; worst case about 8).
#
# The GPU machine has the CUDA toolkit and Python but no GoogleTest, Google Benchmark, BLAS, MPI or
# sentencepiece, so the binaries are built HERE (the development machine, Debian 12, nvcc 13.0) and carried:
#
#   make -j2 gpu-check-build        # -> build/gpu-check/bin/{gpu_tests, bench_*_gpu, lib/libbenchmark.so.1debian}
#                                   #    sm_90a + sm_80 machine code, ~24 MB, needs glibc >= 2.34 and
#                                   #    libcublasLt.so.13 on the GPU machine (CUDA 13 toolkit or PyTorch's wheel)
#   then, with the device tool:
#   run(command="scripts/gpu-check.sh $OUT/check", carry=["build/gpu-check/bin"], timeout_s=600)
#
# What comes back from $OUT is limited to 8 files two folders deep: this script writes exactly these 8 into
# OUTDIR: summary.log (machine, toolkit, the table), tests.log, sanitizer.log, benches.log and
# bench_{attention,gemm,memory,train_step}.json (Google Benchmark JSON).
#
# Checks, in order:
#   1. gpu_tests: every op against its CPU twin on fresh random inputs (poisoned outputs, shapes off the tile
#      sizes, bf16 error within 2x of a naive same-precision version; determinism of the backward passes);
#      attention fwd/bwd for head dims 64/128 (tensor cores) and 8/16/32; the GPU model against the
#      transformers fixtures (logits, loss, every gradient) and 10 AdamW steps against the CPU model.
#   2. benches: attention fwd/bwd TFLOP/s (causal, hd128, seq 2k/4k/8k), GEMM TFLOP/s at LLaMA 1B/8B/70B
#      shapes, RMSNorm/RoPE/SwiGLU/AdamW GB/s against a device copy, the 1B-shaped training step's tokens/s and
#      MFU (and its forward-only and AdamW-only parts).
#   3. compute-sanitizer memcheck (attention, rmsnorm, classifier, embedding tests) and racecheck (attention);
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

log() { echo "$*" | tee -a "$SUMMARY"; }

log "== gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(pwd)"
log "git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown) $(git status --porcelain 2>/dev/null | wc -l) changed files"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 || true; } | tee -a "$SUMMARY"
{ nvcc --version 2>&1 | tail -1 || true; } | tee -a "$SUMMARY"

# cuBLASLt: the toolkit's, else PyTorch's nvidia-cublas wheel.
for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
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
    grep -oE 'HMMA|LDSM|LDGSTS' | sort | uniq -c | tr '\n' ' ')"
fi

# ---- 1. tests, one process per suite: a kernel fault (which poisons the CUDA context) then costs one suite only.
log "== 1. GPU tests ($BIN/gpu_tests, one process per suite)"
: >"$OUT/tests.log"
suites=$("$BIN/gpu_tests" --gtest_list_tests | grep -v '^ ' | grep '\.$' || true)
STEP[tests]="ok"
for suite in $suites; do
  timeout 150 "$BIN/gpu_tests" --gtest_color=no --gtest_filter="${suite}*" >"$OUT/suite.tmp" 2>&1
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
  timeout "$limit" "$BIN/bench_${name}_gpu" --benchmark_out="$OUT/bench_${name}.json" --benchmark_out_format=json \
    --benchmark_counters_tabular=true >>"$OUT/benches.log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then STEP[bench_$name]="ok"; else STEP[bench_$name]="FAILED (rc $rc)"; status=1; fi
}
run_bench memory 90
run_bench attention 90
run_bench gemm 90
run_bench train_step 120

# ---- 3. memory and race checker over the riskiest kernels (shared-memory tiling, double buffers, in-place rows)
: >"$OUT/sanitizer.log"
if command -v compute-sanitizer >/dev/null 2>&1; then
  log "== compute-sanitizer"
  filter='AttentionGpu.HeadDim64GroupedQuery:AttentionGpu.SmallHeadDimsOfTinyModels:RmsNormGpu.*:ClassifierGpu.*:EmbeddingGpu.*'
  timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/gpu_tests" --gtest_filter="$filter" \
    >>"$OUT/sanitizer.log" 2>&1
  rc_mem=$?
  timeout 100 compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/gpu_tests" \
    --gtest_filter='AttentionGpu.HeadDim*' >>"$OUT/sanitizer.log" 2>&1
  rc_race=$?
  # rc 9: the sanitizer found errors; 1: a test failed under it; 124: timeout. gVisor machines refuse it.
  if grep -q "Device not supported" "$OUT/sanitizer.log"; then STEP[sanitizer]="unavailable here (Device not supported)"
  elif [ $rc_mem -eq 0 ] && [ $rc_race -eq 0 ]; then STEP[sanitizer]="ok (memcheck, racecheck)"
  elif [ $rc_mem -eq 124 ] || [ $rc_race -eq 124 ]; then STEP[sanitizer]="timed out (memcheck rc $rc_mem, racecheck rc $rc_race)"
  else STEP[sanitizer]="FAILED (memcheck rc $rc_mem, racecheck rc $rc_race)"; status=1; fi
else
  STEP[sanitizer]="skipped (no compute-sanitizer)"
fi

# ---- summary table (last)
python3 - "$OUT" "$SUMMARY" "${STEP[tests]}" "${STEP[sanitizer]}" "${STEP[bench_memory]}" "${STEP[bench_attention]}" \
  "${STEP[bench_gemm]}" "${STEP[bench_train_step]}" <<'PY' | tee -a "$SUMMARY"
import json, os, re, sys
out, _, tests, sanitizer, b_mem, b_att, b_gemm, b_train = sys.argv[1:9]
rows = []
def add(section, what, value, note=""):
    rows.append((section, what, value, note))

log = open(os.path.join(out, "tests.log"), errors="replace").read()
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

for b in bench("attention"):
    add("attention", b.get("label", b["name"]), f"{b.get('TFLOP/s', 0)/1:.0f} TFLOP/s", f"{100*b.get('of_peak', 0):.0f}% of peak")
if not bench("attention"): add("attention", "bench_attention_gpu", "no results", b_att)
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
exit $status
