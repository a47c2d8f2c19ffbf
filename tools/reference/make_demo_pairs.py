#!/usr/bin/env python3
"""Make demo/preference/pairs.jsonl: preference pairs of real text from the demo corpus (Debian's license texts).

Each pair asks for the sentence that follows one of a license's sentences. The chosen answer is the license's own
next sentence, verbatim; the rejected one is a sentence of another license, of about the same length, drawn by a
seeded generator. A model that has read the licenses (the demo's SFT run) prefers the true continuation a little;
DPO on the training pairs should make it prefer it on held-out pairs more. Plain format (TRL's prompt, chosen,
rejected strings). Deterministic: re-running rewrites the same file.

Usage: python3 tools/reference/make_demo_pairs.py
"""

import json
import os
import random
import re

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CORPUS = os.path.join(ROOT, "demo", "corpus", "text")
OUT = os.path.join(ROOT, "demo", "preference", "pairs.jsonl")
NAMES = {
    "Apache-2.0": "the Apache License 2.0", "Artistic": "the Artistic License", "BSD": "the BSD license",
    "CC0-1.0": "Creative Commons CC0 1.0", "GFDL-1.3": "the GNU FDL 1.3", "GPL-2": "the GNU GPL version 2",
    "GPL-3": "the GNU GPL version 3", "LGPL-2.1": "the GNU LGPL 2.1", "LGPL-3": "the GNU LGPL 3",
    "MPL-1.1": "the Mozilla Public License 1.1", "MPL-2.0": "the Mozilla Public License 2.0",
}
PER_LICENSE = 40


def sentences(text):
    flat = re.sub(r"\s+", " ", text).strip()
    return [s.strip() for s in re.split(r"(?<=[.;:])\s+(?=[A-Z(\"])", flat) if 30 <= len(s.strip()) <= 240]


def main():
    rng = random.Random(20261203)
    by_license = {}
    for lic in sorted(os.listdir(CORPUS)):
        seq = []
        for doc in sorted(os.listdir(os.path.join(CORPUS, lic))):
            with open(os.path.join(CORPUS, lic, doc), encoding="utf-8") as f:
                seq.append(sentences(f.read()))
        by_license[lic] = seq
    pool = [(lic, s) for lic, docs in by_license.items() for d in docs for s in d]
    pairs = []
    for lic, docs in by_license.items():
        candidates = [(d[i], d[i + 1]) for d in docs for i in range(len(d) - 1) if d[i + 1] != d[i]]
        rng.shuffle(candidates)
        for first, following in candidates[:PER_LICENSE]:
            others = [s for l, s in pool if l != lic and abs(len(s) - len(following)) <= 0.3 * len(following)]
            if not others:
                continue
            rejected = rng.choice(others)
            pairs.append({"prompt": f"In {NAMES[lic]}, what follows: \"{first}\"",
                          "chosen": following, "rejected": rejected})
    rng.shuffle(pairs)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        for p in pairs:
            f.write(json.dumps(p, ensure_ascii=False) + "\n")
    print(f"{len(pairs)} pairs -> {OUT}")


if __name__ == "__main__":
    main()
