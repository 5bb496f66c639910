#!/usr/bin/env python3
"""Load generator for `ferrite serve` (or any OpenAI-compatible server).

Sends N streaming /v1/completions requests at concurrency C, each with a prompt of about
P tokens (token ids, so the length is exact) and G generated tokens (ignore_eos), and reports
output tokens/s, time to first token and inter-token latency (p50/p99), prompt tokens the
server's prefix cache served (`usage.prompt_tokens_details.cached_tokens`), and errors.
`--shared-prefix S`: every prompt starts with the same S tokens (a system prompt), then its
own. Standard library only.

    python3 tools/loadgen.py --url http://127.0.0.1:8080 -n 32 -c 8 --prompt-tokens 128 --gen-tokens 64
"""

import argparse
import concurrent.futures
import json
import random
import time
import urllib.request


def percentile(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def one(args, model, seed):
    rng = random.Random(seed)
    # Ordinary-word token ids well inside any vocabulary; distinct per request.
    shared = random.Random(-1)
    prefix = [shared.randrange(1000, 20000) for _ in range(min(args.shared_prefix, args.prompt_tokens))]
    prompt = prefix + [rng.randrange(1000, 20000) for _ in range(args.prompt_tokens - len(prefix))]
    body = {"model": model, "prompt": prompt, "max_tokens": args.gen_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(args.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    if args.api_key:
        req.add_header("Authorization", f"Bearer {args.api_key}")
    t0 = time.perf_counter()
    times = []
    cached = 0
    with urllib.request.urlopen(req, timeout=args.timeout) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
    if not times:
        raise RuntimeError("no tokens")
    ttft = times[0] - t0
    itl = [b - a for a, b in zip(times, times[1:])]
    return ttft, itl, args.gen_tokens, cached


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", help="default: the first model the server lists")
    ap.add_argument("--api-key")
    ap.add_argument("-n", "--requests", type=int, default=32)
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="the first S prompt tokens are the same in every request")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args()

    model = args.model
    if not model:
        req = urllib.request.Request(args.url + "/v1/models")
        if args.api_key:
            req.add_header("Authorization", f"Bearer {args.api_key}")
        with urllib.request.urlopen(req, timeout=30) as r:
            model = json.load(r)["data"][0]["id"]

    t0 = time.perf_counter()
    ttfts, itls, tokens, errors, cached = [], [], 0, [], 0
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as ex:
        futs = [ex.submit(one, args, model, i) for i in range(args.requests)]
        for f in concurrent.futures.as_completed(futs):
            try:
                ttft, itl, n, c = f.result()
                cached += c
                ttfts.append(ttft)
                itls.extend(itl)
                tokens += n
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                errors.append(str(e))
    wall = time.perf_counter() - t0
    s = {
        "model": model, "requests": args.requests, "concurrency": args.concurrency,
        "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
        "shared_prefix": args.shared_prefix, "cached_prompt_tokens": cached,
        "wall_s": round(wall, 2), "output_tok_s": round(tokens / wall, 1),
        "ttft_p50_ms": round(1000 * percentile(ttfts, 50), 1),
        "ttft_p99_ms": round(1000 * percentile(ttfts, 99), 1),
        "itl_p50_ms": round(1000 * percentile(itls, 50), 1),
        "itl_p99_ms": round(1000 * percentile(itls, 99), 1),
        "errors": len(errors),
    }
    if args.json:
        print(json.dumps(s))
    else:
        for k, v in s.items():
            print(f"{k:>14}: {v}")
        for e in errors[:5]:
            print("error:", e)


if __name__ == "__main__":
    main()
