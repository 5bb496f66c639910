#!/usr/bin/env python3
"""GGUF files with q5_0, iq4_nl and q3_K tensors written by llama.cpp's own Python package
(gguf-py's GGUFWriter), run by ferrite (which converts those types at load to q8_0 / q6_K),
against the same model with every such tensor stored as F32 values from gguf-py's
dequantizer: an oracle for the whole path (file layout, conversion, model) that shares no
code with ferrite.

- q5_0 and iq4_nl (32-weight blocks, as F32 rows are summed on the CPU): logits bit-identical;
- with q3_K too (converted to q6_K, whose 256-weight blocks the CPU sums in another order than
  F32's 32-weight ones): logits within SUM_ORDER_TOL of the F32 file's, the same argmax;
- SmolLM2-135M-Instruct (ferrite's default model) with its matrices requantized to q5_0 by
  gguf-py's quantizer still gives its known answer;
- a q2_K tensor (a type neither computed with nor converted) is listed by `info` and refused
  by name by `run`.

Usage: python3 tests/gguf_py/test_converted_types.py [path/to/ferrite]
(default: target/release/ferrite); needs `pip install gguf==0.19.0 numpy`. Plain unittest.
"""

import json
import os
import struct
import subprocess
import sys
import tempfile
import unittest

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants
from gguf.constants import GGML_QUANT_SIZES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("FERRITE_BIN") or os.path.join(ROOT, "target", "release", "ferrite")
TOKENS = "100,2000,345,9999,12,77,4000,31,151,2718"

# Largest |Δlogit| / max |logit| allowed where only the summation order differs (q6_K's
# 256-weight blocks against F32's 32-weight ones): f32 reassociation of dots over at most
# 256 terms errs by ~256 · 2^-24 of Σ|w x| at worst; measured ~2e-7.
SUM_ORDER_TOL = 1e-5

# Per type: the f16 scale's byte offset in a block and its value (weights of at most ~0.04,
# the synthetic model's scale).
SCALE = {T.Q5_0: (0, 0.0025), T.IQ4_NL: (0, 0.0003), T.Q3_K: (108, 0.0003)}


def ferrite(*args):
    r = subprocess.run([BIN, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise AssertionError(f"ferrite {' '.join(args)} failed:\n{r.stderr}")
    return r


def logits(model, out):
    ferrite("logits", "--model", model, "--tokens", TOKENS, "--output", out, "--device", "cpu")
    with open(out, "rb") as f:
        b = f.read()
    n = struct.unpack("<Q", b[:8])[0]
    t = json.loads(b[8 : 8 + n])["logits"]
    s, e = t["data_offsets"]
    return np.frombuffer(b[8 + n + s : 8 + n + e], dtype="<f4").reshape(t["shape"])


def writer_like(r, path):
    """A GGUFWriter at `path` with the metadata of the file `r` reads."""
    w = GGUFWriter(path, bytes(r.fields["general.architecture"].parts[-1]).decode())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vt = f.types[0]
        if vt == GGUFValueType.ARRAY:
            w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1])
        else:
            w.add_key_value(f.name, f.contents(), vt)
    return w


def finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rewrite(src, mixed, f32, with_q3k, seed):
    """`src`'s Q8_0 matrices as random q5_0 / iq4_nl blocks in turn (q3_K where the rows take
    256-blocks and `with_q3k`) into `mixed`, and as gguf-py's dequantization of those blocks
    (F32) into `f32`. The types used."""
    r = GGUFReader(src)
    ws = [writer_like(r, mixed), writer_like(r, f32)]
    rng = np.random.default_rng(seed)
    used, i = set(), 0
    for t in r.tensors:
        shape = [int(x) for x in reversed(t.shape)]  # row-major
        if t.tensor_type != T.Q8_0 or len(shape) < 2:
            for w in ws:
                w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            continue
        q = T.Q3_K if with_q3k and shape[-1] % 256 == 0 else (T.Q5_0, T.IQ4_NL)[i % 2]
        i += 1
        used.add(q.name)
        bs, ts = GGML_QUANT_SIZES[q]
        nb = int(np.prod(shape)) // bs
        blocks = rng.integers(0, 256, (nb, ts), dtype=np.uint8)
        at, d = SCALE[q]
        blocks[:, at : at + 2] = np.full(nb, d, dtype=np.float16).view(np.uint8).reshape(nb, 2)
        raw = blocks.reshape(shape[:-1] + [shape[-1] // bs * ts])
        ws[0].add_tensor(t.name, raw, raw_dtype=q)
        values = quants.dequantize(raw, q).astype(np.float32).reshape(shape)
        ws[1].add_tensor(t.name, values, raw_dtype=T.F32)
    for w in ws:
        finish(w)
    return used


class ConvertedTypes(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        cls.models = {}
        for preset in ("tiny-qwen3", "tiny-qwen3.5"):
            path = os.path.join(cls.dir.name, f"{preset}-q8_0.gguf")
            ferrite("synth", "--preset", preset, "--quant", "Q8_0", "--output", path)
            cls.models[preset] = path

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    def pair(self, preset, with_q3k):
        tag = f"{preset}-{'q3k' if with_q3k else 'nl'}"
        mixed, f32 = (os.path.join(self.dir.name, f"{tag}-{k}.gguf") for k in ("mixed", "f32"))
        used = rewrite(self.models[preset], mixed, f32, with_q3k, seed=len(tag))
        a = logits(mixed, mixed + ".st")
        b = logits(f32, f32 + ".st")
        self.assertTrue(np.isfinite(a).all(), tag)
        return used, a, b

    def test_32_blocks_bit_identical(self):
        for preset in self.models:
            used, a, b = self.pair(preset, with_q3k=False)
            self.assertEqual(used, {"Q5_0", "IQ4_NL"}, preset)
            self.assertTrue(np.array_equal(a.view(np.uint32), b.view(np.uint32)), preset)

    def test_q3_k_within_summation_order(self):
        for preset in self.models:
            used, a, b = self.pair(preset, with_q3k=True)
            self.assertIn("Q3_K", used, preset)
            err = np.abs(a - b).max() / np.abs(b).max()
            print(f"{preset}: q3_K as q6_K against F32, max |Δlogit| / max |logit| {err:.2e}")
            self.assertLessEqual(err, SUM_ORDER_TOL, preset)
            self.assertTrue((a.argmax(1) == b.argmax(1)).all(), preset)


class UnloadableType(unittest.TestCase):
    """A tensor of a type ferrite neither computes with nor converts (q2_K): `info` lists it,
    `run` stops with its name and type, exit code 1."""

    def test_listed_and_refused(self):
        with tempfile.TemporaryDirectory() as d:
            base = os.path.join(d, "q8.gguf")
            ferrite("synth", "--preset", "tiny-qwen3", "--quant", "Q8_0", "--output", base)
            r = GGUFReader(base)
            path = os.path.join(d, "q2.gguf")
            w = writer_like(r, path)
            for t in r.tensors:
                if t.name == "blk.0.ffn_down.weight":
                    shape = [int(x) for x in reversed(t.shape)]
                    raw = np.zeros(shape[:-1] + [shape[-1] // 256 * 84], np.uint8)
                    w.add_tensor(t.name, raw, raw_dtype=T.Q2_K)
                else:
                    w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            finish(w)
            self.assertIn("q2_K (not loadable)", ferrite("info", "--model", path).stdout)
            run = subprocess.run([BIN, "run", "--model", path, "--prompt", "hi", "--device", "cpu"],
                                 capture_output=True, text=True)
            self.assertEqual(run.returncode, 1, run.stderr)
            self.assertIn("tensor 'blk.0.ffn_down.weight': unsupported type q2_K", run.stderr)


def default_model():
    """SmolLM2-135M-Instruct Q4_1, where ferrite caches its default model (fetched if absent)."""
    cache = os.environ.get("FERRITE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ferrite")
    path = os.path.join(cache, "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(path):
        ferrite("run", "--prompt", "hi", "--max-tokens", "1", "--device", "cpu")
    return path


class SmolLM2AsQ5_0(unittest.TestCase):
    """The real model's 210 matrices requantized to q5_0 by llama.cpp's own quantizer (gguf-py:
    Q4_1 values → Q5_0), loaded through the conversion: still SmolLM2's known answer."""

    def test_known_answer(self):
        r = GGUFReader(default_model())
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "smollm2-q5_0.gguf")
            w = writer_like(r, path)
            n = 0
            for t in r.tensors:
                if t.tensor_type == T.Q4_1:
                    shape = [int(x) for x in reversed(t.shape)]
                    x = quants.dequantize(np.array(t.data), T.Q4_1).astype(np.float32)
                    w.add_tensor(t.name, quants.quantize(x.reshape(shape), T.Q5_0),
                                 raw_dtype=T.Q5_0)
                    n += 1
                else:
                    w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            finish(w)
            self.assertEqual(n, 210)
            out = ferrite("run", "--model", path, "--chat", "--device", "cpu", "--prompt",
                          "What is the capital of France?").stdout
            print(f"SmolLM2 as q5_0: {out.strip()!r}")
            self.assertIn("The capital of France is Paris", out)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        BIN = sys.argv.pop(1)
    unittest.main(verbosity=2)
