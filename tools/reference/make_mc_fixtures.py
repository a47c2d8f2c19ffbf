#!/usr/bin/env python3
"""Make tests/fixtures/mc_eval/: multiple-choice tasks scored by lm-evaluation-harness itself on a tiny LLaMA.

What it writes (tools/reference/README.md, "Multiple-choice evaluation fixtures", documents each file):
  tokenizer.json, tokenizer_config.json  a byte-level BPE of 512 pieces trained here on the Debian copyright files,
                                         with Llama 3's pre-tokenizer, decoder, post-processor and special tokens
  config.json, model.safetensors         a tiny random LlamaForCausalLM over that vocabulary (float32)
  tasks/{two,four,ten,fill}.jsonl        tuna's task records (2, 4, 10 and 2 choices; fill has a context per
                                         choice, as Winogrande), made from the Debian copyright files
  reference.json                         what lm-eval made of them: every request's token ids, log-likelihood and
                                         is_greedy, and acc / acc_norm with their standard errors per task and for
                                         the group of the four

lm-eval runs on the records themselves: tools/reference/mc_tasks/ holds a task YAML per file over the local JSONL
(and the group), model `hf` in float64 on the CPU, once with batch size 1 and once with 7; the script asserts that
the requests lm-eval built equal the records, that both batch sizes give the same metrics, and the properties the
tasks are meant to have (a context ending in whitespace, non-ASCII text, a tie, ...). Deterministic: sorted inputs,
fixed seeds, one thread.

Usage (from anywhere; it runs lm-eval from the repository root, where the YAMLs' data paths start):
  python3 tools/reference/make_mc_fixtures.py [--doc-root /usr/share/doc]
"""

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
import unicodedata

import numpy
import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import debian_copyright as deb  # noqa: E402
from make_fixtures import init_weights, make_float64_exact, rope_inv_freq_float64  # noqa: E402

OUT = os.path.join(ROOT, "tests", "fixtures", "mc_eval")
TASK_DIR = os.path.join(HERE, "mc_tasks")
GROUP = "mc_fixture"
TASKS = ["two", "four", "ten", "fill"]            # file names; lm-eval's task names are mc_<name>
SEED = 35

# Llama 3's pre-tokenizer regex (tests/fixtures/tokenizers/llama3/tokenizer.json).
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
VOCAB = 512                                       # 256 bytes + 254 merges + BOS + EOS

MODEL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=500000.0,
             rope_scaling=None, tie_word_embeddings=True, max_position_embeddings=2048, attention_bias=False,
             mlp_bias=False, attention_dropout=0.0, pretraining_tp=1, initializer_range=0.02,
             bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1, use_cache=True)


# ---------------------------------------------------------------------------------------------------
# Tokenizer

def train_tokenizer(files):
    texts = []
    for _, path in files:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tok.train_from_iterator(texts, trainer)
    assert tok.get_vocab_size() == VOCAB - 2, tok.get_vocab_size()
    # The special tokens after the pieces, as Llama 3 has them (128000, 128001).
    tok.add_special_tokens([AddedToken(BOS, special=True, normalized=False),
                            AddedToken(EOS, special=True, normalized=False)])
    assert tok.token_to_id(BOS) == VOCAB - 2 and tok.token_to_id(EOS) == VOCAB - 1
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1",
                                      special_tokens=[(BOS, VOCAB - 2)])])
    return tok


def save_tokenizer(tok, out):
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   clean_up_tokenization_spaces=True, model_max_length=MODEL["max_position_embeddings"])
    fast.save_pretrained(out)
    # Only tokenizer.json and tokenizer_config.json: special_tokens_map.json repeats what the config names.
    os.remove(os.path.join(out, "special_tokens_map.json"))
    with open(os.path.join(out, "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    assert cfg.get("tokenizer_class") == "PreTrainedTokenizerFast", cfg  # not LlamaTokenizerFast, which rewrites
    # the post-processor from its own add_bos_token / add_eos_token


# ---------------------------------------------------------------------------------------------------
# Model

def make_model(out):
    torch.manual_seed(SEED)
    cfg = LlamaConfig(**MODEL)
    model = LlamaForCausalLM(cfg).float()
    init_weights(model, SEED + 1)
    model.save_pretrained(out, safe_serialization=True)
    gen_cfg = os.path.join(out, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)


def load_exact64(out):
    """The saved float32 weights cast up, with RMSNorm and RoPE in float64 (make_fixtures.py's patches)."""
    model = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float64, attn_implementation="sdpa").eval()
    inv_freq, _ = rope_inv_freq_float64(model.config)
    make_float64_exact(model, inv_freq)
    return model


def encode_pair(tok, context, continuation):
    """lm-eval 0.4's HFLM request encoding (TemplateLM._encode_pair with add_bos_token unset): trailing whitespace
    of the context moves to the continuation; the continuation's ids are those of context + continuation encoded
    whole, after as many as the context encodes to; the tokenizer's post-processor adds the BOS to both, unless the
    text starts with the BOS's text."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation

    def encode(text):  # HFLM.tok_encode: no BOS of its own before a text that starts with the BOS's text
        return tok(text, add_special_tokens=not text.startswith(tok.decode([tok.bos_token_id])))["input_ids"]

    whole = encode(context + continuation)
    ctx = encode(context)
    return ctx, whole[len(ctx):]


def loglikelihood(model, ctx, cont):
    ids = torch.tensor([(ctx + cont)[:-1]])
    with torch.no_grad():
        logp = F.log_softmax(model(ids).logits[0, -len(cont):], dim=-1)
    target = torch.tensor(cont)
    return float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


# ---------------------------------------------------------------------------------------------------
# Tasks

def truncate_sentences(text, max_chars):
    """The longest prefix of whole sentences (paragraph breaks kept) of at most max_chars; at least one sentence."""
    out, used = [], 0
    for pi, para in enumerate(text.split("\n\n")):
        for si, s in enumerate(deb.SENTENCE_END.split(para)):
            sep = "" if not out else (" " if si else "\n\n")
            if out and used + len(sep) + len(s) > max_chars:
                return "".join(out)
            out.append(sep + s)
            used += len(sep) + len(s)
    return "".join(out)


def non_ascii(s):
    return any(ord(c) > 127 for c in (s if isinstance(s, str) else "".join(s)))


def make_four(rng, texts):
    """Which licence is this text from? Four licence families; the text with its name removed, cut on a sentence
    boundary to a length drawn from 80 to 1100 characters."""
    by_family = {}
    for _, _, family, text in texts:
        t = deb.clean_licence(text)
        if family and len(t) >= 60:
            by_family.setdefault(family, set()).add(t)
    families = sorted(by_family, key=lambda f: (-len(by_family[f]), f))[:8]
    pools = {f: sorted(by_family[f]) for f in families}
    records = []
    for i in range(32):
        family = families[i % len(families)]
        text = truncate_sentences(rng.choice(pools[family]), rng.randint(80, 1100))
        choices = [family] + rng.sample([f for f in families if f != family], 3)
        rng.shuffle(choices)
        # Every seventh record ends its context in a space (a prompt template's "Answer: "): lm-eval moves it into
        # the continuation.
        tail = "Answer: " if i % 7 == 3 else "Answer:"
        # One context starts with the BOS text, as a chat template's output does (lm-eval --apply_chat_template):
        # lm-eval then adds no BOS of its own, and the text's BOS is parsed as the special token.
        head = BOS if i == 5 else ""
        records.append({"task": "mc_four", "id": f"four-{i:03d}",
                        "context": f"{head}{text}\n\nQuestion: Which licence is this text from?\n{tail}",
                        "choices": [" " + c for c in choices], "gold": choices.index(family)})
    return records


def make_ten(rng, lines, model, tok):
    """Which package's copyright file lists these holders? One to six consecutive holder lines of one package; ten
    packages to choose from. The last record is the tie: the right package appears twice among the choices, and it
    is the model's favourite, so the two equal log-likelihoods are the largest (lm-eval's argmax takes the first)."""
    by_package = {}
    for package, line in lines:
        by_package.setdefault(package, []).append(line)
    packages = sorted(by_package)
    with_non_ascii = [p for p in packages if any(non_ascii(l) for l in by_package[p])]
    records = []

    def record(i, package, take_non_ascii):
        own = by_package[package]
        if take_non_ascii:
            start = next(k for k, l in enumerate(own) if non_ascii(l))
        else:
            start = rng.randrange(len(own))
        held = own[start:start + rng.randint(1, 6)]
        others = rng.sample([p for p in packages if p != package and not set(held) & set(by_package[p])], 9)
        choices = [package] + others
        rng.shuffle(choices)
        # Every fifth record ends in a newline after "Package:" (a template's line break before the answer).
        tail = "Package:\n" if i % 5 == 2 else "Package:"
        context = "Copyright holders:\n" + "\n".join(held) + "\n\nWhich Debian package's copyright file lists them?\n" + tail
        return {"task": "mc_ten", "id": f"ten-{i:03d}", "context": context, "choices": [" " + c for c in choices],
                "gold": choices.index(package)}

    for i in range(23):
        take = i % 6 == 0
        package = rng.choice(with_non_ascii if take else packages)
        records.append(record(i, package, take))
    # The tie: the first candidate (in a seeded order) whose right answer the model ranks first.
    for attempt in range(400):
        r = record(23, rng.choice(packages), False)
        lls = [loglikelihood(model, *encode_pair(tok, r["context"], c))[0] for c in r["choices"]]
        if int(numpy.argmax(lls)) == r["gold"]:
            # Each choice is scored alone, so dropping one and repeating the right one changes no other score.
            choices = r["choices"]
            right = choices[r["gold"]]
            choices.remove(rng.choice([c for c in choices if c != right]))
            first = choices.index(right)
            choices.insert(rng.randint(first + 1, len(choices)), right)
            r["gold"] = first
            assert choices.count(right) == 2 and len(choices) == 10, r
            r["tie"] = True
            records.append(r)
            break
    else:
        raise AssertionError("no tie candidate found")
    return records


def make_two(rng, lines):
    """True or false: does this package's copyright file list this holder? Half true (a line of the package), half
    false (a line of another package, not also in this one's). The choices carry their own leading space and the
    task's delimiter is empty (lm-eval's target_delimiter ""), so acc_norm counts the space."""
    by_package = {}
    for package, line in lines:
        by_package.setdefault(package, set()).add(line)
    packages = sorted(by_package)
    pairs = sorted(lines)
    records = []
    truth = [True] * 15 + [False] * 15
    rng.shuffle(truth)
    for i, is_true in enumerate(truth):
        package, line = rng.choice(pairs)
        if not is_true:
            package = rng.choice([p for p in packages if line not in by_package[p]])
        context = (f"Statement: the copyright file of the Debian package {package} lists \"{line}\" as a copyright "
                   f"holder.\nTrue or false?\nAnswer:")
        records.append({"task": "mc_two", "id": f"two-{i:03d}", "context": context,
                        "choices": [" True", " False"], "gold": 0 if is_true else 1, "delimiter": ""})
    return records


def make_fill(rng, texts):
    """Winogrande's form: a licence sentence with one word left blank; each choice fills it into the context, and
    the rest of the sentence is the continuation, the same for both (lm-eval's partial evaluation)."""
    sentences = set()
    for _, _, _, text in texts:
        for para in deb.clean_licence(text).split("\n\n"):
            for s in deb.SENTENCE_END.split(para):
                if 60 <= len(s) <= 220 and len(s.split()) >= 10:
                    sentences.add(s)
    sentences = sorted(sentences)
    words = sorted({w for s in sentences for w in s.split() if w.isalpha() and len(w) >= 4})
    records = []
    while len(records) < 20:
        words_s = rng.choice(sentences).split()
        spots = [k for k in range(3, len(words_s) - 3) if words_s[k].isalpha() and len(words_s[k]) >= 4]
        if not spots:
            continue
        k = rng.choice(spots)
        right = words_s[k]
        wrong = rng.choice([w for w in words if w != right and abs(len(w) - len(right)) <= 2
                            and w[0].isupper() == right[0].isupper()])
        prefix = " ".join(words_s[:k]) + " "
        rest = " ".join(words_s[k + 1:])
        options = [right, wrong]
        rng.shuffle(options)
        records.append({"task": "mc_fill", "id": f"fill-{len(records):03d}",
                        "context": [prefix + o for o in options], "choices": [" " + rest] * 2,
                        "gold": options.index(right)})
    return records


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({k: v for k, v in r.items() if k != "tie"}, ensure_ascii=False) + "\n")


def requests_of(record):
    """(context, continuation) of each choice: tuna's reading of a record."""
    n = len(record["choices"])
    contexts = record["context"] if isinstance(record["context"], list) else [record["context"]] * n
    return [(contexts[j], record["choices"][j]) for j in range(n)]


def norm_length(record, j):
    """lm-eval's acc_norm length: len() of doc_to_choice's entry (the choice without the delimiter, or the context
    when there is one per choice)."""
    if isinstance(record["context"], list):
        return len(record["context"][j])
    return len(record["choices"][j]) - len(record.get("delimiter", " "))


# ---------------------------------------------------------------------------------------------------
# lm-eval

def run_lm_eval(batch_size, captured, task_dir=TASK_DIR, tasks=(GROUP,), num_fewshot=None, limit=None):
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    original = HFLM._loglikelihood_tokens

    def capture(self, requests, *args, **kwargs):
        results = original(self, requests, *args, **kwargs)
        assert len(results) == len(requests)
        for (pair, ctx, cont), res in zip(requests, results):
            captured.setdefault(pair, []).append((list(ctx), list(cont), float(res[0]), bool(res[1])))
        return results

    HFLM._loglikelihood_tokens = capture
    try:
        cwd = os.getcwd()
        os.chdir(ROOT)                   # the YAMLs' data_files are relative to the repository root
        try:
            out = lm_eval.simple_evaluate(
                model="hf", model_args=f"pretrained={os.path.relpath(OUT, ROOT)},dtype=float64",
                tasks=list(tasks), task_manager=TaskManager(include_path=task_dir), batch_size=batch_size,
                device="cpu", log_samples=True, num_fewshot=num_fewshot, limit=limit)
        finally:
            os.chdir(cwd)
    finally:
        HFLM._loglikelihood_tokens = original
    return out


def sample_arguments(sample):
    args = sample["arguments"]
    if isinstance(args, dict):             # {"gen_args_0": {"arg_0": ctx, "arg_1": cont}, ...}
        return [(a["arg_0"], a["arg_1"]) for a in args.values()]
    return [tuple(a) for a in args]


def check_lm_eval_tasks(tasks):
    """lm_eval_tasks.py on the fixture YAMLs: at 0 shots its records equal the task files (but the id, which it takes
    from lm-eval's doc_id); at 2 shots (the YAMLs without their num_fewshot: 0) its contexts equal the requests an
    evaluation run with --num_fewshot 2 hands the model."""
    import lm_eval_tasks
    import tempfile
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        built = lm_eval_tasks.build([f"mc_{t}" for t in TASKS], include_path=TASK_DIR)
        for name in TASKS:
            ours = [{k: v for k, v in r.items() if k not in ("id", "tie")} for r in tasks[name]]
            theirs = [{k: v for k, v in r.items() if k != "id"} for r in built[f"mc_{name}"]]
            assert ours == theirs, name
            assert [r["id"] for r in built[f"mc_{name}"]] == list(range(len(ours)))
        with tempfile.TemporaryDirectory() as tmp:
            for f in sorted(os.listdir(TASK_DIR)):
                if f.endswith(".yaml") or f.endswith(".py"):
                    with open(os.path.join(TASK_DIR, f), encoding="utf-8") as src:
                        text = src.read()
                    with open(os.path.join(tmp, f), "w", encoding="utf-8") as dst:
                        dst.write(text.replace("num_fewshot: 0\n", ""))
            names = [f"mc_{t}" for t in TASKS]
            shots = lm_eval_tasks.build(names, include_path=tmp, num_fewshot=2, limit=6)
            out = run_lm_eval(1, {}, task_dir=tmp, tasks=names, num_fewshot=2, limit=6)
            compared = 0
            for name in names:
                samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
                assert len(samples) == len(shots[name]) == 6
                for s, r in zip(samples, shots[name]):
                    assert sample_arguments(s) == requests_of(r), (name, s["doc_id"])
                    compared += 1
                    zero = requests_of(tasks[name[3:]][s["doc_id"]])
                    assert all(a[0] != b[0] and a[0].endswith(b[0]) and a[1] == b[1]
                               for a, b in zip(requests_of(r), zero)), (name, s["doc_id"])
    finally:
        os.chdir(cwd)
    return {"zero_shot_records_equal_task_files": True, "two_shot_records_equal_evaluation_requests": compared}


def lm_eval_add_bos_note():
    from lm_eval.models import huggingface
    import inspect
    src = inspect.getsource(huggingface.HFLM.tok_encode)
    assert "self.add_bos_token" in src and "_add_special_kwargs" in src, "tok_encode changed: re-check the BOS note"
    return ("HFLM.tok_encode calls tokenizer.encode(text) with add_special_tokens left to the tokenizer when "
            "add_bos_token is unset (the default, None): the tokenizer's post-processor decides. This tokenizer's "
            "(Llama 3's TemplateProcessing) puts the BOS first, so every context and every context+continuation "
            "starts with it: context_ids[0] == bos_token_id in every request below. A text that already starts with "
            "the BOS's text (has_bos_prefix: a chat template's output) is encoded with add_special_tokens=False, so "
            "it gets no second BOS; special tokens written in a text are parsed as such (mc_four's four-005).")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--doc-root", default=deb.DOC_ROOT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    files = deb.copyright_files(args.doc_root)
    assert len(files) >= 100, f"only {len(files)} DEP-5 copyright files under {args.doc_root}"
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(os.path.join(OUT, "tasks"))

    tok = train_tokenizer(files)
    again = train_tokenizer(files)
    assert tok.to_str() == again.to_str(), "tokenizer training is not deterministic"
    save_tokenizer(tok, OUT)
    make_model(OUT)
    hf_tok = transformers.AutoTokenizer.from_pretrained(OUT)
    assert type(hf_tok).__name__ == "PreTrainedTokenizerFast", type(hf_tok)
    assert hf_tok("a b")["input_ids"][0] == MODEL["bos_token_id"]
    model64 = load_exact64(OUT)

    rng = random.Random(SEED)
    texts = deb.licence_texts(files)
    lines = deb.copyright_lines(files)
    tasks = {"two": make_two(rng, lines), "four": make_four(rng, texts), "ten": make_ten(rng, lines, model64, hf_tok),
             "fill": make_fill(rng, texts)}
    for name, records in tasks.items():
        write_jsonl(os.path.join(OUT, "tasks", f"{name}.jsonl"), records)

    # What the tasks are meant to hold.
    all_records = [r for rs in tasks.values() for r in rs]
    assert any(not isinstance(r["context"], list) and r["context"] != r["context"].rstrip() for r in tasks["four"])
    assert any(r["context"].endswith("\n") for r in tasks["ten"])
    assert sum(non_ascii(r["context"]) for r in tasks["ten"]) >= 3
    assert [len(r["choices"]) for r in tasks["ten"]] == [10] * len(tasks["ten"])
    for r in all_records:
        assert 0 <= r["gold"] < len(r["choices"]) and all(requests_of(r))

    # lm-eval, twice.
    captured1, captured7 = {}, {}
    out1 = run_lm_eval(1, captured1)
    out7 = run_lm_eval(7, captured7)
    res1, res7 = out1["results"], out7["results"]
    metric_keys = ["acc,none", "acc_stderr,none", "acc_norm,none", "acc_norm_stderr,none"]
    for name in [f"mc_{t}" for t in TASKS] + [GROUP]:
        for k in metric_keys:
            assert res1[name][k] == res7[name][k], (name, k, res1[name][k], res7[name][k])
    batch_diff = 0.0
    for pair, got in captured1.items():
        a, b = got[0], captured7[pair][0]
        assert a[0] == b[0] and a[1] == b[1] and a[3] == b[3], pair
        batch_diff = max(batch_diff, abs(a[2] - b[2]) / abs(a[2]))

    # Per record: lm-eval's requests must be ours; their ids, log-likelihoods and greedy flags.
    stock64 = LlamaForCausalLM.from_pretrained(OUT, torch_dtype=torch.float64, attn_implementation="sdpa").eval()
    worst_stock, worst_exact, worst_ours_ids = 0.0, 0.0, 0
    reference_tasks = {}
    bos_always = True
    moved = 0
    for name in TASKS:
        task = f"mc_{name}"
        samples = sorted(out1["samples"][task], key=lambda s: s["doc_id"])
        records = tasks[name]
        assert len(samples) == len(records)
        out_records = []
        for s, r in zip(samples, records):
            reqs = requests_of(r)
            assert sample_arguments(s) == reqs, (task, s["doc_id"], sample_arguments(s), reqs)
            choices = []
            lls = []
            for j, pair in enumerate(reqs):
                ctx, cont, ll, greedy = captured1[pair][0]
                assert all(c == captured1[pair][0] for c in captured1[pair])
                assert (ctx, cont) == encode_pair(hf_tok, *pair), pair      # our reading of _encode_pair
                bos_always &= ctx[0] == MODEL["bos_token_id"]
                moved += pair[0] != pair[0].rstrip()
                ll_stock, greedy_stock = loglikelihood(stock64, ctx, cont)
                ll_exact, greedy_exact = loglikelihood(model64, ctx, cont)
                worst_stock = max(worst_stock, abs(ll_stock - ll) / abs(ll))
                worst_exact = max(worst_exact, abs(ll_exact - ll) / abs(ll))
                assert greedy_stock == greedy
                resp = s["resps"][j][0]
                assert float(resp[0]) == ll and bool(resp[1]) == greedy, (resp, ll, greedy)
                lls.append(ll)
                choices.append({"context_ids": ctx, "continuation_ids": cont, "loglikelihood": ll,
                                "is_greedy": greedy, "norm_length": norm_length(r, j)})
            pred = int(numpy.argmax(lls))
            pred_norm = int(numpy.argmax(numpy.array(lls) / numpy.array([c["norm_length"] for c in choices])))
            assert float(pred == r["gold"]) == s["acc"] and float(pred_norm == r["gold"]) == s["acc_norm"], s["doc_id"]
            out_records.append({"line": s["doc_id"] + 1, "id": r["id"], "gold": r["gold"], "acc": s["acc"],
                                "acc_norm": s["acc_norm"], "choices": choices})
        reference_tasks[task] = {
            "file": f"tasks/{name}.jsonl", "n": out1["n-samples"][task]["effective"],
            **{k.split(",")[0]: res1[task][k] for k in metric_keys},
            "records": out_records}
    assert bos_always
    # The context that starts with the BOS text has one BOS, not two.
    bos_text = [r for r in reference_tasks["mc_four"]["records"] if tasks["four"][r["line"] - 1]["context"].startswith(BOS)]
    assert len(bos_text) == 1 and all(c["context_ids"][1] != MODEL["bos_token_id"] for c in bos_text[0]["choices"])
    assert moved > 0
    # A tie: lm-eval scored the two identical requests identically, and took the first.
    tie = [r for r in tasks["ten"] if r.get("tie")][0]
    tie_ref = reference_tasks["mc_ten"]["records"][tasks["ten"].index(tie)]
    tie_lls = [c["loglikelihood"] for c in tie_ref["choices"]]
    assert tie_lls.count(max(tie_lls)) == 2 and tie_ref["acc"] == 1.0, tie_lls
    # acc_norm must differ from acc somewhere, else the length normalization is not tested.
    assert any(r["acc"] != r["acc_norm"] for t in reference_tasks.values() for r in t["records"])
    # and leaving the delimiter in the length would change some record's acc_norm
    delim_matters = 0
    for name in TASKS:
        for r, ref in zip(tasks[name], reference_tasks[f"mc_{name}"]["records"]):
            lls = numpy.array([c["loglikelihood"] for c in ref["choices"]])
            with_delim = numpy.array([len(c) if not isinstance(r["context"], list) else len(r["context"][j])
                                      for j, c in enumerate(r["choices"])])
            delim_matters += float(int(numpy.argmax(lls / with_delim)) == r["gold"]) != ref["acc_norm"]

    lm_eval_tasks_checks = check_lm_eval_tasks(tasks)

    group = res1[GROUP]
    reference = {
        "format": "tuna-mc-reference",
        "versions": {"lm_eval": __import__("lm_eval").__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__, "tokenizers": tokenizers.__version__, "numpy": numpy.__version__},
        "lm_eval_run": ("lm_eval.simple_evaluate(model='hf', model_args='pretrained=tests/fixtures/mc_eval,"
                        "dtype=float64', tasks=['mc_fixture'], task_manager=TaskManager(include_path="
                        "'tools/reference/mc_tasks'), batch_size=1, device='cpu', log_samples=True), from the "
                        "repository root; the same as `lm_eval --model hf --model_args pretrained=tests/fixtures/"
                        "mc_eval,dtype=float64 --include_path tools/reference/mc_tasks --tasks mc_fixture "
                        "--batch_size 1 --device cpu --log_samples`"),
        "bos_token_id": MODEL["bos_token_id"], "eos_token_id": MODEL["eos_token_id"],
        "add_bos": True,
        "add_bos_note": lm_eval_add_bos_note(),
        "encoding_note": ("TemplateLM._encode_pair: whitespace at the end of the context (str.rstrip) moves to the "
                          "front of the continuation; then context_ids = encode(context) and continuation_ids = "
                          "encode(context + continuation)[len(context_ids):] (one encoding of the whole, split at "
                          "the context's length; not the continuation encoded alone). The model reads "
                          "(context_ids + continuation_ids)[:-1] and the log-likelihood is the sum of the "
                          "log-softmax at the continuation's tokens; is_greedy: every continuation token is the "
                          "argmax (first index on ties) of its row."),
        "metrics_note": ("acc: argmax of the log-likelihoods (numpy.argmax: the first index on ties) == gold. "
                         "acc_norm: argmax of loglikelihood / norm_length, norm_length = len() in code points of "
                         "lm-eval's doc_to_choice entry: the choice without the task's target delimiter (the "
                         "record's \"delimiter\", default \" \"), or with a context per choice, that context. "
                         "*_stderr: sqrt(sample variance (ddof 1) / n). The group: the mean over all records "
                         "(weight_by_size), stderr pooled over the tasks (lm-eval's pooled_sample_stderr)."),
        "batch_sizes_checked": [1, 7],
        "lm_eval_tasks_check": lm_eval_tasks_checks,
        "batch_7_vs_1_max_rel_diff_loglikelihood": batch_diff,
        "stock_float64_vs_lm_eval_max_rel_diff": worst_stock,
        "exact_float64_vs_lm_eval_max_rel_diff": worst_exact,
        "exact_float64_note": ("lm-eval's float64 model is stock transformers, whose RMSNorm and RoPE tables are "
                               "float32 even in float64; the exact float64 forward (make_fixtures.py's patches) "
                               "differs from lm-eval's log-likelihoods by at most the figure above, relative."),
        "acc_norm_with_delimiter_in_length_would_change_records": int(delim_matters),
        "tie": {"task": "mc_ten", "id": tie["id"], "note": "the right package appears twice; its two equal "
                "log-likelihoods are the largest and lm-eval's argmax takes the first, which is gold"},
        "group": {"name": GROUP, "tasks": [f"mc_{t}" for t in TASKS], "aggregation": "mean, weight_by_size: true",
                  "n": sum(t["n"] for t in reference_tasks.values()),
                  **{k.split(",")[0]: group[k] for k in metric_keys}},
        "tasks": reference_tasks,
    }
    text = json.dumps(reference, indent=1, ensure_ascii=False)
    # one line per list of numbers
    text = re.sub(r"\[\s+([-0-9.e,\s]+?)\s+\]", lambda m: "[" + ",".join(m.group(1).split()).replace(",,", ",") + "]",
                  text)
    with open(os.path.join(OUT, "reference.json"), "w", encoding="utf-8") as f:
        f.write(text + "\n")

    sizes = {name: os.path.getsize(os.path.join(dp, name)) for dp, _, fs in os.walk(OUT) for name in fs}
    total = sum(sizes.values())
    assert total < 1_000_000, sizes
    for name in TASKS:
        t = reference_tasks[f"mc_{name}"]
        ctx_lens = [len(c["context_ids"]) for r in t["records"] for c in r["choices"]]
        print(f"mc_{name}: n {t['n']}, acc {t['acc']:.4f} ± {t['acc_stderr']:.4f}, acc_norm {t['acc_norm']:.4f} ± "
              f"{t['acc_norm_stderr']:.4f}, context tokens {min(ctx_lens)}-{max(ctx_lens)}")
    print(f"{GROUP}: acc {group['acc,none']:.4f}, acc_norm {group['acc_norm,none']:.4f}")
    print(f"batch 7 vs 1: {batch_diff:.2e}; stock f64 vs lm-eval {worst_stock:.2e}; exact f64 vs lm-eval "
          f"{worst_exact:.2e}; records whose acc_norm a length with the delimiter would change: {delim_matters}")
    print(f"{total} bytes in {OUT}")


if __name__ == "__main__":
    sys.exit(main())
