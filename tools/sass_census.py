#!/usr/bin/env python3
"""Instruction census of decode GEMV kernels, on the development machine (no GPU).

    tools/sass_census.py [--src matmul.cu] [--inst MACRO(...)]... [--fun NAME]... [--against REV]

Compiles crates/backend/src/cuda/kernels/matmul.cu (with common.cuh and mm_decode.cuh
prepended, as the backend does) for sm_90a with NVRTC, keeping only the kernel
instantiations asked for (`--inst`, placed at the end of the file; default: the R = 1
tensor-core Q4_K / Q6_K families and the Q6_K lane code), so a
variant compiles in seconds instead of the whole module's minutes; then prints, per kernel
(`--fun`), its registers and stack, its instruction count, its MMA / dp4a count, the
instructions in the window around its MMAs (the loop bodies) per MMA, and the commonest
opcodes there. MATMUL.md round 10 item 8 is a census taken this way: a change to the loop
can be sized here before it costs device time. `--against REV` also compiles the same
instantiations from git revision REV's matmul.cu, common.cuh and mm_decode.cuh and compares every kernel's
machine code with the working tree's (a refactor that should not change the kernels: MATMUL.md
round 11 item 7).

Needs NVRTC 13 (libnvrtc.so.13 under $CUDA_HOME/lib64 or lib) and cuobjdump ($CUOBJDUMP, or
on PATH; PyPI's `nvidia-cuda-cuobjdump` wheel holds one under nvidia/cu13/bin). The trimmed
module's machine code is the full module's to within a few instructions
(gemvq_swiglu_tc_q4_k_r1 1216 either way; gemvq_tc_q4_k_r1 1104 vs 1112, gemvq_tc_q6_k_r1 856
vs 864), so compare variants with each other, taken the same way.
"""
import argparse
import collections
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "crates/backend/src/cuda/kernels")
# The quantized-GEMV instantiation block at the end of matmul.cu (replaced by --inst).
BLOCK_FIRST = "GEMVQ_ALL_R(q8_0, GGML_Q8_0)"
BLOCK_LAST = "GEMVQ_MIXED_TC_ALL_R(q4_k, GGML_Q4_K, q6_k, GGML_Q6_K)"
# Other instantiations, dropped (not decode GEMVs; they only cost compile time).
DROP = [r"^MM_KERNEL\(.*\)$", r"^GEMV_\w*ALL_R\(.*\)$", r"^GEMVQ_MOE\w*\(.*\)$", r"^MOE_\w*\(.*\)$"]
DEFAULT_INST = [
    "GEMVQ_TC_KERNEL(q4_k, GGML_Q4_K, 1)",
    "GEMVQ_TC_KERNEL(q6_k, GGML_Q6_K, 1)",
    "GEMVQ_KERNEL(q6_k, GGML_Q6_K, 1)",
]
DEFAULT_FUN = ["gemvq_swiglu_tc_q4_k_r1", "gemvq_tc_q4_k_r1", "gemvq_tc_q6_k_r1", "gemvq_q6_k_r1"]


def read_source(path, rev=None):
    """The file at `path` in the working tree, or at git revision `rev`."""
    if rev is not None:
        return git_show(rev, path)
    with open(path) as f:
        return f.read()


def trimmed_source(src_path, insts, rev=None):
    # As the backend's full_source (cuda/mod.rs): common.cuh, then mm_decode.cuh, then matmul.cu.
    s = read_source(src_path if rev is None else os.path.join(KERNELS, "matmul.cu"), rev)
    common, mm_decode = (read_source(os.path.join(KERNELS, n), rev) for n in ("common.cuh", "mm_decode.cuh"))
    if BLOCK_FIRST not in s or BLOCK_LAST not in s:
        sys.exit(f"{src_path}: the instantiation block ({BLOCK_FIRST} .. {BLOCK_LAST}) moved; update this tool")
    a = s.index(BLOCK_FIRST)
    b = s.index("\n", s.index(BLOCK_LAST)) + 1
    head, tail = s[:a], s[b:]
    # The block's macro definitions stay (later instantiations may use them); only its
    # top-level instantiation lines (not a #define's continuation lines) go.
    kept, cont = [], False
    for line in s[a:b].splitlines():
        if cont or line.startswith("#") or not re.match(r"^\w+\(.*\)$", line):
            kept.append(line)
        cont = line.endswith("\\")
    head += "\n".join(kept) + "\n"
    for pat in DROP:  # before the requested instantiations go in (they may be of these families)
        head, tail = (re.sub(pat, "", x, flags=re.M) for x in (head, tail))
    # At the end: every family's macro is defined by then (the MoE ones come after the block).
    t = head + tail + "\n" + "\n".join(insts) + "\n"
    return f"{common}\n#line 1 \"mm_decode.cuh\"\n{mm_decode}\n#line 1 \"matmul.cu\"\n{t}"


def git_show(rev, path):
    rel = os.path.relpath(path, ROOT)
    r = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{rel}"], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"git show {rev}:{rel}: {r.stderr.strip()}")
    return r.stdout


def sass_by_function(cuobjdump, cubin):
    """Every kernel's SASS (instruction text, addresses stripped) by name."""
    out, cur = {}, None
    for l in subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True).stdout.splitlines():
        m = re.match(r"\s*Function : (\S+)", l)
        if m:
            cur = out.setdefault(m.group(1), [])
        elif cur is not None and re.match(r"^\s+/\*[0-9a-f]{4}\*/", l):
            # The address and the encoding comment go (its padding follows the module's
            # longest line, so it differs between builds of the same code).
            ins = re.sub(r"^\s+/\*[0-9a-f]{4}\*/\s+", "", l)
            cur.append(re.sub(r"\s*/\*\s*0x[0-9a-f]+\s*\*/\s*$", "", ins).split(" ;")[0].strip())
    return out


def sass_of_cubin(cuobjdump, cubin):
    """sass_by_function of CUBIN bytes (through a temporary file)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return sass_by_function(cuobjdump, f.name)
    finally:
        os.unlink(f.name)


def find_cuobjdump():
    """$CUOBJDUMP, else cuobjdump on PATH; exits without one."""
    cuobjdump = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not cuobjdump:
        sys.exit("no cuobjdump (set CUOBJDUMP or put it on PATH)")
    return cuobjdump


def nvrtc_cubin(src, arch="sm_90a"):
    return nvrtc_program(src, arch)[0]


def nvrtc_program(src, arch="sm_90a", name="matmul.cu", extra=()):
    """The CUBIN of `src` compiled by NVRTC as the backend compiles it (plus `extra` options),
    and NVRTC's program log (ptxas's report with --ptxas-options=-v: tools/ptxas_info.py)."""
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    lib = None
    for d in ("lib64", "lib"):
        p = os.path.join(home, d, "libnvrtc.so.13")
        if os.path.exists(p):
            # NVRTC opens its builtins library by name at compile time: load it first.
            b = os.path.join(home, d, "libnvrtc-builtins.so.13.0")
            if os.path.exists(b):
                ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(p)
            break
    if lib is None:
        sys.exit(f"no libnvrtc.so.13 under {home}/lib64 or {home}/lib (set CUDA_HOME)")
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [b"--std=c++17", b"-default-device", f"-arch={arch}".encode(), f"-I{home}/include".encode()]
    opts += [o.encode() for o in extra]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.exit("NVRTC failed:\n" + log.value.decode()[-4000:])
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, buf)
    return buf.raw, log.value.decode(errors="replace")


def census(cuobjdump, cubin, fun):
    res = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True).stdout
    m = re.search(rf"Function {fun}:\s*\n\s*REG:(\d+) STACK:(\d+)", res)
    if not m:
        return f"{fun}: not in the module"
    sass = subprocess.run([cuobjdump, "-sass", "-fun", fun, cubin], capture_output=True, text=True).stdout
    ins = [re.sub(r"^\s+/\*[0-9a-f]{4}\*/\s+", "", l).split(" ;")[0].strip()
           for l in sass.splitlines() if re.match(r"^\s+/\*[0-9a-f]{4}\*/", l)]
    ops = [re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0] for i in ins]
    mma = [k for k, o in enumerate(ops) if o in ("IMMA", "HMMA", "IDP")]
    local = sum(o in ("LDL", "STL") for o in ops)
    line = f"{fun}: {m.group(1)} registers, {m.group(2)} B stack, {len(ins)} instructions, {local} local"
    if mma:
        lo, hi = max(0, mma[0] - 60), min(len(ops), mma[-1] + 40)
        top = collections.Counter(ops[lo:hi]).most_common(8)
        line += (f"; {len(mma)} {ops[mma[0]]}, {hi - lo} in their window ({(hi - lo) / len(mma):.1f} per "
                 f"{ops[mma[0]]}): " + ", ".join(f"{o} {c}" for o, c in top))
    return line


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=os.path.join(KERNELS, "matmul.cu"))
    ap.add_argument("--inst", action="append", help="a kernel-instantiating macro call of matmul.cu")
    ap.add_argument("--fun", action="append", help="a kernel to count")
    ap.add_argument("--keep", help="also write the cubin here")
    ap.add_argument("--against", metavar="REV", help="compare every kernel's SASS with git revision REV's")
    a = ap.parse_args()
    cuobjdump = find_cuobjdump()
    cubin = nvrtc_cubin(trimmed_source(a.src, a.inst or DEFAULT_INST))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        for fun in a.fun or DEFAULT_FUN:
            print(census(cuobjdump, f.name, fun))
        if a.keep:
            shutil.copy(f.name, a.keep)
        if a.against:
            now = sass_by_function(cuobjdump, f.name)
            then = sass_of_cubin(cuobjdump, nvrtc_cubin(trimmed_source(a.src, a.inst or DEFAULT_INST, a.against)))
            both = sorted(set(now) & set(then))
            diff = [k for k in both if now[k] != then[k]]
            print(f"against {a.against}: {len(both)} kernels in both, {len(both) - len(diff)} identical, "
                  f"{len(diff)} differ" + "".join(f"\n  differs: {k}" for k in diff))
            for k in sorted(set(now) ^ set(then)):
                print(f"  only in {'the working tree' if k in now else a.against}: {k}")
    finally:
        os.unlink(f.name)


if __name__ == "__main__":
    main()
