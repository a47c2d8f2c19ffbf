#!/usr/bin/env bash
# make demo: the whole workflow on a laptop-sized model, on the CPU, in a few minutes:
#   tokenizer + shards (build/prepare) -> train (build/train) -> eval -> sample -> export to Hugging Face.
# Everything lands in runs/demo/ (deleted first, so the demo always starts from scratch).
set -euo pipefail
cd "$(dirname "$0")/.."
B=${TUNA_BUILD_DIR:-build}
RUN=runs/demo
rm -rf "$RUN"
mkdir -p "$RUN"

echo "== 1/5 prepare: train a 1024-piece sentencepiece tokenizer on demo/corpus and tokenize it"
"$B/prepare" --train-tokenizer --vocab-size 1024 --tokenizer "$RUN/data/tokenizer.model" \
  --out "$RUN/data" --val-fraction 0.05 --quiet demo/corpus/text

echo
echo "== 2/5 train: demo/train.toml (tiny LLaMA from scratch, CPU)"
"$B/train" --config demo/train.toml

CKPT="$RUN/ckpt/latest"  # the newest checkpoint
echo
echo "== 3/5 eval: the trained model on the held-out documents (the directory's val-* shards, the run's seq_len)"
"$B/eval" --checkpoint "$CKPT" --data "$RUN/data" | head -n 1
echo "   and on the shipped multiple-choice tasks (demo/tasks), as lm-evaluation-harness scores them; the training"
echo "   log above has the same at step 0, before any training (a 1M-parameter model: expect little above chance)"
"$B/eval" --checkpoint "$CKPT" --tasks demo/tasks --seq_len 128 --quiet | head -n 4

echo
echo "== 4/5 sample"
"$B/sample" --checkpoint "$CKPT" --prompt "This License applies to" --max_tokens 60 --temperature 0.7 --seed 7

echo
echo "== 5/5 export to Hugging Face format: $RUN/hf"
"$B/convert" tuna-to-hf "$CKPT" "$RUN/hf"
ls -l "$RUN/hf"
echo
echo "Load it with transformers: AutoModelForCausalLM.from_pretrained('$RUN/hf')"
