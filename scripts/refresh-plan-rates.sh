#!/usr/bin/env bash
# scripts/refresh-plan-rates.sh OUTDIR — refreshes build/plan's measured rates (plan/plan_rates.json) from a
# gpu-check run: the gemm, attention and memory benches' Google Benchmark JSON (in OUTDIR/benches.json, or one
# file per bench) replace the GEMM, attention and memory-bound sections, each then naming OUTDIR and the date as
# its source; what no bench measures (the lm_head's effective rate, launch gaps) keeps its figure and its source.
# Review the diff and commit it.
set -euo pipefail
OUT=${1:?usage: scripts/refresh-plan-rates.sh GPU_CHECK_OUTDIR}
cd "$(dirname "$0")/.."
[ -x build/plan ] || make -j2 build/plan
build/plan --refresh_rates "$OUT" --rates plan/plan_rates.json --rates_out plan/plan_rates.json
git --no-pager diff --stat -- plan/plan_rates.json || true
