#!/usr/bin/env python3
"""Peer timing for build/bench_tokenize: Hugging Face `tokenizers` encoding a corpus with a tokenizer.json.

  python3 tools/reference/bench_tokenizers.py --tokenizer tokenizer.json --corpus docs.jsonl [--threads 1]
  python3 tools/reference/bench_tokenizers.py --tokenizer tokenizer.json --docs DIR [--threads 1]

docs.jsonl holds one {"text": ...} per line (bench_tokenize writes it); --docs takes every file of DIR as one
document, in name order, invalid UTF-8 replaced by U+FFFD (scripts/bench-prepare.sh). The documents are encoded with
Tokenizer.encode_batch(docs, add_special_tokens=False) on --threads threads (RAYON_NUM_THREADS, set before
the library loads), after one untimed warm-up over the first 50 documents; the best of --repeat runs counts.
Prints one JSON line: {"bench": "hf_tokenizers", "threads", "bytes", "documents", "tokens", "seconds",
"cpu_seconds" (the process's CPU time over the encoding), "mb_per_s", "mb_per_cpu_s", "version"}. Exit 1 with a message when `tokenizers` is missing.
"""

import argparse
import json
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--corpus")
    ap.add_argument("--docs")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if args.threads > 1 else "false"
    try:
        import tokenizers
    except ImportError:
        print("bench_tokenizers: the Python package 'tokenizers' is missing (pip install tokenizers)", file=sys.stderr)
        return 1
    if bool(args.corpus) == bool(args.docs):
        print("bench_tokenizers: give one of --corpus and --docs", file=sys.stderr)
        return 1
    if args.corpus:
        with open(args.corpus, encoding="utf-8") as f:
            docs = [json.loads(line)["text"] for line in f]
    else:
        docs = []
        for name in sorted(os.listdir(args.docs)):
            with open(os.path.join(args.docs, name), "rb") as f:
                docs.append(f.read().decode("utf-8", errors="replace"))
    size = sum(len(d.encode("utf-8")) for d in docs)
    tok = tokenizers.Tokenizer.from_file(args.tokenizer)
    tok.encode_batch(docs[:50], add_special_tokens=False)
    best = best_cpu = None
    tokens = 0
    for _ in range(max(1, args.repeat)):
        start, start_cpu = time.perf_counter(), time.process_time()
        encodings = tok.encode_batch(docs, add_special_tokens=False)
        seconds, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        tokens = sum(len(e.ids) for e in encodings)
        best = seconds if best is None else min(best, seconds)
        best_cpu = cpu if best_cpu is None else min(best_cpu, cpu)
    print(json.dumps({"bench": "hf_tokenizers", "threads": args.threads, "bytes": size, "documents": len(docs),
                      "tokens": tokens, "seconds": best, "cpu_seconds": best_cpu, "mb_per_s": size / best / 1e6,
                      "mb_per_cpu_s": size / best_cpu / 1e6, "version": tokenizers.__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
