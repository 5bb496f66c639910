#!/usr/bin/env python3
"""One decode step's kernels from an ncu CSV, grouped by kernel and grid.

On the H200 machine (ncu reads the counters there; leave the clocks alone):

    ncu --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
        --launch-skip 2600 --launch-count 900 \
        ferrite bench --model M --reps 1 --prompt-tokens 16 --gen-tokens 8 --gate-tokens 2 > ncu.csv

then `python3 tools/h200/ncu_step.py ncu.csv`. The step is the span between two consecutive
`embed` launches. Kernels are profiled one at a time (serialised, no PDL overlap), so the
sum is above the step time a graph replay takes; the per-kernel times and bytes show which
kernels run under the bandwidth and which are pure latency.
"""
import collections
import csv
import sys


def main(path):
    lines = [l for l in open(path) if l.startswith('"')]
    rows = list(csv.reader(lines))
    hdr, rows = rows[0], rows[1:]
    k = collections.OrderedDict()
    for r in rows:
        d = dict(zip(hdr, r))
        e = k.setdefault(int(d["ID"]), {"name": d["Kernel Name"].split("(")[0], "grid": d["Grid Size"]})
        v = float(d["Metric Value"].replace(",", ""))
        unit = d["Metric Unit"]
        if d["Metric Name"] == "gpu__time_duration.sum":
            e["us"] = v * {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(unit, 1e-3)
        else:
            e["bytes"] = v * {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}.get(unit, 1)
    ids = list(k)
    emb = [i for i in ids if k[i]["name"] == "embed"]
    if len(emb) < 2:
        sys.exit("fewer than two embed launches: widen --launch-count")
    agg = collections.OrderedDict()
    tot_us = tot_b = 0.0
    for i in ids[ids.index(emb[0]) : ids.index(emb[1])]:
        e = k[i]
        a = agg.setdefault(f'{e["name"]} {e["grid"]}', [0, 0.0, 0.0])
        a[0] += 1
        a[1] += e.get("us", 0.0)
        a[2] += e.get("bytes", 0.0)
        tot_us += e.get("us", 0.0)
        tot_b += e.get("bytes", 0.0)
    print(f"one step: {sum(a[0] for a in agg.values())} kernels, {tot_us:.1f} us serialised, {tot_b / 1e6:.1f} MB read")
    print(f'{"kernel grid":52s} {"n":>4s} {"total us":>9s} {"avg us":>7s} {"GB/s":>6s} {"MB each":>8s}')
    for name, (n, us, b) in sorted(agg.items(), key=lambda x: -x[1][1]):
        print(f"{name:52s} {n:4d} {us:9.1f} {us / n:7.2f} {b / us / 1e3 if us else 0:6.0f} {b / n / 1e6:8.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
