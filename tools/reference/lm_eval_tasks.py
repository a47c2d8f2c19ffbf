#!/usr/bin/env python3
"""Write tuna's multiple-choice task records (build/eval --tasks) from lm-evaluation-harness's own task definitions.

For each task (a group such as mmlu expands to its subtasks), lm-eval builds its requests exactly as an evaluation
run does (TaskManager.load, the same num_fewshot override and few-shot seed as simple_evaluate, then
Task.build_all_requests) and each document's requests become one record:

  {"task": "arc_easy", "context": "Question: ...\\nAnswer:", "choices": [" a", " b", ...], "gold": 2, "id": 17}

context is the formatted context (few-shot examples included), each choice carries the task's target delimiter:
request j is (context, choices[j]), the strings lm-eval's model would be handed. A task whose contexts vary per
choice (Winogrande's partial evaluation) gives "context" as a list, one per choice, and the choices are the one
continuation repeated. "delimiter" is written when the task's target delimiter is not " " (acc_norm divides by
the choice's length without it). gold is the document's target as an index. "id" is lm-eval's doc_id.

Nothing is downloaded unless the datasets are missing from the Hugging Face cache: run it offline
(HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1, the default here) on a machine that has them cached.

Usage:
  python3 tools/reference/lm_eval_tasks.py --tasks hellaswag,arc_easy,arc_challenge,mmlu,piqa,winogrande \\
      --out tasks/ [--num_fewshot 5] [--limit 100] [--include_path DIR]
One file OUT/<task>.jsonl per leaf task (a directory build/eval --tasks reads whole), or with --out FILE.jsonl one
file of them all. Only multiple_choice tasks are taken; another output type is an error naming the task.
"""

import argparse
import json
import os
import random
import sys

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def records_of(task_name, task):
    """The task's instances (after build_all_requests), one record per document, in doc_id order."""
    by_doc = {}
    for inst in task.instances:
        by_doc.setdefault(inst.doc_id, []).append(inst)
    delimiter = task.config.target_delimiter
    out = []
    for doc_id in sorted(by_doc):
        insts = sorted(by_doc[doc_id], key=lambda i: i.idx)
        doc = insts[0].doc
        choices = task.doc_to_choice(doc)
        if len(insts) != len(choices):
            # acc_mutual_info adds one unconditional request per choice: tuna does not score that metric
            if len(insts) == 2 * len(choices) and all(i.arguments[0] == "" for i in insts[len(choices):]):
                insts = insts[:len(choices)]
            else:
                raise SystemExit(f"lm_eval_tasks: {task_name} doc {doc_id}: {len(insts)} requests for "
                                 f"{len(choices)} choices")
        contexts = [i.arguments[0] for i in insts]
        continuations = [i.arguments[1] for i in insts]
        if task.multiple_input:
            gold = task.doc_to_text(doc)      # lm-eval: the text is the gold index, the choices are the contexts
        else:
            gold = task.doc_to_target(doc)
        if isinstance(gold, str):
            gold = choices.index(gold) if gold in choices else -1
        if isinstance(gold, list):
            raise SystemExit(f"lm_eval_tasks: {task_name} doc {doc_id}: several gold answers ({gold}); a record has one")
        if not isinstance(gold, int) or not 0 <= gold < len(choices):
            raise SystemExit(f"lm_eval_tasks: {task_name} doc {doc_id}: gold {gold!r} is not an index of its "
                             f"{len(choices)} choices")
        record = {"task": task_name}
        if task.multiple_input:
            record["context"] = contexts
        else:
            if len(set(contexts)) != 1:
                raise SystemExit(f"lm_eval_tasks: {task_name} doc {doc_id}: the choices' contexts differ")
            record["context"] = contexts[0]
        record["choices"] = continuations
        record["gold"] = gold
        if delimiter != " ":
            record["delimiter"] = delimiter
        record["id"] = doc_id
        out.append(record)
    return out


def build(task_names, include_path=None, num_fewshot=None, limit=None, fewshot_seed=1234):
    """{task name: [record, ...]} for every leaf task of task_names, in lm-eval's load order."""
    import numpy
    import torch
    from lm_eval.tasks import TaskManager
    from lm_eval.evaluator_utils import get_sample_size

    # simple_evaluate's seeds (random 0, numpy and torch 1234; the few-shot sampler its own, 1234)
    random.seed(0)
    numpy.random.seed(1234)
    torch.manual_seed(1234)
    tm = TaskManager(include_path=include_path)
    loaded = tm.load(task_names)
    result = {}
    for name, task in loaded["tasks"].items():
        if task.get_config("output_type") != "multiple_choice":
            raise SystemExit(f"lm_eval_tasks: {name} is a {task.get_config('output_type')} task; only "
                             "multiple_choice tasks make records")
        if num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=fewshot_seed)
        task.build_all_requests(limit=get_sample_size(task, limit), rank=0, world_size=1, cache_requests=False,
                                rewrite_requests_cache=False, system_instruction=None, apply_chat_template=False,
                                fewshot_as_multiturn=False, chat_template=None, tokenizer_name="")
        result[name] = records_of(name, task)
    return result


def main():
    ap = argparse.ArgumentParser(description="lm-eval multiple-choice tasks -> tuna task records (JSONL)")
    ap.add_argument("--tasks", required=True, help="comma-separated lm-eval task or group names")
    ap.add_argument("--out", required=True, help="a directory (one <task>.jsonl per task) or a .jsonl file")
    ap.add_argument("--num_fewshot", type=int, default=None,
                    help="as lm_eval --num_fewshot (a task whose config fixes 0 keeps 0)")
    ap.add_argument("--limit", type=float, default=None, help="as lm_eval --limit: documents per task (or a fraction)")
    ap.add_argument("--include_path", default=None, help="as lm_eval --include_path: more task YAMLs")
    ap.add_argument("--fewshot_seed", type=int, default=1234, help="as lm_eval's fewshot_random_seed")
    args = ap.parse_args()

    tasks = build([t for t in args.tasks.split(",") if t], args.include_path, args.num_fewshot,
                  args.limit, args.fewshot_seed)
    one_file = args.out.endswith(".jsonl")
    if not one_file:
        os.makedirs(args.out, exist_ok=True)
    files = {}
    for name, records in tasks.items():
        path = args.out if one_file else os.path.join(args.out, f"{name}.jsonl")
        f = files.get(path) or files.setdefault(path, open(path, "w", encoding="utf-8"))
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        print(f"{name}: {len(records)} records -> {path}")
    for f in files.values():
        f.close()


if __name__ == "__main__":
    sys.exit(main())
