#!/usr/bin/env bash
# scripts/gpu-check.sh [--emulated] OUTDIR — the one command for a GPU machine: every GPU test, the trainer end
# to end, every GPU bench with its peers, the sanitizers and the step's profile; full logs under OUTDIR, ONE
# summary table printed last. Run on a GPU machine, from the repository root, with the binaries of
#
#   make -j2 gpu-check-build   # -> build/gpu-check/bin/{gpu_tests, gpu_benches, bench_*_gpu, train, plan, data/,
#                              #    lib/}: sm_90a code (SM="90a 80" adds sm_80), under 40 MB, for a machine with
#                              #    the CUDA toolkit (libcublasLt.so.13, or PyTorch's wheel), glibc >= 2.34, torch
#                              #    and transformers, and none of the Debian -dev packages; bench_NAME_gpu are
#                              #    scripts running `gpu_benches NAME` (the GPU benches in one binary), data/ is the
#                              #    demo corpus tokenized, lib/ Google Benchmark's, Open MPI's and sentencepiece's
#
# carried beside the repository as build/gpu-check/bin (TUNA_GPU_BIN names another place).
#
# A short lease, or a rerun of what failed: TUNA_GPU_CHECK_ONLY=REGEX (grep -E, on the step names the table prints:
# tests/MatmulGpu, train/straight, bench/gemm, ...) runs the steps it matches and marks the others "skipped (not
# selected)", which fails nothing (tests/list, which finds the suites, always runs); a check over skipped steps'
# output (train/summary, plan/summary) reports them missing, so select it with its inputs or not at all.
#
# The run stops at 440 s (TUNA_GPU_CHECK_SECONDS), inside a 480 s limit: the steps run in four tiers, most
# important first, each allowed until a fixed second of the run (TIER_END below: estimates until a GPU run
# prints the seconds each tier took), so a slow tier leaves the later ones their share:
#   1. the first answers, in this order, in about the first 4 minutes: does every GPU test pass (the hopper
#      forward's documents inside a warpgroup first, alone, under a 60 s watchdog; then every suite, one per
#      process, as a kernel fault poisons its CUDA context only: the ops against their CPU twins, the GPU model
#      against the transformers fixtures and the CPU model, generation, the hopper path, the multi-rank engine
#      with ranks as threads on this GPU, ZeRO stages and recompute modes); does build/train --device cuda train
#      the demo, without adapters and with LoRA; is the mma attention back at its 2026-11-30 speed (b4 x s4096,
#      hd128 and hd64); the 1B step against PyTorch's (transformers eager) on this GPU;
#   2. the rest of the correctness checks: a run stopped and resumed bit for bit (with and without adapters),
#      the first step = the CPU backend's, a 70B model refused before allocating, the trainer at --zero 1/2/3
#      (losses bit for bit ZeRO-0's), QLoRA, LoRA at ZeRO-2, --fp8 tensorwise (its loss falls) and with LoRA;
#   3. the benches (attention, with packed documents masked against unmasked on both paths, GEMM,
#      memory-bound kernels, the 1B step in bf16 and with --fp8 tensorwise, generation), build/plan's planned step
#      time and memory against the measured ones, and the peers timed in the same run
#      (tools/reference/peers_gpu.py: torch SDPA flash/cuDNN, transformers eager and compiled);
#   4. compute-sanitizer (memcheck, racecheck) over the riskiest kernels and the step's kernel time by op (ncu).
# Each step has its own timeout, cut to what is left of its tier; a step with no time left is skipped and says
# so. Whatever fails or hangs, the table, benches.json and the seconds spent per tier come out (a trap prints
# them on exit, on a signal too). Last come the first answers again as the lines a reader needs to fill the
# measurement table of a benchmarks/ file ("for the table:").
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
# The Python parts of the check: beside this script, else (a copy of it run elsewhere) the repository's.
PY=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/gpu_check
[ -d "$PY" ] || PY=$(pwd)/scripts/gpu_check
SCRATCH=$(mktemp -d /tmp/tuna-gpu-check.XXXXXX)  # per-step output, per-bench JSON, the runs: not returned
BENCH_JSON="$SCRATCH/json"
RUNS="$SCRATCH/runs"
mkdir -p "$BENCH_JSON" "$RUNS"
status=0

# ---- the tiers: the latest second of the run each may reach, and the run's own deadline (the table and
# benches.json take a few seconds after it; the device call's limit is 480 s).
DEADLINE=${TUNA_GPU_CHECK_SECONDS:-440}
TIER_END=(0 240 300 400 435)
TIER_TITLE=("" "the first answers (GPU tests, demo on cuda, mma attention's speed, 1B step vs PyTorch)"
            "the rest of the correctness checks (resume, ZeRO, LoRA resume, QLoRA)" "benches and their peers"
            "sanitizers and the profile")
TIER_SECS=(0 0 0 0 0)
TIER=0
TIER_T0=$SECONDS
MIN_STEP_SECONDS=5  # less than this left: the step is skipped, not started to be killed
ONLY=${TUNA_GPU_CHECK_ONLY:-}  # a grep -E of the step names to run (the header); empty: every step
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
# Leaves STEP_RC (-1 when skipped for time, -2 when not selected) and STEP_OUT (its output) for further checks.
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
  if [ -n "$ONLY" ] && [ "$name" != tests/list ] && ! grep -qE -- "$ONLY" <<<"$name"; then
    STEP_RC=-2
    echo "==== $name: skipped, not selected (TUNA_GPU_CHECK_ONLY=$ONLY)" >>"$OUT/$logfile"
    verdict "$name" "skipped (not selected)" 0
    return
  fi
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
  timeout -k 5 60 python3 "$PY/merge_benches.py" "$BENCH_JSON" "$OUT/benches.json" >>"$OUT/benches.log" 2>&1 ||
    { echo "gpu-check: benches.json not written (benches.log)" | tee -a "$SUMMARY"; status=1; }
  local tiers="$SCRATCH/tiers.tsv"
  : >"$tiers"
  for t in 1 2 3 4; do printf '%s\t%s\t%s\t%s\n' "$t" "${TIER_TITLE[$t]}" "${TIER_SECS[$t]}" "${TIER_END[$t]}" >>"$tiers"; done
  timeout -k 5 60 python3 "$PY/table.py" "$OUT" "$STEPS_TSV" "$tiers" "$RUNS" "$EMULATED" 2>&1 | tee -a "$SUMMARY"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { log "gpu-check: the table failed (above)"; status=1; }
  log "seconds per tier: $(for t in 1 2 3 4; do printf '%s: %s s; ' "$t" "${TIER_SECS[$t]}"; done)total $SECONDS s of $((480 * TIME_SCALE))"
  if [ $status -ne 0 ]; then
    log "gpu-check: FAILED: $(awk -F'\t' '$5 == 1 {printf "%s%s: %s", sep, $2, $3; sep="; "}' "$STEPS_TSV")"
  else
    log "gpu-check: every step of tiers 1-3 passed$([ $EMULATED -eq 1 ] && echo ' (emulated: plumbing only, no measurement)')"
  fi
  if [ -s "$RUNS/answers.txt" ]; then
    log "== for the table:"
    while IFS= read -r line; do log "  $line"; done <"$RUNS/answers.txt"
  fi
  rm -rf "$SCRATCH"
  exit $status
}
COMPLETED=0
trap finish EXIT
trap 'COMPLETED=2; verdict gpu-check "FAILED (interrupted by a signal at second $SECONDS)" 0; finish' INT TERM

# The scripts finish() runs are written first, so that they exist whatever happens next.


# ---- the machine
log "== gpu-check$([ $EMULATED -eq 1 ] && echo ' --emulated') $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(pwd), binaries from $BIN"
[ -n "$ONLY" ] && log "only the steps matching TUNA_GPU_CHECK_ONLY=$ONLY (the others: skipped, not selected)"
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
BENCH_BINARY=()  # the GPU benches' one binary, which the bench_*_gpu scripts run (the emulated ones are binaries)
[ $EMULATED -eq 1 ] || BENCH_BINARY=(gpu_benches)
for b in gpu_tests ${BENCH_BINARY[@]+"${BENCH_BINARY[@]}"} train plan "${BENCH_NAMES[@]/#/bench_}"; do
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
test_step() {  # name limit filter [flags]
  step "$1" "$2" tests.log "$BIN/gpu_tests" --gtest_color=no --gtest_filter="$3" "${@:4}"
  if [ "$STEP_RC" -ge 0 ] && ! grep -qE '^tests: ' "$STEP_OUT"; then
    local running
    running=$(grep -E '^\[ RUN      \] ' "$STEP_OUT" | tail -1 | sed 's/^\[ RUN      \] //')
    { echo "[  FAILED  ] ${running:-$1} (rc $STEP_RC: hung or crashed)"
      echo "tests: 0 passed, 1 failed, 0 skipped ($1: rc $STEP_RC)"; } >>"$OUT/tests.log"
  fi
}
HOPPER_TESTS='AttentionGpu.*Hopper*:AttentionGpu.BackwardAppliesRope*'
# The multi-rank engine (ranks as threads sharing this GPU; tp with and without sp, pipeline stages, also over the
# loopback comm), and every ZeRO stage and recompute mode against ZeRO-0: after the other suites, each with a longer
# limit.
ENGINE_SUITES=" EngineGpuThreadRanks. EngineGpuSequenceParallel. EngineGpuPipeline. EngineGpuPipelineLoopback. "
ENGINE_SUITES+="EngineGpuStages. EngineGpuZeroOne. "

# The demo runs of build/train (demo/train.toml, the corpus tokenized in bin/data), each in its own directory.
D="$BIN/data"
TRAIN_ARGS=(--config demo/train.toml --train_data "$D/train-*.bin" --val_data "$D/val-*.bin"
            --tokenizer "$D/tokenizer.model" --log_every 50 --ckpt_every 0)
train_step() {  # name limit args...
  local name=$1 limit=$2; shift 2
  step "train/$name" "$limit" train.log env LD_LIBRARY_PATH="$BIN_LD" "$BIN/train" "${TRAIN_ARGS[@]}" "$@"
}

# ================================ tier 1: the first answers ================================
tier 1
# 1. Every GPU test passes. First, alone, under a watchdog: the hopper forward with documents starting inside a
# consumer warpgroup's rows (the shapes where its warps once chose different wgmma instructions, undefined
# behaviour that may hang the GPU or compute garbage). A hang or a fault there, or in the hopper tests below,
# keeps the hopper path out of every later step, which would hang or fail on it again.
A1_TEST='AttentionGpu.HopperDocumentsStartingInsideAWarpgroup'
test_step tests/hopper-documents-in-a-warpgroup 60 "$A1_TEST"
HOPPER_OK=1
[ "$STEP_RC" -eq -2 ] || grep -qE '^tests: ' "$STEP_OUT" || HOPPER_OK=0
step tests/list 30 tests.log "$BIN/gpu_tests" --gtest_list_tests
suites=$(grep -E '^[A-Za-z0-9_/]+\.$' "$STEP_OUT" || true)  # "Suite." and "Instance/Suite." lines
[ -z "$suites" ] && verdict tests/list "FAILED (no test suite listed: tests.log)" 0
for suite in $suites; do
  [[ $ENGINE_SUITES == *" ${suite##*/} "* ]] && continue
  filter="${suite}*"
  [ "$suite" = "AttentionGpu." ] && filter="${suite}*:-$HOPPER_TESTS:$A1_TEST"  # the hopper tests: their own step
  test_step "tests/${suite%.}" 60 "$filter"
done
if [ $HOPPER_OK -eq 1 ]; then
  test_step tests/hopper 60 "$HOPPER_TESTS:-$A1_TEST"
  [ "$STEP_RC" -eq -2 ] || grep -qE '^tests: ' "$STEP_OUT" || HOPPER_OK=0
else
  verdict tests/hopper "FAILED (not run: the hopper path hung or crashed on $A1_TEST)" 0
fi
for name in $ENGINE_SUITES; do
  listed=$(grep -E "^([A-Za-z0-9_]+/)?$name\$" <<<"$suites" || true)
  [ -n "$listed" ] || { verdict "tests/${name%.}" "FAILED (suite $name not in gpu_tests --gtest_list_tests)" 0; continue; }
  for suite in $listed; do test_step "tests/${suite%.}" 90 "${suite}*"; done
done
if grep -q "no CUDA device visible" "$OUT/tests.log"; then verdict tests "FAILED (no CUDA device visible to the tests)" 0; fi

# 2. The demo trains on cuda, without adapters (300 steps learn) and with them: LoRA (r 8 on all seven
# projections, dropout 0.05) over the straight run's model as the frozen base.
train_step straight 60 --device cuda --out_dir "$RUNS/straight"
LORA_ARGS=(--device cuda --model_config "" --init "$RUNS/straight/ckpt/latest" --lora_rank 8 --lora_alpha 16
           --lora_dropout 0.05)
train_step lora 60 "${LORA_ARGS[@]}" --out_dir "$RUNS/lora"

# 3. The mma attention (the default path) at b4 x s4096, LLaMA-3-8B heads, forward and backward, hd128 and hd64:
# its 2026-11-30 rates were 214 / 139 TFLOP/s at hd128 and 179 / 112 at hd64 (benchmarks/2026-11-30-h200-gpu-check.md).
step bench/attention_mma 45 benches.log "$BIN/bench_attention_gpu" \
  --benchmark_filter='^BM_Attention/seq:4096/hd:(64|128)/bwd:[01]/hopper:0/kv:8/' \
  --benchmark_out="$BENCH_JSON/attention_mma.json" --benchmark_out_format=json --benchmark_counters_tabular=true

# 4. The 1B step at batch 4 x 4096 (the default attention path), and PyTorch's (transformers eager, the same
# shape, on this GPU).
step bench/train_step_1b 45 benches.log "$BIN/bench_train_step_gpu" \
  --benchmark_filter='^BM_TrainStep/batch:4/seq:4096/part:0/hopper:0/fp8:0/' \
  --benchmark_out="$BENCH_JSON/train_step_1b.json" --benchmark_out_format=json --benchmark_counters_tabular=true
if [ $EMULATED -eq 1 ] || python3 -c "import torch, transformers" >/dev/null 2>&1; then
  ADVISORY=1 step peers/step 60 benches.log env PYTHONUNBUFFERED=1 python3 tools/reference/peers_gpu.py \
    --step --step_batches 4 --out "$BENCH_JSON/peers-step.jsonl" ${PEERS_FLAGS[@]+"${PEERS_FLAGS[@]}"}
else
  verdict peers/step "skipped (no torch and transformers in python3 here)" 0
fi

# ================================ tier 2: the rest of the correctness checks ================================
tier 2
# The pipeline's events on this one GPU, the first check of them a one-GPU machine can make: pp 2 and 3 over the
# loopback comm (the stages' copies ordered against their compute by events alone, as NCCL's across GPUs) with
# random-length sleep kernels queued on the comm and compute streams, three seeds, bit for bit one stage's. Emulated,
# the emulator's streams also run out of order (each on a thread of its own, random delays drawn from a seed).
STREAM_FLAGS=()
[ $EMULATED -eq 1 ] && STREAM_FLAGS=(--streams concurrent --jitter 1)
test_step tests/pipeline-jitter 90 'Stages/EngineGpuPipelineLoopback.*jitter*' ${STREAM_FLAGS[@]+"${STREAM_FLAGS[@]}"}
# NCCL's channels for the pipeline's comm (made with at most 2 CTAs, comm/comm.h NcclOptions): only a machine with
# two GPUs can say (NCCL refuses two ranks on one), given a trainer built with NCCL (TUNA_NCCL_TRAIN: gpu-check's own
# has none) and mpirun. NCCL's INIT log counts the channels it made; the line is printed here.
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -c .)
if [ "${GPUS:-0}" -ge 2 ] && [ -x "${TUNA_NCCL_TRAIN:-}" ] && command -v mpirun >/dev/null; then
  step nccl/pp-channels 60 train.log env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT LD_LIBRARY_PATH="$BIN_LD" \
    mpirun --allow-run-as-root -np 2 "$TUNA_NCCL_TRAIN" "${TRAIN_ARGS[@]}" --device cuda --pp 2 --steps 2 \
    --out_dir "$RUNS/nccl-pp"
  log "  NCCL channels of the pp comm: $(grep -ohE '[0-9]+ coll channels.*p2p channels per peer' "$STEP_OUT" | sort -u |
                                        tr '\n' ';')"
else
  verdict nccl/pp-channels "unavailable here (${GPUS:-0} GPU(s); needs 2, TUNA_NCCL_TRAIN and mpirun)" 0
fi
# build/train --device cuda: a run stopped at 150 (exit 75) and resumed logs the straight run's losses bit for
# bit, the first step equals the CPU backend's within bf16 error.
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
# The trainer at ZeRO-1, ZeRO-3 with full recompute and ZeRO-2 with selective recompute: on one GPU the same
# bits as ZeRO-0 without recompute (the tests hold it on the emulator).
train_step zero1 60 --device cuda --zero 1 --out_dir "$RUNS/zero1"
train_step zero3-full 60 --device cuda --zero 3 --recompute full --out_dir "$RUNS/zero3"
train_step zero2-selective 60 --device cuda --zero 2 --recompute selective --out_dir "$RUNS/zero2"
# LoRA stopped at 150 (exit 75) and resumed from its PEFT checkpoint logs the straight LoRA run's losses.
EXPECT=75 train_step lora-stopped 60 "${LORA_ARGS[@]}" --out_dir "$RUNS/lora-split" --stop_at_step 150
train_step lora-resumed 60 --device cuda --out_dir "$RUNS/lora-split" --resume
# QLoRA: the same adapters over the base held in NF4 (quantized as it is read, dequantized a layer at a time).
train_step qlora 60 "${LORA_ARGS[@]}" --base_quant nf4 --out_dir "$RUNS/qlora"
# The adapters at ZeRO-2 (their master, moments and gradients sharded, a layer's gradient reduce-scattered as its
# backward ends): on one GPU the same bits as ZeRO-0 (the tests hold it on the emulator).
train_step lora-zero2 60 "${LORA_ARGS[@]}" --zero 2 --out_dir "$RUNS/lora-zero2"
# FP8: the demo from scratch with the seven projections' GEMMs in FP8 (--fp8 tensorwise: cuBLASLt's e4m3/e5m2 GEMMs,
# the casts, the amaxes folded into the norms and SwiGLU), 40 steps validated once: its loss falls (train_summary.py).
train_step fp8 60 --device cuda --fp8 tensorwise --steps 40 --val_every 40 --out_dir "$RUNS/fp8"
# FP8 with adapters: LoRA r8 over the frozen base's FP8 GEMMs, the base's codes kept in the forward layout only (the
# transposed ones cast at each backward, --fp8_weight_codes forward), 40 steps from the LoRA run's start: the adapters
# train, and the first step's loss is the bf16 LoRA run's within FP8's rounding of one pass (train_summary.py).
train_step fp8-lora 60 "${LORA_ARGS[@]}" --fp8 tensorwise --fp8_weight_codes forward --steps 40 --val_every 40 \
  --out_dir "$RUNS/fp8-lora"
step train/summary 30 train.log python3 "$PY/train_summary.py" "$RUNS" "$RUNS/train_summary.tsv" "$too_big_rc" "$EMULATED"

# ================================ tier 3: benches and their peers ================================
tier 3
bench memory 60
if [ $HOPPER_OK -eq 1 ]; then bench attention 90; else bench attention 90 --benchmark_filter='hopper:0'; fi
# The attention backward at G = 1 against G = 4, equal FLOPs (32 query heads over 32 or 8 kv heads: the bench's
# "bwd G=1" rows beside its plain bwd rows). G=4 / G=1 well under 1 means the hopper path's ordered dQ additions
# stall under grouped-query attention. Lines into the summary log; decides nothing.
ADVISORY=1 step bench/attention_gqa 20 benches.log python3 "$PY/attention_gqa.py" "$BENCH_JSON/attention.json"
while IFS= read -r line; do log "$line"; done <"$STEP_OUT"
bench gemm 75
bench train_step 110 --benchmark_filter='-hopper:1'  # the bf16 and the --fp8 tensorwise rows
# The 1B step at batch 4 x 4096 once more on the hopper attention path (--attention hopper), beside the default's,
# in bf16 and with --fp8 tensorwise (the two together against the bf16 mma step: the 1B figure of FP8's 1.3x aim).
if [ $HOPPER_OK -eq 1 ]; then
  step bench/train_step_hopper 70 benches.log "$BIN/bench_train_step_gpu" \
    --benchmark_filter='BM_TrainStep/batch:4/seq:4096/part:0/hopper:1' \
    --benchmark_out="$BENCH_JSON/train_step_hopper.json" --benchmark_out_format=json
else
  verdict bench/train_step_hopper "skipped (the hopper path hung or crashed in tier 1)" 0
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
  [ "$STEP_RC" -eq -2 ] || grep -q "no GEMM, attention or memory bench results" "$STEP_OUT" ||
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
step plan/summary 30 benches.log python3 "$PY/plan_summary.py" "$BENCH_JSON" "$RUNS" "$RUNS/plan_summary.tsv" "$EMULATED"
# The peers on the same GPU (torch and transformers as the machine has them). A peer that cannot run here is
# reported, not a failure of tuna.
if [ $EMULATED -eq 1 ] || python3 -c "import torch, transformers" >/dev/null 2>&1; then
  ADVISORY=1 step peers 150 benches.log env PYTHONUNBUFFERED=1 python3 tools/reference/peers_gpu.py \
    --attention --step --step_batches 2 --compile --out "$BENCH_JSON/peers.jsonl" ${PEERS_FLAGS[@]+"${PEERS_FLAGS[@]}"}
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
    "$BIN/bench_train_step_gpu" --benchmark_filter='BM_TrainStep/batch:2/seq:4096/part:0/hopper:0/fp8:0'
else
  verdict profile "skipped (no ncu)" 0
fi
COMPLETED=1
# finish (the EXIT trap) writes benches.json and the table.
