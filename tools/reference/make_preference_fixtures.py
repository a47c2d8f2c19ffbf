#!/usr/bin/env python3
"""Make the preference-loss fixtures in tests/fixtures/preference_<base>/, computed by TRL's own code.

For each base fixture (make_fixtures.py's llama2_tiny and the tied GQA llama32_tiny) and each objective case,
on three (prompt, chosen, rejected) pairs, in float64 from the float32 weights cast up:
  - the per-sequence completion log-probs TRL computes (policy and reference), the loss, TRL's metrics
    (rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen, logps/rejected),
  - d loss / d each sequence's log-prob (autograd through TRL's loss from those log-probs as leaves),
  - every parameter gradient (the adapters' for the LoRA case),
  - 10 AdamW steps (make_fixtures.py's schedule at lr 5e-4, no clipping): loss, gradient norm and metrics of each.

The losses are TRL's: DPOTrainer.concatenated_forward / dpo_loss / get_batch_loss_metrics (sigmoid, ipo, hinge;
rpo_alpha), CPOTrainer with loss_type "simpo" (cpo_alpha 0), ORPOTrainer. Their methods run on a namespace that
carries exactly the attributes they read (building a whole Trainer needs a tokenizer, a dataset and accelerate's
state, none of which changes the numbers). The reference of the full fine-tune cases is a second model (the base
with every weight perturbed), whose summed log-probs a tuna test takes as a precomputed reference (TRL's
batch["ref_chosen_logps"] path); the LoRA case's is the base with the adapter disabled (TRL's null_ref_context).

Usage: python3 tools/reference/make_preference_fixtures.py   (after make_fixtures.py and make_lora_fixtures.py)
Versions: tools/reference/requirements.txt (TRL 0.13.0: 0.12's DPO forward dropped the last token of the
longest sequence of a padded batch).
"""

import copy
import json
import math
import os
import sys
import types

import peft
import safetensors.torch
import torch
import transformers
import trl
from trl.trainer.cpo_trainer import CPOTrainer
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.orpo_trainer import ORPOTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import HYPER, load_float64, lr_at, make_float64_exact, rope_inv_freq_float64  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures")
PAD = 0  # padding_value; never a loss token (labels there are masked)
# make_fixtures.py's optimizer at a third of its learning rate: a preference loss on three pairs is driven to ~0 in
# 10 steps at 1.5e-3, where fp32 and float64 runs part; at 5e-4 the losses still move by 2x to 10x.
PREF_HYPER = dict(HYPER, lr=5e-4, min_lr=5e-5)

# (prompt, chosen, rejected) lengths in tokens: the prompt starts with BOS (1), each completion ends with EOS (2).
PAIR_LENGTHS = [(5, 4, 5), (3, 6, 3), (7, 2, 6)]

# name, objective, TRL loss_type, beta, rpo_alpha (DPO) / cpo_alpha (SimPO), simpo_gamma, lora
CASES = [
    ("dpo_sigmoid", "dpo", "sigmoid", 0.1, None, None, False),
    ("dpo_sigmoid_rpo", "dpo", "sigmoid", 0.1, 0.5, None, False),
    ("dpo_ipo", "dpo", "ipo", 0.1, None, None, False),
    ("dpo_hinge", "dpo", "hinge", 0.5, None, None, False),
    ("simpo", "simpo", "simpo", 2.0, None, 0.5, False),
    ("orpo", "orpo", None, 0.1, None, None, False),
    ("lora_dpo_sigmoid", "dpo", "sigmoid", 0.5, None, None, True),
]


def make_pairs(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for lp, lc, lr in PAIR_LENGTHS:
        # Ids from 3 up: never PAD (TRL's rpo NLL ignores label 0), BOS or EOS inside the text.
        draw = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
        pairs.append({"prompt": [1] + draw(lp - 1), "chosen": draw(lc - 1) + [2], "rejected": draw(lr - 1) + [2]})
    return pairs


def pad_rows(rows, value, left=False):
    n = max(len(r) for r in rows)
    return torch.tensor([([value] * (n - len(r)) + r) if left else (r + [value] * (n - len(r))) for r in rows])


def dpo_batch(pairs):
    """DataCollatorForPreference's output: prompts left-padded, completions right-padded."""
    b = {}
    for key, left in (("prompt", True), ("chosen", False), ("rejected", False)):
        rows = [p[key] for p in pairs]
        b[f"{key}_input_ids"] = pad_rows(rows, PAD, left)
        b[f"{key}_attention_mask"] = pad_rows([[1] * len(r) for r in rows], 0, left)
    return b


def cpo_batch(pairs):
    """CPO/ORPO's tokenized rows: prompt + completion, labels -100 on the prompt and the padding."""
    b = {}
    for key in ("chosen", "rejected"):
        rows = [p["prompt"] + p[key] for p in pairs]
        b[f"{key}_input_ids"] = pad_rows(rows, PAD)
        b[f"{key}_attention_mask"] = pad_rows([[1] * len(r) for r in rows], 0)
        b[f"{key}_labels"] = pad_rows([[-100] * len(p["prompt"]) + p[key] for p in pairs], -100)
    b["prompt_input_ids"] = pad_rows([p["prompt"] for p in pairs], PAD, left=True)
    return b


def trainer_self(cls, objective, loss_type, beta, alpha, gamma):
    """The attributes TRL 0.13.0's loss methods read, with the methods bound to it."""
    s = types.SimpleNamespace(
        beta=beta, label_smoothing=0.0, loss_type=loss_type, reference_free=False, f_divergence_type="reverse_kl",
        f_divergence_params={}, use_weighting=False, aux_loss_enabled=False, aux_loss_coef=0.0,
        is_encoder_decoder=False, label_pad_token_id=-100, padding_value=PAD, use_num_logits_to_keep=False,
        accelerator=types.SimpleNamespace(device=torch.device("cpu")),
        args=types.SimpleNamespace(max_length=None, rpo_alpha=alpha, discopop_tau=0.05),
        cpo_alpha=alpha or 0.0, simpo_gamma=gamma)
    for name in ("concatenated_forward", "get_batch_loss_metrics", "dpo_loss", "cpo_loss", "odds_ratio_loss"):
        if hasattr(cls, name):
            setattr(s, name, types.MethodType(getattr(cls, name), s))
    s.concatenated_inputs = cls.concatenated_inputs  # a static method
    if hasattr(cls, "get_batch_logps"):
        s.get_batch_logps = cls.get_batch_logps
    return s


def sequence_logps(model, pairs):
    """Summed completion log-probs per sequence, TRL's DPO forward (sums: loss_type sigmoid)."""
    s = trainer_self(DPOTrainer, "dpo", "sigmoid", 0.1, None, None)
    with torch.no_grad():
        out = s.concatenated_forward(model, dpo_batch(pairs))
    return out["chosen_logps"].clone(), out["rejected_logps"].clone()


class Case:
    def __init__(self, name, objective, loss_type, beta, alpha, gamma, lora):
        self.name, self.objective, self.loss_type = name, objective, loss_type
        self.beta, self.alpha, self.gamma, self.lora = beta, alpha, gamma, lora
        cls = {"dpo": DPOTrainer, "simpo": CPOTrainer, "orpo": ORPOTrainer}[objective]
        self.trl = trainer_self(cls, objective, loss_type, beta, alpha, gamma)

    def averaged(self):
        return self.objective in ("simpo", "orpo") or self.loss_type == "ipo"

    def loss_and_metrics(self, model, pairs, ref):
        """TRL's loss and metrics on the batch. ref: (chosen, rejected) summed reference log-probs, or None."""
        if self.objective == "dpo":
            batch = dpo_batch(pairs)
            rc, rr = ref
            if self.loss_type == "ipo":  # TRL's reference forward averages them too for ipo
                rc = rc / torch.tensor([len(p["chosen"]) for p in pairs], dtype=torch.float64)
                rr = rr / torch.tensor([len(p["rejected"]) for p in pairs], dtype=torch.float64)
            batch["ref_chosen_logps"], batch["ref_rejected_logps"] = rc, rr
            loss, metrics = self.trl.get_batch_loss_metrics(model, batch)
        else:
            loss, metrics = self.trl.get_batch_loss_metrics(model, cpo_batch(pairs))
        return loss, {k: float(v) for k, v in metrics.items()}

    def loss_from_logps(self, c, r, ref, nll):
        """TRL's pair losses from per-sequence log-probs as leaves (as the loss takes them), for d loss / d logps."""
        if self.objective == "dpo":
            losses, _, _ = self.trl.dpo_loss(c, r, *ref)
            loss = losses.mean()
            if self.alpha is not None:
                loss = loss + self.alpha * nll
            return loss
        if self.objective == "simpo":
            losses, _, _ = self.trl.cpo_loss(c, r)
            return losses.mean() + self.trl.cpo_alpha * nll
        losses = self.trl.odds_ratio_loss(c, r)[0]
        return nll - losses.mean()


def lora_params(model):
    return [(n.replace(".default.", "."), p) for n, p in model.named_parameters() if "lora_" in n]


def load_policy(base, lora):
    d = os.path.join(ROOT, base)
    model = load_float64(d)
    inv_freq64, _ = rope_inv_freq_float64(model.config)
    make_float64_exact(model, inv_freq64)
    if lora:
        model = peft.PeftModel.from_pretrained(model, os.path.join(ROOT, "lora_" + base), is_trainable=True)
        for _, p in model.named_parameters():
            p.data = p.data.double()
    model.eval()
    return model


def perturbed_reference(model, seed):
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1 * p.std().clamp_min(1e-3))
    return ref


def trained_params(model, lora):
    if lora:
        return lora_params(model)
    return [(n, p) for n, p in model.named_parameters()]


def run_case(case, base, pairs, out, meta):
    model = load_policy(base, case.lora)
    if case.lora:
        with model.disable_adapter():  # TRL's null_ref_context: the base is the reference
            ref = sequence_logps(model, pairs)
    else:
        ref = sequence_logps(perturbed_reference(model, 1234), pairs)
    params = trained_params(model, case.lora)
    for _, p in params:
        p.requires_grad_(True)

    # Per-sequence log-probs as TRL's loss takes them, and the chosen NLL, from the policy (no grad).
    with torch.no_grad():
        pc, pr = sequence_logps(model, pairs)
    nc = torch.tensor([len(p["chosen"]) for p in pairs], dtype=torch.float64)
    nr = torch.tensor([len(p["rejected"]) for p in pairs], dtype=torch.float64)

    loss, metrics = case.loss_and_metrics(model, pairs, ref)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in params}
    for _, p in params:
        p.grad = None

    # d loss / d (summed sequence log-probs), through TRL's loss with the log-probs as leaves. The NLL term is
    # linear in the tokens' log-probs and does not depend on them here: a constant.
    c = (pc / nc if case.averaged() else pc).clone().requires_grad_(True)
    r = (pr / nr if case.averaged() else pr).clone().requires_grad_(True)
    ref_args = None
    if case.objective == "dpo":
        rc, rr = ref
        ref_args = (rc / nc, rr / nr) if case.averaged() else (rc, rr)
    leaf_loss = case.loss_from_logps(c, r, ref_args, torch.tensor(metrics.get("nll_loss", 0.0), dtype=torch.float64))
    assert abs(leaf_loss.item() - loss.item()) < 1e-12 * max(1.0, abs(loss.item())), (leaf_loss.item(), loss.item())
    leaf_loss.backward()
    d_chosen = c.grad / nc if case.averaged() else c.grad  # per summed log-prob
    d_rejected = r.grad / nr if case.averaged() else r.grad

    # 10 AdamW steps, make_fixtures.py's optimizer (decay on matrices; LoRA: on every adapter tensor), no clipping.
    h = PREF_HYPER
    if case.lora:
        groups = [{"params": [p for _, p in params], "weight_decay": h["weight_decay"]}]
    else:
        groups = [{"params": [p for _, p in params if p.dim() >= 2], "weight_decay": h["weight_decay"]},
                  {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], foreach=False)
    train_losses, grad_norms, step_metrics = [], [], []
    for step in range(h["steps"]):
        step_loss, step_m = case.loss_and_metrics(model, pairs, ref)
        train_losses.append(step_loss.item())
        step_metrics.append(step_m)
        step_loss.backward()
        grad_norms.append(math.sqrt(sum(float((p.grad.double() ** 2).sum()) for _, p in params)))
        lr = lr_at(step, h["lr"], h["min_lr"], h["warmup_steps"], h["steps"])
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert train_losses[0] == loss.item()

    for n, g in grads.items():
        out[f"{case.name}.grad.{n}"] = g.contiguous()
    meta["cases"][case.name] = {
        "objective": case.objective,
        "loss_type": case.loss_type if case.objective == "dpo" else "sigmoid",
        "beta": case.beta,
        "rpo_alpha": case.alpha or 0.0,
        "simpo_gamma": case.gamma if case.gamma is not None else 0.5,
        "lora": case.lora,
        "loss": loss.item(),
        "metrics": metrics,
        "policy_chosen_logps": pc.tolist(),
        "policy_rejected_logps": pr.tolist(),
        "ref_chosen_logps": ref[0].tolist(),
        "ref_rejected_logps": ref[1].tolist(),
        "d_chosen": d_chosen.tolist(),
        "d_rejected": d_rejected.tolist(),
        "train_losses": train_losses,
        "grad_norms": grad_norms,
        "step_metrics": step_metrics,
    }


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    for base in ("llama2_tiny", "llama32_tiny"):
        cfg = json.load(open(os.path.join(ROOT, base, "config.json")))
        pairs = make_pairs(cfg["vocab_size"], seed=7)
        out, meta = {}, {
            "base": base,
            "pairs": pairs,
            "pad": PAD,
            **PREF_HYPER,
            "grad_clip": 0.0,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "trl": trl.__version__, "peft": peft.__version__},
            "gradients": "float32 (computed in float64, stored rounded: 6e-8 relative, far below the tests' 1e-5)",
            "cases": {},
        }
        for spec in CASES:
            run_case(Case(*spec), base, pairs, out, meta)
            print(f"{base} {spec[0]}: loss {meta['cases'][spec[0]]['loss']:.6f} -> "
                  f"{meta['cases'][spec[0]]['train_losses'][-1]:.6f}")
        d = os.path.join(ROOT, "preference_" + base)
        os.makedirs(d, exist_ok=True)
        safetensors.torch.save_file({k: v.float() for k, v in out.items()}, os.path.join(d, "grads.safetensors"),
                                    metadata={"format": "tuna-preference-reference", "base": base})
        with open(os.path.join(d, "reference.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
