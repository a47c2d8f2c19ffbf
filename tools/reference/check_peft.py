#!/usr/bin/env python3
"""Check a tuna LoRA checkpoint against Hugging Face PEFT, and its merged export against transformers.

Usage: check_peft.py --checkpoint LORA_CKPT --tokenizer TOKENIZER [--base BASE] [--merged MERGED_DIR]
                     [--build build] [--prompt TEXT] [--max-tokens N] [--rtol R]

Checks, in order:
  1. PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), LORA_CKPT) loads the checkpoint
     (PEFT reads adapter_config.json and adapter_model.safetensors; BASE is --base or the path the checkpoint's
     base_model.json records), and so does AutoModelForCausalLM.from_pretrained(LORA_CKPT) (transformers finds
     adapter_config.json and loads the adapter onto its base: the directory must not pass for a full model);
  2. `build/sample --greedy --logits_out` on the checkpoint (tuna's CPU forward of base + merged adapters):
     every generated position's logits equal PEFT's (float64) on the same ids, to --rtol in the relative
     error norm, and so do the greedy tokens;
  3. with --merged (the output of `build/convert merge-lora`): transformers loads it, its logits equal PEFT's to
     --rtol, and its weights equal PEFT's own merge (merge_and_unload) to float32 rounding.
Prints one line per check, then OK or FAIL. Exit status 0 when everything holds.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

PREFIX = "check_peft:"


def rel_err(ours, ref):
    ours, ref = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-300))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tokenizer", required=True, help="the tokenizer build/sample encodes the prompt with")
    ap.add_argument("--base", default="")
    ap.add_argument("--merged", default="")
    ap.add_argument("--build", default="build")
    ap.add_argument("--prompt", default="Permission is hereby granted")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rtol", type=float, default=1e-5)
    args = ap.parse_args()

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    failures = []
    base = args.base
    if not base:
        with open(os.path.join(args.checkpoint, "base_model.json")) as f:
            base = json.load(f)["path"]

    # 1. PEFT loads the checkpoint onto its base; transformers takes the directory for an adapter.
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).double()
    peft = PeftModel.from_pretrained(model, args.checkpoint, torch_dtype=torch.float64).double().eval()
    print(f"{PREFIX} PEFT loaded {args.checkpoint} onto {base}")
    if not args.base:  # transformers follows adapter_config.json to the recorded base
        auto = AutoModelForCausalLM.from_pretrained(args.checkpoint, torch_dtype=torch.float32)
        if not hasattr(auto, "peft_config"):
            failures.append("AutoModelForCausalLM did not load the directory as an adapter")
        else:
            print(f"{PREFIX} AutoModelForCausalLM.from_pretrained loads it as an adapter on its base")

    # 2. tuna's logits (base + adapters merged on load) against PEFT's, position by position.
    with tempfile.TemporaryDirectory() as tmp:
        logits_path = os.path.join(tmp, "logits.f32")
        cmd = [os.path.join(args.build, "sample"), "--checkpoint", args.checkpoint, "--tokenizer", args.tokenizer,
               "--prompt", args.prompt, "--greedy", "--max_tokens", str(args.max_tokens), "--stop_at_eos", "false",
               "--print_ids", "--logits_out", logits_path, "--device", "cpu", "--kv_cache", "false"]
        if args.base:
            cmd += ["--base", args.base]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{PREFIX} {' '.join(cmd)} failed:\n{r.stderr}")
            return 1
        line = next(l for l in r.stderr.splitlines() if l.startswith("ids:"))
        prompt_ids, generated = line[len("ids:"):].split("|")
        prompt_ids = [int(x) for x in prompt_ids.split()]
        generated = [int(x) for x in generated.split()]
        ours = np.fromfile(logits_path, dtype="<f4")
    vocab = model.config.vocab_size
    ours = ours.reshape(-1, vocab)
    ids = torch.tensor([prompt_ids + generated])
    with torch.no_grad():
        ref = peft(input_ids=ids).logits[0].numpy()
    rows = ref[len(prompt_ids) - 1: len(prompt_ids) - 1 + ours.shape[0]]
    err = rel_err(ours, rows)
    greedy = [int(np.argmax(rows[i])) for i in range(len(generated))]
    print(f"{PREFIX} build/sample vs PEFT: {ours.shape[0]} positions, prompt {len(prompt_ids)} tokens, "
          f"relative error {err:.2e} (tolerance {args.rtol:g}); greedy tokens {'equal' if greedy == generated else 'DIFFER'}")
    if not err <= args.rtol:
        failures.append(f"sample logits differ from PEFT's: {err:.2e}")
    if greedy != generated:
        failures.append(f"greedy tokens differ: tuna {generated}, PEFT {greedy}")

    # 3. The merged export against PEFT, as transformers loads it.
    if args.merged:
        merged = AutoModelForCausalLM.from_pretrained(args.merged, torch_dtype=torch.float32)
        with torch.no_grad():
            got = merged.double()(input_ids=ids).logits[0].numpy()
        err = rel_err(got, ref)
        print(f"{PREFIX} merge-lora output vs PEFT: relative error {err:.2e} (tolerance {args.rtol:g})")
        if not err <= args.rtol:
            failures.append(f"merged model's logits differ from PEFT's: {err:.2e}")
        # PEFT's own merge in float32, tensor by tensor (the export is float32 only when asked; compare in float32).
        own = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32),
                                        args.checkpoint).merge_and_unload().state_dict()
        exported = AutoModelForCausalLM.from_pretrained(args.merged, torch_dtype=torch.float32).state_dict()
        worst = 0.0
        for k, v in own.items():
            if k not in exported:
                failures.append(f"merged model lacks {k}")
                continue
            d = (exported[k].float() - v.float()).abs().max().item() / max(v.float().abs().max().item(), 1e-30)
            worst = max(worst, d)
        print(f"{PREFIX} merge-lora weights vs PEFT merge_and_unload: max relative difference {worst:.2e}")
        if merged.config.torch_dtype == torch.float32 and worst > 1e-6:
            failures.append(f"merged weights differ from PEFT's merge by {worst:.2e}")

    for f in failures:
        print(f"{PREFIX} {f}")
    print(f"{PREFIX} {'FAIL' if failures else 'OK'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
