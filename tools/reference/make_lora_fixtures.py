#!/usr/bin/env python3
"""Make the LoRA reference fixtures in tests/fixtures/lora_<base>/ with PEFT + transformers in float64.

Each fixture is a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors, float32, written by PEFT's
save_pretrained) on one of the base fixtures of make_fixtures.py, plus what tuna must reproduce with the base
frozen, computed in float64 from the float32 files cast up: logits, loss, the gradient of every adapter tensor,
and 10 AdamW steps of the adapters alone (warmup + cosine learning rate, global-norm clipping over the adapters),
on the base fixture's own batch. tools/reference/README.md documents the files.

Usage (from the repository root): python3 tools/reference/make_lora_fixtures.py [--out tests/fixtures]

Deterministic: fixed seeds, one CPU thread, deterministic algorithms.
"""

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass

import numpy
import peft
import safetensors
import safetensors.torch
import torch
import transformers
from transformers import LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import (HYPER, IGNORE_INDEX, cross_entropy, independent_logits, load_float64,  # noqa: E402
                           lr_at, make_float64_exact, max_rel, rope_inv_freq_float64)


@dataclass(frozen=True)
class LoraFixture:
    name: str
    base: str        # a base fixture directory under tests/fixtures (make_fixtures.py)
    rank: int
    alpha: float
    targets: tuple   # PEFT module names
    seed: int


FIXTURES = [
    # Every projection of the untied LLaMA-2-style base.
    LoraFixture("lora_llama2_tiny", "llama2_tiny", rank=4, alpha=8.0,
                targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), seed=4321),
    # A subset, on the tied, GQA, llama3-RoPE base: two column-parallel projections and one row-parallel.
    LoraFixture("lora_llama32_tiny", "llama32_tiny", rank=2, alpha=6.0, targets=("q_proj", "v_proj", "down_proj"),
                seed=8765),
]

INIT_NOTE = ("lora_A: PEFT's own initialization (kaiming_uniform_, a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))) under "
             "torch.manual_seed(seed). lora_B: PEFT initializes it to zero, which would make every lora_A gradient "
             "zero and the test weak; it is re-drawn as N(0, 1) / (4 sqrt(r)) from torch.Generator(seed + 1) in "
             "named_parameters() order. The adapter is saved in float32 and the reference computed from those "
             "values cast up to float64.")


def file_key(param_name):
    """PEFT's parameter name -> its key in adapter_model.safetensors (the adapter name removed)."""
    return param_name.replace(".default.", ".")


def lora_params(model):
    return [(file_key(n), p) for n, p in model.named_parameters() if "lora_" in n]


def run_steps(model, input_ids, targets, grad_clip, h):
    params = [p for _, p in lora_params(model)]
    opt = torch.optim.AdamW(params, lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                            weight_decay=h["weight_decay"], foreach=False)
    losses, norms, lrs = [], [], []
    for step in range(h["steps"]):
        loss = cross_entropy(model(input_ids=input_ids, use_cache=False).logits, targets)
        losses.append(loss.item())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        norms.append(norm.item())
        lr = lr_at(step, h["lr"], h["min_lr"], h["warmup_steps"], h["steps"])
        for group in opt.param_groups:
            group["lr"] = lr
        lrs.append(lr)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, norms, lrs


def load_peft_float64(base_dir, adapter_dir):
    model = load_float64(base_dir)
    inv_freq64, _ = rope_inv_freq_float64(model.config)
    make_float64_exact(model, inv_freq64)
    model = peft.PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
    for n, p in model.named_parameters():
        if "lora_" in n and p.dtype != torch.float64:
            p.data = p.data.double()
    model.eval()  # no dropout anywhere (lora_dropout is 0 too)
    return model, inv_freq64


def make_fixture(fx, root):
    d = os.path.join(root, fx.name)
    base_dir = os.path.join(root, fx.base)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)

    # --- the starting adapter, float32, written by PEFT --------------------------------------------
    base32 = LlamaForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    config = peft.LoraConfig(r=fx.rank, lora_alpha=fx.alpha, lora_dropout=0.0, target_modules=list(fx.targets),
                             bias="none", task_type="CAUSAL_LM", init_lora_weights=True)
    torch.manual_seed(fx.seed)
    model32 = peft.get_peft_model(base32, config)
    gen = torch.Generator().manual_seed(fx.seed + 1)
    with torch.no_grad():
        for n, p in model32.named_parameters():
            if "lora_B" in n:
                assert torch.count_nonzero(p) == 0, n  # PEFT's init
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * (0.25 / fx.rank ** 0.5))
    model32.save_pretrained(d, safe_serialization=True)
    for extra in ("README.md",):
        if os.path.exists(os.path.join(d, extra)):
            os.remove(os.path.join(d, extra))
    saved = safetensors.torch.load_file(os.path.join(d, "adapter_model.safetensors"))

    # --- float64 reference ---------------------------------------------------------------------------
    model, inv_freq64 = load_peft_float64(base_dir, d)
    params = dict(lora_params(model))
    assert sorted(saved) == sorted(params), (sorted(saved), sorted(params))
    for n, p in params.items():
        assert saved[n].dtype == torch.float32, n
        assert torch.equal(saved[n].double(), p.detach()), f"{n}: float64 adapter != saved float32"
    ref = safetensors.torch.load_file(os.path.join(base_dir, "reference.safetensors"))
    input_ids, targets = ref["input_ids"].long(), ref["targets"].long()

    logits = model(input_ids=input_ids, use_cache=False).logits
    loss = cross_entropy(logits, targets)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    for n, p in model.named_parameters():
        assert ("lora_" in n) == p.requires_grad, f"{n}: only the adapters train"
    model.zero_grad(set_to_none=True)

    # Cross-check: the independent float64 forward on merged weights W + (alpha / r) B A, forward and backward.
    scale = fx.alpha / fx.rank
    base = {n: p.detach().clone() for n, p in load_float64(base_dir).named_parameters()}
    A = {n: p.detach().clone().requires_grad_(True) for n, p in params.items() if ".lora_A." in n}
    Bm = {n: p.detach().clone().requires_grad_(True) for n, p in params.items() if ".lora_B." in n}
    P = dict(base)
    for name in A:
        module = name[len("base_model.model."):-len(".lora_A.weight")]
        P[module + ".weight"] = base[module + ".weight"] + scale * Bm[name.replace("lora_A", "lora_B")] @ A[name]
    ind_logits = independent_logits(P, model.config, input_ids, inv_freq64)
    cross_entropy(ind_logits, targets).backward()
    logits_err = max_rel(logits.detach(), ind_logits.detach())
    grad_err = max(max_rel(grads[n], (A.get(n) if n in A else Bm[n]).grad) for n in grads)
    assert logits_err < 1e-12 and grad_err < 1e-10, (logits_err, grad_err)
    unadapted = load_float64(base_dir)
    make_float64_exact(unadapted, inv_freq64)
    with torch.no_grad():
        base_logits = unadapted(input_ids=input_ids, use_cache=False).logits
    adapter_effect = max_rel(logits.detach() - base_logits, base_logits)

    # --- 10 AdamW steps of the adapters ---------------------------------------------------------------
    # grad_clip: the first candidate (midpoints of the unclipped norms) under which clipping engages on some
    # steps and not others, with no norm within 2% of it (an fp32 run clips on the same steps).
    h = HYPER
    _, free_norms, _ = run_steps(load_peft_float64(base_dir, d)[0], input_ids, targets, float("inf"), h)
    ordered = sorted(free_norms)
    candidates = [(a + b) / 2 for a, b in zip(ordered, ordered[1:])]
    candidates.sort(key=lambda c: abs(c - numpy.median(ordered)))
    chosen = None
    for clip in candidates:
        clip = float(f"{clip:.3g}")
        trial = load_peft_float64(base_dir, d)[0]
        losses, norms, lrs = run_steps(trial, input_ids, targets, clip, h)
        clipped = [s for s, n in enumerate(norms) if n + 1e-6 > clip]
        margin = min(abs(n - clip) for n in norms) / clip
        if 0 < len(clipped) < h["steps"] and margin > 2e-2:
            chosen = (clip, trial, losses, norms, lrs, clipped, margin)
            break
    assert chosen, f"{fx.name}: no grad_clip separates the norms {free_norms}"
    grad_clip, trained, losses, norms, lrs, clipped, margin = chosen
    assert losses[0] == loss.item(), (losses[0], loss.item())

    # --- write ------------------------------------------------------------------------------------------
    tensors = {
        "input_ids": input_ids.to(torch.int32),
        "targets": targets.to(torch.int32),
        "logits": logits.detach().contiguous(),
        "loss": loss.detach().reshape(1),
        "train_losses": torch.tensor(losses, dtype=torch.float64),
        "grad_norms": torch.tensor(norms, dtype=torch.float64),
        "lrs": torch.tensor(lrs, dtype=torch.float64),
    }
    for n, g in grads.items():
        tensors["grad." + n] = g.contiguous()
    for n, p in lora_params(trained):
        tensors["final." + n] = p.detach().contiguous()
    safetensors.torch.save_file(tensors, os.path.join(d, "reference.safetensors"),
                                metadata={"format": "tuna-reference", "fixture": fx.name})
    B, T = input_ids.shape
    meta = {
        "fixture": fx.name,
        "base": fx.base,
        "batch": B,
        "seq_len": T,
        "ignore_index": IGNORE_INDEX,
        "lora": {"r": fx.rank, "alpha": fx.alpha, "dropout": 0.0, "targets": list(fx.targets), "scale": scale},
        **h,
        "grad_clip": grad_clip,
        "schedule": "cosine",
        "weight_decay_params": "every adapter tensor (lora_A and lora_B); the base is frozen",
        "clip": "torch.nn.utils.clip_grad_norm_ over the adapter tensors: total = sqrt(sum of ||g||^2); "
                "g *= min(1, grad_clip / (total + 1e-6))",
        "clipped_steps": clipped,
        "clip_margin": margin,
        "loss": loss.item(),
        "final_train_loss": losses[-1],
        "adapter_effect_on_logits_max_rel": adapter_effect,
        "init": INIT_NOTE,
        "independent_check_max_rel_err": {"logits": logits_err, "grads": grad_err},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                     "safetensors": safetensors.__version__, "numpy": numpy.__version__},
    }
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    print(f"{fx.name}: loss {loss.item():.6f}  adapter moves logits by {adapter_effect:.3f} (rel)  "
          f"train losses {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"  grad norms {[round(n, 4) for n in norms]}  clip {grad_clip}: clipped steps {clipped}")
    print(f"  independent check: logits {logits_err:.1e}, grads {grad_err:.1e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    for fx in FIXTURES:
        make_fixture(fx, args.out)


if __name__ == "__main__":
    main()
