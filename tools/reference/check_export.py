#!/usr/bin/env python3
"""Check that an exported Hugging Face LLaMA directory equals a reference one.

Usage: check_export.py EXPORTED_DIR REFERENCE_DIR [--logits-atol A]

Checks, in order:
  1. the weight files on disk: same tensor names, dtypes, shapes, and bitwise-equal bytes
     (model.safetensors, or the shards listed in model.safetensors.index.json);
  2. the architecture fields of config.json (what changes the function or the token ids);
  3. both directories load with transformers' AutoModelForCausalLM in float32, and every tensor of the
     loaded state dicts is bitwise equal;
  4. logits of both models on the reference's input_ids (REFERENCE_DIR/reference.safetensors; a fixed
     random batch if absent) are equal (max abs diff <= --logits-atol, default 0: with bitwise-equal
     weights and config any difference is a bug).
Prints one line per mismatch, then one OK or FAIL line. Exit status 0 when everything matches, 1 otherwise
(including a directory that cannot be read or loaded).
"""

import argparse
import json
import os
import sys

import torch

PREFIX = "check_export:"

ARCH_FIELDS = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
               "rope_theta", "rope_scaling", "tie_word_embeddings", "max_position_embeddings",
               "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id"]


def model_files(d):
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    if os.path.exists(os.path.join(d, "model.safetensors")):
        return ["model.safetensors"]
    raise FileNotFoundError(f"{d}: neither model.safetensors nor model.safetensors.index.json")


def load_raw(d):
    from safetensors.torch import load_file
    tensors = {}
    for name in model_files(d):
        for k, v in load_file(os.path.join(d, name)).items():
            if k in tensors:
                raise ValueError(f"{d}: tensor {k} appears in more than one file")
            tensors[k] = v
    return tensors


def bits(t):
    """Bytes of a tensor as an integer tensor of the same element size, so that comparison is bitwise
    (NaN == NaN, -0 != +0)."""
    int_of_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    t = t.detach().contiguous()
    return t.view(int_of_size[t.element_size()]) if t.is_floating_point() else t


def describe_diff(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"dtype/shape {a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}"
    n = int((bits(a) != bits(b)).sum())
    diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    return f"{n} of {a.numel()} elements differ (max abs diff {diff:.3g})"


def compare_tensors(what, exp, ref, problems):
    for k in sorted(set(ref) - set(exp)):
        problems.append(f"{what}: tensor {k} missing from export")
    for k in sorted(set(exp) - set(ref)):
        problems.append(f"{what}: unexpected tensor {k} in export")
    n_equal = 0
    for k in sorted(set(ref) & set(exp)):
        a, b = exp[k], ref[k]
        if a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b)):
            n_equal += 1
        else:
            problems.append(f"{what}: tensor {k}: {describe_diff(a, b)}")
    return n_equal


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("exported_dir")
    ap.add_argument("reference_dir")
    ap.add_argument("--logits-atol", type=float, default=0.0)
    args = ap.parse_args()
    exp_dir, ref_dir = args.exported_dir, args.reference_dir
    problems = []

    try:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        torch.manual_seed(0)

        # 1. raw files
        n_raw = compare_tensors("file", load_raw(exp_dir), load_raw(ref_dir), problems)

        # 2. config
        exp_cfg, ref_cfg = AutoConfig.from_pretrained(exp_dir), AutoConfig.from_pretrained(ref_dir)
        for key in ARCH_FIELDS:
            a, b = getattr(exp_cfg, key, None), getattr(ref_cfg, key, None)
            if a != b:
                problems.append(f"config: {key} = {a!r}, reference has {b!r}")

        # 3. loaded models
        def load(d):
            return AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
        exp_model, ref_model = load(exp_dir), load(ref_dir)
        n_loaded = compare_tensors("loaded", exp_model.state_dict(), ref_model.state_dict(), problems)

        # 4. logits
        ref_file = os.path.join(ref_dir, "reference.safetensors")
        if os.path.exists(ref_file):
            from safetensors.torch import load_file
            input_ids = load_file(ref_file)["input_ids"].long()
        else:
            gen = torch.Generator().manual_seed(0)
            input_ids = torch.randint(0, ref_cfg.vocab_size, (2, 16), generator=gen)
        with torch.no_grad():
            exp_logits = exp_model(input_ids=input_ids, use_cache=False).logits
            ref_logits = ref_model(input_ids=input_ids, use_cache=False).logits
        if exp_logits.shape != ref_logits.shape:
            problems.append(f"logits: shape {list(exp_logits.shape)} vs {list(ref_logits.shape)}")
            logits_diff = float("inf")
        else:
            logits_diff = (exp_logits - ref_logits).abs().max().item()
            if not logits_diff <= args.logits_atol:
                problems.append(f"logits: max abs diff {logits_diff:.3g} > {args.logits_atol:g} "
                                f"on input_ids {list(input_ids.shape)}")
    except Exception as e:  # unreadable / unloadable directory: a failed check, not a crash
        problems.append(f"error: {type(e).__name__}: {e}")
        n_raw = n_loaded = 0
        logits_diff = float("nan")

    shown = 20
    for p in problems[:shown]:
        print(f"{PREFIX} MISMATCH {p}")
    if len(problems) > shown:
        print(f"{PREFIX} MISMATCH ... and {len(problems) - shown} more")
    if problems:
        print(f"{PREFIX} FAIL {exp_dir} vs {ref_dir}: {len(problems)} mismatch(es)")
        return 1
    print(f"{PREFIX} OK {exp_dir} == {ref_dir}: {n_raw} file tensors and {n_loaded} loaded tensors "
          f"bitwise equal, config equal, logits max abs diff {logits_diff:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
