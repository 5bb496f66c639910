#!/usr/bin/env python3
"""Independent oracle for ferrite's chat templates.

Renders chat templates with jinja2 exactly the way Hugging Face transformers does
(`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`, the `tojson`
filter without HTML escaping, `raise_exception`, `strftime_now`) and writes the rendered
strings as JSON. The Rust tests compare `ChatTemplate::render` against that file, so a
divergence between minijinja and jinja2 shows up as a test failure.

Usage (from the workspace root):
    python3 crates/tokenizer/tools/chat_template_check.py \
        --smollm2-gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf   # optional, refreshes the .jinja
It reads:  tests/data/tokenizers/qwen3-json/tokenizer_config.json
           tests/data/tokenizers/smollm2/chat_template.jinja
writes:    tests/data/tokenizers/chat_expected.json
"""
import argparse
import json
import struct
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

DATA = Path("tests/data/tokenizers")


def gguf_metadata_string(path, key):
    """Minimal GGUF v2/v3 metadata reader: returns the string value of `key`."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise SystemExit(f"{path}: not a GGUF file")
        (version,) = struct.unpack("<I", f.read(4))
        _n_tensors, n_kv = struct.unpack("<QQ", f.read(16))
        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

        def rstr():
            (n,) = struct.unpack("<Q", f.read(8))
            return f.read(n).decode("utf-8")

        def rval(t):
            if t == 8:
                return rstr()
            if t == 9:
                (et,) = struct.unpack("<I", f.read(4))
                (n,) = struct.unpack("<Q", f.read(8))
                if et in sizes:
                    f.seek(sizes[et] * n, 1)
                    return None
                return [rval(et) for _ in range(n)]
            f.seek(sizes[t], 1)
            return None

        for _ in range(n_kv):
            k = rstr()
            (t,) = struct.unpack("<I", f.read(4))
            v = rval(t)
            if k == key:
                return v
    raise SystemExit(f"{path}: no key {key}")


def hf_render(template, messages, **kwargs):
    """Mirror transformers' `_compile_jinja_template` + `render`."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template).render(messages=messages, **kwargs)


CONVERSATIONS = {
    "one_user": [{"role": "user", "content": "What is the capital of France?"}],
    "hi": [{"role": "user", "content": "hi"}],
    "system_user": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "hi"},
    ],
    "multi_turn_think": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nSimple arithmetic.\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    "multi_turn_plain": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ],
}

# A tool round trip as OpenAI clients send it back: the assistant's call (arguments as a JSON
# string, OpenAI's wire form) and the tool's answer.
TOOL_ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"C\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "22 C, sunny"},
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smollm2-gguf", help="refresh smollm2/chat_template.jinja from this GGUF")
    args = ap.parse_args()

    smol_path = DATA / "smollm2" / "chat_template.jinja"
    if args.smollm2_gguf:
        smol_path.parent.mkdir(parents=True, exist_ok=True)
        smol_path.write_text(gguf_metadata_string(args.smollm2_gguf, "tokenizer.chat_template"))
    templates = {
        "smollm2": smol_path.read_text(),
        "qwen3": json.loads((DATA / "qwen3-json" / "tokenizer_config.json").read_text())["chat_template"],
    }
    specials = {
        "smollm2": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
        "qwen3": {"bos_token": None, "eos_token": "<|im_end|>"},
    }

    cases = []
    for tname, template in templates.items():
        for cname, msgs in CONVERSATIONS.items():
            for agp in (True, False):
                kw = dict(add_generation_prompt=agp, **specials[tname])
                cases.append({"template": tname, "conversation": cname,
                              "add_generation_prompt": agp, "enable_thinking": None,
                              "tools": False, "expected": hf_render(template, msgs, **kw)})
    # Qwen3-only switches: thinking off, and tools.
    for cname in ("hi", "multi_turn_think"):
        kw = dict(add_generation_prompt=True, enable_thinking=False, **specials["qwen3"])
        cases.append({"template": "qwen3", "conversation": cname, "add_generation_prompt": True,
                      "enable_thinking": False, "tools": False,
                      "expected": hf_render(templates["qwen3"], CONVERSATIONS[cname], **kw)})
    kw = dict(add_generation_prompt=True, tools=TOOLS, **specials["qwen3"])
    cases.append({"template": "qwen3", "conversation": "system_user", "add_generation_prompt": True,
                  "enable_thinking": None, "tools": True,
                  "expected": hf_render(templates["qwen3"], CONVERSATIONS["system_user"], **kw)})

    CONVERSATIONS_WITH_TOOLS = dict(CONVERSATIONS, tool_round_trip=TOOL_ROUND_TRIP)
    kw = dict(add_generation_prompt=True, tools=TOOLS, **specials["qwen3"])
    cases.append({"template": "qwen3", "conversation": "tool_round_trip", "add_generation_prompt": True,
                  "enable_thinking": None, "tools": True,
                  "expected": hf_render(templates["qwen3"], TOOL_ROUND_TRIP, **kw)})

    out = {"generated_by": "crates/tokenizer/tools/chat_template_check.py (jinja2 "
                           + jinja2.__version__ + ", HF transformers settings)",
           "conversations": CONVERSATIONS_WITH_TOOLS, "tools": TOOLS, "cases": cases}
    (DATA / "chat_expected.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(cases)} cases to {DATA / 'chat_expected.json'}")


if __name__ == "__main__":
    main()
