#!/usr/bin/env bash
# Prepare's tokenizing speed on unique real text against the reference encoders, side by side in one run:
# benchmarks/2026-12-01-prepare-tokenizing-speed.md.
#
# Corpus: this machine's Debian copyright files (/usr/share/doc/*/copyright), deduplicated by build/prepare
# itself (its default exact and near dedup): what prepare tokenizes. For each tokenizer, the whole
# build/prepare process (--threads 1, dedup off: the corpus is unique already; read, clean, filter, hash,
# tokenize, write shards) is timed against its peer on the same documents, one thread each:
#   - sentencepiece models: spm_encode --output_format=id, one process, the documents as one file (it encodes
#     line by line), the whole process;
#   - Llama 3 (tokenizer.json and tiktoken): Hugging Face tokenizers' encode_batch on 1 thread
#     (tools/reference/bench_tokenizers.py), its encoding time only (not Python's start or the file's load).
# CPU seconds (user + sys, /usr/bin/time) are the fair measure on a shared machine; wall is shown too. Each
# pair runs --repeat times alternately, and the best of each column counts.
#
# Usage: scripts/bench-prepare.sh [--repeat N] [--spm32k MODEL] [--work DIR]
#   --spm32k  a real 32k-piece sentencepiece model (LLaMA 2's family); its row is skipped without one
#   --work    scratch directory (default: a new one under /tmp, removed at the end)
# Needs build/prepare, the sentencepiece tools (spm_train, spm_encode), zstd, and python3 with the
# `tokenizers` package (pip install tokenizers).
set -euo pipefail

repeat=3 spm32k="" work=""
while [ $# -gt 0 ]; do
  case "$1" in
    --repeat) repeat="$2"; shift 2 ;;
    --spm32k) spm32k="$2"; shift 2 ;;
    --work) work="$2"; shift 2 ;;
    *) echo "usage: scripts/bench-prepare.sh [--repeat N] [--spm32k MODEL] [--work DIR]" >&2; exit 2 ;;
  esac
done
root="$(cd "$(dirname "$0")/.." && pwd)"
prepare="$root/build/prepare"
for tool in "$prepare" spm_train spm_encode zstd python3 /usr/bin/time; do
  command -v "$tool" >/dev/null || { echo "bench-prepare: $tool not found" >&2; exit 1; }
done
if [ -n "$spm32k" ] && [ ! -f "$spm32k" ]; then echo "bench-prepare: --spm32k $spm32k: no such file" >&2; exit 1; fi
if [ -z "$work" ]; then
  work="$(mktemp -d /tmp/tuna-bench-prepare-XXXXXX)"
  trap 'rm -rf "$work"' EXIT
fi
mkdir -p "$work"

# 1. The unique documents: every copyright file, then the ones prepare keeps (its dropped.jsonl names the rest).
rm -rf "$work/all" "$work/corpus" && mkdir -p "$work/all" "$work/corpus"
for f in /usr/share/doc/*/copyright; do
  [ -f "$f" ] && cp -L "$f" "$work/all/$(basename "$(dirname "$f")").txt"
done
"$prepare" --quiet --overwrite --tokenizer "$root/tests/fixtures/tokenizers/spm/tokenizer.model" \
  --out "$work/dedup" "$work/all" >/dev/null
sed -n 's/.*"where":"all\/\([^"]*\)".*/\1/p; s/.*"where":"[^"]*\/all\/\([^"]*\)".*/\1/p' \
  "$work/dedup/dropped.jsonl" | sort -u >"$work/dropped.txt"
for f in "$work"/all/*.txt; do
  grep -qxF "$(basename "$f")" "$work/dropped.txt" || cp "$f" "$work/corpus/"
done
cat "$work"/corpus/*.txt >"$work/corpus.txt"
docs=$(ls "$work/corpus" | wc -l)
bytes=$(stat -c %s "$work/corpus.txt")
echo "bench-prepare: $(ls "$work/all" | wc -l) copyright files, $docs kept by prepare's dedup, $bytes bytes" >&2

# 2. The tokenizers.
spm_train --input="$work/corpus.txt" --model_prefix="$work/spm8k" --model_type=bpe --byte_fallback=true \
  --vocab_size=8000 --num_threads=1 --minloglevel=2 >/dev/null 2>&1
"$prepare" --quiet --overwrite --train-tokenizer --vocab-size 8000 --tokenizer "$work/llama8k.model" \
  --out "$work/train-tok" "$work/corpus" >/dev/null
mkdir -p "$work/llama3/original"
for name in tokenizer.json tokenizer_config.json original/tokenizer.model; do
  zstd -q -d -f "$root/tests/fixtures/tokenizers/llama3/$name.zst" -o "$work/llama3/$name"
done

# 3. Timings: "cpu wall" of a command's whole process, best of $repeat (each column on its own).
timed() {  # timed OUTFILE command...: appends "user+sys wall" of one run to OUTFILE
  local out="$1"; shift
  /usr/bin/time -f "%U %S %e" -o "$work/time.txt" "$@" >/dev/null 2>"$work/stderr.txt" ||
    { cat "$work/stderr.txt" >&2; exit 1; }
  awk '{ printf "%.3f %.3f\n", $1 + $2, $3 }' "$work/time.txt" >>"$out"
}
best() { sort -n -k1,1 "$1" | head -1 | cut -d' ' -f1; sort -n -k2,2 "$1" | head -1 | cut -d' ' -f2; }
run_prepare() { timed "$1" "$prepare" --threads 1 --no_near_dedup --no_exact_dedup --quiet --overwrite \
                  --tokenizer "$2" --out "$work/out" "$work/corpus"; }

rows=()
row() {  # row NAME PEER PEER_TIMES TUNA_TIMES
  read -r -d '' pc pw < <(best "$3"; printf '\0') || true
  read -r -d '' tc tw < <(best "$4"; printf '\0') || true
  rows+=("$(awk -v n="$1" -v p="$2" -v pc="$pc" -v pw="$pw" -v tc="$tc" -v tw="$tw" -v b="$bytes" 'BEGIN {
    printf "| %s | %s | %.2f / %.2f | %.2f / %.2f | **%.1fx** | %.1fx |", n, p, pc, pw, tc, tw, pc / tc, pw / tw }')")
}

sp_row() {  # sp_row NAME MODEL
  : >"$work/peer.t"; : >"$work/tuna.t"
  for _ in $(seq "$repeat"); do
    timed "$work/peer.t" sh -c "spm_encode --model='$2' --output_format=id <'$work/corpus.txt' >'$work/spm.ids'"
    run_prepare "$work/tuna.t" "$2"
  done
  row "$1" "spm_encode" "$work/peer.t" "$work/tuna.t"
}
sp_row "sentencepiece BPE, 8,000 pieces, trained on the corpus by spm_train (its defaults: nmt_nfkc)" "$work/spm8k.model"
sp_row "sentencepiece BPE, 8,000 pieces, trained on the corpus by build/prepare --train-tokenizer (LLaMA's settings)" \
  "$work/llama8k.model"
[ -n "$spm32k" ] && sp_row "sentencepiece BPE, 32,000 pieces: $(basename "$spm32k")" "$spm32k"

: >"$work/peer.t"; : >"$work/json.t"; : >"$work/tiktoken.t"
for _ in $(seq "$repeat"); do
  python3 "$root/tools/reference/bench_tokenizers.py" --threads 1 --tokenizer "$work/llama3/tokenizer.json" \
    --docs "$work/corpus" >"$work/hf.json"
  sed 's/.*"seconds": \([0-9.e-]*\), "cpu_seconds": \([0-9.e-]*\),.*/\2 \1/' "$work/hf.json" >>"$work/peer.t"
  run_prepare "$work/json.t" "$work/llama3/tokenizer.json"
  run_prepare "$work/tiktoken.t" "$work/llama3/original/tokenizer.model"
done
hf_version=$(sed 's/.*"version": "\([^"]*\)".*/\1/' "$work/hf.json")
row "Llama 3.2 tokenizer.json" "HF tokenizers $hf_version, 1 thread" "$work/peer.t" "$work/json.t"
row "Llama 3.2 tiktoken original/tokenizer.model" "HF tokenizers $hf_version (tokenizer.json), 1 thread" "$work/peer.t" \
  "$work/tiktoken.t"

# The general tokenizer.json pipelines of the fixtures (tests/fixtures/tokenizers/*/): each against the library on
# the same documents, one thread. --bos/--eos: a tokenizer that names neither frames documents with its own
# end-of-text token here (what is timed is the tokenizing).
pipeline_row() {  # pipeline_row NAME WHAT EOS
  mkdir -p "$work/$1"
  for name in tokenizer.json tokenizer_config.json; do
    [ -f "$root/tests/fixtures/tokenizers/$1/$name.zst" ] &&
      zstd -q -d -f "$root/tests/fixtures/tokenizers/$1/$name.zst" -o "$work/$1/$name"
  done
  : >"$work/peer.t"; : >"$work/tuna.t"
  for _ in $(seq "$repeat"); do
    python3 "$root/tools/reference/bench_tokenizers.py" --threads 1 --tokenizer "$work/$1/tokenizer.json" \
      --docs "$work/corpus" >"$work/hf.json"
    sed 's/.*"seconds": \([0-9.e-]*\), "cpu_seconds": \([0-9.e-]*\),.*/\2 \1/' "$work/hf.json" >>"$work/peer.t"
    timed "$work/tuna.t" "$prepare" --threads 1 --no_near_dedup --no_exact_dedup --quiet --overwrite \
      --tokenizer "$work/$1" --bos "$3" --eos "$3" --out "$work/out" "$work/corpus"
  done
  row "$2" "HF tokenizers $hf_version, 1 thread" "$work/peer.t" "$work/tuna.t"
}
pipeline_row gpt_neox "GPT-NeoX tokenizer.json (NFC, GPT-2's ByteLevel)" "<|endoftext|>"
pipeline_row starcoder "StarCoder tokenizer.json (Digits, ByteLevel)" "<|endoftext|>"
pipeline_row claude "Claude tokenizer.json (NFKC, ByteLevel)" "<EOT>"
pipeline_row deepseek_coder "DeepSeek Coder tokenizer.json (four Splits, Digits, ByteLevel)" "<｜end▁of▁sentence｜>"
pipeline_row mistral "Mistral tokenizer.json (Metaspace, byte fallback)" "</s>"
pipeline_row llama2_hf "LLaMA-2-style tokenizer.json (Prepend, Replace, byte fallback; 2,000 pieces)" "</s>"

echo "Unique Debian copyright files: $docs documents, $bytes bytes; best of $repeat; load average: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| tokenizer | peer (1 thread) | peer CPU s / wall s | build/prepare CPU s / wall s | per CPU second | wall |"
echo "|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
