#!/usr/bin/env python3
"""An oracle for Llama 3.1's "llama3" RoPE scaling, from check_oracle.py's float64 numpy
Llama (which matches transformers on the unscaled fixtures to NMSE ~1e-12) with the scaling
as transformers' `_compute_llama3_parameters` defines it.

The llama-tiny fixture's weights and tokens, with its `rope_parameters` replaced by
LLAMA3 (original context 1024 over head_dim 32 and theta 1e4: frequencies 0-6 keep their
value, 7-8 are blended, 9-15 are slowed 8x). Writes into tests/data/oracle/llama-tiny/:
`llama3.json` (the rope_parameters) and `llama3_oracle.safetensors` (`tokens`, `logits`).
Numpy only. A transformers oracle of the same (make_oracle.py, on a machine with torch) is
still to make.
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_oracle import forward, nmse, read_safetensors  # noqa: E402
from mtp_oracle import write_safetensors  # noqa: E402

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


def main():
    d = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "data",
                     "oracle", "llama-tiny")
    cfg = json.load(open(os.path.join(d, "config.json")))
    W = read_safetensors(os.path.join(d, "model.safetensors"))
    tokens = read_safetensors(os.path.join(d, "oracle.safetensors"))["tokens"]
    plain, _, _ = forward(cfg, W, tokens)
    cfg["rope_parameters"] = LLAMA3
    logits, _, _ = forward(cfg, W, tokens)
    print(f"{len(tokens)} tokens; NMSE of the scaled logits against the unscaled: "
          f"{nmse(logits, plain):.3e}")
    with open(os.path.join(d, "llama3.json"), "w") as f:
        json.dump(LLAMA3, f, indent=1)
        f.write("\n")
    write_safetensors(os.path.join(d, "llama3_oracle.safetensors"),
                      {"tokens": ("I64", tokens), "logits": ("F32", logits)})


if __name__ == "__main__":
    main()
