"""Read Debian's machine-readable copyright files (/usr/share/doc/<package>/copyright, DEP-5 format).

Plain Python, no packages: make_demo_tasks.py (which must run without any) and make_mc_fixtures.py share it.
Only what the task generators need: each file's paragraphs as field -> value, a licence paragraph's text with
DEP-5's continuation markup undone, and a licence short name mapped to a family ("GPL-2+" and "GPLv2+" are one).
Every listing is sorted, so that what is made from it does not depend on the order the file system returns.
"""

import glob
import hashlib
import os
import re

DOC_ROOT = "/usr/share/doc"


def copyright_files(root=DOC_ROOT):
    """(package, path) of every DEP-5 copyright file under root, one per distinct content (several packages of one
    source ship the same file: the first package name in sorted order keeps it), sorted by package."""
    seen = set()
    out = []
    for path in sorted(glob.glob(os.path.join(root, "*", "copyright"))):
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not text.startswith("Format:") or "copyright-format" not in text.split("\n", 1)[0]:
            continue
        digest = hashlib.sha256(raw).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        out.append((os.path.basename(os.path.dirname(path)), path))
    return out


def paragraphs(path):
    """The file's paragraphs: a list of dicts field -> value; a value keeps its continuation lines, one per line,
    with their leading whitespace removed and DEP-5's " ." (an empty line) turned back into an empty line."""
    with open(path, encoding="utf-8") as f:
        text = f.read().replace("\r\n", "\n")
    paras = []
    for block in re.split(r"\n[ \t]*\n", text):
        fields, key = {}, None
        for line in block.split("\n"):
            if not line.strip():
                continue
            if line[0] in " \t":
                if key is None:
                    continue
                body = line.strip()
                fields[key].append("" if body == "." else body)
            elif ":" in line:
                key, value = line.split(":", 1)
                key = key.strip()
                fields[key] = [value.strip()]
            # a line of neither kind (a stray comment) is left out
        if fields:
            paras.append({k: "\n".join(v) for k, v in fields.items()})
    return paras


def licence_text(value):
    """A License field's value split into (short name, text): the first line names the licence, the rest is the
    text (empty for a Files paragraph that refers to a stand-alone licence paragraph). The text's lines are joined
    into paragraphs (lines of one paragraph by spaces, paragraphs by a blank line)."""
    first, _, rest = value.partition("\n")
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", rest)]
    return first.strip(), "\n\n".join(p for p in paras if p)


# Licence families: a short name (as a file spells it) to the family it belongs to. Only single licences: a name
# with "or", "and", "with" or a comma is a combination, left out.
_FAMILIES = [
    (r"gpl-?v?2(\.0)?\+?(-only|-or-later)?", "GPL-2"),
    (r"gpl-?v?3(\.0)?\+?(-only|-or-later)?", "GPL-3"),
    (r"lgpl-?v?2(\.1)?\+?(-only|-or-later)?", "LGPL-2"),
    (r"lgpl-?v?3(\.0)?\+?(-only|-or-later)?", "LGPL-3"),
    (r"apache-?(2|2\.0)", "Apache-2.0"),
    (r"bsd-3(-clause)?", "BSD-3-clause"),
    (r"bsd-2(-clause)?", "BSD-2-clause"),
    (r"(mit|expat)", "MIT"),
    (r"zlib", "Zlib"),
    (r"isc", "ISC"),
    (r"bsl-1\.0", "BSL-1.0"),
    (r"mpl-?2(\.0)?", "MPL-2.0"),
    (r"mpl-?1\.1", "MPL-1.1"),
    (r"(cc0|cc0-1\.0)", "CC0-1.0"),
    (r"artistic(-1(\.0)?)?", "Artistic"),
    (r"(public-domain|pd)", "public-domain"),
]


def licence_family(name):
    """The family of a single licence's short name ("GPL-2+" -> "GPL-2"), or None for a combination or a name
    outside the table."""
    n = name.strip().lower()
    if not n or re.search(r"\s(or|and|with)\s|,|\|", n):
        return None
    for pattern, family in _FAMILIES:
        if re.fullmatch(pattern, n):
            return family
    return None


def licence_texts(files):
    """Every licence text of the given copyright files: (package, short name, family, text) for each License field
    that carries a text, sorted by (package, position in the file)."""
    out = []
    for package, path in files:
        for para in paragraphs(path):
            if "License" not in para:
                continue
            name, text = licence_text(para["License"])
            if text:
                out.append((package, name, licence_family(name), text))
    return out


def copyright_lines(files):
    """Every holder line of every Copyright field: (package, line), in file order."""
    out = []
    for package, path in files:
        for para in paragraphs(path):
            for line in para.get("Copyright", "").split("\n"):
                line = line.strip()
                if line:
                    out.append((package, line))
    return out


# Where one sentence ends and the next begins (after . ; : ! or ?).
SENTENCE_END = re.compile(r"(?<=[.;:!?])\s+(?=\S)")


def clean_licence(text):
    """A licence text with what names it outright removed: Debian's pointer sentences to
    /usr/share/common-licenses/<NAME> ("On Debian systems, the complete text ... can be found in ...")."""
    paras = []
    for para in text.split("\n\n"):
        kept = [s for s in SENTENCE_END.split(para)
                if "common-licenses" not in s and "On Debian" not in s and "Debian systems" not in s]
        if kept:
            paras.append(" ".join(kept))
    return "\n\n".join(paras)
