#!/usr/bin/env python3
"""Whether a change left a kernel module's machine code alone, on the development machine (no GPU).

    tools/sass_same.py MODULE [--against REV]     (MODULE: attention, elementwise, matmul, mmw, ...)

Compiles crates/backend/src/cuda/kernels/MODULE.cu whole, as the backend does at start-up
(cuda/mod.rs `full_source` with no switch set: common.cuh, then mm_decode.cuh for the modules
that take it, then the file), for sm_90a with NVRTC, once from the working tree and once from
git revision REV (default HEAD), and sorts every kernel of the two CUBINs into: identical;
the same instructions but for addresses and offsets (a static shared-memory layout or a branch
target moved: the same machine code in effect); different; only in one. A change that should
not touch the default kernels (new entry points beside them, a template flag that folds away)
is checked here before it costs device time (ATTENTION.md, 61st session: the prefill
attention's tc2p entries beside its 177 default kernels). tools/sass_census.py does the same for
matmul.cu's trimmed decode-GEMV instantiations in seconds (`--against`); this takes the whole
module (attention.cu ~1.5 minutes a compile here).

Needs NVRTC 13 (CUDA_HOME, as tools/sass_census.py), cuobjdump ($CUOBJDUMP or on PATH) and the
nvdisasm it calls (on PATH or $NVDISASM_PATH). Without a CUDA toolkit, PyPI's wheels hold both:
`pip download --no-deps nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`, unzip, nvidia/cu13/bin.
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass_census as sc  # noqa: E402

# The modules cuda/mod.rs `full_source` gives mm_decode.cuh after common.cuh.
WITH_MM_DECODE = {"matmul", "mmw", "moe", "elementwise", "attention"}


def module_source(name, rev=None):
    files = ["common.cuh"] + (["mm_decode.cuh"] if name in WITH_MM_DECODE else []) + [f"{name}.cu"]
    return "\n".join(sc.read_source(os.path.join(sc.KERNELS, f), rev) for f in files)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("module", help="a kernel file's name without .cu")
    ap.add_argument("--against", default="HEAD", metavar="REV")
    a = ap.parse_args()
    cuobjdump = sc.find_cuobjdump()
    now, then = (sc.sass_of_cubin(cuobjdump, sc.nvrtc_program(module_source(a.module, rev), name=f"{a.module}.cu")[0])
                 for rev in (None, a.against))
    if not now:
        sys.exit("cuobjdump gave no kernels (is nvdisasm on PATH or NVDISASM_PATH?)")
    blind = lambda code: [re.sub(r"0x[0-9a-f]+", "#", i) for i in code]  # noqa: E731
    both = sorted(set(now) & set(then))
    same = [k for k in both if now[k] == then[k]]
    near = [k for k in both if now[k] != then[k] and blind(now[k]) == blind(then[k])]
    diff = [k for k in both if blind(now[k]) != blind(then[k])]
    print(f"{a.module} against {a.against}: {len(both)} kernels in both, {len(same)} identical, "
          f"{len(near)} the same but for addresses, {len(diff)} differ")
    for k in near:
        print(f"  addresses only: {k}")
    for k in diff:
        print(f"  differs: {k}")
    for k in sorted(set(now) ^ set(then)):
        print(f"  only in {'the working tree' if k in now else a.against}: {k}")
    sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
