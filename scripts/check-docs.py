#!/usr/bin/env python3
"""Checks the README, docs/ and benchmarks/ against the repository (make test runs it, tests/tools/test_docs.cpp):
links and anchors resolve, paths named in backticks exist, every --option a page gives a tool is one the built tool
declares (its --help), no page lists test names, and no tracked file points outside the repository.

  scripts/check-docs.py [BUILD_DIR]      (default: build; run from the repository root)"""
import os, re, sys, subprocess, glob
build = sys.argv[1] if len(sys.argv) > 1 else 'build'
os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
pages = ['README.md'] + sorted(glob.glob('docs/*.md')) + sorted(glob.glob('benchmarks/*.md'))
errors = []

def slug(h):
    h = h.strip().lower()
    h = re.sub(r'[`*_]', '', h) if False else h.replace('`', '')
    h = re.sub(r'[^\w\- ]', '', h)
    return h.replace(' ', '-')

def anchors(path):
    out = set(); fence = False
    for line in open(path):
        if line.startswith('```'): fence = not fence
        if not fence and line.startswith('#'):
            out.add(slug(line.lstrip('#')))
    return out

# 1. links
for p in pages:
    text = open(p).read()
    for m in re.finditer(r'\]\(([^)\s]+)\)', text):
        target = m.group(1)
        if re.match(r'[a-z]+://', target): errors.append(f'{p}: external link {target}'); continue
        path, _, anchor = target.partition('#')
        full = os.path.normpath(os.path.join(os.path.dirname(p), path)) if path else p
        if not os.path.exists(full): errors.append(f'{p}: link to missing {target}'); continue
        if anchor and full.endswith('.md') and anchor not in anchors(full):
            errors.append(f'{p}: link to missing anchor {target}')

# 2. references outside the repository
tracked = subprocess.run(['git', 'ls-files'], capture_output=True, text=True).stdout.split()
for f in tracked + pages:
    if not os.path.isfile(f) or f.startswith('tests/fixtures/') or f == 'scripts/check-docs.py': continue
    try: t = open(f, errors='replace').read()
    except Exception: continue
    for pat in [r'\.\./shared', r'DESIGN\.md', r'STYLE\.md', r'/work/', r'\bissue \d+', r"[Ii]ssue \d+'s"]:
        for m in re.finditer(pat, t):
            line = t[:m.start()].count('\n') + 1
            errors.append(f'{f}:{line}: outside reference {m.group(0)!r}')

# 3. test names and "Held:" lists in user pages
for p in ['README.md'] + sorted(glob.glob('docs/*.md')):
    for i, line in enumerate(open(p), 1):
        for m in re.finditer(r'`?\b([A-Z][A-Za-z0-9]+(?:/[A-Z][A-Za-z0-9]+)?)\.([A-Z][A-Za-z0-9]{3,}|\*)\b`?', line):
            errors.append(f'{p}:{i}: test name? {m.group(0)}')
        if re.search(r'\bHeld:', line): errors.append(f'{p}:{i}: "Held:" list')

# 4. paths in backticks exist
for p in pages:
    fence = False
    for i, line in enumerate(open(p), 1):
        for m in re.finditer(r'`([A-Za-z0-9_./-]+/[A-Za-z0-9_.*-]+)`', line):
            path = m.group(1)
            first = path.split('/')[0]
            if first not in ('core','comm','kernels','data','model','dist','plan','ckpt','engine','tools','tests','bench','scripts','docs','benchmarks','examples','demo'): continue
            if '*' in path or path.endswith('/'):
                if not glob.glob(path.rstrip('/')): errors.append(f'{p}:{i}: no such path {path}')
            elif not os.path.exists(path) and not glob.glob(path + '.*'):
                errors.append(f'{p}:{i}: no such path {path}')

# 5. options
def declared(tool):
    """The options a built tool declares: the --name lines of its --help."""
    out = subprocess.run([os.path.join(build, tool), '--help'], capture_output=True, text=True)
    return set(re.findall(r'^  --([a-z_0-9]+)', out.stdout + out.stderr, re.M)) | {'config', 'help'}
tools = {t: declared(t) for t in ('train', 'plan', 'prepare', 'convert', 'eval', 'sample', 'report')}
for p in pages:
    lines = open(p).read().split('\n')
    i = 0
    while i < len(lines):
        line = lines[i]
        for m in re.finditer(r'build/(train|plan|prepare|convert|eval|sample|report)\b', line):
            tool = m.group(1)
            cmd = line[m.end():]
            j = i
            while cmd.rstrip().endswith('\\') and j + 1 < len(lines):
                j += 1; cmd += ' ' + lines[j]
            cmd = cmd.split('#')[0] if '`' not in cmd else cmd
            # stop at the end of an inline code span
            if '`' in cmd: cmd = cmd.split('`')[0]
            for o in re.findall(r'(?<![\w-])--([a-z][a-z0-9_-]*)', cmd):
                name = o.replace('-', '_')
                if name not in tools[tool]:
                    errors.append(f'{p}:{i+1}: build/{tool} has no option --{o}')
        i += 1

for e in errors: print(e)
print(f'{len(errors)} problems in {len(pages)} pages')
sys.exit(1 if errors else 0)
