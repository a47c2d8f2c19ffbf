#!/usr/bin/env bash
# build/eval --tasks against lm-evaluation-harness (transformers backend), one CPU thread each, per CPU-second:
# benchmarks/2026-12-04-mc-eval-vs-lm-eval.md. Run from the repository root after `make`:
#
#   PY=/path/to/venv/bin/python tools/reference/bench_mc_eval.sh     # setup, then lm-eval, tuna, lm-eval, tuna
#   PY=... ROUNDS=1 LM_BATCH="1 8" TUNA_MB="1 4 8" OUT=/tmp/mc_speed tools/reference/bench_mc_eval.sh   # variants
#   PY=... COMPARE_ONLY=1 tools/reference/bench_mc_eval.sh                 # the table and checks of the runs in OUT
#
# PY: a python with lm-eval 0.4.13, torch 2.5.1, transformers 4.46.3 (tools/reference/requirements.txt); lm-eval runs
# through its own entry point with torch pinned to one thread. Makes under OUT: model/ (the 135M LLaMA shape of bench/llama_135m.json, random N(0, 0.02)
# weights, seed 135, float32, with the tokenizer of tests/fixtures/mc_eval), tasks/ (the first N_RECORDS records of
# demo/tasks/debian_licenses.jsonl and demo/tasks/bigbench_sports_understanding.jsonl), yaml/ (lm-eval task YAMLs over
# those files, as tools/reference/mc_tasks/), then per run a `/usr/bin/time -v` log, lm-eval's samples, tuna's
# --output; last, compare: both tools' acc / acc_norm and every request's log-likelihood, and a table.
set -euo pipefail
PY=${PY:?set PY to the python of a venv with lm-eval 0.4.13}
OUT=${OUT:-/tmp/mc_speed}
N_RECORDS=${N_RECORDS:-150}
ROUNDS=${ROUNDS:-2}
LM_BATCH=${LM_BATCH-1}
TUNA_MB=${TUNA_MB-1}
ROOT=$(pwd)
[[ -f bench/llama_135m.json ]] || { echo "bench_mc_eval: run from the repository root" >&2; exit 1; }
[[ -z "$TUNA_MB" || -x build/eval ]] || { echo "bench_mc_eval: no build/eval: run make first" >&2; exit 1; }
mkdir -p "$OUT/tasks" "$OUT/yaml" "$OUT/runs"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1

# --- setup -------------------------------------------------------------------------------------------------------
if [[ ! -f "$OUT/model/model.safetensors" ]]; then
  "$PY" - "$ROOT" "$OUT/model" <<'PYEOF'
import json, os, shutil, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
root, out = sys.argv[1], sys.argv[2]
cfg = json.load(open(os.path.join(root, "bench/llama_135m.json")))
cfg.update(bos_token_id=510, eos_token_id=511)  # the tokenizer's own BOS and EOS
torch.manual_seed(135)
model = LlamaForCausalLM(LlamaConfig(**cfg)).float()
with torch.no_grad():
    for name, p in model.named_parameters():
        p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
model.save_pretrained(out, safe_serialization=True)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(root, "tests/fixtures/mc_eval", f), out)
print("model:", sum(p.numel() for p in model.parameters()), "parameters ->", out)
PYEOF
fi
head -n "$N_RECORDS" demo/tasks/debian_licenses.jsonl > "$OUT/tasks/debian_licenses.jsonl"
head -n "$N_RECORDS" demo/tasks/bigbench_sports_understanding.jsonl > "$OUT/tasks/bigbench_sports_understanding.jsonl"
cp tools/reference/mc_tasks/mc_utils.py "$OUT/yaml/"
for task in debian_licenses bigbench_sports_understanding; do
  cat > "$OUT/yaml/speed_$task.yaml" <<YEOF
task: speed_$task
dataset_path: json
dataset_kwargs:
  data_files:
    test: $OUT/tasks/$task.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: !function mc_utils.doc_to_choice
doc_to_target: !function mc_utils.doc_to_target
target_delimiter: " "
num_fewshot: 0
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
YEOF
done
cat > "$OUT/yaml/speed.yaml" <<YEOF
group: speed
task:
  - speed_debian_licenses
  - speed_bigbench_sports_understanding
aggregate_metric_list:
  - metric: acc
    aggregation: mean
    weight_by_size: true
  - metric: acc_norm
    aggregation: mean
    weight_by_size: true
metadata:
  version: 1.0
YEOF

# --- runs --------------------------------------------------------------------------------------------------------
# lm-eval through a two-line wrapper that pins torch to one intra-op and one inter-op thread before lm-eval starts
# (OMP_NUM_THREADS already does the first); the rest is lm-eval's own command line.
run_lm_eval() {  # batch size, round
  local name="lm_eval_bs$1_r$2"
  echo "$(date +%T) $name  load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/runs/load.txt"
  rm -rf "$OUT/runs/$name"
  /usr/bin/time -v -o "$OUT/runs/$name.time" "$PY" -c \
    'import sys, torch; torch.set_num_threads(1); torch.set_num_interop_threads(1)
from lm_eval.__main__ import cli_evaluate; sys.argv[0] = "lm_eval"; cli_evaluate()' \
    --model hf --model_args "pretrained=$OUT/model,dtype=float32" --include_path "$OUT/yaml" --tasks speed \
    --batch_size "$1" --device cpu --log_samples --output_path "$OUT/runs/$name" > "$OUT/runs/$name.log" 2>&1
  echo "$(date +%T) $name done  load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/runs/load.txt"
}
run_tuna() {  # micro batch, round
  local name="tuna_mb$1_r$2"
  echo "$(date +%T) $name  load: $(cut -d' ' -f1-3 /proc/loadavg)  build/eval $(stat -c %y build/eval | cut -c1-19)" \
    | tee -a "$OUT/runs/load.txt"
  /usr/bin/time -v -o "$OUT/runs/$name.time" build/eval --checkpoint "$OUT/model" \
    --tasks "$OUT/tasks/debian_licenses.jsonl,$OUT/tasks/bigbench_sports_understanding.jsonl" --threads 1 \
    --micro_batch "$1" --output "$OUT/runs/$name.jsonl" > "$OUT/runs/$name.log" 2>&1
  echo "$(date +%T) $name done  load: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/runs/load.txt"
}
if [[ -z "${COMPARE_ONLY:-}" ]]; then
  for ((round = 1; round <= ROUNDS; round++)); do
    for bs in $LM_BATCH; do run_lm_eval "$bs" "$round"; done
    for mb in $TUNA_MB; do run_tuna "$mb" "$round"; done
  done
fi

# --- compare -----------------------------------------------------------------------------------------------------
"$PY" - "$OUT" <<'PYEOF'
import glob, json, os, re, sys
out = sys.argv[1]
runs = os.path.join(out, "runs")
requests = 0
for f in ("debian_licenses", "bigbench_sports_understanding"):
    requests += sum(len(json.loads(l)["choices"]) for l in open(os.path.join(out, "tasks", f + ".jsonl")))

def time_v(path):
    t = open(path).read()
    get = lambda key: re.search(re.escape(key) + r": (.*)", t).group(1).strip()
    wall = get("Elapsed (wall clock) time (h:mm:ss or m:ss)").split(":")
    wall_s = sum(float(x) * 60 ** i for i, x in enumerate(reversed(wall)))
    return float(get("User time (seconds)")), float(get("System time (seconds)")), wall_s, int(get("Maximum resident set size (kbytes)"))

# per request log-likelihoods and metrics, keyed (task, line, choice)
def lm_eval_side(name):
    ll, metrics = {}, {}
    for path in glob.glob(os.path.join(runs, name, "**", "samples_speed_*.jsonl"), recursive=True):
        task = re.search(r"samples_speed_(.*)_\d{4}-", os.path.basename(path)).group(1)
        for line in open(path):
            s = json.loads(line)
            for i, r in enumerate(s["resps"]):
                ll[(task, s["doc_id"] + 1, i)] = float(r[0][0])
    res = glob.glob(os.path.join(runs, name, "**", "results_*.json"), recursive=True)
    r = json.load(open(res[0]))["results"]
    for task in ("debian_licenses", "bigbench_sports_understanding"):
        m = r["speed_" + task]
        metrics[task] = (m["acc,none"], m["acc_norm,none"])
    metrics["all"] = (r["speed"]["acc,none"], r["speed"]["acc_norm,none"])
    return ll, metrics

def tuna_side(name):
    ll = {}
    for line in open(os.path.join(runs, name + ".jsonl")):
        rec = json.loads(line)
        for i, v in enumerate(rec["loglikelihoods"]):
            ll[(rec["task"], rec["line"], i)] = float(v)
    last = [l for l in open(os.path.join(runs, name + ".log")) if l.startswith("{")][-1]
    m = json.loads(last)["metrics"]
    return ll, {k: (v["acc"], v["acc_norm"]) for k, v in m.items()}

rows = []
for path in sorted(glob.glob(os.path.join(runs, "*.time"))):
    name = os.path.basename(path)[:-5]
    user, sys_, wall, rss = time_v(path)
    rows.append((name, user, sys_, wall, rss))
print(f"{requests} requests")
print(f"| run | user s | sys s | CPU s | wall s | CPU/wall | max RSS MB | requests / CPU s |")
print(f"|---|---:|---:|---:|---:|---:|---:|---:|")
for name, user, sys_, wall, rss in rows:
    cpu = user + sys_
    print(f"| {name} | {user:.1f} | {sys_:.1f} | {cpu:.1f} | {wall:.1f} | {cpu / wall:.2f} | {rss / 1024:.0f} | {requests / cpu:.3f} |")
best = {}
for name, user, sys_, wall, rss in rows:
    side = name.split("_")[0]
    best[side] = min(best.get(side, (1e30, "")), (user + sys_, name))
if "lm" in best and "tuna" in best:
    print(f"best lm-eval {best['lm'][1]} {best['lm'][0]:.1f} CPU s; best tuna {best['tuna'][1]} {best['tuna'][0]:.1f} CPU s;"
          f" ratio {best['lm'][0] / best['tuna'][0]:.2f}x")

lm_names = sorted({r[0] for r in rows if r[0].startswith("lm_eval")})
tuna_names = sorted({r[0] for r in rows if r[0].startswith("tuna")})
if lm_names and tuna_names:
    ref_ll, ref_m = lm_eval_side(lm_names[0])
    for n in lm_names[1:]:
        ll, m = lm_eval_side(n)
        d = max(abs(ll[k] - ref_ll[k]) / abs(ref_ll[k]) for k in ref_ll)
        print(f"{n} vs {lm_names[0]}: max relative log-likelihood difference {d:.2e}, metrics equal: {m == ref_m}")
    for n in tuna_names:
        ll, m = tuna_side(n)
        assert ll.keys() == ref_ll.keys(), (n, len(ll), len(ref_ll))
        rel = sorted(abs(ll[k] - ref_ll[k]) / abs(ref_ll[k]) for k in ref_ll)
        print(f"{n} vs {lm_names[0]}: {len(rel)} log-likelihoods, relative difference max {rel[-1]:.2e}, "
              f"median {rel[len(rel) // 2]:.2e}")
        for task in ("debian_licenses", "bigbench_sports_understanding", "all"):
            print(f"  {task:30s} acc/acc_norm  lm-eval {ref_m[task][0]:.6f} {ref_m[task][1]:.6f}   "
                  f"tuna {m[task][0]:.6f} {m[task][1]:.6f}   {'equal' if m[task] == ref_m[task] else 'DIFFERENT'}")
PYEOF
