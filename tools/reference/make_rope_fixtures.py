#!/usr/bin/env python3
"""Make the RoPE-scaling fixtures tests/fixtures/rope_{linear,dynamic,yarn}/.

Each is a tiny random LlamaForCausalLM (config.json + model.safetensors, float32) whose rope_scaling is one of
transformers' `linear`, `dynamic` (NTK-aware) or `yarn`, run on a batch LONGER than the original context
(max_position_embeddings for dynamic and yarn, rope_scaling's original_max_position_embeddings for linear), plus
what tuna must reproduce in float64 from the float32 weights cast up: the inverse frequencies and attention factor,
logits, loss and every parameter gradient. The dynamic fixture also holds generation with a KV cache (a prompt
inside the original context, then one token at a time past it): transformers recomputes dynamic's frequencies as
the sequence grows and rotates each new position with the current ones, so those logits differ from the
whole-context forward's and are what tuna's sampler must give.

The model, the float64 patches (RoPE tables and RMSNorm computed in float64, as make_fixtures.py explains) and
the independent cross-check come from make_fixtures.py. The float64 frequencies are written here from
transformers' modeling_rope_utils.py (4.46.3) and asserted equal, to float32 rounding, to the table transformers
itself computes; the patched float64 model is asserted to be within float32 rounding of the stock one.

Usage: python3 tools/reference/make_rope_fixtures.py [--out tests/fixtures]
Deterministic (fixed seeds, one thread); takes a few seconds. tools/reference/README.md documents the files.
"""

import argparse
import json
import math
import os
import shutil
import sys
import types

import numpy
import safetensors
import safetensors.torch
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import (IGNORE_INDEX, FLOAT64_NOTE, INIT_NOTE, cross_entropy, independent_logits,  # noqa: E402
                           init_weights, load_float64, make_float64_exact, max_rel)

ORIGINAL = 32  # the original context of every fixture
SEQ = 48       # the batch's length: past the original context
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, hidden_act="silu", rms_norm_eps=1e-5, attention_bias=False,
              mlp_bias=False, attention_dropout=0.0, pretraining_tp=1, initializer_range=0.02, bos_token_id=1,
              eos_token_id=2, rope_theta=1000.0, tie_word_embeddings=True, use_cache=True)

FIXTURES = [
    # linear: positions divided by factor. transformers reads only `factor`; max_position_embeddings is the
    # extended context, as linear-scaled checkpoints publish it.
    dict(name="rope_linear", seed=11,
         config=dict(max_position_embeddings=ORIGINAL * 2,
                     rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # dynamic NTK: max_position_embeddings is the original context; the base grows with the sequence past it.
    dict(name="rope_dynamic", seed=12,
         config=dict(max_position_embeddings=ORIGINAL, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    # yarn: max_position_embeddings is the original context; beta_fast given, beta_slow and attention_factor at
    # their defaults (1 and 0.1 ln(factor) + 1). With head_dim 16 and theta 1000 the correction range is dims
    # [0, 2]: one frequency kept, one blended, six interpolated.
    dict(name="rope_yarn", seed=13,
         config=dict(max_position_embeddings=ORIGINAL,
                     rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 16.0})),
]

# Generation with a KV cache for the dynamic fixture: a prompt of CACHE_PROMPT tokens, then one at a time.
CACHE_PROMPT = 28


def rope_float64(cfg, seq_len):
    """transformers 4.46's inverse frequencies and attention factor for a forward whose sequence is seq_len
    long, in float64."""
    d, base, rs = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
    kind = rs.get("rope_type", rs.get("type"))
    factor = rs["factor"]
    exponents = torch.arange(0, d, 2, dtype=torch.float64) / d
    if kind == "linear":
        return 1.0 / (base ** exponents) / factor, 1.0
    mpe = cfg.max_position_embeddings
    if kind == "dynamic":
        s = seq_len if seq_len is not None and seq_len > mpe else mpe
        base = base * ((factor * s / mpe) - (factor - 1)) ** (d / (d - 2))
        return 1.0 / (base ** exponents), 1.0
    assert kind == "yarn", kind
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def correction_dim(rotations):
        return (d * math.log(mpe / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** exponents
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, attention_factor


def _rotary_forward_float64(self, x, position_ids):
    # LlamaRotaryEmbedding.forward in float64, dynamic's recomputation included: transformers' module remembers the
    # longest sequence it has seen (max_seq_len_cached) and resets below the original context; the same here.
    seq_len = int(position_ids.max()) + 1
    if self.dynamic:
        if seq_len > self.cached_len:
            self.inv_freq_float64, _ = rope_float64(self.config, seq_len)
            self.cached_len = seq_len
        if seq_len < self.config.max_position_embeddings and self.cached_len > self.config.max_position_embeddings:
            self.inv_freq_float64, _ = rope_float64(self.config, None)
            self.cached_len = self.config.max_position_embeddings
    freqs = position_ids[:, :, None].to(torch.float64) * self.inv_freq_float64[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return ((emb.cos() * self.attention_float64).to(x.dtype), (emb.sin() * self.attention_float64).to(x.dtype))


def make_exact(model):
    cfg = model.config
    inv_freq, attention = rope_float64(cfg, None)
    make_float64_exact(model, inv_freq)  # RMSNorm in float64; the rotary forward replaced again below
    for m in model.modules():
        if isinstance(m, LlamaRotaryEmbedding):
            m.dynamic = m.rope_type == "dynamic"
            m.cached_len = cfg.max_position_embeddings
            m.inv_freq_float64, m.attention_float64 = inv_freq, attention
            m.forward = types.MethodType(_rotary_forward_float64, m)


def cached_logits(model, ids, prompt):
    """Last-position logits of generation with transformers' KV cache: the prompt, then one token at a time."""
    out = []
    with torch.no_grad():
        o = model(input_ids=ids[:, :prompt], use_cache=True)
        out.append(o.logits[:, -1])
        past = o.past_key_values
        for t in range(prompt, ids.shape[1]):
            o = model(input_ids=ids[:, t:t + 1], past_key_values=past, use_cache=True)
            out.append(o.logits[:, -1])
            past = o.past_key_values
    return torch.stack(out, dim=1)  # [B, 1 + T - prompt, V]


def make_fixture(fx, out_root):
    d = os.path.join(out_root, fx["name"])
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    B, T, seed = 2, SEQ, fx["seed"]

    torch.manual_seed(seed)
    config = LlamaConfig(**COMMON, **fx["config"], torch_dtype="float32")
    model32 = LlamaForCausalLM(config).float()
    init_weights(model32, seed)
    model32.save_pretrained(d, safe_serialization=True)
    gen_cfg = os.path.join(d, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)

    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, config.vocab_size, (B, T + 1), generator=gen, dtype=torch.int64)
    input_ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    targets[0, -1] = IGNORE_INDEX
    targets[1, 3] = IGNORE_INDEX

    # transformers' own table (float32) for this length: the float64 one written above must be it, rounded.
    stock = load_float64(d)
    cfg = stock.config
    rotary = stock.model.rotary_emb
    with torch.no_grad():
        stock_logits = stock(input_ids=input_ids, use_cache=False).logits
    inv_freq64, attention = rope_float64(cfg, T)
    assert torch.allclose(inv_freq64, rotary.inv_freq.double(), rtol=2e-6, atol=0), (inv_freq64, rotary.inv_freq)
    assert abs(rotary.attention_scaling - attention) < 1e-12, (rotary.attention_scaling, attention)
    default_inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    scaled = (inv_freq64 / default_inv_freq).tolist()
    assert any(abs(r - 1) > 1e-3 for r in scaled), "the scaling changed nothing"

    model = load_float64(d)
    make_exact(model)
    logits = model(input_ids=input_ids, use_cache=False).logits
    loss = cross_entropy(logits, targets)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    stock_diff = (stock_logits - logits.detach()).abs().max().item()
    assert stock_diff < 1e-4, f"float64 reference differs from stock transformers by {stock_diff}"

    # Independent float64 forward from the math.
    P = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    # Scaling cos and sin by the attention factor a scales q.k by a^2: the same as every layer's q_proj and k_proj
    # scaled by a, which the independent forward (plain RoPE) is given instead.
    Q = dict(P)
    for layer in range(cfg.num_hidden_layers):
        for w in ("q_proj", "k_proj"):
            name = f"model.layers.{layer}.self_attn.{w}.weight"
            Q[name] = P[name] * attention
    ind = independent_logits(Q, cfg, input_ids, inv_freq64)
    cross_entropy(ind, targets).backward()
    logits_err = max_rel(logits.detach(), ind.detach())
    grad_err = max(max_rel(grads[n], P[n].grad) for n in grads)
    assert logits_err < 1e-12 and grad_err < 1e-10, (logits_err, grad_err)

    tensors = {"input_ids": input_ids.to(torch.int32), "targets": targets.to(torch.int32),
               "logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1),
               "rope_inv_freq": inv_freq64.contiguous()}
    for n, g in grads.items():
        tensors["grad." + n] = g.contiguous()

    meta_cache = None
    if cfg.rope_scaling.get("rope_type") == "dynamic":
        fresh = load_float64(d)
        make_exact(fresh)
        cached = cached_logits(fresh, input_ids, CACHE_PROMPT)
        with torch.no_grad():
            stock_cached = cached_logits(load_float64(d), input_ids, CACHE_PROMPT)
        cache_stock_diff = (stock_cached - cached).abs().max().item()
        assert cache_stock_diff < 1e-4, cache_stock_diff
        # Past the original context the cached positions keep older frequencies: not the whole-context logits.
        whole_tail = logits.detach()[:, CACHE_PROMPT - 1:]
        cache_vs_whole = max_rel(cached[:, -1], whole_tail[:, -1])
        assert cache_vs_whole > 1e-3, cache_vs_whole
        tensors["cached_last_logits"] = cached.contiguous()
        meta_cache = {"prompt": CACHE_PROMPT, "then": "one token at a time to seq_len",
                      "stock_hf_float64_max_abs_diff": cache_stock_diff,
                      "last_step_rel_diff_from_whole_context": cache_vs_whole}

    safetensors.torch.save_file(tensors, os.path.join(d, "reference.safetensors"),
                                metadata={"format": "tuna-reference-rope", "fixture": fx["name"]})
    meta = {"fixture": fx["name"], "batch": B, "seq_len": T, "original_context": ORIGINAL,
            "ignore_index": IGNORE_INDEX, "rope_scaling": cfg.rope_scaling,
            "max_position_embeddings": cfg.max_position_embeddings, "loss": loss.item(),
            "rope_inv_freq": inv_freq64.tolist(), "rope_attention_factor": attention,
            "rope_inv_freq_over_default": scaled, "init": INIT_NOTE, "float64": FLOAT64_NOTE,
            "stock_hf_float64_logits_max_abs_diff": stock_diff,
            "independent_check_max_rel_err": {"logits": logits_err, "grads": grad_err},
            "cached_generation": meta_cache,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "safetensors": safetensors.__version__, "numpy": numpy.__version__}}
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    print(f"{fx['name']}: loss {loss.item():.6f}, inv_freq / default {[round(r, 4) for r in scaled]}, "
          f"attention factor {attention:.6f}, stock HF differs by {stock_diff:.1e}, independent {logits_err:.1e} / "
          f"{grad_err:.1e}" + (f", cached generation {meta_cache}" if meta_cache else ""))
    return d


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests",
                                                  "fixtures"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    out = os.path.normpath(args.out)
    total = 0
    for fx in FIXTURES:
        d = make_fixture(fx, out)
        for name in sorted(os.listdir(d)):
            total += os.path.getsize(os.path.join(d, name))
    print(f"total {total} bytes")
    assert total < 1024 * 1024, "fixtures must stay small"


if __name__ == "__main__":
    sys.exit(main())
