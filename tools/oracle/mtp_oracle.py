#!/usr/bin/env python3
"""MTP-head oracle for the two tiny Qwen3.5 fixtures (float64 numpy, no torch).

transformers does not implement Qwen3.5's multi-token-prediction head (it drops the
`mtp.*` tensors), so this script is the head's reference. It defines the head as vLLM's
`Qwen3_5MultiTokenPredictor` does:

    e = zc_norm(embed(x[t+1]), pre_fc_norm_embedding)
    g = zc_norm(h[t], pre_fc_norm_hidden)          h = the target's final-normed hidden state
    u = fc(concat(e, g))                           embedding half first
    u = full-attention decoder layer (u), at position t
    d = zc_norm(u, norm); logits = d @ lm_head.T   lm_head and embed shared with the target

where zc_norm(x, w) = rms_norm(x) * (1 + w) (Qwen3.5's zero-centred RMSNorm).

The decoder layer is checked first against transformers itself: applied to the fixture's
`layer_outputs[2]` (the input of layer 3, the full-attention layer) it must reproduce
`layer_outputs[3]`, and the output norm `final_norm`. Only then are MTP weights drawn
(seeded, rounded to bf16 as checkpoints store them) and the head's logits computed, with
transformers' `final_norm` rows as h[t] and the fixture's tokens as x[t+1].

Writes, per model directory: `mtp.safetensors` (the `mtp.*` weights, bf16) and
`mtp_oracle.safetensors` (`hidden_in` [T-1, H] f32, `tokens_in` [T-1] i64, `logits`
[T-1, V] f32, `draft_hidden` [T-1, H] f32).

Usage: PYTHONPATH=<numpy> python3 tools/oracle/mtp_oracle.py [ORACLE_DIR]
"""

import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_oracle import nmse, read_safetensors, rmsnorm, rope, silu  # noqa: E402

MODELS = ["qwen35-tiny", "qwen35-moe-tiny"]
# The seed of each model's MTP weights; the first of SEEDS whose logits keep MARGIN.
SEEDS = range(1000, 1100)
# Smallest top-1/top-2 logit gap accepted at any position, so that an implementation that
# is right to f32 rounding cannot disagree on the argmax (as make_oracle.py's margin).
MARGIN = 5e-3


def zc_norm(x, w, eps):
    return rmsnorm(x, 1.0 + w, eps)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def attention_layer(cfg, W, p, x, pos):
    """One Qwen3.5 full-attention decoder layer (gated attention + dense or MoE FFN)."""
    T, H = x.shape
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    rp = cfg["rope_parameters"]
    rot = int(hd * rp["partial_rotary_factor"])
    theta = rp["rope_theta"]

    def rope_part(a):
        return np.concatenate([rope(a[..., :rot], pos, theta), a[..., rot:]], axis=-1)

    h = zc_norm(x, W[p + "input_layernorm.weight"], eps)
    qg = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(T, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
    k = (h @ W[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd)
    v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd)
    q = rope_part(zc_norm(q, W[p + "self_attn.q_norm.weight"], eps))
    k = rope_part(zc_norm(k, W[p + "self_attn.k_norm.weight"], eps))
    mask = np.triu(np.full((T, T), -np.inf), 1)
    att = np.zeros((T, nh, hd))
    for hh in range(nh):
        kv = hh // (nh // nkv)
        s = q[:, hh, :] @ k[:, kv, :].T / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        att[:, hh, :] = s @ v[:, kv, :]
    x = x + (att.reshape(T, nh * hd) * sigmoid(gate)) @ W[p + "self_attn.o_proj.weight"].T
    h = zc_norm(x, W[p + "post_attention_layernorm.weight"], eps)

    def mlp(a, pre):
        g = a @ W[pre + "gate_proj.weight"].T
        u = a @ W[pre + "up_proj.weight"].T
        return (silu(g) * u) @ W[pre + "down_proj.weight"].T

    if p + "mlp.gate.weight" in W:
        logits = h @ W[p + "mlp.gate.weight"].T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.zeros_like(h)
        for t in range(T):
            sel = np.argsort(-probs[t], kind="stable")[: cfg["num_experts_per_tok"]]
            wts = probs[t, sel] / probs[t, sel].sum()
            for e, w in zip(sel, wts):
                out[t] += w * mlp(h[t], f"{p}mlp.experts.{e}.")
        out += sigmoid(h @ W[p + "mlp.shared_expert_gate.weight"].T) * mlp(h, p + "mlp.shared_expert.")
    else:
        out = mlp(h, p + "mlp.")
    return x + out


def bf16(a):
    """Round float64 to bf16 (nearest even) and back, as float64."""
    u = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32) << 16
    return u.view(np.float32).astype(np.float64)


def write_safetensors(path, tensors):
    """tensors: name -> (dtype, ndarray); dtype in BF16, F32, I64."""
    header, blobs, off = {}, [], 0
    for name, (dt, a) in tensors.items():
        if dt == "BF16":
            raw = (np.asarray(a, dtype=np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        elif dt == "F32":
            raw = np.asarray(a, dtype="<f4").tobytes()
        else:
            raw = np.asarray(a, dtype="<i8").tobytes()
        header[name] = {"dtype": dt, "shape": list(np.shape(a)), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def draw_mtp(cfg, W, seed):
    """MTP weights shaped as the model's full-attention layer 3, drawn as make_oracle.py
    draws (matrices 0.1·randn, router 0.2·randn, zero-centred norms 0.1·randn), bf16."""
    rng = np.random.default_rng(seed)
    H = cfg["hidden_size"]
    M = {
        "mtp.fc.weight": 0.1 * rng.standard_normal((H, 2 * H)),
        "mtp.pre_fc_norm_embedding.weight": 0.1 * rng.standard_normal(H),
        "mtp.pre_fc_norm_hidden.weight": 0.1 * rng.standard_normal(H),
        "mtp.norm.weight": 0.1 * rng.standard_normal(H),
    }
    for name in sorted(k for k in W if k.startswith("model.layers.3.")):
        scale = 0.2 if name.endswith("mlp.gate.weight") else 0.1
        M["mtp.layers.0." + name[len("model.layers.3.") :]] = scale * rng.standard_normal(W[name].shape)
    return {k: bf16(v) for k, v in M.items()}


def mtp_forward(cfg, W, M, hidden, tokens_in, pos):
    eps = cfg["rms_norm_eps"]
    e = zc_norm(W["model.embed_tokens.weight"][tokens_in], M["mtp.pre_fc_norm_embedding.weight"], eps)
    g = zc_norm(hidden, M["mtp.pre_fc_norm_hidden.weight"], eps)
    u = np.concatenate([e, g], axis=-1) @ M["mtp.fc.weight"].T
    x = attention_layer(cfg, M, "mtp.layers.0.", u, pos)
    d = zc_norm(x, M["mtp.norm.weight"], eps)
    return d @ W["lm_head.weight"].T, d


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "data", "oracle"
    )
    ok = True
    for name in MODELS:
        d = os.path.join(root, name)
        cfg = json.load(open(os.path.join(d, "config.json")))
        W = read_safetensors(os.path.join(d, "model.safetensors"))
        O = read_safetensors(os.path.join(d, "oracle.safetensors"))
        tokens = O["tokens"]
        T = len(tokens)
        pos = np.arange(T, dtype=np.float64)
        assert cfg["layer_types"][3] == "full_attention"
        # The layer against transformers.
        x3 = attention_layer(cfg, W, "model.layers.3.", O["layer_outputs"][2], pos)
        e_layer = nmse(x3, O["layer_outputs"][3])
        e_norm = nmse(zc_norm(x3, W["model.norm.weight"], cfg["rms_norm_eps"]), O["final_norm"])
        good = e_layer < 1e-10 and e_norm < 1e-10
        print(f"{name:18s} layer 3 vs transformers NMSE {e_layer:.2e}, final norm {e_norm:.2e}")
        ok &= good
        if not good:
            continue
        hidden, tokens_in = O["final_norm"][: T - 1], tokens[1:]
        for seed in SEEDS:
            M = draw_mtp(cfg, W, seed)
            logits, dh = mtp_forward(cfg, W, M, hidden, tokens_in, pos[: T - 1])
            top2 = np.sort(logits, axis=-1)[:, -2:]
            margin = float(np.min(top2[:, 1] - top2[:, 0]))
            if margin >= MARGIN:
                break
        else:
            print(f"{name}: no seed in {SEEDS} keeps the margin {MARGIN}")
            ok = False
            continue
        print(f"{name:18s} MTP weights seed {seed}, logits std {logits.std():.3f}, min top-1/top-2 gap {margin:.2e}")
        write_safetensors(os.path.join(d, "mtp.safetensors"), {k: ("BF16", v) for k, v in M.items()})
        write_safetensors(
            os.path.join(d, "mtp_oracle.safetensors"),
            {
                "hidden_in": ("F32", hidden),
                "tokens_in": ("I64", tokens_in),
                "logits": ("F32", logits),
                "draft_hidden": ("F32", dh),
            },
        )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
