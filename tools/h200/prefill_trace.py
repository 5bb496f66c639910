#!/usr/bin/env python3
"""Where a prefill forward's time goes, from a kernel_trace.c log.

    python3 tools/h200/prefill_trace.py trace.txt [--top N]

The forward is the span from one `embed` kernel to the next whose kernels ran longest (`busy`:
with `bench`, the pp test's forward; decode steps and the gate's short forward ran far less,
though a host stall can make the gate's span the longest in wall time). Within it kernel i "adds" end[i] - end[i-1]
(kernel_trace.py explains why the end-to-end gaps partition the span under PDL). Printed per
kernel name (grids merged: prefill grids vary with the weight shape): calls, µs added in
total, µs per call, and the share of the forward.
"""
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_trace  # noqa: E402  (the trace reader, beside this file)


def busy(span):
    """The time a span's kernels ran, overlaps counted once and gaps not at all: the pp forward
    has the most, where the longest wall span can be a short forward followed by a host stall
    (a bench's gate forward: its last kernel's end comes ~9 ms late)."""
    t, prev = 0, span[0][0]
    for s, e, _ in span:
        t += max(0, e - max(s, prev))
        prev = max(prev, e)
    return t


def main(path, top):
    fwd = max(kernel_trace.spans(path, grid=False), key=busy)
    total = (fwd[-1][1] - fwd[0][0]) / 1e3
    add = collections.defaultdict(float)
    n = collections.Counter()
    prev = fwd[0][0]
    for s, e, name in fwd:
        add[name] += max(0, e - prev) / 1e3
        n[name] += 1
        prev = max(prev, e)
    print(f"forward: {len(fwd)} kernels, {total:.1f} us")
    for name, us in sorted(add.items(), key=lambda x: -x[1])[:top]:
        print(f"{name:48s} {n[name]:5d} calls {us:9.1f} us {us / n[name]:8.2f} us/call {100 * us / total:5.1f}%")


if __name__ == "__main__":
    a = sys.argv[1:]
    top = int(a[a.index("--top") + 1]) if "--top" in a else 30
    main(a[0], top)
