#!/usr/bin/env python3
"""Run a GGUF export of tuna in llama.cpp (llama-cpp-python) and compare it with tuna itself.

Usage:
  check_llama_cpp.py generate GGUF CKPT_DIR --prompt TEXT [--tokens 32] [--build build]
      tuna: build/sample --greedy on CKPT_DIR (ids and each step's logits); llama.cpp: the same prompt,
      tokenized by llama.cpp from the GGUF's own tokenizer, then
        - prompt ids: llama.cpp's against tuna's;
        - greedy: llama.cpp's own 32 greedy tokens against tuna's;
        - logits: llama.cpp's logits at every position tuna drew a token from (fed tuna's sequence), against
          tuna's: max |difference|, and that over the largest |logit| of the step.
  check_llama_cpp.py pipelines [--build build] [--tokens 32]
      every tokenizer.json pipeline of tests/fixtures/tokenizers/pipelines.json.zst (and Llama 3's): a tiny model
      with random weights and that tokenizer, exported by build/convert tuna-to-gguf at f16. Where tuna refuses
      the export, the refusal is printed (it must name the pipeline); where it exports, llama.cpp's ids for every
      text, probe and random slice of the fixture must equal the ids of Hugging Face tokenizers stored there, and
      the `generate` check runs on a prompt of real text (llama.cpp's greedy tokens against tuna's, which equal
      transformers' by the logits fixtures).
  check_llama_cpp.py tokenize GGUF FORMAT
      the Debian copyright texts of tests/fixtures/tokenizers/reference.json.zst (ids that tuna's tokenizer
      tests hold tuna's own ids equal to): llama.cpp's ids for each text against them. FORMAT: llama3 (the
      Llama 3.2 tokenizer's ids) or spm (the fixture sentencepiece model's).
Prints one JSON line of figures per check; exit status 1 on a mismatch of ids.
Needs llama-cpp-python (pip install llama-cpp-python: it builds llama.cpp from source) and numpy; not CI.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from llama_cpp import Llama


def load(gguf, n_ctx=512, n_ubatch=512):
    # n_ubatch 1 evaluates a token at a time: llama.cpp 0.3.36's CPU backend (built for this machine's AVX-512 /
    # AMX) crashes on batched q8_0 and q4_0 products of these tiny models, with llama.cpp's own quantization too.
    return Llama(model_path=gguf, n_ctx=n_ctx, logits_all=True, n_threads=2, n_batch=512, n_ubatch=n_ubatch,
                 verbose=False, seed=0)


def generate(args):
    with tempfile.TemporaryDirectory() as tmp:
        logits_path = os.path.join(tmp, "logits.f32")
        cmd = [os.path.join(args.build, "sample"), "--checkpoint", args.ckpt, "--prompt", args.prompt, "--greedy",
               "--max_tokens", str(args.tokens), "--stop_at_eos", "false", "--print_ids", "--logits_out", logits_path,
               "--device", "cpu", "--threads", "2"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"build/sample failed: {run.stderr}")
        line = [l for l in run.stderr.splitlines() if l.startswith("ids:")][-1]
        prompt_part, gen_part = line[4:].split("|")
        tuna_prompt = [int(t) for t in prompt_part.split()]
        tuna_gen = [int(t) for t in gen_part.split()]
        tuna_logits = np.fromfile(logits_path, dtype=np.float32)
    llm = load(args.gguf, n_ctx=len(tuna_prompt) + args.tokens + 8, n_ubatch=args.n_ubatch)
    vocab = llm.n_vocab()
    tuna_logits = tuna_logits.reshape(-1, vocab)
    ok = True
    cpp_prompt = llm.tokenize(args.prompt.encode("utf-8"), add_bos=True, special=True)
    prompt_equal = cpp_prompt == tuna_prompt
    ok &= prompt_equal

    # llama.cpp's own greedy continuation of its own prompt ids.
    llm.reset()
    llm.eval(cpp_prompt)
    cpp_gen = []
    for _ in range(args.tokens):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        cpp_gen.append(nxt)
        llm.eval([nxt])
    greedy_equal = cpp_gen == tuna_gen
    first_diff = next((i for i, (a, b) in enumerate(zip(cpp_gen, tuna_gen)) if a != b), None)
    ok &= greedy_equal

    # Logits on tuna's own sequence, at each position tuna drew from.
    llm.reset()
    seq = tuna_prompt + tuna_gen
    llm.eval(seq[:-1])
    rows = np.array([llm.scores[len(tuna_prompt) - 1 + i] for i in range(len(tuna_gen))], dtype=np.float32)
    diff = np.abs(rows - tuna_logits[:len(tuna_gen)])
    scale = np.abs(tuna_logits[:len(tuna_gen)]).max(axis=1)
    print(json.dumps({
        "check": "generate", "gguf": args.gguf, "checkpoint": args.ckpt, "prompt": args.prompt,
        "prompt_ids_equal": prompt_equal, "prompt_tokens": len(tuna_prompt),
        "greedy_tokens": len(tuna_gen), "greedy_equal": greedy_equal, "first_difference_at": first_diff,
        "logits_max_abs_diff": float(diff.max()), "logits_max_rel_diff": float((diff.max(axis=1) / scale).max()),
        "logits_max_abs": float(scale.max()),
    }))
    if not prompt_equal:
        print("prompt ids differ: llama.cpp", cpp_prompt, "tuna", tuna_prompt, file=sys.stderr)
    if not greedy_equal:
        print("greedy tokens differ: llama.cpp", cpp_gen, "tuna", tuna_gen, file=sys.stderr)
    return 0 if ok else 1


def tokenize(args):
    here = os.path.dirname(os.path.abspath(__file__))
    ref_path = os.path.join(here, "..", "..", "tests", "fixtures", "tokenizers", "reference.json.zst")
    raw = subprocess.run(["zstd", "-dc", "--long=27", ref_path], capture_output=True, check=True).stdout
    ref = json.loads(raw)
    key = {"llama3": "llama3_text", "spm": "spm"}[args.format]
    llm = Llama(model_path=args.gguf, vocab_only=True, verbose=False)
    texts = ref["texts"]
    equal = 0
    tokens = 0
    chars = 0
    mismatches = []
    for i, t in enumerate(texts):
        want = ref["ids"][key][i]
        got = llm.tokenize(t["text"].encode("utf-8"), add_bos=False, special=False)
        tokens += len(want)
        chars += len(t["text"].encode("utf-8"))
        if got == want:
            equal += 1
        else:
            first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            mismatches.append({"source": t["source"], "first_difference_at": first, "llama_cpp": got[first:first + 5],
                               "tuna": want[first:first + 5]})
    print(json.dumps({"check": "tokenize", "gguf": args.gguf, "format": args.format, "texts": len(texts),
                      "bytes": chars, "tokens": tokens, "texts_equal": equal, "mismatches": mismatches[:5]}))
    return 0 if equal == len(texts) else 1


FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures")


def unzstd(path):
    return subprocess.run(["zstd", "-dc", "--long=27", path], capture_output=True, check=True).stdout


def write_tiny_model(hf_dir, name):
    """A Hugging Face directory: llama32_tiny's config with the tokenizer's vocabulary size, random float32 weights
    (fixed seed) written as safetensors by hand (no torch here), and the fixture's tokenizer files."""
    tok_dir = os.path.join(FIXTURES, "tokenizers", name)
    os.makedirs(hf_dir, exist_ok=True)
    for f in os.listdir(tok_dir):
        if f.endswith(".zst"):
            with open(os.path.join(hf_dir, f[:-4]), "wb") as out:
                out.write(unzstd(os.path.join(tok_dir, f)))
    tok = json.load(open(os.path.join(hf_dir, "tokenizer.json"), encoding="utf-8"))
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok.get("added_tokens", [])]
    vocab = max(ids) + 1
    config = json.load(open(os.path.join(FIXTURES, "llama32_tiny", "config.json")))
    config.update(vocab_size=vocab, rope_scaling=None, max_position_embeddings=4096, num_hidden_layers=2)
    json.dump(config, open(os.path.join(hf_dir, "config.json"), "w"), indent=2)
    c, f, kv = config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"] * config["head_dim"]
    q = config["num_attention_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, c), "model.norm.weight": (c,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (c,), p + "post_attention_layernorm.weight": (c,),
                       p + "self_attn.q_proj.weight": (q, c), p + "self_attn.k_proj.weight": (kv, c),
                       p + "self_attn.v_proj.weight": (kv, c), p + "self_attn.o_proj.weight": (c, q),
                       p + "mlp.gate_proj.weight": (f, c), p + "mlp.up_proj.weight": (f, c),
                       p + "mlp.down_proj.weight": (c, f)})
    rng = np.random.default_rng(7)
    header, blobs, offset = {}, [], 0
    for key, shape in shapes.items():
        a = (np.ones(shape) if key.endswith("norm.weight") else rng.normal(0, 0.2, shape)).astype(np.float32)
        blobs.append(a.tobytes())
        header[key] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + len(blobs[-1])]}
        offset += len(blobs[-1])
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(hf_dir, "model.safetensors"), "wb") as out:
        out.write(len(h).to_bytes(8, "little") + h)
        for b in blobs:
            out.write(b)


def pipelines(args):
    ref = json.loads(unzstd(os.path.join(FIXTURES, "tokenizers", "reference.json.zst")))
    pipe = json.loads(unzstd(os.path.join(FIXTURES, "tokenizers", "pipelines.json.zst")))
    groups = [("text", t["text"]) for t in ref["texts"]] + [("probe", p) for p in ref["probes"]] + \
             [("slice", s["text"]) for s in pipe["slices"]]
    prompt = ref["texts"][0]["text"][:200]
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in pipe["ids"]:
            hf = os.path.join(tmp, name)
            write_tiny_model(hf, name)
            gguf = os.path.join(tmp, name + ".gguf")
            run = subprocess.run([os.path.join(args.build, "convert"), "tuna-to-gguf", hf, gguf, "--type", "f16"],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                print(json.dumps({"check": "pipeline", "tokenizer": name, "exported": False,
                                  "refusal": run.stderr.strip().splitlines()[-1]}))
                continue
            pre = next((l for l in run.stdout.splitlines() + run.stderr.splitlines() if "GGUF '" in l), "")
            llm = Llama(model_path=gguf, vocab_only=True, verbose=False)
            equal = {"text": 0, "probe": 0, "slice": 0}
            total = dict.fromkeys(equal, 0)
            mismatches = []
            for (group, text), want in zip(groups, pipe["ids"][name]):
                got = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
                total[group] += 1
                if got == want:
                    equal[group] += 1
                elif len(mismatches) < 3:
                    first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                    mismatches.append({"group": group, "text": text[max(0, first - 20):first + 20],
                                       "first_difference_at": first, "llama_cpp": got[first:first + 5],
                                       "library": want[first:first + 5]})
            del llm
            ok = equal == total
            print(json.dumps({"check": "pipeline", "tokenizer": name, "exported": True, "convert": pre.strip(),
                              "equal": equal, "of": total, "mismatches": mismatches}))
            ckpt = os.path.join(tmp, name + "-tuna")
            subprocess.run([os.path.join(args.build, "convert"), "hf-to-tuna", hf, ckpt], check=True,
                           capture_output=True)
            g = argparse.Namespace(gguf=gguf, ckpt=ckpt, prompt=prompt, tokens=args.tokens, build=args.build,
                                   n_ubatch=512)
            ok &= generate(g) == 0
            failed += not ok
            sys.stdout.flush()
    return 1 if failed else 0


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="what", required=True)
    g = sub.add_parser("generate")
    g.add_argument("gguf")
    g.add_argument("ckpt")
    g.add_argument("--prompt", required=True)
    g.add_argument("--tokens", type=int, default=32)
    g.add_argument("--build", default="build")
    g.add_argument("--n_ubatch", type=int, default=512, help="llama.cpp's micro-batch (1: a token at a time)")
    t = sub.add_parser("tokenize")
    t.add_argument("gguf")
    t.add_argument("format", choices=["llama3", "spm"])
    a = sub.add_parser("pipelines")
    a.add_argument("--build", default="build")
    a.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    return {"generate": generate, "tokenize": tokenize, "pipelines": pipelines}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
