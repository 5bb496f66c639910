#!/usr/bin/env bash
# One GPU session on the H200 machine (which has no Rust, no models and no network): the
# binary built on the development machine (`cargo build --profile dist -p ferrite-cli`)
# travels as target/dist/ferrite, with target/kernel-cache.txz if present.
#
#   tools/h200/session.sh STAGE...    with OUT set to a directory whose files come back
#
# Stages (run in the order given):
#   info     nvidia-smi, versions
#   check    ferrite check --device cuda (every op vs the CPU reference + end-to-end gates)
#   perf     ferrite check --device cuda --perf
#   bench8b  synth Qwen3-8B Q4_K_M, Q8_0, F16 and bench pp512/tg128 each (--record)
#   bench30b synth Qwen3-30B-A3B Q4_K_M and bench it
#   benchllama synth Llama-3.1-8B Q4_K_M (llama3 RoPE scaling, Llama 3 vocabulary) and bench it
#   hostexp  Qwen3-30B-A3B Q4_K_M tg32 with its experts all in VRAM, about half in host memory
#            (--vram-weights 10) and all there (--vram-weights 1), not recorded
#   depth    Qwen3-8B Q4_K_M tg128 at depth 8192 and 32768
#   bench35  synth Qwen3.5-9B and Qwen3.5-35B-A3B Q4_K_M, bench each; 9B also at depth 8192
#   q8kv     Qwen3-8B Q4_K_M with --kv-cache-q8 at depth 0 and 32768 (not recorded)
#   guxg     the MoE gate/up's x gathered into list order and taken by tensor copies
#            (FERRITE_MMW_GU_XG, bits: 1 the gather, 2 tile-major blocks; MOE.md 50th session;
#            the cache needs each value's mmw CUBIN: `FERRITE_MMW_GU_XG=v tools/h200/kernel_cache.sh
#            mmw`): moe check under 1 and 3, then pp512 of GUXG_MODELS (default Qwen3-30B-A3B
#            Q4_K_M) at GUXG_VALS (default "0 1 3") in turn, two rounds
#   rsq5     the Q5_K register-A form (FERRITE_MMW_RS_Q5, on by default; MATMUL.md rounds 91, 93;
#            the off form's CUBIN first: `FERRITE_MMW_RS_Q5=0 tools/h200/kernel_cache.sh mmw`): the matmul
#            check under it, then pp512 of Qwen3.5-35B-A3B and Qwen3.5-9B Q4_K_M (their Q5_K
#            in-projections) off / on in turn, two rounds
#   f16      Qwen3-8B F16's prefill against cuBLAS: tools/h200/cublas_shapes.py, check --perf of the
#            16-bit matmuls, the pp512 trace (ptrace)
#   tshift   a dense launch's last token tile read inside x's tensor map (FERRITE_MMW_TSHIFT, on by
#            default; MATMUL.md round 93; the off form's CUBIN: `FERRITE_MMW_TSHIFT=0
#            tools/h200/kernel_cache.sh mmw`): pp300 of Qwen3-8B Q4_K_M and F16 off / on, two rounds
#   attnx16  the prefill attention writing the o-projection's 16-bit x (FERRITE_ATTN_X16, on by
#            default since the 59th session; MATMUL.md round 99; the same CUBIN serves both
#            values): its attention+o check cases under 1, then Qwen3-8B Q4_K_M and F16 pp512
#            off / on, two rounds
#   cat      the concatenated 192-output tile for Q, K, V of 16-bit weights (FERRITE_MMW_TA_CAT,
#            on by default since the 59th session; MATMUL.md round 100): the grouped 16-bit matmul
#            checks under 1 and 2, check --perf of the 512-row ones under 0 and 1, then Qwen3-8B
#            F16 pp512 off / on, two rounds
#   lt       the 16-bit prefill GEMMs on cuBLASLt (FERRITE_CUBLASLT, 1 by default since the 59th
#            session; MATMUL.md round 101; no CUBIN of its own): the f16/bf16 checks under 3,
#            check --perf --eager of the 512-row O, down, K/V shapes under 0 / 1 and the Q, K, V
#            group under 0 / 2, then Qwen3-8B F16 pp512 under 0, 1, 3 in turn, two rounds
#   f16ab    rounds 99-101 together in one short call (the 59th session's first; all three on by
#            default since, so (1,1,1) is the default and (0,0,0) all three off): the
#            f16 checks under FERRITE_CUBLASLT=3 first, then Qwen3-8B F16 pp512 under (CAT, X16,
#            LT) = (0,0,0), (0,1,3), (1,1,1), (0,0,0) once each, then the checks under
#            FERRITE_MMW_TA_CAT=1 and FERRITE_ATTN_X16=1; `lt cat attnx16` are the full stages
#   bytes    rounds 102-104 of MATMUL.md (on by default): the 300-row checks, then Qwen3-8B F16
#            pp512 with FERRITE_NORM_X16_ONLY, FERRITE_LT_ADD and FERRITE_KV_FUSE all 0 / all 1
#            and Q4_K_M with X16_ONLY and KV_FUSE 0 / 1, two rounds
#   taks     the TA wide tile with K split between a cluster's two blocks (FERRITE_MMW_TA_KS=2, on
#            by default since the 53rd session; MATMUL.md round 95; the same CUBIN serves both values):
#            the matmul check and check --perf of the 16-bit matmuls under it, then Qwen3-8B F16
#            pp512 and pp300 (gate at 300) off / on, two rounds
#   rsq6     the Q6_K register-A form (FERRITE_MMW_RS_Q6, on by default; the off form's cache
#            first: `FERRITE_MMW_RS_Q6=0 tools/h200/kernel_cache.sh mmw`): matmul check, then Qwen3-8B
#            Q4_K_M pp512 off / on, two rounds
#   predict  MoE experts predicted a layer ahead and prefetched into L2 (FERRITE_MOE_PREDICT; MOE.md
#            63rd session): Qwen3-30B-A3B and Qwen3.5-35B-A3B tg128 at PREDICT_VALS (default
#            "0 8 12") in turn, two rounds, with the prefill/decode gate; then N = 8 without the
#            prefetch (FERRITE_MOE_PREDICT_PF=0: the prediction's own cost), and each N's hit rate
#            (FERRITE_MOE_PREDICT_HITS=1: how many of the router's top-k the prediction held)
#   moe4w    the RS MoE experts on 160-thread blocks (FERRITE_MMW_MOE=4, the default since the 49th session;
#            MOE.md 48th session): moe check under it, then pp512 of Qwen3-30B-A3B and
#            Qwen3.5-35B-A3B Q4_K_M at MOE=3 / 4 in turn, two rounds, and the 30B's trace under 4
#   bound    the decode step without its weight copies (FERRITE_GEMV_DIAG 0 / 2 / 1: all, no
#            bulk weight copies, no GEMV compute) on Qwen3-8B Q4_K_M and Q8_0 and Qwen3-30B-A3B
#            (BOUND_MODELS="preset:quant ..." for others), then Qwen3-8B Q4_K_M's block timeline
#            with and without the copies (tools/timeline.py --summary of each; the cache needs
#            the stamped CUBINs beside the plain ones, after the full build: `FERRITE_DIAG_TL=1
#            tools/h200/kernel_cache.sh attention elementwise gated_delta matmul mmq mmw moe`)
#   phases   the one-row tensor-core GEMV blocks' phases on Qwen3-8B Q4_K_M (gemvq_tc_block's
#            marks under FERRITE_DIAG_TL, replay 100; tools/timeline.py --phases: x staging, the
#            tile's wait, the super-block loop, the store, per launch kind and wave), with and
#            without the weight copies (FERRITE_GEMV_DIAG 0 / 2); needs the stamped CUBINs as
#            `bound` does (DECODE_STEP.md, 68th session)
#   spec35   speculation's cost on Qwen3.5-9B Q4_K_M with a random MTP head (synth --mtp):
#            bench --mtp-depth K --draft-right R (scripted drafts, the head run for its cost)
#            at K = 1, 2, 4 with every draft right and with none right: tokens/s against plain
#            decode's tg128 (not recorded); all right also eager (FERRITE_SPEC_GRAPHS=0),
#            none right also rolled back by replay (FERRITE_SPEC_REPLAY=1)
#   spec8b   the same on Qwen3-8B Q4_K_M (no head: scripted drafts only), K = 2, 4
#   rows     Qwen3-8B and Qwen3.5-9B Q4_K_M: pp of n = 1, 2, 3, 4, 5, 8, 9 tokens (the cost of a
#            forward of n rows on the few-row decode GEMVs)
#   batch    Qwen3-8B Q4_K_M and Q8_0: bench --batch N (serve's batched decode step) at N = 2, 3,
#            4, 5, 8, 9, 16 against tg128 alone
#   batch35  the same on Qwen3.5-9B and Qwen3.5-35B-A3B Q4_K_M (hybrid: each sequence on its
#            own Gated DeltaNet state slot) at N = 2, 4, 8, 16, after the batched conv/delta
#            check cases
#   prefix   serve's prefix cache on / off: 48 requests at 16, 512-token prompts sharing 448,
#            64 generated (tools/loadgen.py --shared-prefix), on Qwen3-8B and Qwen3.5-9B
#            Q4_K_M (PREFIX_MODELS="preset:quant ..." for others; bench/serving.md)
#   tm       the token-major Q4_K GEMV (FERRITE_GEMV_TM=1): its matmul check cases, then check
#            --perf of the Q4_K matmuls with it off and on
#   profile  ncu per kernel of one Qwen3-8B Q4_K_M decode step, grouped by tools/h200/ncu_step.py
#   gemv_detail  ncu --set full of the two largest Qwen3-8B Q4_K_M decode GEMVs
#   attn_detail  ncu --set full of one pp512 prefill attention launch (attn_prefill_tc2_128, or
#            attn_prefill_tc_128 under FERRITE_ATTN_TC2=0) of Qwen3-8B Q4_K_M: pipes, stalls,
#            occupancy (ATTENTION.md 53rd session)
#   ptrace   where a pp512 forward's time goes, per kernel (CUPTI; TRACE_MODELS as trace's,
#            default Qwen3-30B-A3B Q4_K_M)
#   trace    what each kernel adds to a Qwen3-8B Q4_K_M decode step in the real graph (CUPTI
#            injection, tools/h200/kernel_trace.{c,py}); the raw trace comes back gzipped.
#            TRACE_MODELS="preset:quant ..." traces others (e.g. "qwen3-8b:Q8_0
#            qwen3-30b-a3b:Q4_K_M"), one trace-<preset>-<quant>.txt each
#   geometry Qwen3-8B Q8_0 tg128 A/B of the lane-code block geometry (MATMUL.md round 26):
#            FERRITE_GEMV_ONE_WAVE 1 (default) / 2 / 0, then FERRITE_GEMVQ_SMEM 40 / 56 / 80 KB,
#            two rounds each; Qwen3-8B Q4_K_M with ONE_WAVE 1 / 2 once (its lane code is Q6_K)
#   pre2     the ticket-merge form of the keys-before-the-wait decode attention (the default)
#            (FERRITE_ATTN_PRE=2; ATTENTION.md): its check cases, then Qwen3-8B and
#            Qwen3-30B-A3B Q4_K_M tg128 in caches of 2,178 and 3,130 positions (35 and 49
#            splits, chunks of one tile), FERRITE_ATTN_PRE 1 / 2 alternating, two rounds
#   exact    exact prefill (FERRITE_MMQ=1): matmul/moe checks, and a 4-layer Qwen3.5-35B-A3B cut's
#            CUDA-vs-CPU logits per position plus its prefill/decode gate
#   normq    the Q4_K norm hand-over (FERRITE_DEFER_NORM_Q, on by default; MATMUL.md round 24):
#            its check cases, Qwen3-8B Q4_K_M tg128 off / on alternating (twice), a CUPTI trace
#            of each, and the full check with it on
#   kvfuse   a prefill's keys and values stored by the qk_norm_rope launch (FERRITE_KV_FUSE,
#            on by default; MATMUL.md rounds 104 and 106): its check cases, then Qwen3.5-9B
#            Q4_K_M pp512 FERRITE_KV_FUSE 0 / 1 in turn, two rounds (KVFUSE_MODELS: the presets,
#            default qwen3.5-9b; "qwen3.5-9b qwen3.5-35b-a3b" for both)
# Logs and bench/results.jsonl lines are written under $OUT. To compare two builds in one
# call (a change against its baseline): tools/h200/ab.sh.
#
# SmolLM2 (98 MB) is larger than what one call may carry next to the working tree: split it
# into ignored parts (`split -b 31M -d -a 1 SmolLM2-135M-Instruct.Q4_1.gguf .xfer/smol.part`),
# carry one part per call into /tmp/smol/ while the machine stays warm, then concatenate,
# check the sha256 (b179c952...) and run `ferrite run --device cuda --chat ...` on it.
#
# Start-up on a fresh machine: every kernel module is compiled by NVRTC straight to a CUBIN
# for the device (the modules in parallel; matmul.cu is the slowest) and cached in
# $FERRITE_CACHE_DIR/kernels. tools/h200/kernel_cache.sh makes that cache here (same NVRTC
# 13.0, same cache key) as target/kernel-cache.txz; carried, it is unpacked below and the
# machine skips NVRTC.
set -uo pipefail
: "${OUT:?set OUT to the directory for logs}"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export FERRITE_CACHE_DIR=/tmp/ferrite-cache
F=./target/dist/ferrite
M=/tmp/ferrite-models
mkdir -p "$M" "$FERRITE_CACHE_DIR"
[ -f target/kernel-cache.txz ] && tar xJf target/kernel-cache.txz -C "$FERRITE_CACHE_DIR"
RES="$OUT/results.jsonl"

synth() { # preset quant [more synth args]
    local f="$M/$1-$2.gguf"
    [ -f "$f" ] || $F synth --preset "$1" --quant "$2" --output "$f" "${@:3}" 2>&1 | tail -1
    echo "$f"
}

# The CUPTI kernel tracer (tools/h200/kernel_trace.c) built as /tmp/libktrace.so, and
# `traced FILE command...`: the command with every kernel's start and end logged to FILE.
KT_C=/usr/local/cuda/targets/x86_64-linux
ktrace_build() {
    nvcc -shared -Xcompiler -fPIC -DKREC=CUpti_ActivityKernel10 -I$KT_C/include \
        tools/h200/kernel_trace.c -L$KT_C/lib -lcupti -o /tmp/libktrace.so
}
traced() {
    local t=$1
    shift
    LD_LIBRARY_PATH="$KT_C/lib:$LD_LIBRARY_PATH" CUDA_INJECTION64_PATH=/tmp/libktrace.so TRACE_OUT="$t" "$@"
}

# Two rounds of bench on model file $4 with switch $2 at each value of $3 in turn (labelled by
# $5), printing the lines that match $1; further arguments go to bench.
ab_runs() { # PATTERN VAR "values" model label [bench args...]
    local pat=$1 var=$2 vals=$3 f=$4 label=$5 r v
    shift 5
    for r in 1 2; do
        for v in $vals; do
            echo "$label $var=$v $(env "$var=$v" $F bench --model "$f" --reps 2 "$@" 2>&1 | grep -E "$pat" | tr -s ' ' | tr '\n' ' ')"
        done
    done
}
# The block timeline of decode-graph replay 100 of model file $2 under FERRITE_GEMV_DIAG=$1
# (0 all, 2 no bulk weight copies): its tg128 line, the stamps at /tmp/tl-$1.tsv, gzipped to
# $OUT/tl-$1.tsv.gz, and tools/timeline.py --summary of them in $OUT/tl-summary-$1.txt.
timeline_run() { # diag model
    local d=$1 f=$2
    FERRITE_DIAG_TL=100 FERRITE_DIAG_TL_OUT="/tmp/tl-$d.tsv" FERRITE_GEMV_DIAG=$d $F bench --model "$f" \
        --reps 1 --gate-tokens 8 --prompt-tokens 64 2>&1 | grep -E 'tg128|rror'
    python3 tools/timeline.py "/tmp/tl-$d.tsv" --summary > "$OUT/tl-summary-$d.txt" 2>&1
    gzip -c "/tmp/tl-$d.tsv" > "$OUT/tl-$d.tsv.gz"
}
# `ferrite check --device cuda --filter FILTER` under the switch setting VAR=V, logged whole to
# $OUT/LOG, its last TAIL lines (default 6) shown.
check_under() { # VAR=V filter log [tail]
    env "$1" $F check --device cuda --filter "$2" 2>&1 | tee "$OUT/$3" | tail -"${4:-6}"
}
# `ferrite check --device cuda --filter FILTER` under the switch setting VAR=V ("-" for none) as
# one line: LABEL, then the summary and the first failures; the whole log to $OUT/LOG if given.
check_line() { # LABEL VAR=V|- filter [log]
    local label=$1 filter=$3 log=/dev/null e=()
    [ "$2" != - ] && e=("$2")
    [ -n "${4:-}" ] && log="$OUT/$4"
    echo "$label: $(env "${e[@]}" $F check --device cuda --filter "$filter" 2>&1 | tee "$log" \
        | grep -E 'cases in|FAIL|ERROR|rror' | head -8 | tr '\n' ' ')"
}
# The 512-row `check --perf` lines of the cases matching FILTER under VAR=V, on one line;
# further arguments go to check (--eager: launches back to back, no graph).
perf512() { # VAR=V filter [check args...]
    env "$1" $F check --device cuda --perf --filter "$2" "${@:3}" 2>&1 | grep -E "rows=512" | tr -s ' '
}
# The grouped 16-bit Q, K, V case at Qwen3-8B's shapes (cat, lt).
F16_QKV512="f16 f16 f16: 4096 + 4096->1024 x2 rows=512 (checked: the first"
# tg128 (ab_switch) or pp512 with the prefill/decode gate of `gate_tokens` tokens (ab_pp, 16
# generated tokens) in that A/B.
ab_switch() { # VAR "values" model label [bench args...]
    ab_runs 'tg128|rror' "$@"
}
ab_pp() { # VAR "values" model label [bench args...]
    local var=$1 vals=$2 f=$3 label=$4
    shift 4
    ab_runs 'pp512|gate|rror' "$var" "$vals" "$f" "$label" --gen-tokens 16 --gate-tokens "$(gate_tokens "$label")" "$@"
}
# The prefill/decode gate's length for a preset (bench35's: MOE.md says why the Qwen3.5-35B-A3B
# gate is 16 tokens on random weights).
gate_tokens() { # preset (or a label starting with it)
    case "$1" in qwen3.5-35b-a3b*) echo 16 ;; *) echo 32 ;; esac
}

for stage in "$@"; do
    echo "=== $stage $(date -u +%H:%M:%S)"
    case "$stage" in
    info)
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
        $F --version
        ;;
    check) $F check --device cuda --e2e tests/data/oracle 2>&1 | tee "$OUT/check.log" | tail -60 ;;
    perf) $F check --device cuda --perf 2>&1 | tee "$OUT/perf.log" | tail -80 ;;
    bench8b)
        for q in Q4_K_M Q8_0 F16; do
            f=$(synth qwen3-8b $q | tail -1)
            $F bench --model "$f" --label qwen3-8b --reps 3 --record --results "$RES" 2>&1 | tee -a "$OUT/bench.log" | tail -8
            rm -f "$f"
        done
        ;;
    benchllama)
        # Llama-3.1-8B Q4_K_M (Llama 3's vocabulary, the llama3 RoPE scaling: the _tab rotary
        # kernels, GGUF's adjacent pairs), not among issue 4's targets.
        f=$(synth llama3.1-8b Q4_K_M | tail -1)
        $F bench --model "$f" --label llama3.1-8b --reps 3 --record --results "$RES" 2>&1 | tee -a "$OUT/bench.log" | tail -8
        rm -f "$f"
        ;;
    bench30b)
        f=$(synth qwen3-30b-a3b Q4_K_M | tail -1)
        $F bench --model "$f" --label qwen3-30b-a3b --reps 3 --record --results "$RES" 2>&1 | tee -a "$OUT/bench.log" | tail -8
        rm -f "$f"
        ;;
    hostexp)
        # MoE experts held in host memory (--vram-weights; bench/host_experts.md): Qwen3-30B-A3B
        # Q4_K_M tg128 with every expert in VRAM, about half, and none (not recorded). The
        # logits' bit-for-bit check is the e2e check's "experts in host memory" lines.
        f=$(synth qwen3-30b-a3b Q4_K_M | tail -1)
        for v in none 10 1; do
            a=(); [ $v != none ] && a=(--vram-weights $v)
            echo "vram-weights $v: $($F bench --model "$f" --reps 1 --prompt-tokens 64 --gen-tokens 32 "${a[@]}" 2>&1 | grep -E 'tg32|host memory|rror|gate' | tr '\n' ' ')"
        done
        rm -f "$f"
        ;;
    depth)
        f=$(synth qwen3-8b Q4_K_M | tail -1)
        for d in 8192 32768; do
            $F bench --model "$f" --label qwen3-8b --depth $d --prompt-tokens 512 --reps 1 --record --results "$RES" 2>&1 | tee -a "$OUT/bench.log" | tail -6
        done
        ;;
    bench35)
        # Qwen3.5-35B-A3B: the gate at 16 tokens (recorded as gate_tokens; MOE.md says why: on
        # random weights the bf16 prefill flips near-tied choices of 256 near-uniform routers),
        # and the 32-token gate with exact prefill (FERRITE_MMQ=1), not recorded.
        for p in qwen3.5-9b qwen3.5-35b-a3b; do
            f=$(synth $p Q4_K_M | tail -1)
            g=$(gate_tokens "$p")
            for d in 0 8192; do
                $F bench --model "$f" --label $p --depth $d --prompt-tokens 512 --gate-tokens $g --reps 3 --record --results "$RES" 2>&1 | tee -a "$OUT/bench.log" | tail -6
            done
            [ $p = qwen3.5-35b-a3b ] && FERRITE_MMQ=1 $F bench --model "$f" --reps 1 --gen-tokens 8 2>&1 | grep -i gate | tee -a "$OUT/bench.log"
            rm -f "$f"
        done
        ;;
    spec35)
        f=$(synth qwen3.5-9b Q4_K_M --mtp | tail -1)
        for k in 1 2 4; do
            # every draft right: graphs (default) / eager; none right: the rollback from
            # per-row states (default) / by replay
            for m in "$k" "$k FERRITE_SPEC_GRAPHS=0" "0" "0 FERRITE_SPEC_REPLAY=1"; do
                set -- $m
                echo "-- depth $k, $1 right ${2:-default}" | tee -a "$OUT/spec.log"
                env ${2:-FERRITE_SPEC_GRAPHS=1} $F bench --model "$f" --label qwen3.5-9b --reps 2 --prompt-tokens 64 --mtp-depth $k --draft-right $1 2>&1 | tee -a "$OUT/spec.log" | grep -E "tg128|gate"
            done
        done
        rm -f "$f" "${f%.gguf}.mtp.safetensors"
        ;;
    spec8b)
        f=$(synth qwen3-8b Q4_K_M | tail -1)
        for k in 2 4; do
            for r in $k 0; do
                echo "-- depth $k, $r right" | tee -a "$OUT/spec.log"
                $F bench --model "$f" --label qwen3-8b --reps 2 --prompt-tokens 64 --mtp-depth $k --draft-right $r 2>&1 | tee -a "$OUT/spec.log" | grep -E "tg128|gate"
            done
        done
        ;;
    rows)
        # What a forward of n rows costs (prefill of n tokens: eager, so with its launches) on
        # the few-row decode GEMVs: the verify of a speculative step and serve's batched steps.
        # First the GEMVs alone at the real widths (µs by row count).
        $F check --device cuda --perf --filter "matmul " 2>&1 | grep -E -- "->(4096|12288|1024) rows=[0-9] " | tee "$OUT/rows-perf.txt"
        for p in qwen3-8b qwen3.5-9b; do
            f=$(synth $p Q4_K_M | tail -1)
            for n in 1 2 3 4 5 8 9; do
                echo "$p rows $n $($F bench --model "$f" --reps 3 --prompt-tokens $n --gen-tokens 2 2>&1 | grep -E "pp$n |rror" | tr '\n' ' ')"
            done | tee -a "$OUT/rows.txt"
            rm -f "$f"
        done
        ;;
    batch)
        # serve's batched decode step at N sequences (bench --batch N: tg128-bN, all tokens/s
        # and the step's % of the roofline) against tg128 alone.
        for pq in qwen3-8b:Q4_K_M qwen3-8b:Q8_0; do
            f=$(synth "${pq%%:*}" "${pq##*:}" | tail -1)
            for n in 2 3 4 5 8 9 16; do
                echo "$pq $($F bench --model "$f" --reps 2 --prompt-tokens 64 --batch $n 2>&1 | grep -E "tg128|rror" | tr '\n' ' ')"
            done | tee -a "$OUT/batch.txt"
            rm -f "$f"
        done
        ;;
    batch35)
        # Hybrid models in serve's batched step: the segmented conv / delta-rule cases, then
        # bench --batch N against tg128 alone.
        $F check --device cuda --filter "batched causal_conv1d" 2>&1 | tee "$OUT/check-batch35.log" | tail -2
        for pq in qwen3.5-9b:Q4_K_M qwen3.5-35b-a3b:Q4_K_M; do
            f=$(synth "${pq%%:*}" "${pq##*:}" | tail -1)
            g=$(gate_tokens "$pq")
            for n in 2 4 8 16; do
                echo "$pq $($F bench --model "$f" --reps 2 --prompt-tokens 64 --gate-tokens $g --batch $n 2>&1 | grep -E "tg128|rror" | tr '\n' ' ')"
            done | tee -a "$OUT/batch35.txt"
            rm -f "$f"
        done
        ;;
    prefix)
        # tools/h200/serve_bench.sh at 16 sequences, 48 requests of 512 + 64 tokens sharing
        # 448, serve's default chunk (256) and a 1024-token context, cache on then off.
        for pq in ${PREFIX_MODELS:-qwen3-8b:Q4_K_M qwen3.5-9b:Q4_K_M}; do
            for flag in "" --no-prefix-cache; do
                mkdir -p "$OUT/prefix-${pq%%:*}$flag"
                OUT="$OUT/prefix-${pq%%:*}$flag" F=$F PRESET="${pq%%:*}" QUANT="${pq##*:}" SHARED=448 \
                    CTX=1024 CHUNK=256 SERVE_FLAGS="$flag" tools/h200/serve_bench.sh 16 48 512 64 > /dev/null
                echo "$pq ${flag:-cache}: $(cat "$OUT/prefix-${pq%%:*}$flag/loadgen.json")"
            done | tee -a "$OUT/prefix.txt"
            rm -f "$M/${pq%%:*}-${pq##*:}.gguf"
        done
        ;;
    tm)
        # The token-major Q4_K GEMV (FERRITE_GEMV_TM=1, MATMUL.md round 78): its check (the
        # plain Q4_K matmul cases, with the row-invariance assertion), then µs by row count
        # at the real widths against the default GEMVs.
        FERRITE_GEMV_TM=1 $F check --device cuda --filter "matmul q4_K" 2>&1 | tee "$OUT/check-tm.log" | tail -2
        for v in 0 1; do
            echo "FERRITE_GEMV_TM=$v"
            FERRITE_GEMV_TM=$v $F check --device cuda --perf --filter "matmul q4_K" 2>&1 | grep -E -- "->(4096|12288|1024) rows=([1-9]|1[0-6]) "
        done | tee "$OUT/tm-perf.txt"
        ;;
    predict)
        # The MoE experts predicted a layer ahead and prefetched into L2 beside the decode chain
        # (FERRITE_MOE_PREDICT, off by default; MOE.md, 63rd session): Qwen3-30B-A3B and
        # Qwen3.5-35B-A3B Q4_K_M tg128 (with the gate of gate_tokens: a hint must leave every
        # logit as it was) at PREDICT_VALS (default "0 8 12") in turn, two rounds.
        for p in qwen3-30b-a3b qwen3.5-35b-a3b; do
            f=$(synth $p Q4_K_M | tail -1)
            ab_runs 'tg128|gate|prediction|rror' FERRITE_MOE_PREDICT "${PREDICT_VALS:-0 8 12}" "$f" "$p" \
                --gate-tokens "$(gate_tokens "$p")" | tee -a "$OUT/predict.log"
            # The prediction alone, without its prefetch (FERRITE_MOE_PREDICT_PF=0): its own cost.
            FERRITE_MOE_PREDICT_PF=0 ab_runs 'tg128|gate|rror' FERRITE_MOE_PREDICT 8 "$f" "$p-pf0" \
                --gate-tokens "$(gate_tokens "$p")" | tee -a "$OUT/predict.log"
            # How many routed experts it held (FERRITE_MOE_PREDICT_HITS: a timing diagnostic).
            for n in ${PREDICT_VALS:-0 8 12}; do
                [ "$n" = 0 ] && continue
                echo "$p PREDICT=$n hits: $(FERRITE_MOE_PREDICT=$n FERRITE_MOE_PREDICT_HITS=1 $F bench --model "$f" \
                    --reps 1 --prompt-tokens 64 2>&1 | grep -E 'predicted|rror' | sed 's/.*INFO//')" | tee -a "$OUT/predict.log"
            done
            rm -f "$f"
        done
        ;;
    kvfuse)
        check_line "check qk_norm_rope" - qk_norm_rope | tee -a "$OUT/kvfuse.log"
        for p in ${KVFUSE_MODELS:-qwen3.5-9b}; do
            f=$(synth "$p" Q4_K_M | tail -1)
            ab_runs "pp512|gate|rror" FERRITE_KV_FUSE "0 1" "$f" "$p" --gen-tokens 8 \
                --gate-tokens "$(gate_tokens "$p")" | tee -a "$OUT/kvfuse.log"
            rm -f "$f"
        done
        ;;
    predictat)
        # Where the predicted experts' prefetch is issued and at what priority
        # (FERRITE_MOE_PREDICT_AT: 0 with the prediction at the layer before's end, 1 after the
        # layer's Q, K, V launch, 2 after its attention launch; FERRITE_MOE_PREDICT_PRIO: 1 the
        # side launches at the greatest priority; MOE.md, 64th session): Qwen3-30B-A3B and
        # Qwen3.5-35B-A3B Q4_K_M tg128 at the settings of PREDICT_AT_RUNS ("N:AT:PRIO ...", N = 0
        # off), in turn, two rounds; then the 30B's step traced under each (CUPTI): the side
        # launches against the chain (side_trace.py), and the chain's kernels against the first
        # setting (kernel_trace.py --vs, the side launches left out of its end-to-end gaps);
        # PREDICT_TRACE=0 skips the traces.
        runs=${PREDICT_AT_RUNS:-0:0:0 4:1:1 8:1:1}
        # A setting N:AT:PRIO as environment words.
        penv() {
            echo "FERRITE_MOE_PREDICT=${1%%:*} FERRITE_MOE_PREDICT_AT=$(echo "$1" | cut -d: -f2)" \
                "FERRITE_MOE_PREDICT_PRIO=$(echo "$1" | cut -d: -f3)"
        }
        # The prediction kernel against the CPU (logits by NMSE, picks against its logits).
        check_line "check moe_predict" - moe_predict | tee -a "$OUT/predictat.log"
        for p in qwen3-30b-a3b qwen3.5-35b-a3b; do
            f=$(synth $p Q4_K_M | tail -1)
            for r in 1 2; do
                for na in $runs; do
                    echo "$p N:AT:PRIO=$na $(env $(penv "$na") $F bench --model "$f" \
                        --reps 2 --gate-tokens "$(gate_tokens "$p")" 2>&1 | grep -E 'tg128|gate|rror' | tr -s ' ' | tr '\n' ' ')"
                done
            done | tee -a "$OUT/predictat.log"
            if [ "$p" = qwen3-30b-a3b ] && [ "${PREDICT_TRACE:-1}" != 0 ] && ktrace_build; then
                for na in $runs; do
                    t=/tmp/trace-${na//:/-}
                    # (traced is a shell function: the settings exported in a subshell, not by env)
                    (export $(penv "$na"); traced $t-raw.txt $F bench --model "$f" \
                        --reps 1 --gate-tokens 8 2>&1) | grep -E "tg128|rror" | sed "s/^/trace N:AT:PRIO=$na /"
                    grep -v -E 'moe_predict|moe_prefetch_experts' $t-raw.txt > $t.txt
                done
                for na in $runs; do
                    [ "${na%%:*}" = 0 ] && continue
                    echo "--- N:AT:PRIO=$na: the side launches"
                    python3 tools/h200/side_trace.py "/tmp/trace-${na//:/-}-raw.txt"
                    echo "--- N:AT:PRIO=$na vs ${runs%% *}"
                    python3 tools/h200/kernel_trace.py "/tmp/trace-${na//:/-}.txt" --vs "/tmp/trace-$(echo "${runs%% *}" | tr : -).txt" 2>&1 | head -12
                done | tee "$OUT/predictat-trace.txt"
            fi
            rm -f "$f"
        done
        ;;
    moe4w)
        # The RS MoE experts on one consumer warpgroup and one producer warp (160 threads; Q4_K
        # four blocks an SM, Q6_K three), whose wgmmas ptxas keeps asynchronous, against moe3's
        # 256-thread blocks, whose it serializes (MOE.md, 48th session).
        check_line "check moe [MOE=4]" FERRITE_MMW_MOE=4 moe check-moe4w.log | tee -a "$OUT/moe4w.log"
        for pq in qwen3-30b-a3b:Q4_K_M qwen3.5-35b-a3b:Q4_K_M; do
            p=${pq%%:*} q=${pq##*:}
            f=$(synth "$p" "$q" | tail -1)
            ab_pp FERRITE_MMW_MOE "3 4" "$f" "$p" | tee -a "$OUT/moe4w.log"
            if [ "$p" = qwen3-30b-a3b ] && ktrace_build; then
                FERRITE_MMW_MOE=4 traced /tmp/trace.txt $F bench --model "$f" --reps 1 --gate-tokens "$(gate_tokens "$p")" 2>&1 | grep -E "pp512|rror"
                python3 tools/h200/prefill_trace.py /tmp/trace.txt --top 8 | tee "$OUT/ptrace-moe4w.txt"
            fi
            rm -f "$f"
        done
        ;;
    guxg)
        # The MoE gate/up's x by one tensor copy a step over rows gathered in list order, and its
        # blocks tile-major (FERRITE_MMW_GU_XG bits 1, 2; MOE.md, 50th session).
        for v in 1 3; do
            check_line "check moe [GU_XG=$v]" FERRITE_MMW_GU_XG=$v moe check-guxg$v.log | tee -a "$OUT/guxg.log"
        done
        for pq in ${GUXG_MODELS:-qwen3-30b-a3b:Q4_K_M}; do
            p=${pq%%:*} q=${pq##*:}
            f=$(synth "$p" "$q" | tail -1)
            ab_pp FERRITE_MMW_GU_XG "${GUXG_VALS:-0 1 3}" "$f" "$p" | tee -a "$OUT/guxg.log"
            rm -f "$f"
        done
        ;;
    rsq5)
        # The register-A form for Q5_K (FERRITE_MMW_RS_Q5; MATMUL.md round 91).
        check_line "check matmul [RS_Q5]" FERRITE_MMW_RS_Q5=1 matmul check-rsq5.log | tee -a "$OUT/rsq5.log"
        for p in qwen3.5-35b-a3b qwen3.5-9b; do
            f=$(synth "$p" Q4_K_M | tail -1)
            ab_pp FERRITE_MMW_RS_Q5 "0 1" "$f" "$p" | tee -a "$OUT/rsq5.log"
            rm -f "$f"
        done
        ;;
    f16)
        # Qwen3-8B F16's prefill against cuBLAS (MATMUL.md round 92): cuBLAS at the forward's
        # GEMM shapes, `check --perf` of the 16-bit matmul cases, then the pp512 trace.
        python3 tools/h200/cublas_shapes.py 2>&1 | tee "$OUT/cublas.txt"
        $F check --device cuda --perf --filter f16 2>&1 | grep -E "rows=(300|512)|cases in|FAIL" | tee "$OUT/perf-f16.txt"
        TRACE_MODELS=qwen3-8b:F16 "$0" ptrace
        ;;
    cat)
        for v in 1 2; do
            FERRITE_MMW_TA_CAT=$v $F check --device cuda --filter " x2 rows=" 2>&1 | grep -E "f16|cases in|FAIL" | tee "$OUT/check-cat$v.log" | tail -4
        done
        for v in 0 1; do
            echo "FERRITE_MMW_TA_CAT=$v: $(perf512 FERRITE_MMW_TA_CAT=$v "$F16_QKV512")"
        done
        f=$(synth qwen3-8b F16 | tail -1)
        ab_pp FERRITE_MMW_TA_CAT "0 1" "$f" "qwen3-8b F16"
        rm -f "$f"
        ;;
    lt)
        # check --perf --eager: a graph-captured timing would be mmw's under every value
        # (cuBLASLt never runs under capture, blas.rs); eager times include launch overhead.
        check_under FERRITE_CUBLASLT=3 "f16" check-lt3.log
        for shape in "4096->4096" "12288->4096" "4096->1024"; do
            for v in 0 1; do
                echo "LT=$v: $(perf512 FERRITE_CUBLASLT=$v "matmul f16 $shape rows=512" --eager)"
            done
        done
        echo "group LT=0: $(perf512 FERRITE_CUBLASLT=0 "$F16_QKV512" --eager)"
        echo "group LT=2: $(perf512 FERRITE_CUBLASLT=2 "$F16_QKV512" --eager)"
        f=$(synth qwen3-8b F16 | tail -1)
        ab_pp FERRITE_CUBLASLT "0 1 3" "$f" "qwen3-8b F16"
        rm -f "$f"
        ;;
    bytes)
        # Rounds 102-104 (all on by default): the prefill checks they touch, then pp512 of
        # Qwen3-8B F16 under (X16_ONLY, LT_ADD, KV_FUSE) = all off / all on and Q4_K_M under
        # (X16_ONLY, KV_FUSE), two rounds.
        check_under FERRITE_KV_FUSE=1 "rows=300" check-bytes.log 4
        f=$(synth qwen3-8b F16 | tail -1)
        for r in 1 2; do
            for v in 0 1; do
                echo "qwen3-8b F16 X16_ONLY=LT_ADD=KV_FUSE=$v $(FERRITE_NORM_X16_ONLY=$v FERRITE_LT_ADD=$v FERRITE_KV_FUSE=$v \
                    $F bench --model "$f" --reps 2 --gen-tokens 8 --gate-tokens 32 2>&1 | grep -E 'pp512|gate|rror' | tr -s ' ' | tr '\n' ' ')"
            done
        done
        rm -f "$f"
        f=$(synth qwen3-8b Q4_K_M | tail -1)
        for r in 1 2; do
            for v in 0 1; do
                echo "qwen3-8b Q4_K_M X16_ONLY=KV_FUSE=$v $(FERRITE_NORM_X16_ONLY=$v FERRITE_KV_FUSE=$v \
                    $F bench --model "$f" --reps 2 --gen-tokens 8 --gate-tokens 32 2>&1 | grep -E 'pp512|gate|rror' | tr -s ' ' | tr '\n' ' ')"
            done
        done
        rm -f "$f"
        ;;
    f16ab)
        check_under FERRITE_CUBLASLT=3 "f16" check-lt3.log 4
        f=$(synth qwen3-8b F16 | tail -1)
        for v in "0 0 0" "0 1 3" "1 1 1" "0 0 0"; do
            read -r c x l <<<"$v"
            echo "qwen3-8b F16 CAT=$c X16=$x LT=$l $(FERRITE_MMW_TA_CAT=$c FERRITE_ATTN_X16=$x FERRITE_CUBLASLT=$l \
                $F bench --model "$f" --reps 2 --gen-tokens 8 --gate-tokens 32 2>&1 | grep -E 'pp512|gate|rror' | tr -s ' ' | tr '\n' ' ')"
        done
        rm -f "$f"
        check_under FERRITE_MMW_TA_CAT=1 " x2 rows=" check-cat1.log 4
        check_under FERRITE_ATTN_X16=1 "attention+o" check-attnx16.log 4
        ;;
    attnx16)
        check_under FERRITE_ATTN_X16=1 "attention+o" check-attnx16.log
        for q in Q4_K_M F16; do
            f=$(synth qwen3-8b $q | tail -1)
            ab_pp FERRITE_ATTN_X16 "0 1" "$f" "qwen3-8b $q"
            rm -f "$f"
        done
        ;;
    tshift)
        # A dense launch's last token tile read inside x's map (FERRITE_MMW_TSHIFT, on by
        # default; MATMUL.md round 93). F16's gate at 300 tokens too, so that its prefill runs
        # the shifted tile (a 16-token gate prefills on the GEMVs). Q4_K_M's at 160 (its
        # launches on 128-token tiles: two, the second shifted): at 300 its random weights'
        # bf16 prefill ranks a near tie the other way (7.3e-3 apart) under both values alike
        # (MATMUL.md round 94).
        for q in Q4_K_M F16; do
            f=$(synth qwen3-8b $q | tail -1)
            g=300
            [ $q = Q4_K_M ] && g=160
            ab_runs 'pp300|gate|rror' FERRITE_MMW_TSHIFT "0 1" "$f" "qwen3-8b $q" --prompt-tokens 300 --gen-tokens 16 --gate-tokens $g
            rm -f "$f"
        done | tee "$OUT/tshift.log"
        ;;
    taks)
        # The K-split wide tile (FERRITE_MMW_TA_KS=2; MATMUL.md round 95): checked first, then
        # timed against the 128-output tiles it replaces.
        check_line "check matmul under it" FERRITE_MMW_TA_KS=2 matmul check-matmul-ks.log
        for v in 0 2; do
            FERRITE_MMW_TA_KS=$v $F check --device cuda --perf --filter f16 > "$OUT/perf-f16-ks$v.txt" 2>&1
            echo "FERRITE_MMW_TA_KS=$v"
            grep -E 'f16 (4096|12288)->[0-9]+ rows=(512|300)|f16 f16 f16|cases in|FAIL' "$OUT/perf-f16-ks$v.txt"
        done
        f=$(synth qwen3-8b F16 | tail -1)
        ab_pp FERRITE_MMW_TA_KS "0 2" "$f" "qwen3-8b F16"
        ab_runs 'pp300|gate|rror' FERRITE_MMW_TA_KS "0 2" "$f" "qwen3-8b F16" --prompt-tokens 300 --gen-tokens 16 --gate-tokens 300
        rm -f "$f"
        ;;
    rsq6)
        # The register-A form for Q6_K (FERRITE_MMW_RS_Q6, on by default; MATMUL.md rounds 86,
        # 87; the off form's CUBIN needs `FERRITE_MMW_RS_Q6=0 tools/h200/kernel_cache.sh mmw`):
        # the matmul check under it (its Q6_K cases, the mixed Q, K, V groups), then pp512 of
        # Qwen3-8B Q4_K_M (V and half the downs Q6_K) off / on, two rounds.
        check_line "check matmul [RS_Q6]" FERRITE_MMW_RS_Q6=1 matmul check-rsq6.log | tee -a "$OUT/rsq6.log"
        f=$(synth qwen3-8b Q4_K_M | tail -1)
        ab_pp FERRITE_MMW_RS_Q6 "0 1" "$f" qwen3-8b | tee -a "$OUT/rsq6.log"
        rm -f "$f"
        ;;
    bound)
        # What the decode step is without its weight traffic (FERRITE_GEMV_DIAG, a timing
        # diagnostic: 0 all, 2 no bulk weight copies, 1 no GEMV compute; MATMUL.md round 86,
        # DECODE_STEP.md 45th session), tg128 at 64 prompt tokens, then the block timeline
        # (FERRITE_DIAG_TL, replay 100) with and without the copies: which launches hold the
        # chain. The timeline's stamps change every kernel's source: the cache needs their
        # CUBINs too (the stage list above), or the machine compiles them (minutes).
        for pq in ${BOUND_MODELS:-qwen3-8b:Q4_K_M qwen3-8b:Q8_0 qwen3-30b-a3b:Q4_K_M}; do
            f=$(synth ${pq%:*} ${pq#*:} | tail -1)
            for d in 0 2 1; do
                echo "$pq GEMV_DIAG=$d $(FERRITE_GEMV_DIAG=$d $F bench --model "$f" --reps 2 --prompt-tokens 64 --gate-tokens 4 2>&1 | grep -E 'tg128|rror' | tr -s ' ' | tr '\n' ' ')"
            done
            if [ "$pq" = qwen3-8b:Q4_K_M ]; then
                for d in 0 2; do timeline_run "$d" "$f"; done
            fi
            rm -f "$f"
        done | tee -a "$OUT/bound.log"
        ;;
    phases)
        f=$(synth qwen3-8b Q4_K_M | tail -1)
        for d in 0 2; do
            timeline_run "$d" "$f"
            echo "GEMV_DIAG=$d:"
            python3 tools/timeline.py "/tmp/tl-$d.tsv" --phases 2>&1 | tee "$OUT/phases-$d.txt"
            head -12 "$OUT/tl-summary-$d.txt"
        done
        echo "untimed by the diagnostics: $($F bench --model "$f" --reps 2 --gate-tokens 8 --prompt-tokens 64 2>&1 | grep -E 'tg128|rror' | tr -s ' ')"
        ;;
    q8kv)
        f=$(synth qwen3-8b Q4_K_M | tail -1)
        $F bench --model "$f" --label qwen3-8b --kv-cache-q8 --reps 3 2>&1 | tee -a "$OUT/bench.log" | tail -6
        $F bench --model "$f" --label qwen3-8b --kv-cache-q8 --depth 32768 --prompt-tokens 512 --reps 1 2>&1 | tee -a "$OUT/bench.log" | tail -6
        rm -f "$f"
        ;;
    profile)
        f=$(synth qwen3-8b Q4_K_M | tail -1)
        "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" --clock-control none --cache-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum \
            --csv --launch-skip 2600 --launch-count 900 \
            $F bench --model "$f" --reps 1 --prompt-tokens 16 --gen-tokens 8 --gate-tokens 2 > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
        python3 tools/h200/ncu_step.py "$OUT/ncu.csv" | tee "$OUT/profile.txt"
        rm -f "$f"
        ;;
    gemv_detail)
        # ncu's full sections (stall reasons, occupancy, DRAM %) for the two largest GEMVs of a
        # Qwen3-8B Q4_K_M decode step.
        f=$(synth qwen3-8b Q4_K_M | tail -1)
        "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" --clock-control none \
            --kernel-name regex:"gemvq_swiglu_q4_k_r1|gemvq_q4_k_r1" --launch-skip 60 --launch-count 2 --set full \
            $F bench --model "$f" --reps 1 --prompt-tokens 16 --gen-tokens 8 --gate-tokens 2 > "$OUT/ncu_detail.txt" 2>&1
        grep -E "gemvq|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots" "$OUT/ncu_detail.txt"
        rm -f "$f"
        ;;
    attn_detail)
        f=$(synth qwen3-8b Q4_K_M | tail -1)
        "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" --clock-control none \
            --kernel-name regex:"attn_prefill_tc2?_128" --launch-skip 8 --launch-count 1 --set full \
            $F bench --model "$f" --reps 1 --gen-tokens 4 --gate-tokens 2 > "$OUT/ncu_attn.txt" 2>&1
        grep -E "attn_prefill|Duration|Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per|Issue Slots|Block Limit|Pipe|Stall|L2 Hit|Executed Ipc" "$OUT/ncu_attn.txt" | head -60
        rm -f "$f"
        ;;
    trace)
        # PDL overlaps the kernels, so ncu's one-at-a-time times do not add up to a step;
        # CUPTI's start/end of each graph kernel do (kernel_trace.py: end-to-end gaps).
        ktrace_build || continue
        for pq in ${TRACE_MODELS:-qwen3-8b:Q4_K_M}; do
            p=${pq%%:*} q=${pq##*:}
            f=$(synth "$p" "$q" | tail -1)
            traced /tmp/trace.txt $F bench --model "$f" --reps 1 2>&1 | grep -E "tg128|rror"
            python3 tools/h200/kernel_trace.py /tmp/trace.txt --order > "$OUT/trace-$p-$q.txt" 2>&1
            head -20 "$OUT/trace-$p-$q.txt"
            gzip -c /tmp/trace.txt > "$OUT/trace-$p-$q-raw.txt.gz"
            rm -f "$f"
        done
        ;;
    ptrace)
        # Where a pp512 forward's time goes, per kernel (CUPTI, tools/h200/prefill_trace.py):
        # TRACE_MODELS="preset:quant ..." (default Qwen3-30B-A3B Q4_K_M), one ptrace-<preset>-<quant>.txt each.
        ktrace_build || continue
        for pq in ${TRACE_MODELS:-qwen3-30b-a3b:Q4_K_M}; do
            p=${pq%%:*} q=${pq##*:}
            f=$(synth "$p" "$q" | tail -1)
            traced /tmp/trace.txt $F bench --model "$f" --reps 1 --gate-tokens "$(gate_tokens "$p")" 2>&1 | grep -E "pp512|rror"
            python3 tools/h200/prefill_trace.py /tmp/trace.txt --top 20 | tee "$OUT/ptrace-$p-$q.txt"
            rm -f "$f"
        done
        ;;
    normq)
        FERRITE_DEFER_NORM_Q=1 $F check --device cuda --filter matmul_add 2>&1 | tee "$OUT/check-normq.log" | tail -3
        f=$(synth qwen3-8b Q4_K_M | tail -1)
        for r in 1 2; do
            for v in 0 1; do
                echo "FERRITE_DEFER_NORM_Q=$v $(FERRITE_DEFER_NORM_Q=$v $F bench --model "$f" --reps 2 2>&1 | grep -E 'tg128|gate|rror' | tr '\n' ' ')"
            done
        done | tee "$OUT/normq-ab.txt"
        if ktrace_build; then
            for v in 0 1; do
                FERRITE_DEFER_NORM_Q=$v traced /tmp/trace-q$v.txt $F bench --model "$f" --reps 1 2>&1 |
                    grep -E "tg128|rror"
            done
            python3 tools/h200/kernel_trace.py /tmp/trace-q1.txt --vs /tmp/trace-q0.txt | tee "$OUT/normq-vs.txt" | head -24
        fi
        FERRITE_DEFER_NORM_Q=1 $F check --device cuda --e2e tests/data/oracle 2>&1 | tee "$OUT/check-normq-full.log" | tail -4
        ;;
    geometry)
        f=$(synth qwen3-8b Q8_0 | tail -1)
        for r in 1 2; do
            for v in 1 2 0; do
                echo "Q8_0 FERRITE_GEMV_ONE_WAVE=$v $(FERRITE_GEMV_ONE_WAVE=$v $F bench --model "$f" --reps 2 2>&1 | grep -E 'tg128|gate|rror' | tr '\n' ' ')"
            done
            for kb in 40 56 80; do
                echo "Q8_0 FERRITE_GEMVQ_SMEM=$kb $(FERRITE_GEMVQ_SMEM=$kb $F bench --model "$f" --reps 2 2>&1 | grep -E 'tg128|gate|rror' | tr '\n' ' ')"
            done
        done | tee "$OUT/geometry-ab.txt"
        rm -f "$f"
        f=$(synth qwen3-8b Q4_K_M | tail -1)
        for v in 1 2; do
            echo "Q4_K_M FERRITE_GEMV_ONE_WAVE=$v $(FERRITE_GEMV_ONE_WAVE=$v $F bench --model "$f" --reps 2 2>&1 | grep -E 'tg128|gate|rror' | tr '\n' ' ')"
        done | tee -a "$OUT/geometry-ab.txt"
        rm -f "$f"
        ;;
    pre2)
        FERRITE_ATTN_PRE=2 $F check --device cuda --filter attention 2>&1 | tee "$OUT/check-pre2.log" | tail -2
        for pq in qwen3-8b:Q4_K_M qwen3-30b-a3b:Q4_K_M; do
            f=$(synth "${pq%%:*}" "${pq##*:}" | tail -1)
            for d in 2048 3000; do
                ab_switch FERRITE_ATTN_PRE "1 2" "$f" "$pq depth $d" --depth $d --prompt-tokens 64
            done
            rm -f "$f"
        done | tee "$OUT/pre2-ab.txt"
        ;;
    exact)
        FERRITE_MMQ=1 $F check --device cuda --filter matmul 2>&1 | tail -3
        FERRITE_MMQ=1 $F check --device cuda --filter moe 2>&1 | tail -3
        f="$M/q35moe-l4.gguf"
        $F synth --preset qwen3.5-35b-a3b --layers 4 --output "$f" 2>&1 | tail -1
        toks=$(python3 -c "print(','.join(str(100 + (i * 7919) % 200000) for i in range(32)))")
        for d in cpu cuda; do FERRITE_MMQ=1 $F logits --device $d --model "$f" --tokens "$toks" -o "$M/l4-$d.st" 2>&1 | tail -1; done
        python3 - "$M/l4-cpu.st" "$M/l4-cuda.st" <<'PY'
import sys
from safetensors.torch import load_file
c, a = (load_file(p)["logits"] for p in sys.argv[1:3])
d = a - c
nm = (d * d).sum(1) / (c * c).sum(1)
print("NMSE per position:", " ".join(f"{x:.1e}" for x in nm.tolist()))
print("argmax agree", int((a.argmax(1) == c.argmax(1)).sum()), "/", c.shape[0])
PY
        FERRITE_MMQ=1 $F bench --model "$f" --reps 1 --gen-tokens 4 2>&1 | grep -i gate
        rm -f "$f"
        ;;
    *) echo "unknown stage $stage" ;;
    esac
done
echo "=== done $(date -u +%H:%M:%S)"
