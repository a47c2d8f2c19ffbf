#!/usr/bin/env python3
"""Check that a model trained with --rope_scaling exports to a directory transformers runs as tuna does.

  python3 tools/reference/check_rope_export.py --checkpoint CKPT --hf HF_EXPORT --prompt_file TEXT [--build build]

1. The export's config.json carries the checkpoint's rope_scaling and max_position_embeddings.
2. `build/sample --greedy --print_ids --logits_out` on the checkpoint (tuna's CPU model with its KV cache) against
   transformers' float64 forward of the export (rope tables in float64 as in make_rope_fixtures.py) on the prompt
   and the generated tokens: the relative error of the logits at every generated position, the greedy tokens, and
   the loss (mean negative log-likelihood) of the generated tokens under each. A prompt longer than the original
   context puts those positions where the scaling matters.
Prints `check_rope_export: OK ...` or `... FAIL ...`; exit 0 / 1. Not CI (needs torch and transformers).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_rope_fixtures import make_exact  # noqa: E402

PREFIX = "check_rope_export:"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--hf", required=True)
    ap.add_argument("--prompt_file", required=True)
    ap.add_argument("--build", default="build")
    ap.add_argument("--max_tokens", type=int, default=8)
    ap.add_argument("--rtol", type=float, default=1e-4)
    args = ap.parse_args()
    failures = []

    with open(os.path.join(args.checkpoint, "config.json")) as f:
        ckpt_cfg = json.load(f)
    with open(os.path.join(args.hf, "config.json")) as f:
        hf_cfg = json.load(f)
    for key in ("rope_scaling", "max_position_embeddings", "rope_theta"):
        if ckpt_cfg.get(key) != hf_cfg.get(key):
            failures.append(f"config.json {key}: checkpoint {ckpt_cfg.get(key)}, export {hf_cfg.get(key)}")
    print(f"{PREFIX} export config: rope_scaling {hf_cfg.get('rope_scaling')}, max_position_embeddings "
          f"{hf_cfg.get('max_position_embeddings')}")

    with open(args.prompt_file) as f:
        prompt = f.read()
    with tempfile.TemporaryDirectory() as tmp:
        logits_path = os.path.join(tmp, "logits.f32")
        cmd = [os.path.join(args.build, "sample"), "--checkpoint", args.checkpoint, "--prompt", prompt, "--greedy",
               "--max_tokens", str(args.max_tokens), "--stop_at_eos", "false", "--print_ids", "--logits_out",
               logits_path, "--device", "cpu"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{PREFIX} build/sample failed:\n{r.stderr}")
            return 1
        line = next(l for l in r.stderr.splitlines() if l.startswith("ids:"))
        prompt_ids, generated = line[len("ids:"):].split("|")
        prompt_ids = [int(x) for x in prompt_ids.split()]
        generated = [int(x) for x in generated.split()]
        ours = np.fromfile(logits_path, dtype="<f4").astype(np.float64)

    model = AutoModelForCausalLM.from_pretrained(args.hf, torch_dtype=torch.float64).eval()
    make_exact(model)
    vocab = model.config.vocab_size
    ours = ours.reshape(-1, vocab)
    ids = torch.tensor([prompt_ids + generated])
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits[0].numpy()
    rows = ref[len(prompt_ids) - 1: len(prompt_ids) - 1 + ours.shape[0]]
    err = np.linalg.norm(ours - rows) / np.linalg.norm(rows)
    greedy = [int(np.argmax(rows[i])) for i in range(len(generated))]

    def nll(logits):
        logits = torch.tensor(logits)
        return torch.nn.functional.cross_entropy(logits[: len(generated)], torch.tensor(generated)).item()

    print(f"{PREFIX} build/sample vs transformers: prompt {len(prompt_ids)} tokens, {ours.shape[0]} generated "
          f"positions, logits relative error {err:.2e} (tolerance {args.rtol:g}); loss of the generated tokens "
          f"tuna {nll(ours):.6f}, transformers {nll(rows):.6f}; greedy tokens {'equal' if greedy == generated else 'DIFFER'}")
    if not err <= args.rtol:
        failures.append(f"logits differ: {err:.2e}")
    if greedy != generated:
        failures.append(f"greedy tokens differ: tuna {generated}, transformers {greedy}")
    for f_ in failures:
        print(f"{PREFIX} FAIL {f_}")
    if not failures:
        print(f"{PREFIX} OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
