#!/usr/bin/env python3
"""Reads the block timeline of one decode step (FERRITE_DIAG_TL; DECODE_STEP.md).

Usage: timeline.py ferrite-timeline.tsv [--summary | --launch I | --late I | --marks MODULE | --phases
                                        | --first I --count N]

Stamps: kind 1 a block's PDL wait entry (the block runs, past whatever it issued before its
wait), 2 the wait's return (the predecessor grid has completed), 3 a tensor-core GEMV's block
written its outputs, 4 + k a kernel's TL_MARK(k) (timeline.cuh: points on a block's path
after its wait). A launch is the blocks of one (module, grid, warps a block) in time
order, each block index once. Per launch, in the order the step started them (µs from the
step's first stamp):

  start    the first block's wait entry
  dep      the first wait return: when the predecessor completed (the launch's chain start)
  chain    the next launch's dep minus this one's: the launch's share of the step's chain
  early    blocks that entered their wait before dep (their copies issued under PDL)
  last_in  the last block's wait entry (the last wave's start)
  end      the last block's output stamp (tensor-core GEMVs only)

`--late I`: the SMs of launch I's blocks that entered their wait after its dep (their copies
issued only then), and how many of them ran a block of the launch before it (its blocks'
SMs): a launch whose blocks do not fit beside its predecessor's (MATMUL.md round 74).

`--marks MODULE`: over the launches of MODULE whose blocks stamped TL_MARKs (attention.cu's
decode launch: ATTENTION.md, 33rd session), per mark its first and last block's time from the
launch's dep (mean over the launches, with the last wait return and the next launch's dep):
where the launch's chain goes after its wait.

`--phases`: the one-row tensor-core GEMV blocks (matmul.cu gemvq_tc_block, whose three marks
are 0 x staged, 1 the tile's copy waited for, 2 warp 0's super-block loop done; DECODE_STEP.md,
68th session), per kind of launch and per wave (the blocks that entered their wait before the
launch's dep, whose copies went out under PDL, and the later ones), the median µs of each
phase of a block: `dep` its wait entry to the wait's return, `x` the return to x staged, `tile`
x staged to the copy waited for (0: it had landed), `loop` the super-block loop, `store` the
loop's end to the outputs written; `copy` the wait entry (the copies were issued just before
it) to the copy waited for, an upper bound of the copy's time where `tile` > 0; `block` the wait
entry to the outputs.
"""
import argparse
import collections
import statistics
import sys


def read(path):
    rows = []
    with open(path) as f:
        next(f)
        for line in f:
            m, kind, t, sm, warps, grid, block = line.split("\t")
            rows.append((int(t), m, int(kind), int(sm), int(warps), int(grid), int(block)))
    rows.sort()
    return rows


def launches(rows):
    """Groups the stamps into launches: per (module, grid, warps), a block index seen twice
    (wait entry) starts the next launch of that key."""
    open_l = {}
    out = []
    for t, m, kind, sm, warps, grid, block in rows:
        key = (m, grid, warps)
        cur = open_l.get(key)
        if kind == 1:
            if cur is None or block in cur["in"]:
                cur = {"key": key, "in": {}, "out": {}, "end": {}, "sm": {}, "marks": {}}
                open_l[key] = cur
                out.append(cur)
            cur["in"][block] = t
            cur["sm"][block] = sm
        elif cur is not None and kind in (2, 3):
            d = cur["out"] if kind == 2 else cur["end"]
            d.setdefault(block, t)
        elif cur is not None and kind >= 4:
            cur["marks"].setdefault(kind - 4, {}).setdefault(block, t)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--first", type=int, default=0, help="first launch to print")
    ap.add_argument("--count", type=int, default=10**9, help="launches to print")
    ap.add_argument("--summary", action="store_true", help="per kind of launch: mean chain and early blocks")
    ap.add_argument("--launch", type=int, help="one launch's blocks: starts and ends per 0.5 µs from its dep")
    ap.add_argument("--late", type=int, help="one launch's blocks that entered after its dep: their SMs")
    ap.add_argument("--marks", help="a module's launches with TL_MARKs: each mark's first and last block from dep")
    ap.add_argument("--phases", action="store_true", help="the tensor-core GEMV blocks' phases, per launch kind and wave")
    a = ap.parse_args()
    rows = read(a.path)
    if not rows:
        sys.exit("no stamps")
    # The step's first wait entry (an output stamp of a block that never took its slots
    # before, as a kernel without a PDL wait would, carries no time of this step).
    t0 = min(r[0] for r in rows if r[2] == 1)
    ls = launches(rows)
    ls.sort(key=lambda l: min(l["in"].values()))
    for l in ls:
        l["start"] = min(l["in"].values())
        l["dep"] = min(l["out"].values()) if l["out"] else None
        l["last_in"] = max(l["in"].values())
        l["end_t"] = max(l["end"].values()) if l["end"] else None
        l["early"] = sum(1 for t in l["in"].values() if l["dep"] is not None and t < l["dep"])
    deps = [l for l in ls if l["dep"] is not None]
    deps.sort(key=lambda l: l["dep"])
    for i, l in enumerate(deps):
        l["chain"] = (deps[i + 1]["dep"] - l["dep"]) if i + 1 < len(deps) else None
    us = lambda t: "" if t is None else f"{(t - t0) / 1000:9.2f}"
    if a.launch is not None:
        l = ls[a.launch]
        base = l["dep"] if l["dep"] is not None else l["start"]
        hist = collections.Counter()
        for t in l["in"].values():
            hist[("in", (t - base) // 500)] += 1
        for t in l["end"].values():
            hist[("end", (t - base) // 500)] += 1
        bins = sorted({b for _, b in hist})
        print(f"launch {a.launch} {l['key']}: blocks by 0.5 µs bin from dep (negative: before it)")
        for b in bins:
            print(f"{b * 0.5:7.1f} in {hist[('in', b)]:5d} end {hist[('end', b)]:5d}")
        return
    if a.late is not None:
        if a.late == 0:
            sys.exit("--late: launch 0 has no launch before it")
        l, prev = ls[a.late], ls[a.late - 1]
        if l["dep"] is None:
            sys.exit(f"--late: launch {a.late} has no wait return")
        late = sorted(l["sm"][b] for b, t in l["in"].items() if t >= l["dep"])
        prev_sms = set(prev["sm"].values())
        print(f"launch {a.late} {l['key']}: {len(late)} of {len(l['in'])} blocks entered at or after its dep")
        print(f"  their SMs: {late}")
        print(f"  on an SM of launch {a.late - 1} {prev['key']}: {sum(1 for s in late if s in prev_sms)}")
        return
    if a.marks is not None:
        rows_m = collections.defaultdict(list)  # name -> values (µs from dep), one per launch
        n = 0
        for l in deps:
            if l["key"][0] != a.marks or not l["marks"] or l.get("chain") is None:
                continue
            n += 1
            dep = l["dep"]
            rows_m["wait return, last"].append((max(l["out"].values()) - dep) / 1000)
            for k, blocks in sorted(l["marks"].items()):
                ts = sorted(blocks.values())
                rows_m[f"mark {k}, first"].append((ts[0] - dep) / 1000)
                rows_m[f"mark {k}, last"].append((ts[-1] - dep) / 1000)
            rows_m["next launch's dep"].append(l["chain"] / 1000)
        if not n:
            sys.exit(f"--marks: no launch of {a.marks} has marks")
        print(f"{a.marks}: µs from the launch's dep, over {n} launches")
        print(f"{'':<24}{'mean':>8}{'min':>8}{'max':>8}")
        for name, v in rows_m.items():
            print(f"{name:<24}{sum(v) / len(v):>8.2f}{min(v):>8.2f}{max(v):>8.2f}")
        return
    if a.phases:
        phases(deps)
        return
    if a.summary:
        agg = collections.OrderedDict()
        for l in deps:
            k = l["key"]
            s = agg.setdefault(k, [0, 0.0, 0, 0.0, 0])
            s[0] += 1
            if l.get("chain") is not None:
                s[1] += l["chain"] / 1000
            s[2] += l["early"]
            if l["end_t"] is not None:
                s[3] += (l["end_t"] - l["dep"]) / 1000
                s[4] += 1
        print(f"{'module':<12}{'grid':>7}{'warps':>6}{'n':>5}{'chain µs':>10}{'total':>9}{'early':>7}{'dep→end':>9}")
        for (m, grid, warps), (n, ch, early, de, ne) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
            print(f"{m:<12}{grid:>7}{warps:>6}{n:>5}{ch / n:>10.2f}{ch:>9.1f}{early / n:>7.0f}"
                  + (f"{de / ne:>9.2f}" if ne else ""))
        step = (deps[-1]["dep"] - deps[0]["dep"]) / 1000
        print(f"step (first dep to last dep): {step:.1f} µs over {len(deps)} launches")
        return
    print(f"{'#':>4} {'module':<12}{'grid':>7}{'warps':>6}{'start':>10}{'dep':>10}{'chain':>8}{'early':>7}{'last_in':>10}{'end':>10}")
    for i, l in enumerate(ls[a.first:a.first + a.count], a.first):
        m, grid, warps = l["key"]
        ch = "" if l.get("chain") is None else f"{l['chain'] / 1000:8.2f}"
        print(f"{i:>4} {m:<12}{grid:>7}{warps:>6}{us(l['start'])}{us(l['dep']) or ' ' * 10:>10}{ch:>8}"
              f"{l['early']:>7}{us(l['last_in'])}{us(l['end_t']):>10}")


def phases(deps):
    """--phases (see the module's doc): per (launch kind, wave) the median of each block phase."""
    names = ["dep", "x", "tile", "loop", "store", "copy", "block"]
    agg = collections.OrderedDict()  # (key, wave) -> name -> values (µs)
    for l in deps:
        m = l["marks"]
        if l["key"][0] != "matmul" or not all(k in m for k in (0, 1, 2)):
            continue
        for b, t_in in l["in"].items():
            t_out, end = l["out"].get(b), l["end"].get(b)
            t0, t1, t2 = m[0].get(b), m[1].get(b), m[2].get(b)
            if None in (t_out, end, t0, t1, t2):
                continue
            wave = "early" if t_in < l["dep"] else "late"
            v = agg.setdefault((l["key"], wave), {n: [] for n in names})
            for n, d in zip(names, [t_out - t_in, t0 - t_out, t1 - t0, t2 - t1, end - t2, t1 - t_in, end - t_in]):
                v[n].append(d / 1000)
    if not agg:
        sys.exit("--phases: no matmul launch has the three marks (FERRITE_DIAG_TL on this build?)")
    print("median µs a block, per launch kind (module, grid, warps) and wave")
    print(f"{'launch':<26}{'wave':>6}{'blocks':>8}" + "".join(f"{n:>7}" for n in names))
    for ((mod, grid, warps), wave), v in sorted(agg.items(), key=lambda kv: (-len(kv[1]["dep"]), kv[0][1])):
        print(f"{f'{mod} {grid} x {warps}':<26}{wave:>6}{len(v['dep']):>8}"
              + "".join(f"{statistics.median_high(v[n]):>7.2f}" for n in names))


if __name__ == "__main__":
    main()
