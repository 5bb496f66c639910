#!/usr/bin/env bash
# A/B of two ferrite builds in one GPU call (same machine, same minute: the only comparison
# that separates a change from run-to-run variation, ~1-2% on tg128).
#
# Here (the development machine), per build:
#   tools/h200/ab.sh pack new        # cargo build --profile dist, kernel CUBIN cache, xz
#   tools/h200/ab.sh pack new mmw    # the same, only the named modules' CUBINs compiled anew
#                                    # (the rest from target/kernel-cache.txz: kernel_cache.sh)
#   (check out the baseline)  tools/h200/ab.sh pack old
#   -> target/ab/ferrite-{new,old}.xz and target/ab/kc-{new,old}.txz (carry them and this
#      script; ~14 MB beside the ~53 MB working tree, near a call's 64 MiB). Where the two
#      builds differ in a few modules, one archive with both builds' CUBINs as kc-new.txz and
#      no kc-old.txz carries less (run then gives both builds that archive): `pack new
#      MODULE...` writes one when target/kernel-cache.txz is the old build's cache.
# There (the H200 machine, OUT set):
#   tools/h200/ab.sh run [--check] [--perf FILTER]... [--bench PRESET:QUANT]... [--reps N]
#   --check         ferrite check --device cuda --e2e on the new build (log in $OUT)
#   --perf FILTER   ferrite check --perf --filter FILTER on both builds (µs lines only)
#   --bench P:Q     synth preset P at quant Q, then pp512 and tg128 old, new, old, new (--reps each)
#   --switch VAR=a,b P:Q   the new build alone on preset P at quant Q with switch VAR at a, b, ...
#                   in turn, two rounds (a switch's A/B inside one binary)
set -uo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-}
shift || true
case "$mode" in
pack)
    tag=${1:?pack needs a tag: new or old}
    shift
    mkdir -p target/ab
    touch crates/cli/build.rs
    cargo build --profile dist -p ferrite-cli 2>&1 | grep -E "^(warning|error)" || true
    xz -6 -T0 -c target/dist/ferrite > "target/ab/ferrite-$tag.xz"
    tools/h200/kernel_cache.sh "$@" > /dev/null && cp target/kernel-cache.txz "target/ab/kc-$tag.txz"
    ls -l "target/ab/ferrite-$tag.xz" "target/ab/kc-$tag.txz"
    ;;
run)
    : "${OUT:?set OUT to the directory for logs}"
    export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
    export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
    for v in old new; do
        mkdir -p "/tmp/ab-$v/cache"
        xz -dc "target/ab/ferrite-$v.xz" > "/tmp/ab-$v/ferrite" && chmod +x "/tmp/ab-$v/ferrite"
        # Without kc-old.txz the old build reads kc-new.txz too (one archive holding both
        # builds' CUBINs: each looks up its own keys; a smaller carry than two archives).
        kc="target/ab/kc-$v.txz"
        [ -f "$kc" ] || kc=target/ab/kc-new.txz
        tar xJf "$kc" -C "/tmp/ab-$v/cache"
    done
    fer() { local v=$1; shift; FERRITE_CACHE_DIR="/tmp/ab-$v/cache" "/tmp/ab-$v/ferrite" "$@"; }
    reps=2
    M=/tmp/ab-models
    mkdir -p "$M"
    while [ $# -gt 0 ]; do
        case "$1" in
        --reps) reps=$2; shift 2 ;;
        --check)
            echo "== check (new) $(date -u +%T)"
            fer new check --device cuda --e2e tests/data/oracle > "$OUT/check.log" 2>&1
            grep -E "cases in|ALL GREEN|FAIL" "$OUT/check.log" | head -20
            shift
            ;;
        --perf)
            echo "== perf '$2' $(date -u +%T)"
            for v in old new; do
                fer $v check --device cuda --perf --filter "$2" 2>&1 | grep -E " µs " |
                    sed -E "s/^/$v /; s/NMSE.*(OK|FAIL)//"
            done | tee -a "$OUT/perf.log"
            shift 2
            ;;
        --bench)
            p=${2%%:*} q=${2##*:}
            echo "== bench $p $q $(date -u +%T)"
            fer new synth --preset "$p" --quant "$q" --output "$M/m.gguf" 2>&1 | tail -1
            for v in old new old new; do
                echo "-- $v"
                fer $v bench --model "$M/m.gguf" --reps "$reps" 2>&1 | grep -E "pp512|tg128|gate|memory in use"
            done | tee -a "$OUT/bench.log"
            rm -f "$M/m.gguf"
            shift 2
            ;;
        --switch)
            var=${2%%=*} vals=${2#*=} p=${3%%:*} q=${3##*:}
            echo "== switch $var over $vals, $p $q $(date -u +%T)"
            fer new synth --preset "$p" --quant "$q" --output "$M/m.gguf" 2>&1 | tail -1
            for r in 1 2; do
                for v in ${vals//,/ }; do
                    echo "$var=$v $(export "$var=$v"; fer new bench --model "$M/m.gguf" --reps "$reps" 2>&1 |
                        grep -E "pp512|tg128|rror" | tr -s ' ' | tr '\n' ' ')"
                done
            done | tee -a "$OUT/switch.log"
            rm -f "$M/m.gguf"
            shift 3
            ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
        esac
    done
    echo "== done $(date -u +%T)"
    ;;
*)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
