#!/usr/bin/env python3
"""The peers of tuna's attention bench: torch SDPA's flash and cuDNN backends at bench_attention_gpu's shapes.

Usage: bench_attention_peers.py [--json OUT] [--min-time 0.3] [--backends flash,cudnn]

Shapes and FLOP convention as bench/bench_attention_gpu.cpp: causal, 32 query heads and 8 kv heads
(grouped-query), head_dim 128 at seq 2048/4096/8192 and head_dim 64 at seq 4096, 16384 tokens per call
(batch = 16384 / seq), bf16; forward FLOPs 4 * b * h * s^2 / 2 * d, backward 2.5x that, whatever a
kernel recomputes. Tensors are laid out as tuna's ([batch, seq, heads, head_dim]) and handed to SDPA as
transposed views. Grouped-query heads go in with enable_gqa=True; a backend that refuses it gets K and V
expanded to 32 heads beforehand (outside the timing), and the row says "gqa expanded".

Timing: CUDA events around each call, 3 warm-up calls, then calls until --min-time seconds have passed
(at least 5); the median. The backward is torch.autograd.grad of the forward's output (the forward is not
timed; SDPA's backward kernels recompute what they need from the saved tensors).

Prints one human line per row and, with --json, writes {"rows": [...]} with each row's label (the label of
tuna's bench row without the path), backend, ms, TFLOP/s, and how GQA was handled. scripts/gpu-check.sh
runs it and prints tuna's ratio to the best peer of each row. A backend that is unavailable on this
machine gives a row with "error" instead of numbers. Needs torch with CUDA (the GPU machine has it);
tuna never imports it.
"""

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

TOKENS, HEADS, KV_HEADS = 16384, 32, 8
SHAPES = [(2048, 128), (4096, 128), (8192, 128), (4096, 64)]
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def timed(fn, min_time):
    """Median milliseconds of fn() by CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times, total = [], 0.0
    while len(times) < 5 or total < min_time * 1e3:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
        total += times[-1]
    return statistics.median(times)


def run_row(backend, seq, head_dim, backward, min_time):
    batch = max(1, TOKENS // seq)
    label = f"{'bwd' if backward else 'fwd'} causal hd{head_dim} seq {seq} batch {batch}"
    row = {"label": label, "backend": backend}
    gen = torch.Generator(device="cuda").manual_seed(seq + head_dim)
    shape_q, shape_kv = (batch, seq, HEADS, head_dim), (batch, seq, KV_HEADS, head_dim)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, generator=gen)
    dout = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=gen)
    # SDPA's layout is [batch, heads, seq, head_dim]: transposed views of tuna's.
    qt, kt, vt = (x.transpose(1, 2).requires_grad_(backward) for x in (q, k, v))

    def attend(kk, vv, gqa):
        with sdpa_kernel(BACKENDS[backend]):
            return F.scaled_dot_product_attention(qt, kk, vv, is_causal=True, enable_gqa=gqa)

    gqa = "native"
    try:
        out = attend(kt, vt, True)
        call_k, call_v, call_gqa = kt, vt, True
    except RuntimeError:
        gqa = "expanded"
        call_k = kt.detach().repeat_interleave(HEADS // KV_HEADS, dim=1).requires_grad_(backward)
        call_v = vt.detach().repeat_interleave(HEADS // KV_HEADS, dim=1).requires_grad_(backward)
        call_gqa = False
        try:
            out = attend(call_k, call_v, False)
        except RuntimeError as e:
            row["error"] = str(e).splitlines()[0][:200]
            return row
    row["gqa"] = gqa
    if backward:
        dout_t = dout.transpose(1, 2)
        inputs = (qt, call_k, call_v)
        ms = timed(lambda: torch.autograd.grad(out, inputs, dout_t, retain_graph=True), min_time)
    else:
        with torch.no_grad():
            ms = timed(lambda: attend(call_k, call_v, call_gqa), min_time)
    flops = 4.0 * batch * HEADS * seq * seq / 2.0 * head_dim * (2.5 if backward else 1.0)
    row["ms"] = ms
    row["TFLOP/s"] = flops / (ms * 1e-3) / 1e12
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds of timed calls per row")
    ap.add_argument("--backends", default="flash,cudnn", help="comma-separated: flash, cudnn")
    args = ap.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        ap.error(f"--backends: unknown {unknown}; expected some of {sorted(BACKENDS)}")
    if not torch.cuda.is_available():
        print("bench_attention_peers: no CUDA device visible to torch", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}")
    rows = []
    for seq, head_dim in SHAPES:
        for backward in (False, True):
            for backend in backends:
                row = run_row(backend, seq, head_dim, backward, args.min_time)
                rows.append(row)
                if "error" in row:
                    print(f"{row['label']:<36} {backend:<6} error: {row['error']}")
                else:
                    print(f"{row['label']:<36} {backend:<6} {row['ms']:8.3f} ms {row['TFLOP/s']:7.1f} TFLOP/s"
                          f" (gqa {row['gqa']})")
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
