#!/usr/bin/env python3
"""Registers, spills and shared memory of each kernel of a module, as ptxas reports them, with
NVRTC alone (no GPU, no cuobjdump: tools/sass_census.py needs that for the instructions).

    python3 tools/ptxas_info.py MODULE [REGEX]      e.g. mmw 'mmw_moe_.*q4_k'

MODULE is a file of crates/backend/src/cuda/kernels/ (matmul, mmw, moe, attention, ...),
compiled as the backend compiles it (common.cuh, and mm_decode.cuh for matmul / mmw / moe,
prepended; mod.rs `full_source`, without the timing diagnostics) for sm_90a, with
`--ptxas-options=-v` (sass_census.py's NVRTC loader). Needs libnvrtc.so.13 under
$CUDA_HOME/lib64 or lib and the CUDA headers under $CUDA_HOME/include.
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_census import nvrtc_program  # noqa: E402  (the NVRTC loader, beside this file)

KDIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "backend", "src", "cuda", "kernels")


def source(module):
    def read(n):
        with open(os.path.join(KDIR, n)) as f:
            return f.read()

    common = read("common.cuh")
    src = read(f"{module}.cu")
    if module in ("matmul", "mmw", "moe"):
        return f'{common}\n#line 1 "mm_decode.cuh"\n{read("mm_decode.cuh")}\n#line 1 "{module}.cu"\n{src}'
    return f'{common}\n#line 1 "{module}.cu"\n{src}'


def main(module, pattern):
    _, text = nvrtc_program(source(module), name=f"{module}.cu", extra=("--ptxas-options=-v",))
    rx = re.compile(pattern or ".")
    name = None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            name = m.group(1)
            continue
        if name and rx.search(name) and re.search(r"registers|spill|stack frame", line):
            print(f"{name}: {line.split('info    :')[-1].strip()}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
