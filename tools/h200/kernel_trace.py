#!/usr/bin/env python3
"""What each kernel adds to a decode step, from a kernel_trace.c log.

    python3 tools/h200/kernel_trace.py trace.txt [--top N] [--order] [--vs other.txt]

A step is the span from one `embed` kernel to the next; decode steps are those with the most
common kernel count (prefill steps and the first eager steps differ). Within a step, kernel i
"adds" end[i] - end[i-1]: with programmatic dependent launch the kernels' own [start, end]
spans overlap (a kernel starts while its predecessor runs and waits), but each ends after its
predecessor, so the end-to-end gaps partition the step. Printed per (kernel, grid): count per
step, µs added per step, per call, and its own mean span (start to end). --order: the first
step's kernels in order with their mean added µs. --vs: a second trace (another build or
switch), per kernel µs added per call in each and the difference.
"""
import collections
import sys


def spans(path, grid=True):
    """A trace's embed-delimited spans (the last one included): lists of (start, end, label),
    label "name (grid)", or the bare name with grid=False (prefill_trace.py merges grids)."""
    ks = []
    for line in open(path):
        p = line.split(None, 5)
        if len(p) == 6:
            name = p[5].strip()
            label = f"{name[:44]} ({p[2]},{p[3]},{p[4]})" if grid else name.split("(")[0][:48]
            ks.append((int(p[0]), int(p[1]), label))
    ks.sort()
    steps, cur = [], []
    for k in ks:
        if k[2].startswith("embed") and cur:
            steps.append(cur)
            cur = []
        cur.append(k)
    if cur:
        steps.append(cur)
    return steps


def load(path):
    """The decode steps of a trace: lists of (start, end, "name (grid)")."""
    steps = spans(path)[:-1]  # the last span may be cut off by the end of the trace
    if not steps:
        sys.exit(f"{path}: no embed-delimited steps in the trace")
    n = collections.Counter(len(s) for s in steps).most_common(1)[0][0]
    dec = [s for s in steps if len(s) == n][1:]  # the first may be the eager step
    if not dec:
        sys.exit(f"{path}: no repeated step shape")
    return dec


def gaps(step):
    """Per kernel of a step, in order: (name, µs it adds = its end minus its predecessor's
    end, the first kernel's own span; µs span)."""
    return [(name, (en - (step[i - 1][1] if i else st)) / 1e3, (en - st) / 1e3)
            for i, (st, en, name) in enumerate(step)]


def added(dec):
    """Per kernel: (calls per step, µs added per step, µs span per call)."""
    add = collections.defaultdict(float)
    span = collections.defaultdict(float)
    cnt = collections.Counter()
    for s in dec:
        for name, a, sp in gaps(s):
            add[name] += a
            span[name] += sp
            cnt[name] += 1
    m = len(dec)
    return {k: (cnt[k] / m, add[k] / m, span[k] / cnt[k]) for k in add}


def main(path, top):
    dec = load(path)
    n, m = len(dec[0]), len(dec)
    total = sum((s[-1][1] - s[0][0]) / 1e3 for s in dec) / m
    st = added(dec)
    print(f"{m} decode steps of {n} kernels; embed start to last end: {total:.1f} us per step")
    if "--vs" in sys.argv:
        other = added(load(sys.argv[sys.argv.index("--vs") + 1]))
        print(f"{'kernel (grid)':60s} {'n':>4s} {'us/call':>8s} {'vs':>8s} {'diff':>7s} {'us/step diff':>12s}")
        keys = sorted(set(st) | set(other), key=lambda k: -max(st.get(k, (0, 0, 0))[1], other.get(k, (0, 0, 0))[1]))
        for k in keys[:top]:
            c, a, _ = st.get(k, (0, 0.0, 0))
            c2, b, _ = other.get(k, (0, 0.0, 0))
            pa, pb = (a / c if c else 0.0), (b / c2 if c2 else 0.0)
            print(f"{k:60s} {max(c, c2):4.0f} {pa:8.2f} {pb:8.2f} {pb - pa:+7.2f} {b - a:+12.1f}")
        print(f"{'sum':60s} {'':4s} {'':8s} {'':8s} {'':7s} {sum(v[1] for v in other.values()) - sum(v[1] for v in st.values()):+12.1f}")
        return
    print(f"{'kernel (grid)':60s} {'n':>4s} {'us/step':>8s} {'us/call':>8s} {'span':>7s}")
    for k in sorted(st, key=lambda k: -st[k][1])[:top]:
        c, a, sp = st[k]
        print(f"{k:60s} {c:4.0f} {a:8.1f} {a / c:8.2f} {sp:7.2f}")
    print(f"{'sum':60s} {'':4s} {sum(v[1] for v in st.values()):8.1f}")
    if "--order" in sys.argv:
        per_step = [gaps(s) for s in dec]
        for i in range(n):
            a = sum(g[i][1] for g in per_step) / m
            print(f"{i:4d} {dec[0][i][2]:60s} {a:7.2f}")


if __name__ == "__main__":
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 40
    main(sys.argv[1], top)
