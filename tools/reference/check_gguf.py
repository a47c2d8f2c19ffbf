#!/usr/bin/env python3
"""Check a GGUF file written by `build/convert tuna-to-gguf` against the model it was made from.

Usage: check_gguf.py OUT.gguf MODEL_DIR TYPE

MODEL_DIR is a Hugging Face directory (config.json, model.safetensors, the tokenizer files); TYPE the --type
of the export (f32, f16, bf16, q8_0, q4_0). Everything expected is computed here from MODEL_DIR alone, the
way llama.cpp's convert_hf_to_gguf.py and its quantizers (the `gguf` package) compute it:
  1. the `gguf` package reads every key and tensor (GGUFReader: version 3, alignment, offsets);
  2. metadata: general.*, llama.* from config.json; the tokenizer from tokenizer.model (sentencepiece: every
     piece, score and type, read from the model proto here) or tokenizer.json (byte-level BPE: tokens in the
     byte-level alphabet, types, merges in order) and tokenizer_config.json (BOS/EOS, chat template);
  3. tensors: names, shapes (innermost first), ggml types, and bytes: f32 exact, f16/bf16 as numpy / the gguf
     package round them, q8_0/q4_0 byte for byte equal to gguf.quants.quantize of the same fp32 values, with
     attn_q / attn_k rows permuted as llama.cpp's LlamaModel.permute does, and rope_freqs (llama3) equal to
     llama.cpp's factors.
Prints one line per mismatch, then `check_gguf: OK ...` or `check_gguf: FAIL ...`; exit status 0 / 1.
Needs only numpy and gguf (pip install gguf).
"""

import json
import math
import os
import struct
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

PREFIX = "check_gguf:"
problems = []


def expect(cond, what):
    if not cond:
        problems.append(what)
        print(PREFIX, "MISMATCH", what)


def read_safetensors(path):
    """name -> fp32 numpy array (F32, BF16, F16 sources)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        data = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        raw = np.asarray(data[base + b:base + e])
        if info["dtype"] == "F32":
            a = raw.view(np.float32)
        elif info["dtype"] == "F16":
            a = raw.view(np.float16).astype(np.float32)
        elif info["dtype"] == "BF16":
            a = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            raise SystemExit(f"{PREFIX} FAIL {path}: tensor {name} has dtype {info['dtype']}")
        out[name] = a.reshape(info["shape"])
    return out


def varint(buf, i):
    v = shift = 0
    while True:
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return v, i


def proto_fields(buf):
    """(field number, wire type, value) of a protobuf message: enough to read a sentencepiece model."""
    i = 0
    while i < len(buf):
        key, i = varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = varint(buf, i)
        elif wt == 1:
            v, i = buf[i:i + 8], i + 8
        elif wt == 2:
            n, i = varint(buf, i)
            v, i = buf[i:i + n], i + n
        elif wt == 5:
            v, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"wire type {wt}")
        yield num, wt, v


def sentencepiece_vocab(path):
    pieces, scores, types = [], [], []
    for num, wt, v in proto_fields(open(path, "rb").read()):
        if num != 1 or wt != 2:
            continue
        piece, score, typ = "", 0.0, 1
        for n2, w2, v2 in proto_fields(v):
            if n2 == 1:
                piece = v2.decode("utf-8")
            elif n2 == 2:
                score = struct.unpack("<f", v2)[0]
            elif n2 == 3:
                typ = v2
        pieces.append(piece)
        scores.append(score)
        types.append(typ)
    return pieces, scores, types


def byte_level_alphabet():
    """GPT-2's bytes -> printable characters, as tokenizer.json writes tokens."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in keep}
    k = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + k)
            k += 1
    return chars


def field_value(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


def main():
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    path, model_dir, typ = sys.argv[1:]
    reader = gguf.GGUFReader(path)
    config = json.load(open(os.path.join(model_dir, "config.json")))

    # --- metadata
    n_head, n_kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    file_types = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "bf16": 32}
    want = {
        "general.architecture": "llama",
        "general.alignment": 32,
        "general.file_type": file_types[typ],
        "llama.context_length": config["max_position_embeddings"],
        "llama.embedding_length": config["hidden_size"],
        "llama.feed_forward_length": config["intermediate_size"],
        "llama.block_count": config["num_hidden_layers"],
        "llama.attention.head_count": n_head,
        "llama.attention.head_count_kv": n_kv,
        "llama.attention.key_length": head_dim,
        "llama.attention.value_length": head_dim,
        "llama.rope.dimension_count": head_dim,
        "llama.vocab_size": config["vocab_size"],
    }
    for key, value in want.items():
        got = field_value(reader, key)
        expect(got == value, f"{key}: expected {value!r}, found {got!r}")
    for key, value in [("llama.rope.freq_base", config.get("rope_theta", 10000.0)),
                       ("llama.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])]:
        got = field_value(reader, key)
        expect(got is not None and np.float32(got) == np.float32(value), f"{key}: expected {value}, found {got}")
    expect(reader.alignment == 32, f"alignment {reader.alignment}")
    version = reader.fields["GGUF.version"].contents()
    expect(version == 3, f"GGUF version {version}")

    # --- tokenizer
    vocab_size = config["vocab_size"]
    tok_config_path = os.path.join(model_dir, "tokenizer_config.json")
    tok_config = json.load(open(tok_config_path)) if os.path.exists(tok_config_path) else {}
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    types = field_value(reader, "tokenizer.ggml.token_type")
    expect(tokens is not None and len(tokens) == vocab_size, f"tokenizer.ggml.tokens: {len(tokens or [])} tokens, expected {vocab_size}")
    text_to_id = {}
    if os.path.exists(os.path.join(model_dir, "tokenizer.model")):
        pieces, scores, ptypes = sentencepiece_vocab(os.path.join(model_dir, "tokenizer.model"))
        pad = vocab_size - len(pieces)
        expect(field_value(reader, "tokenizer.ggml.model") == "llama", "tokenizer.ggml.model is not llama")
        expect(tokens == pieces + [f"[PAD{i}]" for i in range(len(pieces), vocab_size)], "sentencepiece pieces differ")
        got_scores = field_value(reader, "tokenizer.ggml.scores")
        expect(got_scores is not None and np.array_equal(np.float32(got_scores), np.float32(scores + [0.0] * pad)),
               "sentencepiece scores differ")
        expect(types == ptypes + [5] * pad, "sentencepiece piece types differ")
        expect(field_value(reader, "tokenizer.ggml.merges") is None, "a sentencepiece vocabulary has merges")
        text_to_id = {p: i for i, p in enumerate(pieces)}
        default_bos, default_eos = config.get("bos_token_id"), config.get("eos_token_id")
    else:
        tj = json.load(open(os.path.join(model_dir, "tokenizer.json")))
        expect(field_value(reader, "tokenizer.ggml.model") == "gpt2", "tokenizer.ggml.model is not gpt2")
        expect(field_value(reader, "tokenizer.ggml.pre") == "llama-bpe", "tokenizer.ggml.pre is not llama-bpe")
        want_tokens = [f"[PAD{i}]" for i in range(vocab_size)]
        want_types = [5] * vocab_size
        for text, i in tj["model"]["vocab"].items():
            want_tokens[i], want_types[i] = text, 1
        for added in tj["added_tokens"]:
            want_tokens[added["id"]] = added["content"]
            want_types[added["id"]] = 3 if added["special"] else 4
        expect(tokens == want_tokens, "byte-level tokens differ: " + str(next(
            ((i, a, b) for i, (a, b) in enumerate(zip(tokens or [], want_tokens)) if a != b), None)))
        expect(types == want_types, "byte-level token types differ")
        merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
        got_merges = field_value(reader, "tokenizer.ggml.merges")
        expect(got_merges == merges, f"merges differ ({len(got_merges or [])} against {len(merges)})")
        # The byte-level alphabet itself, independently: every single byte's token spells that byte.
        alphabet = byte_level_alphabet()
        expect(all(alphabet[b] in tj["model"]["vocab"] for b in range(256)), "tokenizer.json lacks a byte's token")
        text_to_id = {t: i for i, t in enumerate(want_tokens)}
        default_bos = default_eos = None

    def token_of(key, default):
        v = tok_config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            return text_to_id[v]
        if isinstance(default, list):
            default = default[0]
        return default

    bos = token_of("bos_token", default_bos if default_bos is not None else config.get("bos_token_id"))
    eos = token_of("eos_token", default_eos if default_eos is not None else config.get("eos_token_id"))
    expect(field_value(reader, "tokenizer.ggml.bos_token_id") == bos, f"bos: expected {bos}")
    expect(field_value(reader, "tokenizer.ggml.eos_token_id") == eos, f"eos: expected {eos}")
    pad = token_of("pad_token", None)
    expect(field_value(reader, "tokenizer.ggml.padding_token_id") == pad, f"padding: expected {pad}")
    expect(field_value(reader, "tokenizer.ggml.add_bos_token") == tok_config.get("add_bos_token", bos is not None),
           "add_bos_token")
    expect(field_value(reader, "tokenizer.ggml.add_eos_token") == tok_config.get("add_eos_token", False), "add_eos_token")
    template = tok_config.get("chat_template")
    expect(field_value(reader, "tokenizer.chat_template") == template, "chat template differs")

    # --- tensors
    weights = read_safetensors(os.path.join(model_dir, "model.safetensors"))
    tied = config.get("tie_word_embeddings", False)
    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    expected = {}
    for name, w in weights.items():
        if name == "lm_head.weight" and tied:
            continue
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            g = "output.weight"
        else:
            parts = name.split(".")
            g = f"blk.{parts[2]}.{layer_names['.'.join(parts[3:-1])]}.weight"
        if g.endswith("attn_q.weight") or g.endswith("attn_k.weight"):
            heads = n_head if g.endswith("attn_q.weight") else n_kv
            # llama.cpp's LlamaModel.permute: rotate-half pairs to interleaved ones.
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        is_head = g == "output.weight" or (tied and g == "token_embd.weight")
        if w.ndim == 1 or typ == "f32":
            qt = Q.F32
        elif typ == "f16":
            qt = Q.F16
        elif typ == "bf16":
            qt = Q.BF16
        elif w.shape[-1] % 32 != 0:
            qt = Q.F16
        elif typ == "q4_0" and not is_head:
            qt = Q.Q4_0
        else:
            qt = Q.Q8_0
        expected[g] = (np.ascontiguousarray(w, dtype=np.float32), qt)
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        base = config.get("rope_theta", 10000.0)
        freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        factor, low, high = scaling["factor"], scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old = scaling.get("original_max_position_embeddings", 8192)
        factors = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < old / high:
                factors.append(1.0)
            elif wavelen > old / low:
                factors.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        expected["rope_freqs.weight"] = (np.array(factors, dtype=np.float32), None)

    got = {t.name: t for t in reader.tensors}
    expect(sorted(got) == sorted(expected), f"tensor names: {sorted(set(got) ^ set(expected))}")
    checked = 0
    for name, (w, qt) in expected.items():
        t = got.get(name)
        if t is None:
            continue
        expect(list(t.shape) == list(reversed(w.shape)), f"{name}: shape {list(t.shape)}, expected {list(reversed(w.shape))}")
        expect(t.data_offset % 32 == 0, f"{name}: data at {t.data_offset}, not 32-byte aligned")
        if qt is None:  # rope_freqs: llama.cpp computes its factors in float32; tuna from its own float64 tables
            expect(t.tensor_type == Q.F32 and np.allclose(t.data, w, rtol=1e-5, atol=0), f"{name}: {t.data} != {w}")
            checked += 1
            continue
        expect(t.tensor_type == qt, f"{name}: type {t.tensor_type.name}, expected {qt.name}")
        want_bytes = gguf.quants.quantize(w, qt).view(np.uint8).tobytes()
        got_bytes = np.asarray(t.data).view(np.uint8).tobytes()
        if got_bytes != want_bytes:
            a = np.frombuffer(got_bytes, np.uint8)
            b = np.frombuffer(want_bytes, np.uint8)
            first = int(np.argmax(a[:min(len(a), len(b))] != b[:min(len(a), len(b))])) if len(a) == len(b) else -1
            expect(False, f"{name} ({qt.name}): bytes differ from gguf.quants.quantize (first at byte {first} of {len(b)})")
        checked += 1

    n_keys = len([k for k in reader.fields if not k.startswith("GGUF.")])
    if problems:
        print(PREFIX, "FAIL", f"{len(problems)} mismatch(es) in {path}")
        return 1
    print(PREFIX, "OK", f"{path}: {n_keys} keys, {checked} tensors ({typ}) equal to the expectations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
