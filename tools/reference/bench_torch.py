#!/usr/bin/env python3
"""PyTorch eager baseline for tuna's CPU training step.

Usage: bench_torch.py --config demo/config.json [--batch 8] [--seq 128] [--steps 20] [--threads 2]
                      [--warmup 3] [--attn sdpa|eager] [--seed 0] [--lora_rank R]

Builds a randomly initialized LlamaForCausalLM (float32, HF's default init) from an HF config.json, and
times full training steps on CPU with torch.set_num_threads(--threads): forward, next-token cross-entropy,
backward, AdamW step, zero_grad. The batch is one random next-token batch of B rows of T+1 tokens, reused
every step. --warmup untimed steps first (allocator, thread pool, lazy init). Prints one human line and
one JSON line (tokens/s = batch*seq / median step time). --lora_rank R wraps the model with PEFT: rank-R adapters
on all seven projections, lora_alpha = R, no dropout (build/bench_train_step's BM_TrainStepLora), the base frozen
and AdamW over the adapters alone.
"""

import argparse
import json
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--config", required=True, help="HF config.json of a LLaMA model")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"],
                    help="transformers attention implementation (both run in PyTorch eager mode)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lora_rank", type=int, default=0, help="PEFT LoRA adapters of this rank (0: full fine-tune)")
    args = ap.parse_args()
    if min(args.batch, args.seq, args.steps, args.threads) < 1 or args.warmup < 0 or args.lora_rank < 0:
        ap.error("--batch, --seq, --steps, --threads must be >= 1, --warmup and --lora_rank >= 0")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    transformers.logging.set_verbosity_error()

    try:
        config = LlamaConfig.from_json_file(args.config)
    except (OSError, ValueError) as e:
        print(f"bench_torch: cannot read --config {args.config}: {e}", file=sys.stderr)
        return 1
    config._attn_implementation = args.attn
    model = LlamaForCausalLM(config).float().train()
    assert model.config._attn_implementation == args.attn, model.config._attn_implementation
    n_params = sum(p.numel() for p in model.parameters())
    if args.lora_rank > 0:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=args.lora_rank, lora_alpha=args.lora_rank, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step():
        logits = model(input_ids=inputs, use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)

    tokens_per_step = args.batch * args.seq
    median = statistics.median(times)
    mean = statistics.fmean(times)
    tok_s = tokens_per_step / median
    what = f"PEFT {__import__('peft').__version__} LoRA r{args.lora_rank}, " if args.lora_rank > 0 else ""
    print(f"pytorch {torch.__version__} eager cpu fp32, {what}{args.threads} threads, {n_params / 1e6:.2f}M params, "
          f"batch {args.batch} x seq {args.seq}: {median * 1e3:.1f} ms/step (median of {args.steps}, "
          f"mean {mean * 1e3:.1f}, min {min(times) * 1e3:.1f}), {tok_s:.0f} tokens/s, last loss {loss:.4f}")
    print(json.dumps({
        "bench": "torch_train_step", "device": "cpu", "dtype": "float32", "attn": args.attn,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
        "config": args.config, "params": n_params, "threads": args.threads,
        "batch": args.batch, "seq": args.seq, "warmup": args.warmup, "steps": args.steps,
        "lora_rank": args.lora_rank, "trainable": sum(p.numel() for p in trainable),
        "ms_per_step": median * 1e3, "ms_per_step_mean": mean * 1e3, "ms_per_step_min": min(times) * 1e3,
        "tokens_per_s": tok_s, "last_loss": loss,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
