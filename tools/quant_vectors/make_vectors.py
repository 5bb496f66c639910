#!/usr/bin/env python3
"""Test vectors for ferrite's ggml quant types, made by an independent implementation.

Uses the numpy (de)quantizers of the `gguf` Python package (gguf-py, from llama.cpp),
generated with gguf 0.19.0 / numpy 2.4.6 (the versions are also recorded in the output).

For each type (f32 f16 bf16 q4_0 q4_1 q8_0 q4_K q5_K q6_K mxfp4) it writes, with a fixed seed:

- `dequant`: N_BLOCKS random blocks (random bytes, except that f16 scale fields d/dmin/m
  are finite, sane values: random bits could be NaN/inf) and their f32 values from
  `gguf.quants.dequantize`;
- `quant`: N_BLOCKS blocks' worth of f32 input (gaussian rows at several magnitudes plus
  edge cases: all zero, constant, single outlier, all positive, all negative) and, where
  gguf-py implements the quantizer (f32 f16 bf16 q4_0 q4_1 q8_0 mxfp4; not the K-quants in
  0.19.0), the bytes of `gguf.quants.quantize`. The inputs are kept for every type so
  the Rust tests can also check round-trip error.

Output: crates/formats/tests/data/quant_vectors/vectors.json (bytes and f32 bit patterns
as little-endian hex, so comparisons are bit-exact).

Usage: pip install gguf numpy && python3 tools/quant_vectors/make_vectors.py
"""

import json
import os
from importlib.metadata import version

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

SEED = 20240611
N_BLOCKS = 16
# pseudo-block for the float types so they get a comparable amount of data
FLOAT_ELEMS = 16 * 32

TYPES = [
    ("f32", T.F32),
    ("f16", T.F16),
    ("bf16", T.BF16),
    ("q4_0", T.Q4_0),
    ("q4_1", T.Q4_1),
    ("q8_0", T.Q8_0),
    ("q4_K", T.Q4_K),
    ("q5_K", T.Q5_K),
    ("q6_K", T.Q6_K),
    # Last, so that adding it left the other types' vectors unchanged.
    ("mxfp4", T.MXFP4),
]

# byte offsets of the f16 scale fields in each block (d, dmin/m); they get sane values
F16_FIELDS = {
    "q4_0": [0],
    "q4_1": [0, 2],
    "q8_0": [0],
    "q4_K": [0, 2],
    "q5_K": [0, 2],
    "q6_K": [208],
    "mxfp4": [],
}

# byte offsets of E8M0 scale fields: exponents 2^-30 .. 2^10 (random bytes reach 2^128,
# where the products overflow)
E8M0_FIELDS = {"mxfp4": [0]}


def sane_f16(rng, n):
    """Finite f16 values with magnitudes 2^-14 .. 2^0 and random sign, as raw bytes."""
    mag = np.exp2(rng.uniform(-14, 0, n)).astype(np.float16)
    sign = np.where(rng.random(n) < 0.5, -1, 1).astype(np.float16)
    return (mag * sign).astype(np.float16).view(np.uint8).reshape(n, 2)


def random_blocks(rng, name, qtype):
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if block_size == 1:
        n = FLOAT_ELEMS
        raw = rng.integers(0, 256, n * type_size, dtype=np.uint8)
        if name == "f16":
            # random f16 bits, but no NaN (inf and subnormals are kept)
            h = raw.view(np.uint16)
            nan = (h & 0x7C00) == 0x7C00
            nan &= (h & 0x03FF) != 0
            h[nan] &= 0xFC00 | 0x0000  # turn NaN into +-inf
            raw = h.view(np.uint8)
        elif name == "f32":
            f = raw.view(np.uint32)
            nan = ((f & 0x7F800000) == 0x7F800000) & ((f & 0x007FFFFF) != 0)
            f[nan] &= 0xFF800000
            raw = f.view(np.uint8)
        # bf16: every bit pattern is fine (decoding is a shift, NaN payloads included)
        return raw, n
    blocks = rng.integers(0, 256, (N_BLOCKS, type_size), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        blocks[:, off : off + 2] = sane_f16(rng, N_BLOCKS)
    for off in E8M0_FIELDS.get(name, []):
        blocks[:, off] = rng.integers(97, 138, N_BLOCKS, dtype=np.uint8)
    return blocks.reshape(-1), N_BLOCKS * block_size


def quant_inputs(rng, n_elems, block_size):
    """Rows to quantize: gaussian blocks at different scales plus edge-case blocks."""
    bs = max(block_size, 32)
    nb = n_elems // bs
    x = np.empty((nb, bs), dtype=np.float32)
    for i in range(nb):
        kind = i % 8
        if kind == 0:
            x[i] = 0.0
        elif kind == 1:
            x[i] = np.float32(rng.normal())  # constant
        elif kind == 2:
            x[i] = rng.normal(0, 0.02, bs)
            x[i, rng.integers(bs)] = rng.normal(0, 2.0)  # one outlier
        elif kind == 3:
            x[i] = np.abs(rng.normal(0, 1, bs)) + 0.5  # all positive
        elif kind == 4:
            x[i] = -np.abs(rng.normal(0, 1, bs)) - 0.5  # all negative
        else:
            x[i] = rng.normal(0, 10.0 ** rng.uniform(-3, 1), bs)
    return x.reshape(-1)


def main():
    rng = np.random.default_rng(SEED)
    types = []
    for name, qtype in TYPES:
        block_size, _ = GGML_QUANT_SIZES[qtype]
        raw, n = random_blocks(rng, name, qtype)
        deq = quants.dequantize(raw, qtype).astype(np.float32).reshape(-1)
        assert deq.size == n
        x = quant_inputs(rng, N_BLOCKS * max(block_size, 32), block_size)
        try:
            with np.errstate(over="ignore"):
                q = quants.quantize(x.reshape(1, -1), qtype).reshape(-1).view(np.uint8)
            qhex = q.tobytes().hex()
        except NotImplementedError:
            qhex = None
        types.append(
            {
                "type": name,
                "dequant": {
                    "n": int(n),
                    "data": raw.tobytes().hex(),
                    "f32_bits": deq.astype("<f4").tobytes().hex(),
                },
                "quant": {
                    "n": int(x.size),
                    "x_f32_bits": x.astype("<f4").tobytes().hex(),
                    # null: gguf-py has no quantizer for this type
                    "data": qhex,
                },
            }
        )
        print(f"{name}: dequant {n} values, quant {x.size} values, reference bytes: {qhex is not None}")
    write_vectors("vectors.json", "tools/quant_vectors/make_vectors.py", SEED, types)


def write_vectors(name, generator, seed, types):
    """The vectors `types` made by `generator` from `seed`, with the versions that made them,
    as crates/formats/tests/data/quant_vectors/NAME."""
    out = {
        "generator": generator,
        "gguf_version": version("gguf"),
        "numpy_version": np.__version__,
        "seed": seed,
        "types": types,
    }
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "crates/formats/tests/data/quant_vectors", name)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes), gguf {out['gguf_version']}")


if __name__ == "__main__":
    main()
