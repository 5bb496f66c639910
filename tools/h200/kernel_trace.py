#!/usr/bin/env python3
"""What each kernel adds to a decode step, from a kernel_trace.c log.

    python3 tools/h200/kernel_trace.py trace.txt [--top N]

A step is the span from one `embed` kernel to the next; decode steps are those with the most
common kernel count (prefill steps and the first eager steps differ). Within a step, kernel i
"adds" end[i] - end[i-1]: with programmatic dependent launch the kernels' own [start, end]
spans overlap (a kernel starts while its predecessor runs and waits), but each ends after its
predecessor, so the end-to-end gaps partition the step. Printed per (kernel, grid): count per
step, µs added per step, per call, and its own mean span (start to end).
"""
import collections
import sys


def main(path, top):
    ks = []
    for line in open(path):
        p = line.split(None, 5)
        if len(p) == 6:
            ks.append((int(p[0]), int(p[1]), f"{p[5].strip()[:44]} ({p[2]},{p[3]},{p[4]})"))
    ks.sort()
    steps, cur = [], []
    for k in ks:
        if k[2].startswith("embed") and cur:
            steps.append(cur)
            cur = []
        cur.append(k)
    if not steps:
        sys.exit("no embed-delimited steps in the trace")
    n = collections.Counter(len(s) for s in steps).most_common(1)[0][0]
    dec = [s for s in steps if len(s) == n][1:]  # the first may be the eager step
    if not dec:
        sys.exit("no repeated step shape")
    add = collections.defaultdict(float)
    span = collections.defaultdict(float)
    cnt = collections.Counter()
    step_us = []
    for s in dec:
        for i, (st, en, name) in enumerate(s):
            prev_end = s[i - 1][1] if i else st
            add[name] += (en - prev_end) / 1e3
            span[name] += (en - st) / 1e3
            cnt[name] += 1
        step_us.append((s[-1][1] - s[0][0]) / 1e3)
    m = len(dec)
    total = sum(step_us) / m
    print(f"{m} decode steps of {n} kernels; embed start to last end: {total:.1f} us per step")
    print(f"{'kernel (grid)':60s} {'n':>4s} {'us/step':>8s} {'us/call':>8s} {'span':>7s}")
    rows = sorted(add, key=lambda k: -add[k])
    for k in rows[:top]:
        c = cnt[k] / m
        print(f"{k:60s} {c:4.0f} {add[k] / m:8.1f} {add[k] / cnt[k]:8.2f} {span[k] / cnt[k]:7.2f}")
    print(f"{'sum':60s} {'':4s} {sum(add.values()) / m:8.1f}")
    # The step in order (first decode step shape, mean over steps): position, kernel, added.
    if "--order" in sys.argv:
        for i in range(n):
            a = sum((s[i][1] - (s[i - 1][1] if i else s[i][0])) / 1e3 for s in dec) / m
            print(f"{i:4d} {dec[0][i][2]:60s} {a:7.2f}")


if __name__ == "__main__":
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 40
    main(sys.argv[1], top)
