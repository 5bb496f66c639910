#!/usr/bin/env bash
# Builds, on the development machine (no GPU needed), the CUBIN cache a GPU session carries so
# that the H200 machine skips NVRTC at start-up (crates/backend/src/cuda/nvrtc.rs):
#
#   tools/h200/kernel_cache.sh      -> target/kernel-cache.txz (~3.5 MB; carry it with the binary)
#   tools/h200/kernel_cache.sh mmw  -> the same, only the named modules compiled anew, the
#                                      other CUBINs taken from the existing archive (minutes
#                                      instead of ~8 here)
#
# Every module is compiled with common.cuh and mm_decode.cuh before it: a change there changes
# every module's cache key, so rebuild them all (no arguments); a partial archive would leave the
# GPU machine compiling the rest with NVRTC at start-up (minutes of its time).
#
# xz, not gzip: the modules' CUBINs are ~31 MB, 8.5 MB gzipped, and a call carries at most 64 MiB
# with the working tree (~53 MB). A partial rebuild keeps the archive's earlier CUBINs of the
# modules it compiles anew beside the new ones (tools/h200/ab.sh: one archive for two builds).
# Needs NVRTC 13.0 and the CUDA headers here (CUDA_HOME); the cache key includes the NVRTC
# version, so an archive made with another version is simply not used there.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
if [ $# -gt 0 ]; then
    [ -f target/kernel-cache.txz ] || { echo "no target/kernel-cache.txz to start from" >&2; exit 1; }
    tar xJf target/kernel-cache.txz -C "$dir"
    export FERRITE_NVRTC_ONLY=$(IFS=,; echo "$*")
fi
FERRITE_CACHE_DIR="$dir" cargo test --release -p ferrite-backend --test nvrtc_compile -- --nocapture \
    | grep -E "CUBIN|skipped" || true
ls "$dir"/kernels/*.cubin > /dev/null 2>&1 || { echo "no CUBIN was built (is NVRTC installed?)" >&2; exit 1; }
tar cf - -C "$dir" $(cd "$dir" && ls kernels/*.cubin) | xz -9 -T0 > target/kernel-cache.txz
ls -l target/kernel-cache.txz
