#!/usr/bin/env python3
"""When the MoE prediction's side launches run, against the decode chain, from a kernel_trace.c log.

    python3 tools/h200/side_trace.py trace.txt [--router NAME] [--gu NAME]

FERRITE_MOE_PREDICT's launches (moe_predict, moe_prefetch_experts) run on a stream beside the
captured decode step (MOE.md, 63rd and 64th sessions). The prefetch helps a MoE layer only if its
bytes are in L2 before that layer's gate/up reads them, i.e. before the router launch ahead of
the gate/up ends. For each prefetch launch this takes the first router launch (a kernel whose name
starts with --router, default add_rms_norm_gemv_f32) ending after the prefetch began, and the first
gate/up launch (--gu, default gemvq_moe_gu) ending after that router, and prints the medians and
quartiles (µs) of:
  predict: its span (start to end), and its start after the chain kernel that ended last before it;
  prefetch: its span, its start after the predict's end, its end against the router's end
    (negative: done before the gate/up could read), and the gate/up's end after the router's.
Trace lines: start_ns end_ns grid_x grid_y grid_z name.
"""
import statistics
import sys


def quart(v):
    if not v:
        return "n/a"
    v = sorted(v)
    q = lambda f: v[min(len(v) - 1, int(f * len(v)))]
    return f"median {statistics.median(v):8.2f}  q1 {q(0.25):8.2f}  q3 {q(0.75):8.2f}  n {len(v)}"


def main():
    path = sys.argv[1]
    def opt(name, default):
        return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default

    router = opt("--router", "add_rms_norm_gemv_f32")
    gu = opt("--gu", "gemvq_moe_gu")
    ks = []
    for line in open(path):
        p = line.split(None, 5)
        if len(p) == 6:
            ks.append((int(p[0]), int(p[1]), p[5].strip()))
    ks.sort()
    side = lambda n: n.startswith("moe_predict") or n.startswith("moe_prefetch_experts")
    chain = [k for k in ks if not side(k[2])]
    routers = [k for k in chain if k[2].startswith(router)]
    gus = [k for k in chain if k[2].startswith(gu)]
    preds = [k for k in ks
             if k[2].startswith("moe_predict") and not k[2].startswith("moe_predict_hits")]
    pfs = [k for k in ks if k[2].startswith("moe_prefetch_experts")]
    if not pfs and not preds:
        sys.exit(f"{path}: no side launches in the trace")
    pred_span, pred_delay = [], []
    for s, e, _ in preds:
        before = [c[1] for c in chain if c[1] <= s]
        pred_span.append((e - s) / 1e3)
        if before:
            pred_delay.append((s - max(before)) / 1e3)
    pf_span, pf_after_pred, pf_vs_router, gu_after_router = [], [], [], []
    for s, e, _ in pfs:
        pf_span.append((e - s) / 1e3)
        pe = [p[1] for p in preds if p[1] <= s]
        if pe:
            pf_after_pred.append((s - max(pe)) / 1e3)
        r = next((r for r in routers if r[1] >= s), None)
        if r is None:
            continue
        pf_vs_router.append((e - r[1]) / 1e3)
        g = next((g for g in gus if g[1] >= r[1]), None)
        if g is not None:
            gu_after_router.append((g[1] - r[1]) / 1e3)
    print(f"predict span                     {quart(pred_span)}")
    print(f"predict start after chain end    {quart(pred_delay)}")
    print(f"prefetch span                    {quart(pf_span)}")
    print(f"prefetch start after predict     {quart(pf_after_pred)}")
    print(f"prefetch end - router end        {quart(pf_vs_router)}")
    print(f"gate/up end - router end         {quart(gu_after_router)}")


if __name__ == "__main__":
    main()
