"""cuBLAS (through torch) at a prefill's GEMM shapes: the reference rate for ferrite's wgmma
kernels (MATMUL.md round 92). Prints µs and TFLOP/s per shape, the mean of REPS products after
five warm-ups, f16 operands with f32 accumulation (torch's default for f16 matmul with reduced-
precision reduction off).

    python3 tools/h200/cublas_shapes.py [ROWS] [N_IN:N_OUT ...]

Default: 512 rows at Qwen3-8B's projections (Q, K, V grouped; O; gate + up; down).
"""
import sys

import torch

REPS = 50


def main():
    args = sys.argv[1:]
    rows = int(args[0]) if args else 512
    shapes = [tuple(int(v) for v in a.split(":")) for a in args[1:]] or [
        (4096, 6144),
        (4096, 4096),
        (4096, 24576),
        (4096, 12288),
        (12288, 4096),
    ]
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    print(torch.cuda.get_device_name())
    for n_in, n_out in shapes:
        x = torch.randn(rows, n_in, device="cuda", dtype=torch.float16)
        w = torch.randn(n_out, n_in, device="cuda", dtype=torch.float16)
        for _ in range(5):
            x @ w.t()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPS):
            x @ w.t()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / REPS
        print(f"cublas f16 {rows} rows, {n_in} -> {n_out}: {us:.1f} us, {2 * rows * n_in * n_out / us / 1e6:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
