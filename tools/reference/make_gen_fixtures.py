#!/usr/bin/env python3
"""Make tests/fixtures/mc_eval/gen/: generative task records answered by lm-evaluation-harness itself.

The model and tokenizer are tests/fixtures/mc_eval's (make_mc_fixtures.py: a tiny random LLaMA over a 512-piece
byte-level BPE of the Debian copyright files). The contexts are that fixture's multiple-choice contexts (real text
nobody here wrote). What it writes:

  gen/tasks/{stop,eos,bos}.jsonl   tuna's generative records: {"task", "id", "context", "until", "max_gen_toks",
                                   "target"}
  gen/reference.json               what lm-eval 0.4 made of them (output_type generate_until, model `hf` in float64
                                   on the CPU, batch size 1, the remove_whitespace + take_first filters): every
                                   record's context ids, generated text and exact_match, and each task's
                                   exact_match with its standard error

The three tasks hold what the generation must get right:
  gen_stop  a stop string the model really generates mid-answer (chosen from a first greedy pass: the most common
            two-character string inside the answers), then "\\n"; 16 tokens at most
  gen_eos   no stop string of its own (lm-eval adds the EOS's text), 10 tokens at most: answers that run to the
            length limit, undecodable byte runs (U+FFFD), transformers' clean_up_tokenization_spaces
  gen_bos   contexts that start with the BOS's text (encoded without another BOS) or end with a space; "\\n\\n"
A target is the first pass's answer stripped for every other record (so exact_match is 1 there unless lm-eval
disagrees with transformers' own generate), something else for the rest. The stop string the first pass finds is two
U+FFFD (the random model emits lone bytes): it also holds lm-eval's look-back stop, which decodes the last few
tokens alone and can find U+FFFD there where the whole answer has a character (gen_stop's record 16 stops so).

Usage: python3 tools/reference/make_gen_fixtures.py   (after make_mc_fixtures.py; deterministic, one thread)
"""

import collections
import json
import os
import sys

import torch
import transformers
from transformers import LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
MC = os.path.join(ROOT, "tests", "fixtures", "mc_eval")
OUT = os.path.join(MC, "gen")
TASK_DIR = os.path.join(HERE, "gen_tasks")
BOS = "<|begin_of_text|>"


def contexts():
    out = []
    for name in ("two", "four", "ten"):
        with open(os.path.join(MC, "tasks", f"{name}.jsonl"), encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                if isinstance(r["context"], str):
                    out.append(r["context"])
    return out


def first_pass(model, tok, texts, max_new):
    """transformers' own greedy generate, no stop string: the answer each context gets."""
    answers = []
    for text in texts:
        ids = tok(text, add_special_tokens=not text.startswith(BOS), return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.eos_token_id)
        answers.append(tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True))
    return answers


def common_inner_pair(answers):
    """The two-character string found strictly inside the most answers (not at their start)."""
    count = collections.Counter()
    for a in answers:
        count.update({a[i:i + 2] for i in range(1, len(a) - 2) if a[i:i + 2].strip() == a[i:i + 2]})
    return count.most_common(1)[0][0]


def records(task, texts, answers, until, max_gen_toks, prefix):
    out = []
    for i, (text, answer) in enumerate(zip(texts, answers)):
        for term in until:
            answer = answer.split(term)[0]
        # tuna refuses an empty target (a data error far more often than a task): an empty answer gets one it misses.
        target = answer.strip() if i % 2 == 0 and answer.strip() else "not " + answer.strip()
        out.append({"task": task, "id": f"{prefix}-{i:03d}", "context": text, "until": until,
                    "max_gen_toks": max_gen_toks, "target": target})
    return out


def write_yaml(task, file, until, max_gen_toks):
    with open(os.path.join(TASK_DIR, f"{task}.yaml"), "w", encoding="utf-8") as f:
        f.write(f"# Fixture task {task}: tuna's records tests/fixtures/mc_eval/gen/tasks/{file} read by lm-eval itself\n"
                "# (paths relative to the repository root). Made and used by make_gen_fixtures.py.\n")
        f.write(f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                f"    test: tests/fixtures/mc_eval/gen/tasks/{file}\ntest_split: test\noutput_type: generate_until\n"
                "doc_to_text: \"{{context}}\"\ndoc_to_target: \"{{target}}\"\ntarget_delimiter: \"\"\n"
                "num_fewshot: 0\n")
        f.write("generation_kwargs:\n  until: " + json.dumps(until) + f"\n  max_gen_toks: {max_gen_toks}\n"
                "  do_sample: false\n")
        f.write("filter_list:\n  - name: strip\n    filter:\n      - function: remove_whitespace\n"
                "      - function: take_first\n")
        f.write("metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
                "metadata:\n  version: 1.0\n")


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    tok = transformers.AutoTokenizer.from_pretrained(MC)
    assert tok.clean_up_tokenization_spaces, "the fixture tokenizer is meant to clean up spaces on decode"
    model = LlamaForCausalLM.from_pretrained(MC, torch_dtype=torch.float64, attn_implementation="sdpa").eval()
    texts = contexts()
    stop_texts, eos_texts = texts[0:30], texts[30:50]
    bos_texts = [BOS + t for t in texts[50:56]] + [t + " " for t in texts[56:60]]

    stop_answers = first_pass(model, tok, stop_texts, 16)
    stop = common_inner_pair(stop_answers)
    tasks = {
        "gen_stop": ("stop.jsonl", records("gen_stop", stop_texts, stop_answers, [stop, "\n"], 16, "stop"), [stop, "\n"], 16),
        "gen_eos": ("eos.jsonl", records("gen_eos", eos_texts, first_pass(model, tok, eos_texts, 10), [], 10, "eos"), [], 10),
        "gen_bos": ("bos.jsonl", records("gen_bos", bos_texts, first_pass(model, tok, bos_texts, 8), ["\n\n"], 8, "bos"),
                    ["\n\n"], 8),
    }
    os.makedirs(os.path.join(OUT, "tasks"), exist_ok=True)
    os.makedirs(TASK_DIR, exist_ok=True)
    for task, (file, rs, until, max_gen_toks) in tasks.items():
        with open(os.path.join(OUT, "tasks", file), "w", encoding="utf-8") as f:
            for r in rs:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        write_yaml(task, file, until, max_gen_toks)

    with open(os.path.join(TASK_DIR, "gen_fixture.yaml"), "w", encoding="utf-8") as f:
        f.write("# The group of the three generative fixture tasks, aggregated as lm-eval's standard groups are: the mean\n"
                "# of the records, each task weighted by its size, and the pooled standard error.\n"
                "group: gen_fixture\ntask:\n" + "".join(f"  - {t}\n" for t in tasks) +
                "aggregate_metric_list:\n  - metric: exact_match\n    aggregation: mean\n    weight_by_size: true\n"
                "    filter_list: [strip]\nmetadata:\n  version: 1.0\n")

    captured = []
    original = HFLM.tok_batch_encode

    def capture(self, strings, *args, **kwargs):
        ids, mask = original(self, strings, *args, **kwargs)
        captured.append((list(strings), ids.tolist()))
        return ids, mask

    HFLM.tok_batch_encode = capture
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        out = lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={os.path.relpath(MC, ROOT)},dtype=float64", tasks=["gen_fixture"],
            task_manager=TaskManager(include_path=TASK_DIR), batch_size=1, device="cpu", log_samples=True)
    finally:
        os.chdir(cwd)
        HFLM.tok_batch_encode = original
    context_ids = {strings[0]: ids[0] for strings, ids in captured}

    reference = {"format": "tuna generative fixture 1",
                 "versions": {"lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__") else "0.4",
                              "transformers": transformers.__version__, "torch": torch.__version__},
                 "lm_eval_run": ("lm_eval.simple_evaluate(model='hf', model_args='pretrained=tests/fixtures/mc_eval,"
                                 "dtype=float64', tasks=['gen_fixture'], task_manager=TaskManager("
                                 "include_path='tools/reference/gen_tasks'), batch_size=1, device='cpu', "
                                 "log_samples=True), from the repository root"),
                 "stop_string": stop, "tasks": {}}
    matched = 0
    for task, (file, rs, until, max_gen_toks) in tasks.items():
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        assert len(samples) == len(rs)
        rows = []
        for r, s in zip(rs, samples):
            assert s["doc"]["id"] == r["id"]
            raw = s["resps"][0][0]
            rows.append({"id": r["id"], "context_ids": context_ids[r["context"]], "response": raw,
                         "filtered": s["filtered_resps"][0], "exact_match": s["exact_match"]})
            matched += s["exact_match"]
        res = out["results"][task]
        reference["tasks"][task] = {"file": f"tasks/{file}", "exact_match": res["exact_match,strip"],
                                    "exact_match_stderr": res["exact_match_stderr,strip"], "records": rows}
    group = out["results"]["gen_fixture"]
    reference["group"] = {"name": "gen_fixture", "exact_match": group["exact_match,strip"],
                          "exact_match_stderr": group["exact_match_stderr,strip"],
                          "records": sum(len(t["records"]) for t in reference["tasks"].values())}
    with open(os.path.join(OUT, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(reference, f, indent=1, ensure_ascii=False)
        f.write("\n")
    n = sum(len(t["records"]) for t in reference["tasks"].values())
    print(f"wrote {OUT}: {n} records, {matched} exact matches, stop string {stop!r}")
    for task, t in reference["tasks"].items():
        print(f"  {task}: exact_match {t['exact_match']:.4f} ± {t['exact_match_stderr']:.4f}")
    print(f"  gen_fixture: exact_match {group['exact_match,strip']:.4f} ± {group['exact_match_stderr,strip']:.4f}")


if __name__ == "__main__":
    sys.exit(main())
