#!/usr/bin/env python3
"""Make the transformers reference fixtures in tests/fixtures/<name>/.

Each fixture is a tiny random LlamaForCausalLM saved as a Hugging Face directory (config.json +
model.safetensors, float32) plus what tuna must reproduce on those exact weights, computed in float64
from the float32 weights cast up: logits, loss, every parameter gradient, and 10 AdamW steps with
warmup + cosine learning rate and global-norm clipping; and the same batch as packed documents (position_ids
restarting at each document and a block-diagonal causal mask, what a padding-free collator gives transformers):
logits, loss and gradients. tools/reference/README.md documents the files.

Usage: python3 tools/reference/make_fixtures.py [--out tests/fixtures]

Deterministic: fixed seeds, one CPU thread, deterministic algorithms; re-running rewrites byte-identical
files (for the same torch / transformers versions, see requirements.txt).
"""

import argparse
import json
import math
import os
import shutil
import sys
import types
from dataclasses import dataclass, field

import numpy
import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

IGNORE_INDEX = -100  # F.cross_entropy's default; tuna's loss uses the same marker for masked targets

# Optimizer and schedule, shared by all fixtures (reference.json repeats them per fixture).
# lr 1.5e-3 (not 1e-2): at 1e-2 the model memorizes the batch (loss -> 0.04), gradients become small and
# noisy, Adam turns fp32 rounding into full-size steps, and an fp32 run drifts from this float64
# reference by up to 5e-4 (losses) / 1e-3 (grad norms) relative. At 1.5e-3 the drift is <= 1e-5 while
# each optimizer bug tried (weight decay on norm weights, no bias correction, no clipping, no warmup)
# still moves the losses by >= 2.4e-3 relative. Measurements: tools/reference/README.md, "Choice of
# hyperparameters".
HYPER = dict(lr=1.5e-3, min_lr=1.5e-4, warmup_steps=2, steps=10, beta1=0.9, beta2=0.95, eps=1e-8,
             weight_decay=0.1)


@dataclass(frozen=True)
class Fixture:
    name: str
    config: dict            # LlamaConfig keyword arguments
    batch: int
    seq_len: int
    seed: int
    # Chosen by looking at the unclipped grad norms of the 10 steps so that clipping engages on some
    # steps and not on others; make_fixture() asserts both happen and that no step is within 2% of the
    # threshold (so an fp32 run, whose norms differ by ~1e-5 relative, clips on the same steps).
    grad_clip: float
    # (row, position) of targets replaced by IGNORE_INDEX: the tail of row 0 (as padding would be) and
    # one position inside row 1 (as an SFT prompt mask would be).
    ignored: tuple = field(default=((0, -3), (0, -2), (0, -1), (1, 5)))
    # Packed documents per row (lengths summing to seq_len): row 0 a one-token document between two longer ones
    # (the first as a window cut from a longer document would begin), row 1 a single document.
    documents: tuple = field(default=((5, 1, 10), (16,)))


COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
              hidden_act="silu", rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False,
              attention_dropout=0.0, pretraining_tp=1, initializer_range=0.02, bos_token_id=1,
              use_cache=True)

FIXTURES = [
    # LLaMA-2 style: multi-head attention (kv heads == heads), plain RoPE, untied output head.
    Fixture(
        name="llama2_tiny",
        config=dict(COMMON, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                    rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False,
                    max_position_embeddings=256, eos_token_id=2),
        batch=2, seq_len=16, seed=1234, grad_clip=2.7),
    # LLaMA-3.2 style: grouped-query attention (4 query heads per kv head), llama3 RoPE scaling,
    # output head tied to the embedding, eos as a list.
    Fixture(
        name="llama32_tiny",
        config=dict(COMMON, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                    rope_theta=500000.0,
                    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                    tie_word_embeddings=True, max_position_embeddings=131072, eos_token_id=[2, 3]),
        batch=2, seq_len=16, seed=5678, grad_clip=3.7),
]

INIT_NOTE = ("HF's default init (std 0.02) gives near-uniform logits and tiny activations, so the test "
             "would be weak. Re-initialized: every weight matrix ~ N(0, 1/fan_in) (nn.Linear fan_in = "
             "in_features; the embedding uses 1/hidden_size because with tied embeddings it is also the "
             "output head), every RMSNorm weight = 1 + 0.1*N(0,1). This keeps activations O(1) and "
             "logits with std ~1. Drawn in float32 from torch.Generator(seed) in named_parameters() order.")

FLOAT64_NOTE = ("transformers 4.46 computes RMSNorm and the RoPE tables in float32 even in a float64 model. "
                "For the reference both are computed in float64 (RMSNorm in the input dtype; RoPE inverse "
                "frequencies, llama3 scaling, cos and sin in float64). Everything else is the stock HF "
                "float64 forward (sdpa attention). An independent float64 implementation agrees to ~1e-15; "
                "stock_hf_float64_logits_max_abs_diff is how far the unpatched HF float64 forward is.")


# ---------------------------------------------------------------------------------------------------
# Learning rate

def lr_at(step, lr, min_lr, warmup_steps, steps):
    """Linear warmup to lr over warmup_steps (first step already at lr/W), then cosine to min_lr at
    step == steps (so the last step, steps-1, is just above min_lr)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / (steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------------------
# Exact float64 RoPE and RMSNorm

def rope_inv_freq_float64(cfg):
    """HF's RoPE inverse frequencies (default or llama3), computed in float64. Also returns, per
    frequency, which llama3 band it falls in."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    bands = ["unscaled"] * len(inv_freq)
    rs = cfg.rope_scaling
    if rs is not None:
        assert rs["rope_type"] == "llama3", rs
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_ctx = rs["original_max_position_embeddings"]
        low_freq_wavelen, high_freq_wavelen = old_ctx / lo, old_ctx / hi
        out = []
        bands = []
        for f in inv_freq.tolist():
            wavelen = 2 * math.pi / f
            if wavelen < high_freq_wavelen:        # high frequency: kept
                out.append(f)
                bands.append("high (kept)")
            elif wavelen > low_freq_wavelen:       # low frequency: divided by factor
                out.append(f / factor)
                bands.append("low (/factor)")
            else:                                  # in between: smooth interpolation
                smooth = (old_ctx / wavelen - lo) / (hi - lo)
                out.append((1 - smooth) * f / factor + smooth * f)
                bands.append("medium (smoothed)")
        inv_freq = torch.tensor(out, dtype=torch.float64)
    return inv_freq, bands


def _rotary_forward_float64(self, x, position_ids):
    # Same contract as LlamaRotaryEmbedding.forward: cos, sin of shape [B, T, head_dim] with the
    # frequency table repeated twice (HF's rotate_half layout), but computed in float64.
    freqs = position_ids[:, :, None].to(torch.float64) * self.inv_freq_float64[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return ((emb.cos() * self.attention_scaling).to(x.dtype),
            (emb.sin() * self.attention_scaling).to(x.dtype))


def _rmsnorm_forward_exact(self, hidden_states):
    # Stock HF upcasts to float32, which for a float64 model is a downcast. Compute in the wider of
    # (input dtype, float32): identical to stock for float32/bf16 inputs, exact for float64.
    input_dtype = hidden_states.dtype
    h = hidden_states.to(torch.promote_types(input_dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(input_dtype)


def make_float64_exact(model, inv_freq64):
    for m in model.modules():
        if isinstance(m, LlamaRotaryEmbedding):
            m.inv_freq_float64 = inv_freq64
            m.forward = types.MethodType(_rotary_forward_float64, m)
        elif isinstance(m, LlamaRMSNorm):
            m.forward = types.MethodType(_rmsnorm_forward_exact, m)


# ---------------------------------------------------------------------------------------------------
# Independent float64 forward (a cross-check of the patched HF model, written from the math)

def independent_logits(P, cfg, ids, inv_freq):
    B, T = ids.shape
    H, KV, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps

    def rms(x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = ang.cos(), ang.sin()

    def rope(x):  # pairs (i, i + hd/2), HF's rotate_half layout
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    causal = torch.ones(T, T, dtype=torch.bool).tril()
    x = P["model.embed_tokens.weight"][ids]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        h = rms(x, P[p + "input_layernorm.weight"])
        q = (h @ P[p + "self_attn.q_proj.weight"].T).view(B, T, H, hd).transpose(1, 2)
        k = (h @ P[p + "self_attn.k_proj.weight"].T).view(B, T, KV, hd).transpose(1, 2)
        v = (h @ P[p + "self_attn.v_proj.weight"].T).view(B, T, KV, hd).transpose(1, 2)
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(H // KV, dim=1)  # query head j uses kv head j // (H/KV)
        v = v.repeat_interleave(H // KV, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        s = s.masked_fill(~causal, float("-inf"))
        a = (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(B, T, H * hd)
        x = x + a @ P[p + "self_attn.o_proj.weight"].T
        h = rms(x, P[p + "post_attention_layernorm.weight"])
        g = h @ P[p + "mlp.gate_proj.weight"].T
        u = h @ P[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(g) * u) @ P[p + "mlp.down_proj.weight"].T
    x = rms(x, P["model.norm.weight"])
    head = P["lm_head.weight"] if "lm_head.weight" in P else P["model.embed_tokens.weight"]
    return x @ head.T


# ---------------------------------------------------------------------------------------------------

def init_weights(model, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.dim() == 1:                                   # RMSNorm weight
                p.copy_(1.0 + 0.1 * z)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(z * hidden ** -0.5)
            else:                                              # nn.Linear [out, in]
                p.copy_(z * p.shape[1] ** -0.5)


def cross_entropy(logits, targets):
    V = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1).long(), ignore_index=IGNORE_INDEX)


def max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def load_float64(fixture_dir):
    # Built from the saved files, so the reference is computed from exactly the float32 weights on
    # disk, cast up.
    return LlamaForCausalLM.from_pretrained(fixture_dir, torch_dtype=torch.float64,
                                            attn_implementation="sdpa").eval()


def packed_batch(documents, T):
    # position_ids restarting at 0 at each document, and the additive [B, 1, T, T] mask of causal attention inside
    # each document (0 where a query sees a key, the dtype's minimum elsewhere): transformers takes a 4-D mask as
    # given ("already in inverted form").
    B = len(documents)
    position_ids = torch.zeros(B, T, dtype=torch.int64)
    allowed = torch.zeros(B, T, T, dtype=torch.bool)
    for b, lengths in enumerate(documents):
        assert sum(lengths) == T, (lengths, T)
        at = 0
        for n in lengths:
            position_ids[b, at:at + n] = torch.arange(n)
            allowed[b, at:at + n, at:at + n] = torch.ones(n, n, dtype=torch.bool).tril()
            at += n
    mask = torch.zeros(B, 1, T, T, dtype=torch.float64)
    mask.masked_fill_(~allowed[:, None], torch.finfo(torch.float64).min)
    return position_ids, mask


def make_packed(fx, d, model, input_ids, targets, unpacked_logits):
    # The batch as packed documents: logits, loss, gradients in float64. Checked here against the oracle (each
    # document run alone, positions from 0, plain causal attention): the same logits, and a loss whose sum over
    # tokens is the sum of the documents'.
    B, T = input_ids.shape
    position_ids, mask = packed_batch(fx.documents, T)
    logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False).logits
    loss = cross_entropy(logits, targets)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        alone = torch.empty_like(logits)
        for b, lengths in enumerate(fx.documents):
            at = 0
            for n in lengths:
                alone[b, at:at + n] = model(input_ids=input_ids[b:b + 1, at:at + n], use_cache=False).logits[0]
                at += n
    oracle_err = max_rel(logits.detach(), alone)
    assert oracle_err < 1e-12, f"packed logits differ from the documents run alone: {oracle_err}"
    crossing = max_rel(logits.detach(), unpacked_logits.detach())
    assert crossing > 1e-2, f"the mask changed nothing: {crossing}"
    tensors = {"position_ids": position_ids.to(torch.int32), "logits": logits.detach().contiguous(),
               "loss": loss.detach().reshape(1)}
    for n, g in grads.items():
        tensors["grad." + n] = g.contiguous()
    safetensors.torch.save_file(tensors, os.path.join(d, "packed.safetensors"),
                                metadata={"format": "tuna-reference-packed", "fixture": fx.name})
    return {"documents": [list(r) for r in fx.documents], "loss": loss.item(),
            "oracle_max_rel_err": oracle_err, "unmasked_logits_max_rel_diff": crossing}


def make_fixture(fx, out_root):
    d = os.path.join(out_root, fx.name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    B, T = fx.batch, fx.seq_len

    # --- model, saved in float32 ------------------------------------------------------------------
    torch.manual_seed(fx.seed)  # HF's own init draws from the global RNG; overwritten below anyway
    config = LlamaConfig(**fx.config, torch_dtype="float32")
    model32 = LlamaForCausalLM(config).float()
    init_weights(model32, fx.seed)
    model32.save_pretrained(d, safe_serialization=True)
    # save_pretrained also writes generation_config.json; the fixture is config + weights only.
    gen_cfg = os.path.join(d, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)

    # --- batch: a real next-token batch of B rows of T+1 tokens -----------------------------------
    gen = torch.Generator().manual_seed(fx.seed + 1)
    tokens = torch.randint(0, config.vocab_size, (B, T + 1), generator=gen, dtype=torch.int64)
    input_ids = tokens[:, :-1].contiguous()
    targets = tokens[:, 1:].contiguous()
    for row, pos in fx.ignored:
        targets[row, pos] = IGNORE_INDEX

    # --- float64 reference model ------------------------------------------------------------------
    model = load_float64(d)
    cfg = model.config
    assert cfg.head_dim == fx.config["head_dim"]
    inv_freq64, bands = rope_inv_freq_float64(cfg)
    hf_inv_freq = model.model.rotary_emb.inv_freq  # HF's float32 table
    assert torch.allclose(inv_freq64, hf_inv_freq.double(), rtol=1e-6, atol=0), (inv_freq64, hf_inv_freq)
    if cfg.rope_scaling is not None:
        # The point of this fixture's head_dim/theta: every llama3 band is exercised.
        assert set(bands) == {"high (kept)", "medium (smoothed)", "low (/factor)"}, bands
    make_float64_exact(model, inv_freq64)

    saved = safetensors.torch.load_file(os.path.join(d, "model.safetensors"))
    params = dict(model.named_parameters())
    assert sorted(saved) == sorted(params), (sorted(saved), sorted(params))
    for n, p in params.items():
        assert saved[n].dtype == torch.float32, n
        assert torch.equal(saved[n].double(), p.detach()), f"{n}: float64 model != saved float32 weights"
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert "lm_head.weight" not in saved

    # --- logits, loss, gradients ------------------------------------------------------------------
    logits = model(input_ids=input_ids, use_cache=False).logits
    loss = cross_entropy(logits, targets)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    # Cross-check against the independent implementation, forward and backward.
    P = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    ind_logits = independent_logits(P, cfg, input_ids, inv_freq64)
    cross_entropy(ind_logits, targets).backward()
    logits_err = max_rel(logits.detach(), ind_logits.detach())
    grad_err = max(max_rel(grads[n], P[n].grad) for n in grads)
    assert logits_err < 1e-12 and grad_err < 1e-10, (logits_err, grad_err)

    packed = make_packed(fx, d, model, input_ids, targets, logits)

    # How far the stock (unpatched) HF float64 forward is: informational.
    with torch.no_grad():
        stock_logits = load_float64(d)(input_ids=input_ids, use_cache=False).logits
    stock_diff = (stock_logits - logits.detach()).abs().max().item()

    # --- 10 AdamW steps ---------------------------------------------------------------------------
    h = HYPER
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": h["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], weight_decay=h["weight_decay"],
        foreach=False)
    train_losses, grad_norms, lrs = [], [], []
    for step in range(h["steps"]):
        step_loss = cross_entropy(model(input_ids=input_ids, use_cache=False).logits, targets)
        train_losses.append(step_loss.item())
        step_loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), fx.grad_clip)
        grad_norms.append(norm.item())
        lr = lr_at(step, h["lr"], h["min_lr"], h["warmup_steps"], h["steps"])
        for group in opt.param_groups:
            group["lr"] = lr
        lrs.append(lr)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert train_losses[0] == loss.item(), (train_losses[0], loss.item())

    # clip_grad_norm_ scales by grad_clip / (norm + 1e-6) when that is < 1.
    clipped = [s for s, n in enumerate(grad_norms) if n + 1e-6 > fx.grad_clip]
    assert 0 < len(clipped) < h["steps"], f"{fx.name}: pick grad_clip; norms {grad_norms}"
    margin = min(abs(n - fx.grad_clip) for n in grad_norms) / fx.grad_clip
    assert margin > 2e-2, f"{fx.name}: a grad norm is within 2% of grad_clip; norms {grad_norms}"

    # --- write ------------------------------------------------------------------------------------
    tensors = {
        "input_ids": input_ids.to(torch.int32),
        "targets": targets.to(torch.int32),
        "logits": logits.detach().contiguous(),
        "loss": loss.detach().reshape(1),
        "train_losses": torch.tensor(train_losses, dtype=torch.float64),
        "grad_norms": torch.tensor(grad_norms, dtype=torch.float64),
        "lrs": torch.tensor(lrs, dtype=torch.float64),
    }
    for n, g in grads.items():
        tensors["grad." + n] = g.contiguous()
    safetensors.torch.save_file(tensors, os.path.join(d, "reference.safetensors"),
                                metadata={"format": "tuna-reference", "fixture": fx.name})

    logits_std = logits.detach().std().item()
    meta = {
        "fixture": fx.name,
        "batch": B,
        "seq_len": T,
        "ignore_index": IGNORE_INDEX,
        "ignored_positions": [[r, p % T] for r, p in fx.ignored],
        **h,
        "grad_clip": fx.grad_clip,
        "schedule": "cosine",
        "weight_decay_params": "dim >= 2 (matrices and embedding); RMSNorm weights get 0",
        "clip": "torch.nn.utils.clip_grad_norm_: total = sqrt(sum over tensors of ||g||^2); "
                "g *= min(1, grad_clip / (total + 1e-6))",
        "clipped_steps": clipped,
        "loss": loss.item(),
        "final_train_loss": train_losses[-1],
        "logits_std": logits_std,
        "rope_inv_freq": inv_freq64.tolist(),
        "rope_bands": bands,
        "init": INIT_NOTE,
        "float64": FLOAT64_NOTE,
        "stock_hf_float64_logits_max_abs_diff": stock_diff,
        "packed": packed,
        "independent_check_max_rel_err": {"logits": logits_err, "grads": grad_err},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "safetensors": safetensors.__version__, "numpy": numpy.__version__},
    }
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")

    print(f"{fx.name}: loss {loss.item():.6f}  logits std {logits_std:.3f}  "
          f"train losses {train_losses[0]:.4f} -> {train_losses[-1]:.4f}")
    print(f"  grad norms {[round(n, 4) for n in grad_norms]}  clip {fx.grad_clip}: clipped steps {clipped}")
    print(f"  rope bands {bands}")
    print(f"  packed documents {packed['documents']}: loss {packed['loss']:.6f}, oracle {packed['oracle_max_rel_err']:.1e}, "
          f"unmasked logits differ by {packed['unmasked_logits_max_rel_diff']:.2f}")
    print(f"  independent check: logits {logits_err:.1e}, grads {grad_err:.1e}; "
          f"stock HF float64 logits differ by {stock_diff:.1e}")
    return d


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "..", "tests", "fixtures"))
    args = ap.parse_args()
    torch.set_num_threads(1)  # reduction order, hence every bit, independent of the machine's cores
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    out = os.path.normpath(args.out)
    os.makedirs(out, exist_ok=True)
    total = 0
    for fx in FIXTURES:
        d = make_fixture(fx, out)
        for name in sorted(os.listdir(d)):
            size = os.path.getsize(os.path.join(d, name))
            total += size
            print(f"  {os.path.join(d, name)}  {size} bytes")
    print(f"total {total} bytes")
    # ~4.2 MB: half of it the float64 gradients, once for the plain batch and once packed.
    assert total < 4.5 * 1024 * 1024, "fixtures must stay small"


if __name__ == "__main__":
    sys.exit(main())
