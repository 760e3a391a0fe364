#!/usr/bin/env bash
# The GPU runs behind benchmarks/results/ (issue 5), as sent to the H200 with the device tool:
#   bash benchmarks/h200_run.sh vl    # GPU tests, the step profile, Qwen3-VL-8B image latency (3 turns, chunk sweep)
#   bash benchmarks/h200_run.sh more  # Qwen3-VL-8B image, project variants only; Qwen3.5-9B image latency (eager
#                                     # engine); Qwen3-VL-8B 64-frame video latency
#   bash benchmarks/h200_run.sh qwen35  # Qwen3.5-9B with every variant (one device call on its own:
#                                     # fla's first-call autotuning ~60 s and stock static's compile ~95 s come first)
#   bash benchmarks/h200_run.sh attention  # GPU tests, few-query attention vs SDPA, the step profile, a short
#                                     # Qwen3-VL-8B image run of full / raincheck / serial
#   bash benchmarks/h200_run.sh video # Qwen3-VL-8B 64-frame video latency, every variant but stock static
#   bash benchmarks/h200_run.sh selectors  # GPU tests of the greedy selectors' kernels; selection time and T1 per
#                                     # selector (Qwen3-VL-8B image + 64-frame video); Qwen3-VL-8B image latency with
#                                     # the default settings (selector mmtok)
#   bash benchmarks/h200_run.sh selectors35  # the same for Qwen3.5-9B (image)
#   bash benchmarks/h200_run.sh gdn_batch  # the GDN kernels at batches 8 / 32 (GDN_BATCHES): chunk kernel vs chunked form
#   bash benchmarks/h200_run.sh gdn   # GPU tests of the Gated DeltaNet kernels; their per-layer cost against the
#                                     # references, eager and in a CUDA graph, with the tile sweep (issue 16)
#   bash benchmarks/h200_run.sh wave  # every GPU test, Qwen3.5-9B latency (default settings), the server against the
#                                     # library, Qwen3-VL-30B-A3B latency (short): the last runs of issues 15, 18-20
#   bash benchmarks/h200_run.sh tpot  # issue 17: its GPU tests, then Qwen3-VL-8B image latency with chunk sizes
#                                     # 7/15/31/63 and "auto" (512-token answer)
#   bash benchmarks/h200_run.sh tpot_compile  # issue 17: stock static, full, c=31 and auto with compile_steps
#   bash benchmarks/h200_run.sh final_tpot  # Qwen3-VL-8B TPOT, compiled and uncompiled twins, c=31 and auto
#   bash benchmarks/h200_run.sh moe35      # Qwen3.5-35B-A3B latency, short (MOE_S, MOE_BUDGET_S)
#   bash benchmarks/h200_run.sh profile35  # Qwen3.5-9B's stages, replayed steps and kernels on its fast path
#   bash benchmarks/h200_run.sh profile_vl  # Qwen3-VL-8B's stages, replayed steps and kernels on its fast path
#   bash benchmarks/h200_run.sh fuzz_stress  # the schedule fuzz's threaded conversations in a loop, side by side
#   bash benchmarks/h200_run.sh prefill35  # captured Qwen3.5 prefills: their GPU tests, Qwen3.5-9B side by side
#   bash benchmarks/h200_run.sh wave3      # the GPU tests of compiled-by-default steps and captured prefills, moe35
#   bash benchmarks/h200_run.sh mapsweep   # the suffix-map update's tile sweep
#   bash benchmarks/h200_run.sh gdn_fuse   # every GPU test, GDN kernels, Qwen3.5-9B full vs raincheck (fused GDN glue)
#   bash benchmarks/h200_run.sh wave4      # chunked GDN kernel + capture-aware auto: tests, kernels, Qwen3.5 / Qwen3-VL
#   bash benchmarks/h200_run.sh vl_sweep   # mapsweep, then Qwen3-VL-8B: stock static compiled, full, raincheck c=7/15/31/63/auto
#   bash benchmarks/h200_run.sh batch      # issue 29: batched generate at B = 1, 8, 32 vs stock (Qwen3-VL-8B, Qwen3.5-9B)
#   bash benchmarks/h200_run.sh loop_tests # the batching loop's, batched generate's and the server's GPU tests only
#   bash benchmarks/h200_run.sh gpu_tests  # every GPU test, the whole `pytest -v` output (benchmarks/results/gpu_tests_h200.log)
#   bash benchmarks/h200_run.sh t1_before_after  # issue 31: an image turn's first token here (and at BASE_TREE)
#   bash benchmarks/h200_run.sh attention_batch  # the few-query attention kernel against SDPA at batches 1 / 8 / 32
#   bash benchmarks/h200_run.sh serve_load # issue 30: the server's batching loop under 1 / 8 / 32 clients
#   bash benchmarks/h200_run.sh streams    # the GPU test of turns prepared on side streams, STREAMS_RUNS times
#   bash benchmarks/h200_run.sh loop_host    # where the batching loop's host time per step goes at 8 / 32 turns
#   bash benchmarks/h200_run.sh prepare_syncs  # where a first turn's preparation for the loop waits for the device
#   bash benchmarks/h200_run.sh soak       # issue 30: the 64-client soak for SOAK_S (300) seconds, memory flat
#   bash benchmarks/h200_run.sh cold_start # issue 31: a fresh process to its first answer, first ever and with the caches
#   bash benchmarks/h200_run.sh defaults31 # issue 31: default settings vs full / stock at 64, 128, 512-token answers
#   bash benchmarks/h200_run.sh fuzz35     # only the Qwen3.5 schedule fuzzes (single-sequence fast path vs eager), verbose
# Wheels carried in .whl/ (transformers 5.24.0, fla 0.6.0, the server tests' clients; made by
# benchmarks/device_wheels.sh); results go to $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONWARNINGS=ignore
case "${1:-vl}" in
batch)
    # issue 29: batched generate at B = 1, 8, 32 (raincheck, full, their B = 1 eager twins, stock), Qwen3-VL-8B then
    # Qwen3.5-9B; 128-token answers, one timed call each after a warm-up (BATCH_REPS; CAPS=none,64: the chunk cap
    # RaincheckConfig.batch_chunk_rows side by side, the default first; BATCH_PROFILE=1: two profiled calls per row,
    # the whole call and its decode steps; CLOCK_CHECK=1: each row timed again with a device wait at every token)
    for m in ${BATCH_MODELS:-qwen3_vl_8b qwen3_5_9b}; do
        timeout "${BATCH_S:-280}" python3 -m raincheck_hf.bench batch --model $m --batch "${BATCHES:-1,8,32}" \
            --reps "${BATCH_REPS:-1}" ${BATCH_VARIANTS:+--variants $BATCH_VARIANTS} ${BATCH_PROFILE:+--profile} ${CLOCK_CHECK:+--clock-check} ${CAPS:+--batch-chunk-rows $CAPS} --json "$OUT/batch_${m}_h200.json" \
            > "$OUT/batch_${m}_h200.log" 2>&1
        tail -14 "$OUT/batch_${m}_h200.log"
    done
    ;;
attention_batch)
    # the few-query attention (Triton kernel, matmul form, upcast form) against stock SDPA at batches 1 / 8 / 32
    timeout "${ATTN_S:-150}" python3 -m raincheck_hf.bench attention --batch 1,8,32 --rows 1,32 --slots 2112 --reps 20 \
        --json "$OUT/attention_batch_h200.json" > "$OUT/attention_batch_h200.log" 2>&1
    tail -8 "$OUT/attention_batch_h200.log"
    ;;
serve_load)
    # issue 30: the server under 1 / 8 / 32 clients through its continuous-batching loop, raincheck and full
    # (SWITCH=0.0005: the interpreter's thread switch interval for the run, SWITCH=0.0005,default: side by side; LOAD_MODEL=qwen3_5_9b: the Qwen3.5 shape;
    # AHEAD=both: each client count with and without steps launched ahead, side by side; FORWARDS=any,1,2: the loop's
    # max_prompt_forwards side by side; PREPARING=any,1,2: its max_preparing side by side; PROFILE=1: one more round
    # at the most clients with the loop's thread under cProfile; STREAMS=both: turns prepared on the default stream and
    # on streams of their own, side by side (STREAMS=on,high: at normal and at the highest priority); RIDE=any,256: the
    # loop's ride_max_rows side by side; ROUNDS=3: each client count's variants three times, A B / B A, with medians;
    # TRACE=1: one more round at the most clients under torch.profiler, the preparations marked, the trace kept;
    # CAPS=none,64: the server config's chunk cap RaincheckConfig.batch_chunk_rows side by side, the default first;
    # SPLIT=default,never: the loop's split_rows (decode steps split by width, or never) side by side;
    # JOIN=both: turns joining while a step runs and only between steps (the default), side by side;
    # FOLLOW=both: follow-ups' sequences made on their request threads and by the loop when they join (the default);
    # WARM_TOKENS=2048: rows of each of the batched engine's places (serve's --warm-up-tokens, default 4096);
    # SPY=1: the run under py-spy, below)
    M="${LOAD_MODEL:-qwen3_vl_8b}"
    # SPY=1: the whole run under py-spy (every thread of the server's process sampled, raw stacks kept;
    # python benchmarks/spy_summary.py reads them)
    SPY_CMD=()
    # (SPY_NATIVE=1: native frames too, e.g. CUDA's launches and synchronizations, at a cost in sampling rate;
    # SPY_GIL=1: only samples of threads holding the interpreter's lock: against a run without it, how much of its
    # time the loop's thread waits for the lock)
    [ -n "${SPY:-}" ] && SPY_CMD=(/tmp/site/bin/py-spy record --threads --nonblocking -r "${SPY_RATE:-200}" -f raw
                                  ${SPY_NATIVE:+--native} ${SPY_GIL:+--gil}
                                  -o "$OUT/serve_load_${M}_spy${SPY_GIL:+_gil}_h200.txt" --)
    timeout "${LOAD_S:-400}" "${SPY_CMD[@]}" python3 -m raincheck_hf.bench serve-load --model "$M" --clients "${CLIENTS:-1,8,32}" \
        --modes "${MODES:-raincheck,full}" --answer-tokens 128 --follow-up-tokens 64 --batching ${SWITCH:+--switch-interval $SWITCH} ${AHEAD:+--launch-ahead $AHEAD} ${FORWARDS:+--prompt-forwards $FORWARDS} ${PREPARING:+--preparing $PREPARING} ${PROFILE:+--profile-loop} ${STREAMS:+--prepare-stream $STREAMS} ${RIDE:+--ride-rows $RIDE} ${CAPS:+--chunk-rows $CAPS} ${SPLIT:+--split-rows $SPLIT} ${JOIN:+--join-in-flight $JOIN} ${FOLLOW:+--follow-ups-ahead $FOLLOW} ${WARM_TOKENS:+--warm-up-tokens $WARM_TOKENS} ${ROUNDS:+--rounds $ROUNDS} ${TRACE:+--trace-round --trace-file "$OUT/serve_load_${M}_trace_h200.json.gz"} \
        --json "$OUT/serve_load_${M}_h200.json" --plot "$OUT/serve_load_${M}_h200.png" \
        > "$OUT/serve_load_${M}_h200.log" 2>&1
    tail -14 "$OUT/serve_load_${M}_h200.log"
    ;;
soak)
    # issue 30's soak on the GPU: 64 clients for SOAK_S seconds (300: the issue's 5 minutes) against the server with
    # its batching loop (SOAK_K=per_turn: the per-turn server), every answer checked, memory flat after the warm-up
    RAINCHECK_SOAK_S="${SOAK_S:-300}" timeout "$(( ${SOAK_S:-300} + 240 ))" python3 -m pytest tests/test_gpu.py -v -s \
        -p no:cacheprovider -rfEs --tb=short -k "serve_soak and ${SOAK_K:-batching}" > "$OUT/gpu_soak_${SOAK_K:-batching}_h200.log" 2>&1
    grep -E "soak \(|PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/gpu_soak_${SOAK_K:-batching}_h200.log" | cut -c1-600 | tail -8
    ;;
loop_host)
    # where the batching loop's host time per step goes at N turns on the real shape (benchmarks/loop_host_profile.py):
    # each part's wall and thread CPU time, the loop thread's synchronizing calls per step, a cProfile of one round
    timeout "${LOOP_S:-300}" python3 -u benchmarks/loop_host_profile.py --model "${LOAD_MODEL:-qwen3_vl_8b}" \
        --turns "${TURNS:-8,32}" --variant "${VARIANT:-server}" --mode "${MODES:-raincheck,full}" --tokens "${TOKENS:-48}" \
        --reps 2 --syncs --cprofile "${CPROFILE:-45}" \
        --json "$OUT/loop_host_profile_${LOAD_MODEL:-qwen3_vl_8b}_h200.json" > "$OUT/loop_host_profile_${LOAD_MODEL:-qwen3_vl_8b}_h200.log" 2>&1
    grep -E "N=|thread CPU|loop thread|^ +[0-9]+  " "$OUT/loop_host_profile_${LOAD_MODEL:-qwen3_vl_8b}_h200.log" | head -80
    ;;
prepare_syncs)
    # where a first turn's preparation for the batching loop waits for the device (benchmarks/prepare_syncs.py)
    timeout "${SYNCS_S:-240}" python3 benchmarks/prepare_syncs.py --model "${LOAD_MODEL:-qwen3_vl_8b}" \
        --json "$OUT/prepare_syncs_${LOAD_MODEL:-qwen3_vl_8b}_h200.json" > "$OUT/prepare_syncs_${LOAD_MODEL:-qwen3_vl_8b}_h200.log" 2>&1
    tail -30 "$OUT/prepare_syncs_${LOAD_MODEL:-qwen3_vl_8b}_h200.log"
    ;;
streams)
    # the GPU tests of turns prepared on streams of their own (both families, both priorities) and of captures on
    # preparing threads beside the loop's steps, STREAMS_RUNS times over
    # with its cases in parallel (the load under which a capture on a preparing thread met the loop's steps)
    for i in $(seq "${STREAMS_RUNS:-3}"); do
        timeout "${STREAMS_S:-180}" python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider -rfE --tb=short -n 4 \
            -k "prepared_on_streams or captures_on_preparing" > "$OUT/gpu_streams_${i}_h200.log" 2>&1
        grep -E "passed|failed" "$OUT/gpu_streams_${i}_h200.log" | tail -1
    done
    ;;
cold_start)
    # issue 31: seconds from a fresh process's start to its first answer, on an empty cache folder and then with
    # what it left (COLD_MODELS, COLD_PROCESSES; COLD_SCOPE=all: everything warmed before the first answer, not only
    # the first turn's graphs with the rest timed after it; COLD_REST=0: each process ends after its answer;
    # COLD_COMPILE=off / on: RaincheckConfig.compile_steps instead of the default; COLD_PROFILE=1: each warm-up under
    # cProfile, where its time went kept in the JSON; COLD_PRELOAD=on / both: torch's compiler imported on a thread
    # while the model is built, fast.compiled.preload_compiler, or the processes alternating off and on, side by side;
    # COLD_BYTECODE=1: the installed packages' bytecode compiled first, as pip does when it installs them, into a
    # cache folder of its own (PYTHONPYCACHEPREFIX), for an interpreter that would otherwise compile them from
    # source in every process: one whose site-packages it cannot write, or that writes no bytecode; COLD_AHEAD=off:
    # autotuned kernels' configurations compiled by the autotuner itself, not ahead on threads, fast.autotune_ahead,
    # and timed as Triton does; COLD_AHEAD=full-timing: compiled ahead, timed as Triton does, not briefly;
    # COLD_PROC_S: a process's own limit, below COLD_S, so that one cut still leaves its marks in the JSON)
    python3 -c '
import os, sys, torch
d = os.path.dirname(torch.__file__)
c = os.path.join(d, "__pycache__")
print("[bytecode] dont_write_bytecode", sys.flags.dont_write_bytecode, "PYTHONDONTWRITEBYTECODE",
      os.environ.get("PYTHONDONTWRITEBYTECODE"), "pycache_prefix", sys.pycache_prefix, "| torch at", d,
      "| its __pycache__", os.path.isdir(c) and len(os.listdir(c)), "files, writable",
      os.access(c if os.path.isdir(c) else d, os.W_OK))'
    if [ -n "${COLD_BYTECODE:-}" ]; then
        export PYTHONPYCACHEPREFIX=/tmp/pycache
        unset PYTHONDONTWRITEBYTECODE
        SITE=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
        t0=$SECONDS
        python3 -m compileall -q -j 0 "$SITE" /tmp/site "$PWD/raincheck_hf" > /dev/null 2>&1
        echo "[bytecode] $SITE, /tmp/site and raincheck_hf compiled into $PYTHONPYCACHEPREFIX in $((SECONDS - t0)) s"
    fi
    for m in ${COLD_MODELS:-qwen3_vl_8b qwen3_5_9b}; do
        timeout "${COLD_S:-280}" python3 -m raincheck_hf.bench cold-start --model $m --processes "${COLD_PROCESSES:-3}" ${COLD_SCOPE:+--warm-up-scope $COLD_SCOPE} ${COLD_REST:+$( [ "$COLD_REST" = 0 ] && echo --no-rest )} ${COLD_COMPILE:+--compile-steps $COLD_COMPILE} ${COLD_PROFILE:+--profile-warm-up} ${COLD_PRELOAD:+--preload-compiler $COLD_PRELOAD} ${COLD_AHEAD:+--compile-ahead $COLD_AHEAD} ${COLD_PROC_S:+--timeout $COLD_PROC_S} \
            --out "$OUT/cold_start_${m}${COLD_COMPILE:+_compile_$COLD_COMPILE}${COLD_BYTECODE:+_bytecode}${COLD_AHEAD:+_ahead_$COLD_AHEAD}_h200.json" > "$OUT/cold_start_${m}${COLD_COMPILE:+_compile_$COLD_COMPILE}${COLD_BYTECODE:+_bytecode}${COLD_AHEAD:+_ahead_$COLD_AHEAD}_h200.log" 2>&1
        tail -8 "$OUT/cold_start_${m}${COLD_COMPILE:+_compile_$COLD_COMPILE}${COLD_BYTECODE:+_bytecode}${COLD_AHEAD:+_ahead_$COLD_AHEAD}_h200.log"
    done
    ;;
defaults31)
    # issue 31: the default settings against full and stock at each answer length (LENGTHS), one process per model
    # (built and warmed once: raincheck_hf.warm_up per Raincheck variant, as the CLI / demo / server call it) and one
    # JSON per length; the default chunk size and "auto" side by side (DEF_MODELS, DEF_CHUNKS, DEF_VARIANTS)
    for M in ${DEF_MODELS:-qwen3_vl_8b}; do
        timeout "${DEF_S:-300}" python3 -m raincheck_hf.bench latency --model "$M" --input image --turns 1 \
            --answer-tokens "${LENGTHS:-64,128,512}" --warmup-tokens answer --warm-up-api --chunk-sizes "${DEF_CHUNKS:-31,auto}" \
            --reps "${DEF_REPS:-3}" --budget-s "$(( ${DEF_S:-300} - 15 ))" \
            --variants "${DEF_VARIANTS:-stock_static_reused,stock_dynamic,full,raincheck}" \
            --json "$OUT/latency_${M}_image_{answer_tokens}_defaults_h200.json" > "$OUT/latency_${M}_image_defaults_h200.log" 2>&1
        grep -E "^(variant|full|raincheck|stock|graph captures|\[latency\] .*answers|raincheck c=auto:)" \
            "$OUT/latency_${M}_image_defaults_h200.log" | cut -c1-200
    done
    ;;
fuzz35)
    # the two Qwen3.5 schedule fuzzes alone (they failed once with a changed attention kernel; a cut run prints tracebacks)
    timeout -s INT -k 30 "${TESTS_S:-300}" python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider -rfEs --tb=long \
        -k "schedule_fuzz and (qwen3_5 or qwen3_5_moe)" $([ "${GPU_WORKERS:-0}" -gt 0 ] && echo "-n ${GPU_WORKERS}") \
        > "$OUT/gpu_fuzz35_h200.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_fuzz35_h200.log" | cut -c1-220 | tail -20
    ;;
gpu_tests)
    # every GPU test (issue 28: the schedule fuzz and the server test included); the log is committed as is.
    # GPU_WORKERS > 0 spreads the tests over that many pytest-xdist processes on the one GPU (wheel carried in .whl/);
    # the package's own RuntimeWarnings (a capture that failed and runs eagerly from then on, say) are shown in the
    # log's warnings summary, the others stay silenced (PYTHONWARNINGS above); GPU_K: only the tests pytest's -k selects
    timeout -s INT -k 30 "${TESTS_S:-530}" python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider -rfEs --tb=short --durations=10 \
        -W "default:raincheck:RuntimeWarning" ${GPU_K:+-k "$GPU_K"} \
        $([ "${GPU_WORKERS:-0}" -gt 0 ] && echo "-n ${GPU_WORKERS}") > "$OUT/gpu_tests_h200.log" 2>&1
    grep -E "FAILED|ERROR|SKIPPED|passed|failed" "$OUT/gpu_tests_h200.log" | cut -c1-220 | tail -20
    ;;
t1_before_after)
    # issue 31: an image turn's first token (`full`, `mmtok`, `uniform`, stock, timelines) side by side at this tree,
    # then, where BASE_TREE names an earlier tree carried beside it (an untracked copy, e.g. `git archive REV`), the
    # same script there in a second process on the same machine (each run's ratios are side by side in its own process)
    python3 benchmarks/mmtok_column_t1.py "$OUT/t1_now.json" "${T1_REPS:-9}" > "$OUT/t1_now.log" 2>&1
    grep -E "^\[(t1|timeline)\]" "$OUT/t1_now.log" | cut -c1-1200
    if [ -n "${BASE_TREE:-}" ]; then
        (cd "$BASE_TREE" && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/mmtok_column_t1.py "$OUT/t1_base.json" \
            "${T1_REPS:-9}" > "$OUT/t1_base.log" 2>&1)
        grep -E "^\[(t1|timeline)\]" "$OUT/t1_base.log" | cut -c1-1200
    fi
    ;;
loop_tests)
    # the GPU tests of the batching loop, batched generate and the server (a subset of gpu_tests for a short call:
    # soaks, turns prepared on streams of their own joining while steps run, the loop's syncs per step, held
    # conversations' memory, the few-query kernel's extent)
    timeout -s INT -k 30 "${TESTS_S:-300}" python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider -rfEs --tb=short \
        --durations=10 -n "${GPU_WORKERS:-8}" -k "soak or prepared_on_streams or captures_on_preparing or \
waits_for_the_device_once or batched_generate or server_parallel or held_at_once or kernel_stops or cancelled_stream" \
        > "$OUT/gpu_loop_tests_h200.log" 2>&1
    grep -E "FAILED|ERROR|SKIPPED|passed|failed" "$OUT/gpu_loop_tests_h200.log" | cut -c1-220 | tail -20
    ;;
final_tests)
    # this wave's GPU checks in one call: the new GPU tests first (GDN kernels, every family's fast path incl.
    # Qwen3.5's, MoE captures, chunk_size=auto, slot buckets, compiled steps, the server), then the rest, then
    # the GDN kernels' timings
    NEW="gdn or suffix_state_map or family or moe or auto or bucket or compiled or server"
    timeout "${NEW_S:-280}" python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider -rfE --tb=short --durations=12 \
        -k "$NEW" > "$OUT/test_gpu_new_h200.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed" "$OUT/test_gpu_new_h200.log" | tail -25
    timeout "${REST_S:-110}" python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -rfE --tb=short \
        -k "not ($NEW)" > "$OUT/test_gpu_rest_h200.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed" "$OUT/test_gpu_rest_h200.log" | tail -12
    timeout "${GDN_S:-45}" python3 -m raincheck_hf.bench gdn --json "$OUT/gdn_kernels_h200.json" \
        > "$OUT/gdn_kernels_h200.log" 2>&1
    tail -14 "$OUT/gdn_kernels_h200.log"
    ;;
final_bench)
    # the two GPU tests fixed after final_tests and the server test (why it skips), the GDN kernels' timings,
    # Qwen3.5-9B with its fast path (default settings), Qwen3-VL-8B's TPOT (compiled steps, chunk_size=auto)
    timeout 70 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -rfEs --tb=short \
        -k "slot_bucket or gdn_ops_launch or server" > "$OUT/test_gpu_fixed_h200.log" 2>&1
    grep -E "FAILED|SKIP|passed|failed" "$OUT/test_gpu_fixed_h200.log" | tail -6
    timeout "${GDN_S:-100}" python3 -u -m raincheck_hf.bench gdn --iters 100 --json "$OUT/gdn_kernels_h200.json" \
        > "$OUT/gdn_kernels_h200.log" 2>&1
    tail -12 "$OUT/gdn_kernels_h200.log"
    timeout "${QWEN35_S:-180}" python3 -m raincheck_hf.bench latency --model qwen3_5_9b --input image --turns 2 \
        --answer-tokens 64 --follow-up-tokens 32 --chunk-sizes 31 --reps 2 --budget-s 160 \
        --variants stock_dynamic,full,hard,raincheck --json "$OUT/latency_qwen3_5_9b_image_fast_h200.json" \
        > "$OUT/latency_qwen3_5_9b_image_fast_h200.log" 2>&1
    tail -9 "$OUT/latency_qwen3_5_9b_image_fast_h200.log"
    timeout "${VL_S:-235}" python3 -m raincheck_hf.bench latency --model qwen3_vl_8b --input image --turns 1 \
        --answer-tokens 512 --chunk-sizes 31,auto --reps 2 --budget-s 215 \
        --variants stock_static_reused,full,full_compiled,raincheck,raincheck_compiled \
        --json "$OUT/latency_qwen3_vl_8b_image_tpot_h200.json" > "$OUT/latency_qwen3_vl_8b_image_tpot_h200.log" 2>&1
    tail -11 "$OUT/latency_qwen3_vl_8b_image_tpot_h200.log"
    ;;
moe35|final_moe35)
    # Qwen3.5-MoE (35B-A3B shape) latency, short, on its fast path (bf16: captured steps)
    timeout "${MOE_S:-150}" python3 -m raincheck_hf.bench latency --model qwen3_5_35b_a3b --input image --turns 1 \
        --answer-tokens 32 --chunk-sizes 7 --reps 1 --budget-s "${MOE_BUDGET_S:-135}" --variants stock_dynamic,full,hard,raincheck \
        --json "$OUT/latency_qwen3_5_35b_a3b_image_h200.json" > "$OUT/latency_qwen3_5_35b_a3b_image_h200.log" 2>&1
    tail -8 "$OUT/latency_qwen3_5_35b_a3b_image_h200.log"
    ;;
profile35|profile_vl)
    # where Qwen3.5-9B's (profile35) or Qwen3-VL-8B's (profile_vl) first token goes on its fast path (stages, captured
    # steps replayed alone, torch.profiler)
    P=$([ "$1" = profile35 ] && echo qwen3_5_9b || echo qwen3_vl_8b)
    timeout "${PROFILE_S:-170}" python3 -u -m raincheck_hf.bench profile --model "$P" --input image \
        --modes "${MODES:-full,raincheck}" --tokens 48 --replays 20 --json "$OUT/profile_${P}_image_h200_fast.json" \
        > "$OUT/profile_${P}_image_h200_fast.log" 2>&1
    grep "\[profile\]" "$OUT/profile_${P}_image_h200_fast.log" | cut -c1-900; tail -3 "$OUT/profile_${P}_image_h200_fast.log"
    ;;
fuzz_stress)
    # the schedule fuzz's threaded conversations in a loop (benchmarks/fuzz_stress.py): FUZZ_PROCS processes side by
    # side for each restoration order in FUZZ_ORDERS ("own": each case's own), FUZZ_S seconds each, FUZZ_FAMILY's cases;
    # FUZZ_ARGS: the tool's switches for every process (e.g. --no-step-graphs, --device-work); FUZZ_MATRIX instead of
    # FUZZ_ORDERS: variants side by side, "|" between them, FUZZ_PROCS processes each, each its switches and NAME=value
    # environment words (e.g. "base|--device-work|CUDA_LAUNCH_BLOCKING=1"), each process's own restoration orders;
    # FUZZ_START: seconds each process may take beyond FUZZ_S (its runs alone, the first kernel tuning: Qwen3.5's
    # bundled model in four fresh processes at once took over 250 s)
    if [ -n "${FUZZ_MATRIX:-}" ]; then
        IFS='|' read -ra variants <<< "$FUZZ_MATRIX"
        for v in "${variants[@]}"; do
            envs=(); flags=()
            for w in $v; do case "$w" in base) ;; [A-Z]*=*) envs+=("$w") ;; *) flags+=("$w") ;; esac; done
            name=$(echo "$v" | tr -c 'A-Za-z0-9_\n' '_' | sed 's/^_*//'); name=${name:-base}
            for i in $(seq "${FUZZ_PROCS:-2}"); do
                (env "${envs[@]}" timeout $(( ${FUZZ_S:-170} + ${FUZZ_START:-60} )) python3 benchmarks/fuzz_stress.py \
                    --family "${FUZZ_FAMILY:-qwen2_5_vl}" --seconds "${FUZZ_S:-170}" --tag "$name" "${flags[@]}" \
                    ${FUZZ_ARGS:-} > "$OUT/fuzz_stress_${name}_$i.txt" 2>&1) &
            done
        done; wait
    else
        for v in ${FUZZ_ORDERS:-own source}; do for i in $(seq "${FUZZ_PROCS:-4}"); do
            (timeout $(( ${FUZZ_S:-170} + ${FUZZ_START:-45} )) python3 benchmarks/fuzz_stress.py \
                --family "${FUZZ_FAMILY:-qwen2_5_vl}" --seconds "${FUZZ_S:-170}" \
                $([ "$v" != own ] && echo "--restore-order $v") --tag "$v" ${FUZZ_ARGS:-} \
                > "$OUT/fuzz_stress_${v}_$i.txt" 2>&1) &
        done; done; wait
    fi
    tail -qn 1 "$OUT"/fuzz_stress_*.txt; grep -h "iteration \|alone" "$OUT"/fuzz_stress_*.txt | cut -c1-260 | head -40
    grep -h " warning " "$OUT"/fuzz_stress_*.txt | cut -c1-300 | sort | uniq -c | head -20
    ;;
prefill35)
    # issue 16's T1: Qwen3.5's prefills of input rows only padded and captured; its GPU tests, then Qwen3.5-9B with
    # every variant side by side (stock static compiled included), 512-token answer
    timeout "${TESTS_S:-180}" python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -rfE --tb=short \
        -k "gdn_prefills or gdn_conversation or (family_fast_path and qwen3_5 and not moe)" \
        > "$OUT/test_gpu_prefill35_h200.log" 2>&1
    grep -E "passed|failed|FAILED|Error" "$OUT/test_gpu_prefill35_h200.log" | tail -8
    timeout "${BENCH_S:-370}" python3 -u -m raincheck_hf.bench latency --model qwen3_5_9b --input image --turns 1 \
        --answer-tokens 512 --chunk-sizes 31 --reps 2 --budget-s "${BUDGET_S:-350}" \
        --variants "${VARIANTS:-stock_static_reused,full,full_compiled,hard,raincheck,raincheck_compiled,serial}" \
        --json "$OUT/latency_qwen3_5_9b_image_512_h200.json" > "$OUT/latency_qwen3_5_9b_image_512_h200.log" 2>&1
    grep -v causal_conv "$OUT/latency_qwen3_5_9b_image_512_h200.log" | tail -14
    ;;
wave3)
    # this session's GPU checks: captured Qwen3.5 prefills, compile_steps on by default, every family's fast path,
    # MoE captures, compiled steps, buckets, auto (verbose, durations: a cut run still says what ran); then moe35
    timeout "${TESTS_S:-330}" python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider -rfE --tb=short --durations=15 \
        -k "gdn_prefills or default_config or family or moe or compiled or gdn_conversation or bucket or auto" \
        > "$OUT/test_gpu_wave3_h200.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/test_gpu_wave3_h200.log" | cut -c1-160 | tail -45
    MOE_S="${MOE_S:-210}" MOE_BUDGET_S="${MOE_BUDGET_S:-190}" bash "$0" moe35
    ;;
mapsweep)
    # the suffix-map update's tile sweep alone (issue 16's 2 µs target), each setting checked against the reference
    timeout "${SWEEP_S:-150}" python3 -u -m raincheck_hf.bench gdn --ops suffix_map_update --sweep --iters 100 \
        --json "$OUT/gdn_suffix_map_sweep_h200.json" > "$OUT/gdn_suffix_map_sweep_h200.log" 2>&1
    tail -20 "$OUT/gdn_suffix_map_sweep_h200.log"
    ;;
vl_sweep)
    # issue 17's Qwen3-VL targets with the default settings (compiled steps): stock static compiled side by side
    # with full and raincheck at chunk 7/15/31/63/auto, 512-token answer; the suffix-map sweep first
    SWEEP_S="${SWEEP_S:-90}" bash "$0" mapsweep
    timeout "${VL_S:-470}" python3 -u -m raincheck_hf.bench latency --model qwen3_vl_8b --input image --turns 1 \
        --answer-tokens 512 --chunk-sizes 7,15,31,63,auto --reps 2 --budget-s "${BUDGET_S:-450}" \
        --variants stock_static_reused,full,raincheck \
        --json "$OUT/latency_qwen3_vl_8b_image_sweep_h200.json" > "$OUT/latency_qwen3_vl_8b_image_sweep_h200.log" 2>&1
    tail -16 "$OUT/latency_qwen3_vl_8b_image_sweep_h200.log"
    ;;
gdn_fuse)
    # the GDN glue folded into the kernels: every GPU test, the kernels' timings, Qwen3.5-9B full vs raincheck c=31
    # (512-token answers, warm-up answers as long, so the timed ones replay graphs captured beforehand)
    timeout "${TESTS_S:-280}" python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -rfE --tb=short --durations=8 \
        > "$OUT/test_gpu_gdn_fuse_h200.log" 2>&1
    grep -E "passed|failed|FAILED|ERROR" "$OUT/test_gpu_gdn_fuse_h200.log" | cut -c1-200 | tail -12
    timeout "${GDN_S:-50}" python3 -m raincheck_hf.bench gdn --iters 100 --json "$OUT/gdn_kernels_h200.json" \
        > "$OUT/gdn_kernels_h200.log" 2>&1
    tail -9 "$OUT/gdn_kernels_h200.log"
    timeout "${BENCH_S:-230}" python3 -u -m raincheck_hf.bench latency --model qwen3_5_9b --input image --turns 1 \
        --answer-tokens 512 --warmup-tokens 512 --chunk-sizes 31 --reps 2 --budget-s "${BUDGET_S:-210}" \
        --variants "${VARIANTS:-full,raincheck}" \
        --json "$OUT/latency_qwen3_5_9b_image_fused_h200.json" > "$OUT/latency_qwen3_5_9b_image_fused_h200.log" 2>&1
    grep -v causal_conv "$OUT/latency_qwen3_5_9b_image_fused_h200.log" | tail -9
    ;;
wave4)
    # capture-aware auto (run while the fast path used gdn_kernels.chunked_step_ for a chunk; it no longer does):
    # GPU tests, the chunk kernels' timings, Qwen3.5-9B and
    # Qwen3-VL-8B full vs raincheck c=31 vs auto (512-token answers and warm-ups; Dynamo's recompiles logged)
    timeout "${TESTS_S:-200}" python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider -rfE --tb=short --durations=8 \
        -k "gdn or auto or bucket or server or default_config or (family_fast_path and qwen3_5 and not moe)" \
        > "$OUT/test_gpu_wave4_h200.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/test_gpu_wave4_h200.log" | cut -c1-150 | tail -30
    timeout 40 python3 -m raincheck_hf.bench gdn --ops recurrent_step_chunk,chunked_step --iters 100 \
        --json "$OUT/gdn_chunk_kernels_h200.json" > "$OUT/gdn_chunk_kernels_h200.log" 2>&1
    tail -7 "$OUT/gdn_chunk_kernels_h200.log"
    TORCH_LOGS=recompiles timeout "${QWEN35_S:-190}" python3 -u -m raincheck_hf.bench latency --model qwen3_5_9b \
        --input image --turns 1 --answer-tokens 512 --warmup-tokens 512 --chunk-sizes 31,auto --reps 2 \
        --budget-s 170 --variants full,raincheck --json "$OUT/latency_qwen3_5_9b_image_wave4_h200.json" \
        > "$OUT/latency_qwen3_5_9b_image_wave4_h200.log" 2>&1
    grep -c "Recompiling" "$OUT/latency_qwen3_5_9b_image_wave4_h200.log"
    grep -v causal_conv "$OUT/latency_qwen3_5_9b_image_wave4_h200.log" | grep -v "^ " | tail -8
    timeout "${VL_S:-110}" python3 -u -m raincheck_hf.bench latency --model qwen3_vl_8b --input image --turns 1 \
        --answer-tokens 512 --warmup-tokens 512 --chunk-sizes 31,auto --reps 2 --budget-s 100 \
        --variants full,raincheck --json "$OUT/latency_qwen3_vl_8b_image_wave4_h200.json" \
        > "$OUT/latency_qwen3_vl_8b_image_wave4_h200.log" 2>&1
    tail -8 "$OUT/latency_qwen3_vl_8b_image_wave4_h200.log"
    ;;
final_tpot)
    # Qwen3-VL-8B's TPOT again after graphs of other settings are kept (final_bench's compiled and uncompiled
    # variants recaptured each other's graphs every repetition): fixed 31 and auto, compiled steps side by side
    timeout "${VL_S:-250}" python3 -m raincheck_hf.bench latency --model qwen3_vl_8b --input image --turns 1 \
        --answer-tokens 512 --chunk-sizes 31,auto --reps 2 --budget-s 230 \
        --variants full,full_compiled,raincheck,raincheck_compiled \
        --json "$OUT/latency_qwen3_vl_8b_image_tpot2_h200.json" > "$OUT/latency_qwen3_vl_8b_image_tpot2_h200.log" 2>&1
    tail -9 "$OUT/latency_qwen3_vl_8b_image_tpot2_h200.log"
    ;;
tpot)
    timeout "${TESTS_S:-240}" python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -rfE --tb=short \
        -k "${TESTS_K:-auto or bucket or compiled}" > "$OUT/test_gpu_tpot_h200.log" 2>&1
    grep -E "passed|failed|FAILED|Error" "$OUT/test_gpu_tpot_h200.log" | tail -20
    timeout "${SWEEP_S:-330}" python3 -m raincheck_hf.bench latency --model qwen3_vl_8b --input image --turns 2 \
        --answer-tokens 512 --follow-up-tokens 128 --chunk-sizes 7,15,31,63,auto --reps 3 --budget-s 300 \
        --variants full,raincheck --json "$OUT/latency_qwen3_vl_8b_image_auto_h200.json" \
        > "$OUT/latency_qwen3_vl_8b_image_auto_h200.log" 2>&1
    tail -16 "$OUT/latency_qwen3_vl_8b_image_auto_h200.log"
    ;;
tpot_compile)
    timeout "${COMPILE_S:-500}" python3 -m raincheck_hf.bench latency --model qwen3_vl_8b --input image --turns 2 \
        --answer-tokens 512 --follow-up-tokens 128 --chunk-sizes 31,auto --reps 3 --budget-s 460 --compile-steps \
        --variants stock_static_reused,full,raincheck --json "$OUT/latency_qwen3_vl_8b_image_compiled_h200.json" \
        > "$OUT/latency_qwen3_vl_8b_image_compiled_h200.log" 2>&1
    tail -16 "$OUT/latency_qwen3_vl_8b_image_compiled_h200.log"
    ;;
families)
    # the GPU tests of issues 18-20 (every family, shared model across threads, cancellation, server) with full
    # reports, then Qwen3.5-MoE (35B-A3B shape) latency, short
    timeout "${TESTS_S:-330}" python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -rfE --tb=short \
        -k "${TESTS_K:-family or moe or two_chats or cancelled or server}" > "$OUT/test_gpu_families_h200.log" 2>&1
    grep -E "passed|failed|FAILED|Error" "$OUT/test_gpu_families_h200.log" | tail -30
    [ -n "${TESTS_ONLY:-}" ] && exit 0
    timeout "${MORE_S:-200}" python3 -m raincheck_hf.bench latency --model qwen3_5_35b_a3b --input image --turns 1 \
        --answer-tokens 32 --chunk-sizes 7 --reps 1 --budget-s 60 --variants stock_dynamic,full,hard,raincheck \
        --json "$OUT/latency_qwen3_5_35b_a3b_image_h200.json" > "$OUT/latency_qwen3_5_35b_a3b_image_h200.log" 2>&1
    tail -8 "$OUT/latency_qwen3_5_35b_a3b_image_h200.log"
    ;;
gdn)
    timeout 200 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -k "gdn or suffix_state_map" \
        > "$OUT/test_gpu_gdn_h200.log" 2>&1
    tail -4 "$OUT/test_gpu_gdn_h200.log"
    timeout 300 python3 -m raincheck_hf.bench gdn --sweep --json "$OUT/gdn_kernels_h200.json" 2>&1 | tee "$OUT/gdn_kernels_h200.log"
    ;;
gdn_batch)
    # the Gated DeltaNet kernels at the batches of the batched engine (GDN_BATCHES, default 8,32): the recurrent chunk
    # kernel against the chunked form and the join, with the tile sweep (GDN_SWEEP=0: without); 35 s a batch was too
    # short for fla's import and the compiles
    for b in $(echo "${GDN_BATCHES:-8,32}" | tr , ' '); do
        timeout "${GDN_S:-150}" python3 -m raincheck_hf.bench gdn --batch "$b" \
            --ops recurrent_step,recurrent_step_chunk,chunked_step,join $([ "${GDN_SWEEP:-1}" = 1 ] && echo --sweep) \
            --json "$OUT/gdn_batch${b}_h200.json" > "$OUT/gdn_batch${b}_h200.log" 2>&1
        tail -12 "$OUT/gdn_batch${b}_h200.log"
    done
    ;;
wave)
    # this wave's GPU checks and runs in one device call, each part bounded so that the next still runs:
    # every GPU test; Qwen3.5-9B image latency with the default settings; the server against the library
    # (issue 19); then, if the call's time allows, the greedy selectors again and Qwen3-VL-30B-A3B (MoE)
    timeout 140 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider > "$OUT/test_gpu_h200.log" 2>&1
    tail -4 "$OUT/test_gpu_h200.log"
    timeout 120 python3 -m raincheck_hf.bench latency --model qwen3_5_9b --input image --turns 2 --answer-tokens 48 \
        --follow-up-tokens 16 --chunk-sizes 31 --reps 1 --budget-s 40 --variants stock_dynamic,full,hard,raincheck \
        --json "$OUT/latency_qwen3_5_9b_image_mmtok_h200.json" > "$OUT/latency_qwen3_5_9b_image_mmtok_h200.log" 2>&1
    tail -8 "$OUT/latency_qwen3_5_9b_image_mmtok_h200.log"
    timeout 90 python3 -m raincheck_hf.bench serve --model qwen3_vl_8b --answer-tokens 64 --follow-up-tokens 16 \
        --reps 1 --think-s 1 --json "$OUT/serve_qwen3_vl_8b_h200.json" > "$OUT/serve_qwen3_vl_8b_h200.log" 2>&1
    tail -14 "$OUT/serve_qwen3_vl_8b_h200.log"
    timeout "${MORE_S:-50}" python3 -m raincheck_hf.bench selectors --model qwen3_vl_8b --inputs image,video \
        --selectors uniform,mmtok,divprune,cdpruner --out "$OUT/selectors_greedy_qwen3_vl_8b_h200.json" 2>&1 \
        | grep -v Warn | tail -16
    timeout "${MORE_S:-80}" python3 -m raincheck_hf.bench latency --model qwen3_vl_30b_a3b --input image --turns 1 \
        --answer-tokens 32 --chunk-sizes 7 --reps 1 --budget-s 40 --variants stock_dynamic,full,hard,raincheck \
        --json "$OUT/latency_qwen3_vl_30b_a3b_image_h200.json" > "$OUT/latency_qwen3_vl_30b_a3b_image_h200.log" 2>&1
    tail -8 "$OUT/latency_qwen3_vl_30b_a3b_image_h200.log"
    ;;
mmtok_kernels)
    # issue 31 (selection time): the greedy selectors' GPU tests, then their selection time, both inputs, 9 repetitions
    # (timeouts: mmtok's one-launch run has its programs wait for each other; a hang must not take the call)
    timeout "${SELTEST_S:-240}" python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -k "greedy or selectors" \
        > "$OUT/test_gpu_selectors_h200.log" 2>&1
    tail -2 "$OUT/test_gpu_selectors_h200.log"
    timeout "${SEL_S:-150}" python3 -m raincheck_hf.bench selectors --model qwen3_vl_8b --inputs image,video --reps 9 \
        --selectors mmtok,divprune,cdpruner,uniform --out "$OUT/selectors_mmtok_step_h200.json" \
        > "$OUT/selectors_mmtok_step_h200.log" 2>&1
    tail -14 "$OUT/selectors_mmtok_step_h200.log"
    ;;
selectors)
    python3 -m pytest tests/test_gpu.py -q -x -p no:cacheprovider -k "greedy or selectors" > "$OUT/test_gpu_selectors_h200.log" 2>&1
    tail -3 "$OUT/test_gpu_selectors_h200.log"
    python3 -m raincheck_hf.bench selectors --model qwen3_vl_8b --inputs image,video --t1 \
        --out "$OUT/selectors_qwen3_vl_8b_h200.json" > "$OUT/selectors_qwen3_vl_8b_h200.log" 2>&1
    tail -32 "$OUT/selectors_qwen3_vl_8b_h200.log"
    # the README's headline: every variant with the library's default settings (selector mmtok)
    python3 -m raincheck_hf.bench latency --model qwen3_vl_8b --input image --turns 2 --answer-tokens 256 \
        --follow-up-tokens 64 --chunk-sizes 31 --reps 2 --budget-s "${BUDGET_VL:-200}" \
        --variants stock_dynamic,full,hard,post_answer,raincheck,serial \
        --json "$OUT/latency_qwen3_vl_8b_image_mmtok_h200.json" > "$OUT/latency_qwen3_vl_8b_image_mmtok_h200.log" 2>&1
    tail -14 "$OUT/latency_qwen3_vl_8b_image_mmtok_h200.log"
    ;;
selectors35)
    python3 -m raincheck_hf.bench selectors --model qwen3_5_9b --inputs image --t1 \
        --out "$OUT/selectors_qwen3_5_9b_h200.json" > "$OUT/selectors_qwen3_5_9b_h200.log" 2>&1
    tail -24 "$OUT/selectors_qwen3_5_9b_h200.log"
    python3 -m raincheck_hf.bench latency --model qwen3_5_9b --input image --turns 2 --answer-tokens 64 \
        --follow-up-tokens 32 --chunk-sizes 31 --reps 2 --budget-s "${BUDGET_35:-150}" \
        --variants stock_dynamic,full,hard,post_answer,raincheck,serial \
        --json "$OUT/latency_qwen3_5_9b_image_mmtok_h200.json" > "$OUT/latency_qwen3_5_9b_image_mmtok_h200.log" 2>&1
    tail -14 "$OUT/latency_qwen3_5_9b_image_mmtok_h200.log"
    ;;
vl)
    python3 -m pytest tests/test_gpu.py -q -x -p no:cacheprovider > "$OUT/test_gpu_h200.log" 2>&1
    tail -3 "$OUT/test_gpu_h200.log"
    python3 -m raincheck_hf.bench profile --model qwen3_vl_8b --modes full,raincheck --tokens 48 --replays 30 \
        --json "$OUT/profile_qwen3_vl_8b_image_h200.json" 2>&1 | grep '^\[profile\]'
    python3 -m raincheck_hf.bench latency --model qwen3_vl_8b --input image --turns 3 --answer-tokens 512 \
        --follow-up-tokens 128 --chunk-sizes 7,15,31,63 --reps 3 --budget-s "${BUDGET_VL:-420}" \
        --json "$OUT/latency_qwen3_vl_8b_image_h200.json" > "$OUT/latency_qwen3_vl_8b_image_h200.log" 2>&1
    tail -20 "$OUT/latency_qwen3_vl_8b_image_h200.log"
    ;;
more)
    # the project's variants again after the fix that captures the 1,408-row full prefill too (first call: eager)
    python3 -m raincheck_hf.bench latency --model qwen3_vl_8b --input image --turns 2 --answer-tokens 256 \
        --follow-up-tokens 64 --chunk-sizes 31 --reps 3 --budget-s "${BUDGET_VL2:-120}" \
        --variants full,hard,post_answer,raincheck,serial \
        --json "$OUT/latency_qwen3_vl_8b_image_project_h200.json" > "$OUT/latency_qwen3_vl_8b_image_project_h200.log" 2>&1
    tail -8 "$OUT/latency_qwen3_vl_8b_image_project_h200.log"
    python3 -m raincheck_hf.bench latency --model qwen3_5_9b --input image --turns 2 --answer-tokens 128 \
        --follow-up-tokens 32 --chunk-sizes 31 --reps 2 --budget-s "${BUDGET_35:-200}" \
        --variants stock_dynamic,full,hard,post_answer,raincheck,serial \
        --json "$OUT/latency_qwen3_5_9b_image_h200.json" > "$OUT/latency_qwen3_5_9b_image_h200.log" 2>&1
    tail -12 "$OUT/latency_qwen3_5_9b_image_h200.log"
    python3 -m raincheck_hf.bench latency --model qwen3_vl_8b --input video --turns 2 --answer-tokens 128 \
        --follow-up-tokens 32 --chunk-sizes 31 --reps 2 --budget-s "${BUDGET_VIDEO:-150}" \
        --variants stock_dynamic,full,hard,post_answer,raincheck,serial \
        --json "$OUT/latency_qwen3_vl_8b_video_h200.json" > "$OUT/latency_qwen3_vl_8b_video_h200.log" 2>&1
    tail -12 "$OUT/latency_qwen3_vl_8b_video_h200.log"
    ;;
attention)
    python3 -m pytest tests/test_gpu.py -q -x -p no:cacheprovider > "$OUT/test_gpu_h200.log" 2>&1
    tail -3 "$OUT/test_gpu_h200.log"
    python3 -m raincheck_hf.bench attention --json "$OUT/attention_h200.json" 2>&1 | tee "$OUT/attention_h200.log"
    python3 -m raincheck_hf.bench profile --model qwen3_vl_8b --modes full,raincheck --tokens 48 --replays 30 \
        --json "$OUT/profile_qwen3_vl_8b_image_h200_few_query.json" 2>&1 | grep '^\[profile\]'
    python3 -m raincheck_hf.bench latency --model qwen3_vl_8b --input image --turns 2 --answer-tokens 256 \
        --follow-up-tokens 64 --chunk-sizes 31 --reps 2 --budget-s "${BUDGET_ATT:-90}" \
        --variants full,raincheck,serial \
        --json "$OUT/latency_qwen3_vl_8b_image_few_query_h200.json" > "$OUT/latency_qwen3_vl_8b_image_few_query_h200.log" 2>&1
    tail -8 "$OUT/latency_qwen3_vl_8b_image_few_query_h200.log"
    ;;
video)
    python3 -m raincheck_hf.bench latency --model qwen3_vl_8b --input video --turns 2 --answer-tokens 128 \
        --follow-up-tokens 32 --chunk-sizes 31 --reps 2 --budget-s "${BUDGET_VIDEO:-200}" \
        --variants stock_dynamic,full,hard,post_answer,raincheck,serial \
        --json "$OUT/latency_qwen3_vl_8b_video_h200.json" > "$OUT/latency_qwen3_vl_8b_video_h200.log" 2>&1
    tail -12 "$OUT/latency_qwen3_vl_8b_video_h200.log"
    ;;
qwen35)
    python3 -m pytest tests/test_gpu.py -q -x -p no:cacheprovider > "$OUT/test_gpu_h200.log" 2>&1
    tail -3 "$OUT/test_gpu_h200.log"
    python3 -m raincheck_hf.bench latency --model qwen3_5_9b --input image --turns 2 --answer-tokens 128 \
        --follow-up-tokens 32 --chunk-sizes 31 --reps 2 --budget-s "${BUDGET_35:-480}" \
        --variants stock_dynamic,stock_static_reused,full,hard,post_answer,raincheck,serial \
        --json "$OUT/latency_qwen3_5_9b_image_h200.json" > "$OUT/latency_qwen3_5_9b_image_h200.log" 2>&1
    tail -12 "$OUT/latency_qwen3_5_9b_image_h200.log"
    ;;
esac
