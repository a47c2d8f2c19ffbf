#!/usr/bin/env python3
"""The peers tuna's GPU benches are compared with, timed on the same GPU in the same gpu-check run.

Usage: peers_gpu.py [--attention] [--step] [--step_batches 2,4] [--compile] [--out FILE] [--emulated]

--attention  torch SDPA's flash (FA2) and cuDNN backends at bench/bench_attention_gpu.cpp's shapes: causal,
             32 query / 8 kv heads (GQA), 16k tokens per launch, head_dim 128 at seq 2k/4k/8k and 64 at 4k,
             forward alone and backward alone (autograd.grad of a saved forward), TFLOP/s by the same
             FlashAttention convention as the bench (forward 4 b h s^2/2 d, backward 2.5x).
--step       Hugging Face LlamaForCausalLM in the LLaMA-3.2-1B shape of bench/bench_train_step_gpu.cpp, at
             batch 2 and 4 x seq 4096 (--step_batches 4: batch 4 alone): fp32 master parameters, bf16
             autocast, SDPA attention, fused AdamW, the usual mixed-precision fine-tune. tokens/s and MFU with
             tuna's FLOP count (6 per matmul weight, lm_head included, plus causal attention's 6 seq q_dim per
             layer) and the same bf16 peak; peak memory from torch.cuda.max_memory_allocated.
--compile    the step with torch.compile(model) at batch 4 (compiling takes a minute or more; timed after
             warmup).

--emulated   no torch: for `scripts/gpu-check.sh --emulated` on a machine without a GPU. Parses the same
             flags and writes the same files, one record per section asked for, each {"emulated": true} and
             without a number, so that gpu-check's plumbing is checked, never its figures.

Each measurement is one JSON line on stdout (and appended to --out). A backend a machine lacks is one line
with "error" instead of numbers, never a crash of the whole script.
"""

import argparse
import json
import math
import os
import sys
import time
import traceback


def emit(record, out):
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def peak_flops(torch):
    """Dense bf16 tensor-core peak, as tuna's gpu_peak_bf16_flops: TUNA_PEAK_TFLOPS, else datasheet x SMs."""
    if os.environ.get("TUNA_PEAK_TFLOPS"):
        return float(os.environ["TUNA_PEAK_TFLOPS"]) * 1e12
    p = torch.cuda.get_device_properties(0)
    if p.major == 9:
        return 989e12 * p.multi_processor_count / 132
    if p.major == 8 and p.minor == 0:
        return 312e12 * p.multi_processor_count / 108
    return float("nan")


def timed(torch, fn, min_seconds=0.3, warmup=2):
    """Median seconds of fn() over repetitions filling min_seconds, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    start_all = time.perf_counter()
    while time.perf_counter() - start_all < min_seconds or len(times) < 3:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2]


def attention(torch, args):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tokens, heads, kv_heads = 16384, 32, 8
    shapes = [(2048, 128), (4096, 128), (8192, 128), (4096, 64)]
    backends = [("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)]
    for seq, hd in shapes:
        batch = max(1, tokens // seq)
        g = torch.Generator(device="cuda").manual_seed(seq + hd)
        q = torch.randn(batch, heads, seq, hd, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(batch, kv_heads, seq, hd, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(batch, kv_heads, seq, hd, device="cuda", dtype=torch.bfloat16, generator=g)
        dout = torch.randn(batch, heads, seq, hd, device="cuda", dtype=torch.bfloat16, generator=g)
        fwd_flops = 4.0 * batch * heads * seq * seq / 2.0 * hd
        for name, backend in backends:
            for gqa in (True, False):  # GQA in place when the backend takes it; else K/V expanded (noted)
                try:
                    kk, vv = (k, v) if gqa else (k.repeat_interleave(heads // kv_heads, 1),
                                                  v.repeat_interleave(heads // kv_heads, 1))
                    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, kk, vv))
                    kwargs = {"is_causal": True, "enable_gqa": True} if gqa else {"is_causal": True}
                    with sdpa_kernel([backend]):
                        fwd = timed(torch, lambda: F.scaled_dot_product_attention(qq, kk, vv, **kwargs))
                        out = F.scaled_dot_product_attention(qq, kk, vv, **kwargs)
                        bwd = timed(torch, lambda: torch.autograd.grad(out, (qq, kk, vv), dout, retain_graph=True))
                    for direction, seconds, flops in (("fwd", fwd, fwd_flops), ("bwd", bwd, 2.5 * fwd_flops)):
                        emit({"peer": name, "what": "attention", "direction": direction, "seq": seq, "hd": hd,
                              "batch": batch, "gqa_in_place": gqa, "ms": seconds * 1e3,
                              "tflops": flops / seconds / 1e12}, args.out)
                    break
                except Exception as e:  # this backend cannot run this shape here: say so, go on
                    if not gqa:
                        emit({"peer": name, "what": "attention", "seq": seq, "hd": hd,
                              "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}, args.out)
                finally:
                    torch.cuda.empty_cache()


def llama_1b_config(transformers):
    # The rope frequencies (llama3 scaling, theta) change no step time, and their config keys moved between
    # transformers 4 and 5: left at the defaults.
    config = transformers.LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    return config


def flops_per_token(c, seq):
    """tuna's model_flops_per_token (model/config.cpp): 6 per matmul weight (lm_head included) + attention."""
    h, f, layers, v = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = h * q_dim + 2 * h * kv_dim + q_dim * h + 3 * h * f + 2 * h  # + the two norm weights
    return 6.0 * (layers * per_layer + h + h * v) + 6.0 * seq * q_dim * layers  # + final norm, head


def step(torch, args, compiled, batches=(2, 4)):
    import transformers
    transformers.logging.set_verbosity_error()
    config = llama_1b_config(transformers)
    seq = 4096
    # Compiling costs a minute or more per shape: the compiled peer runs the comparison shape only.
    for batch in ((4,) if compiled else batches):
        model = None
        try:
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(config).cuda().train()  # fp32 master parameters
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
            forward = torch.compile(model) if compiled else model
            g = torch.Generator(device="cuda").manual_seed(batch)
            ids = torch.randint(0, config.vocab_size, (batch, seq + 1), device="cuda", generator=g)
            inputs, labels = ids[:, :-1], ids[:, 1:]

            def one_step():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = forward(input_ids=inputs).logits
                loss = torch.nn.functional.cross_entropy(logits.float().view(-1, config.vocab_size),
                                                         labels.reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            torch.cuda.reset_peak_memory_stats()
            seconds = timed(torch, one_step, min_seconds=3.0, warmup=3)
            tokens_per_s = batch * seq / seconds
            emit({"peer": "hf-compile" if compiled else "hf-eager", "what": "step", "batch": batch, "seq": seq,
                  "ms": seconds * 1e3, "tokens_per_s": tokens_per_s,
                  "mfu": tokens_per_s * flops_per_token(config, seq) / peak_flops(torch),
                  "gib": torch.cuda.max_memory_allocated() / 2**30}, args.out)
        except Exception as e:
            emit({"peer": "hf-compile" if compiled else "hf-eager", "what": "step", "batch": batch, "seq": seq,
                  "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}, args.out)
            traceback.print_exc(file=sys.stderr)
        finally:
            del model
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--attention", action="store_true")
    ap.add_argument("--step", action="store_true")
    ap.add_argument("--step_batches", default="2,4", help="the eager step's batch sizes, of 2 and 4")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out", default="")
    ap.add_argument("--emulated", action="store_true")
    args = ap.parse_args()
    batches = tuple(int(b) for b in args.step_batches.split(","))
    if not batches or any(b not in (2, 4) for b in batches):
        ap.error(f"--step_batches {args.step_batches}: a list of 2 and 4 (bench_train_step_gpu's batches)")
    if args.emulated:
        emit({"peer": "torch", "emulated": True, "version": "none (emulated)", "device": "none"}, args.out)
        for section, asked in (("attention", args.attention), ("step", args.step), ("step-compile", args.compile)):
            if asked:
                emit({"peer": "emulated", "what": section, "emulated": True}, args.out)
        return 0
    try:
        import torch
    except ImportError as e:
        emit({"peer": "torch", "error": f"no torch here: {e}"}, args.out)
        return 1
    if not torch.cuda.is_available():
        emit({"peer": "torch", "error": "no CUDA device visible to torch"}, args.out)
        return 1
    emit({"peer": "torch", "version": torch.__version__, "device": torch.cuda.get_device_name(0),
          "peak_tflops": peak_flops(torch) / 1e12}, args.out)
    if args.attention:
        attention(torch, args)
    if args.step:
        step(torch, args, compiled=False, batches=batches)
    if args.compile:
        step(torch, args, compiled=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
