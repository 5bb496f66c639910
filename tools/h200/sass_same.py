#!/usr/bin/env python3
"""Whether kernels compiled to the same machine code in two CUBINs of a module.

    tools/h200/sass_same.py OLD.cubin NEW.cubin [KERNEL ...]

Compares each kernel's `.text.<name>` section (its SASS) and `.nv.constant0.<name>` (its
parameter bank layout) byte for byte; with no KERNEL names, every kernel the two files share.
Kernels whose sections are identical run identically, so a change that leaves them so (a new
template instantiation beside them, a comment) needs no GPU measurement of them. The CUBINs
come from tools/h200/kernel_cache.sh's archive (target/kernel-cache.txz, one file per module
version). Uses readelf (binutils) for the section table; exit status 1 if any differ.
"""
import re
import subprocess
import sys

SECTION = re.compile(r"\s*\[\s*\d+\]\s+(\S+)\s+\S+\s+[0-9a-f]+\s+([0-9a-f]+)\s+([0-9a-f]+)")


def sections(path):
    out = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True).stdout
    data = open(path, "rb").read()
    found = {}
    for line in out.splitlines():
        m = SECTION.match(line)
        if m:
            off, size = int(m.group(2), 16), int(m.group(3), 16)
            found[m.group(1)] = data[off:off + size]
    return found


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    old, new = sections(sys.argv[1]), sections(sys.argv[2])
    kernels = sys.argv[3:] or sorted(
        n[len(".text."):] for n in old if n.startswith(".text.") and n in new)
    differ = 0
    for k in kernels:
        for sec in (".text." + k, ".nv.constant0." + k):
            a, b = old.get(sec), new.get(sec)
            if a is None or b is None:
                state = "missing in " + ("old" if a is None else "new")
            else:
                state = "same" if a == b else f"DIFFERENT ({len(a)} -> {len(b)} bytes)"
            differ += state != "same"
            print(f"{sec:60} {state}")
    print(f"{len(kernels)} kernels, {differ} sections differ")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
