#!/usr/bin/env python3
"""Regenerates the performance table in README.md from bench/results.jsonl.

The table sits between the markers `<!-- perf-table:begin -->` and `<!-- perf-table:end -->`;
everything between them is replaced, nothing else in the README is touched. For each
(device, model, quant, test, depth) the newest ferrite record is shown next to llama.cpp's
figure on the same card where one is known (from ../shared/DEVICE.md's table, copied below).

Usage: python3 tools/perf_table.py [--check]   (--check: exit 1 if the README is stale)
"""
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results.jsonl"
README = ROOT / "README.md"
BEGIN, END = "<!-- perf-table:begin -->", "<!-- perf-table:end -->"

# llama.cpp on the H200 (built for sm_90, flash attention on, all layers on the GPU; random-weight
# models with real quant mixes), tokens/s. Key: (model, quant, test, depth).
LLAMA_CPP_H200 = {
    ("qwen3-8b", "Q4_K_M", "pp512", 0): 9188,
    ("qwen3-8b", "Q4_K_M", "tg128", 0): 261,
    ("qwen3-8b", "Q8_0", "pp512", 0): 10480,
    ("qwen3-8b", "Q8_0", "tg128", 0): 241,
    ("qwen3-8b", "F16", "pp512", 0): 19711,
    ("qwen3-8b", "F16", "tg128", 0): 202,
    ("qwen3-30b-a3b", "Q4_K_M", "pp512", 0): 10888,
    ("qwen3-30b-a3b", "Q4_K_M", "tg128", 0): 302,
    ("qwen3-8b", "Q4_K_M", "tg128", 8192): 223,
    ("qwen3-8b", "Q4_K_M", "tg128", 32768): 165,
    ("qwen3.5-9b", "Q4_K_M", "pp512", 0): 7861,
    ("qwen3.5-9b", "Q4_K_M", "tg128", 0): 234,
    ("qwen3.5-9b", "Q4_K_M", "tg128", 8192): 227,
    ("qwen3.5-35b-a3b", "Q4_K_M", "pp512", 0): 5357,
    ("qwen3.5-35b-a3b", "Q4_K_M", "tg128", 0): 246,
}


# `ferrite bench --gate-tokens` default: records without the field ran it.
DEFAULT_GATE_TOKENS = 32


def load_baselines():
    """llama.cpp CPU baselines measured on the development machine (bench/llamacpp_cpu_baseline.jsonl)."""
    out = {}
    p = ROOT / "bench" / "llamacpp_cpu_baseline.jsonl"
    if p.exists():
        for line in p.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                out[(r.get("model", "").lower(), r.get("quant"), r.get("test"), r.get("threads"))] = r["tokens_per_s"]
    return out


def table():
    rows = {}
    for line in RESULTS.read_text().splitlines() if RESULTS.exists() else []:
        if not line.strip():
            continue
        r = json.loads(line)
        if r.get("engine") != "ferrite":
            continue
        quant = r.get("quant") + (f" (KV {r['kv_cache']})" if r.get("kv_cache") else "")
        quant += f" (cache {r['context']})" if r.get("context") else ""
        key = (r.get("gpu", "?"), r.get("backend", "?"), r.get("model"), quant, r.get("test"), r.get("depth", 0))
        rows[key] = r  # newest wins (the file is append-only)
    cpu_base = load_baselines()
    short_gates = set()
    lines = [
        "| date | device | model | quant | test | depth | ferrite tok/s | % of roofline | llama.cpp tok/s (same device) | git |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(rows):
        r = rows[key]
        gpu, backend, model, quant, test, depth = key
        peer = LLAMA_CPP_H200.get((model, quant, test, depth)) if "H200" in gpu else None
        if peer is None and backend.startswith("cpu"):
            threads = backend.split("(")[-1].split()[0] if "(" in backend else None
            for (m, q, t, th), v in cpu_base.items():
                if q == quant and t == test and str(th) == threads and m.split("-")[0] in model:
                    peer = round(v, 1)
        roof = r.get("roofline_pct")
        gate = r.get("gate_tokens", DEFAULT_GATE_TOKENS)
        mark = "" if gate >= DEFAULT_GATE_TOKENS else " ¹"
        if mark:
            short_gates.add(gate)
        lines.append(
            f"| {r['date'][:10]} | {gpu} ({backend}) | {model} | {quant} | {test} | {depth} | "
            f"{r['tokens_per_s']:.1f}{mark} | {'' if roof is None else f'{roof:.1f}%'} | {'' if peer is None else peer} | {r.get('git_sha', '')[:12]} |"
        )
    if short_gates:
        lines.append("")
        lines.append(
            f"¹ prefill/decode gate run at {', '.join(map(str, sorted(short_gates)))} tokens instead of "
            f"{DEFAULT_GATE_TOKENS}: a prompt that short runs the decode kernels (≤ 16 rows), so the "
            "gate checks their row-count invariance, not the prefill kernels. On random weights the "
            "model's 32-token gate fails by a near tie of its 256-expert routers, even with exact "
            "prefill (FERRITE_MMQ=1: the decode's token ranked 7.3e-3 below the prefill's). See "
            "crates/backend/src/cuda/MOE.md."
        )
    return "\n".join(lines)


def main():
    text = README.read_text()
    if BEGIN not in text or END not in text:
        sys.exit(f"README.md has no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{table()}\n{END}{tail}"
    if "--check" in sys.argv:
        sys.exit(0 if new == text else 1)
    README.write_text(new)


if __name__ == "__main__":
    main()
