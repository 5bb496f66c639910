#!/usr/bin/env python3
"""Independent float64 numpy re-implementation of the oracle models.

Reads tests/data/oracle/<name>/{config.json,model.safetensors} with a tiny
safetensors parser (no torch, no transformers), runs the forward pass in
float64 and compares with the transformers fp32 logits in oracle.safetensors
(NMSE and argmax) and with greedy.json. It documents the exact math ferrite
must implement and checks that the fixtures are self-consistent.

Usage: python3 tools/oracle/check_oracle.py [ORACLE_DIR]   (needs numpy)
"""

import json
import os
import struct
import sys

import numpy as np

DTYPES = {"F32": np.float32, "F64": np.float64, "I64": np.int64, "I32": np.int32, "F16": np.float16}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        raw = data[base + a : base + b]
        if v["dtype"] == "BF16":
            u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = u.view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=np.dtype(DTYPES[v["dtype"]]).newbyteorder("<"))
        out[k] = arr.reshape(v["shape"]).astype(np.float64 if arr.dtype.kind == "f" else np.int64)
    return out


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1.0 + np.exp(-x))


def llama3_inv_freq(inv, rp):
    """Llama 3.1's "llama3" RoPE scaling (transformers' _compute_llama3_parameters), float64:
    wavelengths under original / high_freq_factor keep their frequency, those over
    original / low_freq_factor are slowed by `factor`, those between are blended."""
    factor, low, high = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old = rp["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv
    out = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, out)


def rope(x, pos, theta, scaling=None):
    # x: [T, heads, hd]; rotate-half (NeoX) layout, as in transformers. scaling: the
    # rope_parameters of a "llama3" scaling, or None.
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    if scaling is not None:
        inv = llama3_inv_freq(inv, scaling)
    fr = pos[:, None] * inv[None, :]
    emb = np.concatenate([fr, fr], axis=-1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    rot = np.concatenate([-x2, x1], axis=-1)
    return x * cos + rot * sin


def forward(cfg, W, tokens):
    H = cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    eps = cfg["rms_norm_eps"]
    rp = cfg.get("rope_parameters") or {}
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = rp if rp.get("rope_type") == "llama3" else None
    qk_norm = cfg["model_type"].startswith("qwen3")
    n_exp = cfg.get("num_experts", cfg.get("num_local_experts"))
    T = len(tokens)
    pos = np.arange(T, dtype=np.float64)
    x = W["model.embed_tokens.weight"][tokens]
    layer_outs = []
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rmsnorm(x, W[p + "input_layernorm.weight"], eps)
        q = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd)
        if qk_norm:
            q = rmsnorm(q, W[p + "self_attn.q_norm.weight"], eps)
            k = rmsnorm(k, W[p + "self_attn.k_norm.weight"], eps)
        q, k = rope(q, pos, theta, scaling), rope(k, pos, theta, scaling)
        rep = nh // nkv
        att = np.zeros((T, nh, hd))
        for hh in range(nh):
            kv = hh // rep
            s = q[:, hh, :] @ k[:, kv, :].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            att[:, hh, :] = s @ v[:, kv, :]
        x = x + att.reshape(T, nh * hd) @ W[p + "self_attn.o_proj.weight"].T
        h = rmsnorm(x, W[p + "post_attention_layernorm.weight"], eps)
        if p + "mlp.gate.weight" in W:
            topk = cfg["num_experts_per_tok"]
            logits = h @ W[p + "mlp.gate.weight"].T
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            out = np.zeros_like(h)
            for t in range(T):
                sel = np.argsort(-probs[t], kind="stable")[:topk]
                wts = probs[t, sel]
                if cfg.get("norm_topk_prob"):
                    wts = wts / wts.sum()
                for e, w in zip(sel, wts):
                    ep = f"{p}mlp.experts.{e}."
                    g = h[t] @ W[ep + "gate_proj.weight"].T
                    u = h[t] @ W[ep + "up_proj.weight"].T
                    out[t] += w * ((silu(g) * u) @ W[ep + "down_proj.weight"].T)
            assert n_exp == W[p + "mlp.gate.weight"].shape[0]
        else:
            g = h @ W[p + "mlp.gate_proj.weight"].T
            u = h @ W[p + "mlp.up_proj.weight"].T
            out = (silu(g) * u) @ W[p + "mlp.down_proj.weight"].T
        x = x + out
        layer_outs.append(x)
    xn = rmsnorm(x, W["model.norm.weight"], eps)
    head = W.get("lm_head.weight")
    if head is None:
        assert cfg.get("tie_word_embeddings"), "no lm_head.weight and embeddings not tied"
        head = W["model.embed_tokens.weight"]
    return xn @ head.T, np.stack(layer_outs), xn


def nmse(a, ref):
    return float(np.sum((a - ref) ** 2) / np.sum(ref**2))


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "data", "oracle"
    )
    ok = True
    for name in sorted(os.listdir(root)):
        d = os.path.join(root, name)
        if not os.path.isfile(os.path.join(d, "oracle.safetensors")):
            continue
        cfg = json.load(open(os.path.join(d, "config.json")))
        if cfg.get("model_type", "").startswith("qwen3_5"):
            print(f"{name:24s} skipped: a Qwen3.5 hybrid (not covered here)")
            continue
        W = read_safetensors(os.path.join(d, "model.safetensors"))
        O = read_safetensors(os.path.join(d, "oracle.safetensors"))
        tokens = O["tokens"]
        logits, layers, xn = forward(cfg, W, tokens)
        e = nmse(O["logits"], logits)
        am = bool(np.all(np.argmax(O["logits"], -1) == np.argmax(logits, -1)))
        el = nmse(O["layer_outputs"], layers) if "layer_outputs" in O else float("nan")
        en = nmse(O["final_norm"], xn) if "final_norm" in O else float("nan")
        ee = nmse(O["embeddings"], W["model.embed_tokens.weight"][tokens]) if "embeddings" in O else float("nan")
        gr = json.load(open(os.path.join(d, "greedy.json")))
        ids = list(gr["prompt"])
        for _ in range(len(gr["generated"])):
            lg, _, _ = forward(cfg, W, np.array(ids))
            ids.append(int(np.argmax(lg[-1])))
        gok = ids[len(gr["prompt"]) :] == gr["generated"]
        good = e < 1e-10 and am and gok and not (el > 1e-10 or en > 1e-10 or ee > 1e-10)
        ok &= good
        print(f"{name:24s} logits NMSE {e:.3e}  layers {el:.1e}  final_norm {en:.1e}  embeddings {ee:.1e}  argmax {am}  greedy {gok}  {'OK' if good else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
