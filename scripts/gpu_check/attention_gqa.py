#!/usr/bin/env python3
# Part of scripts/gpu-check.sh (which runs it): see there.
import json, re, sys
rates = {}
for b in json.load(open(sys.argv[1])).get("benchmarks", []):
    m = re.match(r"bwd( G=1)? causal hd(\d+) seq (\d+) batch \d+ (mma|hopper)$", b.get("label", ""))
    if m and b.get("TFLOP/s") and not b.get("error_occurred"):
        rates[(m.group(2), m.group(3), m.group(4), "G=1" if m.group(1) else "G=4")] = b["TFLOP/s"]
for (hd, seq, path, g), g1 in sorted(rates.items()):
    g4 = rates.get((hd, seq, path, "G=4"))
    if g == "G=1" and g4:
        print(f"attention bwd hd{hd} seq {seq} {path}: G=1 {g1:.0f}, G=4 {g4:.0f} TFLOP/s, G=4/G=1 {g4 / g1:.2f}")