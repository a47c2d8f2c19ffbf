#!/usr/bin/env python3
"""Make the shipped multiple-choice tasks, demo/tasks/ (build/eval --tasks demo/tasks; demo/tasks/README.md says
where each file comes from and under which licence).

  debian_licenses.jsonl   Which licence is this text? A licence text from the Debian copyright files
                          (/usr/share/doc/*/copyright, the License fields that carry a text), its short name
                          removed (the field's first line, and Debian's pointer sentence to
                          /usr/share/common-licenses/NAME), cut on a sentence boundary to at most 1000 characters;
                          four choices: its licence family and three others, among the eight most frequent.
  bigbench_sports_understanding.jsonl
                          BIG-bench's sports_understanding task (task.json in the bigbench source package on PyPI),
                          every example, formatted as lm-eval's bigbench tasks read it: BIG-bench's own zero-shot
                          formatting of the input (task_prefix + example_input_prefix + input +
                          example_output_prefix), the choices the keys of target_scores, the target delimiter " ".

Plain Python, no packages. Deterministic: sorted inputs and a fixed seed; re-running on the same machine (the same
installed packages) and the same bigbench archive rewrites the same files.

Usage: python3 tools/reference/make_demo_tasks.py --bigbench bigbench-1.0.0.tar.gz [--doc-root /usr/share/doc]
  (the archive: pip download bigbench==1.0.0 --no-deps --no-binary :all:)
"""

import argparse
import hashlib
import json
import os
import random
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import debian_copyright as deb  # noqa: E402

OUT = os.path.join(ROOT, "demo", "tasks")
SEED = 3535
MAX_TEXT_CHARS = 1000      # ~250 tokens of Llama 3's tokenizer, ~330 of Llama 2's: under the demo's longest window
MIN_TEXT_CHARS = 80
PER_FAMILY = 30
FAMILIES = 8
BIGBENCH_TASK = "bigbench/benchmark_tasks/sports_understanding/task.json"

def cut(text, max_chars):
    """The longest run of whole sentences from the start (paragraph breaks kept) of at most max_chars, or None when
    the first sentence alone is longer."""
    out, used = [], 0
    for para in text.split("\n\n"):
        for si, s in enumerate(deb.SENTENCE_END.split(para)):
            sep = "" if not out else (" " if si else "\n\n")
            if used + len(sep) + len(s) > max_chars:
                return "".join(out) or None
            out.append(sep + s)
            used += len(sep) + len(s)
    return "".join(out)


def debian_licenses(doc_root):
    files = deb.copyright_files(doc_root)
    by_family = {}
    for package, name, family, text in deb.licence_texts(files):
        if family is None or family == "public-domain":
            continue
        t = cut(deb.clean_licence(text), MAX_TEXT_CHARS)
        if t is None or len(t) < MIN_TEXT_CHARS:
            continue
        by_family.setdefault(family, {}).setdefault(t, package)     # first package (sorted) keeps a text
    families = sorted(by_family, key=lambda f: (-len(by_family[f]), f))[:FAMILIES]
    rng = random.Random(SEED)
    records = []
    for family in families:
        texts = sorted(by_family[family].items())
        rng.shuffle(texts)
        for text, package in texts[:PER_FAMILY]:
            choices = [family] + rng.sample([f for f in families if f != family], 3)
            rng.shuffle(choices)
            records.append({"task": "debian_licenses",
                            "context": f"Licence text:\n{text}\n\nQuestion: Which licence is this?\nAnswer:",
                            "choices": [" " + c for c in choices], "gold": choices.index(family),
                            "id": f"{package}/copyright"})
    rng.shuffle(records)
    return records, {f: min(PER_FAMILY, len(by_family[f])) for f in families}, len(files)


def bigbench_sports(archive):
    """BIG-bench's json_task.default_format_fn at zero shots (append_choices_to_input is false for this task), then
    lm-eval's bigbench multiple_choice template: doc_to_choice = the target_scores keys in order, gold = the key of
    the highest score (the first such), target delimiter " "."""
    with tarfile.open(archive) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/" + BIGBENCH_TASK))
        raw = tar.extractfile(member).read()
    task = json.loads(raw)
    assert task["append_choices_to_input"] is False and task["preferred_score"] == "multiple_choice_grade"
    prefix = task.get("task_prefix", "")
    input_prefix = task.get("example_input_prefix", "\nQ: ")
    output_prefix = task.get("example_output_prefix", "\nA: ")
    records = []
    for i, ex in enumerate(task["examples"]):
        scores = ex["target_scores"]
        choices = list(scores)
        best = max(scores.values())
        gold = [k for k, v in scores.items() if v == best][0]
        record = {"task": "bigbench_sports_understanding",
                  "context": prefix + input_prefix + ex["input"] + output_prefix,
                  "choices": [" " + c for c in choices], "gold": choices.index(gold), "id": i}
        if i == 0:
            record["canary"] = task["canary"]      # BIG-bench asks that its data carry the canary string
        records.append(record)
    return records, member.name, hashlib.sha256(open(archive, "rb").read()).hexdigest(), task["canary"]


def write(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bigbench", required=True, help="bigbench-1.0.0.tar.gz, the source package from PyPI")
    ap.add_argument("--doc-root", default=deb.DOC_ROOT)
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)

    records, per_family, n_files = debian_licenses(args.doc_root)
    assert len(records) <= 300 and min(per_family.values()) >= 10, per_family
    for r in records:
        assert 0 <= r["gold"] < 4 and len(set(r["choices"])) == 4 and not r["context"].startswith(" ")
    write(os.path.join(OUT, "debian_licenses.jsonl"), records)
    print(f"debian_licenses: {len(records)} records from {n_files} copyright files; per family {per_family}")

    sports, path, sha, canary = bigbench_sports(args.bigbench)
    write(os.path.join(OUT, "bigbench_sports_understanding.jsonl"), sports)
    golds = [r["gold"] for r in sports]
    print(f"bigbench_sports_understanding: {len(sports)} records from {path} (sha256 of the archive {sha}); "
          f"gold 0: {golds.count(0)}, gold 1: {golds.count(1)}")


if __name__ == "__main__":
    sys.exit(main())
