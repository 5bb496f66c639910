#!/usr/bin/env python3
"""Build tiny random-weight Hugging Face checkpoints plus transformers fp32 logits.

These are oracle fixtures for ferrite's CPU backend (see README.md next to this
file). For every model this writes, under --out/<name>/:

  config.json            written by save_pretrained
  generation_config.json written by save_pretrained (if it writes one)
  model.safetensors      bf16 weights written by save_pretrained
  oracle.safetensors     tokens [T] I64, logits [T, vocab] F32 (+ debug activations)
  greedy.json            {"prompt": [...12 ids], "generated": [...8 ids]}
  meta.json              versions, seed, date, checks

The oracle forward pass uses the checkpoint as it was saved (bf16), reloaded
with from_pretrained, cast to float32, run on CPU with eager attention.

Usage: python3 tools/oracle/make_oracle.py --out OUTDIR [--tar FILE.tar]
"""

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import sys
import tarfile
import tempfile
import traceback

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_oracle import llama3_inv_freq  # noqa: E402
from llama3_oracle import LLAMA3  # noqa: E402
from safetensors import safe_open
from safetensors.torch import save_file

VOCAB = 1024
HIDDEN = 128
HEAD_DIM = 32
INTER = 256
MAX_POS = 4096
EPS = 1e-6
N_TOKENS = 24
PROMPT_LEN = 12
NEW_TOKENS = 8
BOS, EOS = 1, 2
WEIGHT_STD = 0.1  # linear + embedding weights
ROUTER_STD = 0.2  # MoE router (mlp.gate) weights
NORM_STD = 0.1  # RMSNorm weights = 1 + NORM_STD * randn
MIN_LOGIT_GAP = 5e-3  # top1 - top2 logit, every checked position
MIN_ROUTER_GAP = 5e-3  # k-th minus (k+1)-th router logit, every token and layer
MAX_SEED_TRIES = 200
MAX_DIR_BYTES = 2 * 1024 * 1024

SPECS = [
    # name, family, layers, seed, extra config fields
    ("qwen3-tiny", "qwen3", 3, 1000, {}),
    ("qwen3-moe-tiny", "qwen3_moe", 2, 2000, {"norm_topk_prob": True}),
    ("qwen3-moe-tiny-nonorm", "qwen3_moe", 2, 3000, {"norm_topk_prob": False}),
    ("llama-tiny", "llama", 2, 4000, {}),
    # Llama 3.1's "llama3" RoPE scaling (llama3_oracle.py's parameters: frequencies 0-6 kept,
    # 7-8 blended, 9-15 slowed 8x).
    ("llama31-tiny", "llama", 2, 7000, {"rope_parameters": LLAMA3}),
    # Qwen3.5 hybrids: layers 0-2 Gated DeltaNet, layer 3 gated full attention.
    ("qwen35-tiny", "qwen3_5", 4, 5000, {}),
    ("qwen35-moe-tiny", "qwen3_5_moe", 4, 6000, {}),
]
QWEN35 = ("qwen3_5", "qwen3_5_moe")
MOE = ("qwen3_moe", "qwen3_5_moe")
PARTIAL_ROTARY = 0.25  # Qwen3.5's default: 8 of each head's 32 dimensions rotate


def log(*a):
    print(*a, flush=True)


def make_config(family, layers, extra):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        hidden_act="silu",
        max_position_embeddings=MAX_POS,
        rms_norm_eps=EPS,
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    if family == "qwen3":
        cls_cfg, cls_model = transformers.Qwen3Config, transformers.Qwen3ForCausalLM
        theta = 1e6
        fields = dict(common, tie_word_embeddings=False, use_sliding_window=False)
    elif family == "qwen3_moe":
        cls_cfg, cls_model = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
        theta = 1e6
        fields = dict(
            common,
            tie_word_embeddings=False,
            use_sliding_window=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=False,
        )
    elif family in QWEN35:
        linear = dict(
            layer_types=["linear_attention"] * (layers - 1) + ["full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            tie_word_embeddings=False,
        )
        theta = 1e7
        rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": PARTIAL_ROTARY}
        if family == "qwen3_5":
            cls_cfg, cls_model = transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM
            fields = dict(common, **linear, intermediate_size=128)
        else:
            cls_cfg, cls_model = transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM
            fields = dict(
                common,
                **linear,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
                output_router_logits=False,
            )
            del fields["intermediate_size"]
        fields.update(extra)
        return cls_cfg, cls_model, cls_cfg(**fields, rope_parameters=rope), theta
    elif family == "llama":
        cls_cfg, cls_model = transformers.LlamaConfig, transformers.LlamaForCausalLM
        theta = 10000.0
        fields = dict(common, tie_word_embeddings=True, mlp_bias=False, pretraining_tp=1)
    else:
        raise ValueError(family)
    extra = dict(extra)
    rp = extra.pop("rope_parameters", {"rope_type": "default", "rope_theta": theta})
    theta = rp["rope_theta"]
    fields.update(extra)

    # transformers 5's rope_parameters, or 4.x's rope_theta (+ rope_scaling for a scaling).
    legacy = {"rope_theta": theta}
    if rp["rope_type"] != "default":
        legacy["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    rope_forms = [{"rope_parameters": rp}, legacy]
    # Fall back to dropping optional fields if a strict config rejects them.
    drop_sets = [(), ("pretraining_tp",), ("pretraining_tp", "head_dim")]
    last = None
    for drop in drop_sets:
        for rope in rope_forms:
            kw = {k: v for k, v in fields.items() if k not in drop}
            kw.update(rope)
            try:
                cfg = cls_cfg(**kw)
                return cls_cfg, cls_model, cfg, theta
            except Exception as e:  # noqa: BLE001
                last = e
                log(f"  config attempt failed ({type(e).__name__}: {e}); retrying")
    raise last


def redraw_weights(model, seed, family=None):
    """Replace the init with larger random weights so logits are decisive."""
    if family in QWEN35:
        return redraw_weights_qwen35(model, seed)
    g = torch.Generator().manual_seed(seed)
    seen = set()
    with torch.no_grad():
        for name, p in model.named_parameters():  # shared (tied) params appear once
            if id(p) in seen:
                continue
            seen.add(id(p))
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if p.ndim == 1:  # RMSNorm weights (no biases in these models)
                p.copy_(1.0 + NORM_STD * noise)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(ROUTER_STD * noise)
            else:
                p.copy_(WEIGHT_STD * noise)


def redraw_weights_qwen35(model, seed):
    """Qwen3.5's RMSNorms scale by (1 + weight) (zero-centred), except the gated norm of the
    linear-attention output, which scales by weight. A_log and dt_bias set the decay
    g = -exp(A_log) * softplus(a + dt_bias); the conv taps get a larger std so the short
    convolution matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + NORM_STD * noise)
            elif name.endswith("A_log") or name.endswith("dt_bias"):
                p.copy_(0.5 * noise)
            elif p.ndim == 1:  # zero-centred RMSNorm weights
                p.copy_(NORM_STD * noise)
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * noise)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(ROUTER_STD * noise)
            else:
                p.copy_(WEIGHT_STD * noise)


def load_fp32(path, moe):
    kw = dict(attn_implementation="eager", output_loading_info=True)
    tries = [{"dtype": torch.float32}, {"torch_dtype": torch.float32}]
    if moe:
        tries.insert(0, {"dtype": torch.float32, "experts_implementation": "eager"})
    last = None
    for extra in tries:
        try:
            model, info = transformers.AutoModelForCausalLM.from_pretrained(path, **kw, **extra)
            break
        except Exception as e:  # noqa: BLE001
            last = e
            log(f"  from_pretrained with {list(extra)} failed ({type(e).__name__}: {e})")
    else:
        raise last
    model = model.float().eval()
    cfg = model.config
    if hasattr(cfg, "_experts_implementation"):
        try:
            if cfg._experts_implementation not in (None, "eager"):
                cfg._experts_implementation = "eager"
        except Exception:  # noqa: BLE001
            pass
    return model, info


def saved_tensor_info(path):
    out = {}
    with safe_open(path, framework="pt") as f:
        for k in f.keys():
            sl = f.get_slice(k)
            out[k] = (sl.get_dtype(), list(sl.get_shape()))
    return out


def rewrite_fused_experts(path, cfg):
    """If save_pretrained wrote fused expert tensors, rewrite them in the
    original Hub layout (per-expert gate_proj/up_proj/down_proj)."""
    tensors = {}
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    inter = cfg.moe_intermediate_size
    out = {}
    for k, t in tensors.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            assert t.ndim == 3 and t.shape[1] == 2 * inter and t.shape[2] == HIDDEN, (k, t.shape)
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter, :].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:, :].contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            assert t.ndim == 3 and t.shape[1] == HIDDEN and t.shape[2] == inter, (k, t.shape)
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[k] = t
    meta = dict(meta)
    meta.setdefault("format", "pt")
    save_file(out, path, metadata=meta)


def top_gap(logits_row):
    v = torch.topk(logits_row.double(), 2).values
    return float(v[0] - v[1])


class Capture:
    """Hooks that record embeddings, per-layer outputs, final norm output and
    router inputs (to check routing decisions are not near-ties)."""

    def __init__(self, model):
        self.handles = []
        self.records = {}
        self.router_inputs = []  # (layer, x[T,H], weight[E,H], k)
        inner = model.model
        self._hook(inner.embed_tokens, "embeddings")
        for i, layer in enumerate(inner.layers):
            self._hook(layer, f"layer{i}")
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is not None and getattr(gate, "weight", None) is not None:
                k = model.config.num_experts_per_tok
                self.handles.append(
                    gate.register_forward_pre_hook(self._router_hook(i, gate, k))
                )
        self._hook(inner.norm, "final_norm")

    def _hook(self, mod, key):
        def fn(_m, _inp, out):
            if isinstance(out, (tuple, list)):
                out = out[0]
            self.records[key] = out.detach().float().clone()

        self.handles.append(mod.register_forward_hook(fn))

    def _router_hook(self, i, gate, k):
        def fn(_m, inp):
            x = inp[0].detach().float().reshape(-1, inp[0].shape[-1])
            self.router_inputs.append((i, x.clone(), gate.weight.detach().float(), k))

        return fn

    def min_router_gap(self):
        gaps = []
        for _i, x, w, k in self.router_inputs:
            logits = (x.double() @ w.double().T)
            s = torch.sort(logits, dim=-1, descending=True).values
            gaps.append(float((s[:, k - 1] - s[:, k]).min()))
        return min(gaps) if gaps else None

    def remove(self):
        for h in self.handles:
            h.remove()


def greedy_manual(model, prompt, n_new):
    """No-cache greedy decode with full forward passes; returns ids and gaps."""
    ids = list(prompt)
    gaps = []
    with torch.no_grad():
        for _ in range(n_new):
            out = model(input_ids=torch.tensor([ids]), use_cache=False)
            row = out.logits[0, -1].float()
            gaps.append(top_gap(row))
            ids.append(int(torch.argmax(row)))
    return ids[len(prompt):], gaps


def build_one(name, family, layers, seed0, extra, out_root):
    cls_cfg, cls_model, cfg, theta = make_config(family, layers, extra)
    log(f"[{name}] config class {cls_cfg.__name__}, model class {cls_model.__name__}")
    report = {}
    for attempt in range(MAX_SEED_TRIES):
        seed = seed0 + attempt
        tmp = tempfile.mkdtemp(prefix=f"{name}-")
        torch.manual_seed(seed)
        model = cls_model(cfg)
        model = model.float()
        redraw_weights(model, seed, family)
        if family == "llama":
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "llama not tied"
        else:
            assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr(), "unexpected tie"
        model = model.to(torch.bfloat16)
        ref_sd = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
        runtime_params = {k: (str(v.dtype), list(v.shape)) for k, v in model.named_parameters()}
        model.save_pretrained(tmp)
        del model

        st_path = os.path.join(tmp, "model.safetensors")
        native = saved_tensor_info(st_path)
        fused = [k for k in native if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj")]
        native_layout = None
        if family in MOE:
            native_layout = "fused" if fused else "per_expert"
            if fused and family == "qwen3_moe":
                log(f"[{name}] save_pretrained wrote FUSED expert tensors; rewriting as per-expert Hub layout")
                rewrite_fused_experts(st_path, cfg)

        # config.json must carry head_dim explicitly.
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path) as f:
            cfg_json = json.load(f)
        head_dim_added = False
        if "head_dim" not in cfg_json:
            cfg_json["head_dim"] = HEAD_DIM
            head_dim_added = True
            with open(cfg_path, "w") as f:
                json.dump(cfg_json, f, indent=2, sort_keys=True)
                f.write("\n")

        # Reload exactly what was saved, in fp32.
        model, info = load_fp32(tmp, family in MOE)
        problems = {k: [str(x) for x in v] for k, v in info.items() if v}
        if problems:
            log(f"[{name}] loading info (checked by the weight comparison below): {problems}")
        re_sd = {k: v.detach().float() for k, v in model.state_dict().items()}
        for k, v in ref_sd.items():
            if k not in re_sd:
                raise RuntimeError(f"reloaded model lacks {k}")
            if not torch.equal(v, re_sd[k]):
                raise RuntimeError(f"reloaded weight {k} differs from the bf16 model")
        for k, v in model.named_parameters():
            assert v.dtype == torch.float32, (k, v.dtype)
        # RoPE base check.
        inv = None
        for mod in model.modules():
            if hasattr(mod, "inv_freq") and isinstance(mod.inv_freq, torch.Tensor):
                inv = mod.inv_freq.double()
                break
        rot = int(HEAD_DIM * PARTIAL_ROTARY) if family in QWEN35 else HEAD_DIM
        exp_inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
        if extra.get("rope_parameters", {}).get("rope_type") == "llama3":
            exp_inv = torch.from_numpy(llama3_inv_freq(exp_inv.numpy(), extra["rope_parameters"]))
        assert inv is not None and inv.numel() == rot // 2, "no inv_freq"
        assert torch.allclose(inv, exp_inv, rtol=1e-5), ("rope theta mismatch", inv[:3], exp_inv[:3])
        attn = [l.self_attn for l in model.model.layers if hasattr(l, "self_attn")][0]
        assert getattr(attn, "head_dim", HEAD_DIM) == HEAD_DIM

        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, VOCAB, (N_TOKENS,), generator=g, dtype=torch.int64)
        tokens[0] = BOS

        cap = Capture(model)
        with torch.no_grad():
            out = model(input_ids=tokens[None], use_cache=False)
        logits = out.logits[0].float().contiguous()
        acts = dict(cap.records)
        logit_gaps = [top_gap(logits[t]) for t in range(N_TOKENS)]

        prompt = tokens[:PROMPT_LEN].tolist()
        manual, gen_gaps = greedy_manual(model, prompt, NEW_TOKENS)
        router_gap = cap.min_router_gap()
        cap.remove()

        ok = min(logit_gaps) >= MIN_LOGIT_GAP and min(gen_gaps) >= MIN_LOGIT_GAP and EOS not in manual
        if router_gap is not None:
            ok = ok and router_gap >= MIN_ROUTER_GAP
        log(
            f"[{name}] seed {seed}: min logit gap {min(logit_gaps):.4g}, min greedy gap {min(gen_gaps):.4g}, "
            f"router gap {router_gap}, eos in greedy {EOS in manual} -> {'OK' if ok else 'retry'}"
        )
        if not ok:
            shutil.rmtree(tmp)
            continue

        with torch.no_grad():
            gen = model.generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, PROMPT_LEN, dtype=torch.int64),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
        generated = gen[0, PROMPT_LEN:].tolist()
        gen_match = generated == manual
        if not gen_match:
            log(f"[{name}] WARNING generate {generated} != manual greedy {manual}")

        # logits should also be consistent with the prompt-only forward.
        std = float(logits.std())
        n_layers = cfg.num_hidden_layers
        oracle = {"tokens": tokens.contiguous(), "logits": logits}
        if "embeddings" in acts:
            oracle["embeddings"] = acts["embeddings"][0].contiguous()
        layer_outs = [acts.get(f"layer{i}") for i in range(n_layers)]
        if all(x is not None for x in layer_outs):
            oracle["layer_outputs"] = torch.stack([x[0] for x in layer_outs]).contiguous()
        if "final_norm" in acts:
            oracle["final_norm"] = acts["final_norm"][0].contiguous()
        save_file(oracle, os.path.join(tmp, "oracle.safetensors"), metadata={"format": "pt"})

        with open(os.path.join(tmp, "greedy.json"), "w") as f:
            json.dump({"prompt": prompt, "generated": generated}, f)
            f.write("\n")

        sha = hashlib.sha256(open(st_path, "rb").read()).hexdigest()
        meta = {
            "name": name,
            "model_class": cls_model.__name__,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "seed": seed,
            "init": {
                "linear_and_embedding_std": WEIGHT_STD,
                "router_std": ROUTER_STD if family in MOE else None,
                "rmsnorm_weight": f"1 + {NORM_STD} * randn"
                + (" (Qwen3.5: stored weight = the randn term, scale = 1 + weight)" if family in QWEN35 else ""),
                "generator": "torch.Generator().manual_seed(seed), params in named_parameters() order",
            },
            "weights_dtype": "bfloat16",
            "oracle": "transformers forward, weights reloaded from model.safetensors and cast to float32, "
            "CPU, attn_implementation=eager, use_cache=False",
            "device": "cpu",
            "tokens": tokens.tolist(),
            "logits_std": std,
            "min_top2_logit_gap": min(logit_gaps),
            "min_top2_logit_gap_greedy": min(gen_gaps),
            "min_router_topk_gap": router_gap,
            "greedy_generate_matches_nocache_argmax": gen_match,
            "greedy_nocache_argmax": manual,
            "tie_word_embeddings": bool(getattr(model.config, "tie_word_embeddings", None)),
            "rope_theta": theta,
            "head_dim_added_to_config_json": head_dim_added,
            "model_safetensors_sha256": sha,
            "oracle_tensors": {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in oracle.items()},
        }
        if family in MOE:
            meta["expert_layout_written_by_save_pretrained"] = native_layout
            meta["expert_layout_in_model_safetensors"] = "per_expert" if family == "qwen3_moe" else native_layout
            meta["runtime_expert_params_layer0"] = {
                k: v for k, v in runtime_params.items() if k.startswith("model.layers.0.mlp.")
            }
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")

        dest = os.path.join(out_root, name)
        if os.path.exists(dest):
            shutil.rmtree(dest)
        shutil.move(tmp, dest)
        total = sum(os.path.getsize(os.path.join(dest, x)) for x in os.listdir(dest))
        report = {
            "files": {x: os.path.getsize(os.path.join(dest, x)) for x in sorted(os.listdir(dest))},
            "total_bytes": total,
            "native_expert_layout": native_layout,
            "native_saved_tensors": native,
            "final_saved_tensors": saved_tensor_info(os.path.join(dest, "model.safetensors")),
            "config_json": json.load(open(os.path.join(dest, "config.json"))),
            "greedy": {"prompt": prompt, "generated": generated, "match_manual": gen_match},
            "logits_std": std,
            "runtime_params_layer0": {k: v for k, v in runtime_params.items() if k.startswith("model.layers.0.")},
        }
        if total > MAX_DIR_BYTES:
            log(f"[{name}] WARNING directory is {total} bytes (> 2 MB)")
        return report
    raise RuntimeError(f"{name}: no acceptable seed in {MAX_SEED_TRIES} tries")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tar", default=None, help="also pack --out into this tar file")
    ap.add_argument("--only", default=None, help="comma-separated model names")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    transformers.logging.set_verbosity_error()

    log(f"python {platform.python_version()} torch {torch.__version__} transformers {transformers.__version__}")
    os.makedirs(args.out, exist_ok=True)
    failures = []
    for name, family, layers, seed, extra in SPECS:
        if args.only and name not in args.only.split(","):
            continue
        try:
            rep = build_one(name, family, layers, seed, extra, args.out)
        except Exception:  # noqa: BLE001
            failures.append(name)
            log(f"[{name}] FAILED")
            traceback.print_exc()
            sys.stdout.flush()
            continue
        log(f"===== {name}: {rep['total_bytes']} bytes; files {rep['files']}")
        log(f"  config.json: {json.dumps(rep['config_json'], sort_keys=True)}")
        log(f"  native expert layout: {rep['native_expert_layout']}")
        if rep["native_saved_tensors"] != rep["final_saved_tensors"]:
            log("  NATIVE save_pretrained tensors (before rewrite):")
            for k, (dt, sh) in sorted(rep["native_saved_tensors"].items()):
                if ".layers.0." in k or ".layers." not in k:
                    log(f"    {k} {dt} {sh}")
        log("  model.safetensors tensors (layer 0 + non-layer):")
        n = 0
        for k, (dt, sh) in sorted(rep["final_saved_tensors"].items()):
            if ".layers.0." in k or ".layers." not in k:
                log(f"    {k} {dt} {sh}")
            n += 1
        log(f"  ({n} tensors total)")
        log("  runtime params layer 0: " + json.dumps(rep["runtime_params_layer0"]))
        log(f"  greedy: {rep['greedy']}  logits std {rep['logits_std']:.3f}")

    if args.tar:
        with tarfile.open(args.tar, "w") as tf:
            for name in sorted(os.listdir(args.out)):
                tf.add(os.path.join(args.out, name), arcname=name)
        log(f"wrote {args.tar} ({os.path.getsize(args.tar)} bytes)")
    if failures:
        log(f"FAILED: {failures}")
        sys.exit(1)
    log("ALL OK")


if __name__ == "__main__":
    main()
