"""doc_to_choice / doc_to_target of the fixture tasks' YAMLs: lm-eval reads tuna's own task records (the JSONL
under tests/fixtures/mc_eval/tasks/), so that the requests it builds can be asserted equal to those records.

A record's choices carry the task's target delimiter (lm-eval's request strings); lm-eval's doc_to_choice is the
choice without it (acc_norm divides by that length), and lm-eval puts the delimiter back when it builds a request.
A record with a context per choice (Winogrande's partial evaluation) has doc_to_choice = its contexts and one
target, the continuation without the delimiter.
"""


def _strip(doc, choice):
    delimiter = doc.get("delimiter")
    if delimiter is None:  # tuna's default, and lm-eval's
        delimiter = " "
    assert choice.startswith(delimiter), (choice, delimiter)
    return choice[len(delimiter):]


def doc_to_choice(doc):
    if isinstance(doc["context"], list):
        return list(doc["context"])
    return [_strip(doc, c) for c in doc["choices"]]


def doc_to_target(doc):
    if isinstance(doc["context"], list):
        return _strip(doc, doc["choices"][0])
    return doc["gold"]
