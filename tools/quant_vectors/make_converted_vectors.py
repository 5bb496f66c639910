#!/usr/bin/env python3
"""Test vectors for the ggml types ferrite converts at load (q5_0, q3_K, iq4_nl: to q8_0 or
q6_K without loss; crates/formats/src/quant/converted.rs), made by an independent
implementation: gguf-py's numpy dequantizers, as make_vectors.py does for the types ferrite
computes with (same block generator; a seed of its own, so that file's vectors are unchanged).

Output: crates/formats/tests/data/quant_vectors/converted.json: for each type N_BLOCKS random
blocks (f16 scale fields finite) and their f32 values from `gguf.quants.dequantize`, as
little-endian hex.

Usage: pip install gguf==0.19.0 numpy && python3 tools/quant_vectors/make_converted_vectors.py
"""

import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_vectors as mv  # noqa: E402

SEED = 20261207
TYPES = [("q5_0", T.Q5_0), ("q3_K", T.Q3_K), ("iq4_nl", T.IQ4_NL)]
mv.F16_FIELDS.update({"q5_0": [0], "q3_K": [108], "iq4_nl": [0]})


def main():
    rng = np.random.default_rng(SEED)
    types = []
    for name, qtype in TYPES:
        raw, n = mv.random_blocks(rng, name, qtype)
        deq = quants.dequantize(raw, qtype).astype(np.float32).reshape(-1)
        assert deq.size == n
        types.append(
            {
                "type": name,
                "n": int(n),
                "data": raw.tobytes().hex(),
                "f32_bits": deq.astype("<f4").tobytes().hex(),
            }
        )
        print(f"{name}: {n} values")
    mv.write_vectors("converted.json", "tools/quant_vectors/make_converted_vectors.py", SEED, types)


if __name__ == "__main__":
    main()
