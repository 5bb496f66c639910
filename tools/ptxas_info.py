#!/usr/bin/env python3
"""Registers, spills and shared memory of each kernel of a module, as ptxas reports them, with
NVRTC alone (no GPU, no cuobjdump: tools/sass_census.py needs that for the instructions).

    python3 tools/ptxas_info.py MODULE [REGEX]      e.g. mmw 'mmw_moe_.*q4_k'

MODULE is a file of crates/backend/src/cuda/kernels/ (matmul, mmw, moe, attention, ...),
compiled as the backend compiles it (common.cuh, and mm_decode.cuh for matmul / mmw / moe,
prepended; mod.rs `full_source`, without the timing diagnostics) for sm_90a, with
`--ptxas-options=-v`. Needs libnvrtc.so.13 under $CUDA_HOME/lib64 or lib and the CUDA headers
under $CUDA_HOME/include.
"""
import ctypes
import os
import re
import sys

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
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    lib = next((p for p in (f"{home}/lib64/libnvrtc.so.13", f"{home}/lib/libnvrtc.so.13") if os.path.exists(p)), None)
    if lib is None:
        sys.exit(f"no libnvrtc.so.13 under {home}/lib64 or {home}/lib (set CUDA_HOME)")
    nv = ctypes.CDLL(lib)
    prog = ctypes.c_void_p()
    src = source(module).encode()
    if nv.nvrtcCreateProgram(ctypes.byref(prog), src, f"{module}.cu".encode(), 0, None, None) != 0:
        sys.exit("nvrtcCreateProgram failed")
    opts = [b"--std=c++17", b"-default-device", b"-arch=sm_90a", f"-I{home}/include".encode(),
            b"--ptxas-options=-v"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nv.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace")
    if rc != 0:
        sys.exit(f"compile failed ({rc}):\n{text}")
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
