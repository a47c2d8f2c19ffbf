#!/usr/bin/env bash
# tools/reference/compare_cpu_step.sh [ROUNDS] [LORA_RANK] — tuna's CPU training step against PyTorch eager on the
# same model and batch (demo/config.json, batch 8 x 128, forward + backward + AdamW), at 1 and 2 threads, run in
# turns (tuna 1, torch 1, tuna 2, torch 2, ROUNDS times, default 3) so that a change in the machine's load
# hits both alike; prints every run and the median of each. LORA_RANK (0, the default: a full fine-tune; 16) times the
# LoRA step instead: rank-16 adapters on all seven projections, tuna's BM_TrainStepLora against PEFT on the same
# PyTorch. Needs build/bench_train_step and $PYTHON (python3 by default) with torch, transformers and for LoRA peft
# (tools/reference/requirements.txt). Not part of CI.
set -euo pipefail
rounds=${1:-3}
lora=${2:-0}
python=${PYTHON:-python3}
case "$lora" in
  0) tuna_bench="BM_TrainStep/8/128/%d/" ;;
  16) tuna_bench="BM_TrainStepLora/8/128/%d/16/" ;;
  *) echo "compare_cpu_step.sh: LORA_RANK: expected 0 or 16 (the ranks bench/bench_train_step.cpp registers), found $lora" >&2
     exit 2 ;;
esac
cd "$(dirname "$0")/../.."
declare -A runs
for ((r = 1; r <= rounds; r++)); do
  for threads in 1 2; do
    # shellcheck disable=SC2059
    tuna=$(build/bench_train_step --benchmark_filter="$(printf "$tuna_bench" "$threads")" --benchmark_min_time=3 \
             --benchmark_format=json | python3 -c 'import json,sys; print(json.load(sys.stdin)["benchmarks"][0]["real_time"])')
    torch=$("$python" tools/reference/bench_torch.py --config demo/config.json --batch 8 --seq 128 --steps 30 \
              --threads "$threads" --lora_rank "$lora" | python3 -c 'import json,sys; print(json.loads(sys.stdin.read().splitlines()[-1])["ms_per_step"])')
    printf 'round %d, %d thread(s): tuna %.1f ms/step, pytorch %.1f ms/step (load %s)\n' "$r" "$threads" "$tuna" "$torch" \
      "$(cut -d' ' -f1 /proc/loadavg)"
    runs[tuna$threads]+="$tuna "
    runs[torch$threads]+="$torch "
  done
done
for threads in 1 2; do
  python3 - "$threads" "${runs[tuna$threads]}" "${runs[torch$threads]}" <<'PY'
import statistics, sys
threads, tuna, torch = sys.argv[1], [float(x) for x in sys.argv[2].split()], [float(x) for x in sys.argv[3].split()]
t, p = statistics.median(tuna), statistics.median(torch)
print(f"median, {threads} thread(s): tuna {t:.1f} ms/step ({1024e3 / t:,.0f} tokens/s), "
      f"pytorch {p:.1f} ms/step ({1024e3 / p:,.0f} tokens/s), tuna/pytorch time {t / p:.2f}")
PY
done
