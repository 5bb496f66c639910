#!/usr/bin/env bash
# The serving load test on the H200 (issue 3): `ferrite serve` on the GPU (batched steps over
# the paged KV cache) with a synthesized Qwen3-8B Q4_K_M, driven by tools/loadgen.py.
#
#   OUT=dir tools/h200/serve_bench.sh [CONCURRENCY [REQUESTS [PROMPT [GEN]]]]
#
# Defaults: 32 concurrent, 32 requests, 256-token prompts, 128 generated (llama-server: 753
# output tokens/s there). A short warm-up round first (graphs are captured per batch size on
# a size's second decode step). Writes serve.log, warmup.json, loadgen.json, metrics.txt.
# DEVICE=cpu PRESET=tiny-qwen3 QUANT=F16 try the script without a GPU; WARMUP=0 skips the
# warm-up round. The prefix cache: SHARED=S gives the measured prompts (not the warm-up's) the
# same first S tokens; SERVE_FLAGS (e.g. --no-prefix-cache) go to serve; CTX (default
# PROMPT + GEN + 64) and CHUNK (default 512) set its --max-context and --prefill-chunk.
set -uo pipefail
: "${OUT:?set OUT to the directory for logs}"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export FERRITE_CACHE_DIR="${FERRITE_CACHE_DIR:-/tmp/ferrite-cache}"
F="${F:-./target/dist/ferrite}"
C="${1:-32}"
N="${2:-$C}"
P="${3:-256}"
G="${4:-128}"
DEVICE="${DEVICE:-cuda}"
PRESET="${PRESET:-qwen3-8b}"
QUANT="${QUANT:-Q4_K_M}"
M="/tmp/ferrite-models/$PRESET-$QUANT.gguf"
CTX="${CTX:-$((P + G + 64))}"
PORT=18080
mkdir -p /tmp/ferrite-models
[ -f "$M" ] || "$F" synth --preset "$PRESET" --quant "$QUANT" --output "$M" 2>&1 | tail -1
"$F" serve --model "$M" --device "$DEVICE" --port $PORT --max-batch "$C" \
    --max-context "$CTX" --max-kv-tokens $((C * CTX)) \
    --prefill-chunk "${CHUNK:-512}" ${SERVE_FLAGS:-} >"$OUT/serve.log" 2>&1 &
PID=$!
up() { python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" 2>/dev/null; }
for _ in $(seq 1 600); do
    up && break
    kill -0 $PID 2>/dev/null || { echo "serve exited"; tail -20 "$OUT/serve.log"; exit 1; }
    sleep 0.2
done
echo "serve up after $SECONDS s"
L="python3 tools/loadgen.py --url http://127.0.0.1:$PORT --json"
[ "${WARMUP:-1}" = 0 ] || $L -n "$C" -c "$C" --prompt-tokens "$P" --gen-tokens 8 | tee "$OUT/warmup.json"
$L -n "$N" -c "$C" --prompt-tokens "$P" --gen-tokens "$G" --shared-prefix "${SHARED:-0}" | tee "$OUT/loadgen.json"
python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$PORT/metrics').read().decode())" >"$OUT/metrics.txt"
kill $PID
wait $PID 2>/dev/null
tail -5 "$OUT/serve.log"
echo "done after $SECONDS s"
