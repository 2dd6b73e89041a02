#!/usr/bin/env bash
# Qwen2.5-3B runs on the lent H200 box (issue 6), each phase one <= 10-minute device command:
#
#   bash benchmarks/run_3b.sh PHASE OUTDIR      PHASE: gputests | best1 | best2 | knobs | spec* | fair16k | fairbest | check
#
#   gputests  the test suite on the GPU (the real three-stream path; tests marked gpu run only there);
#             PYTEST_ARGS="-m gpu tests" runs only those
#   best1/2   the harness's own best-batch search for all three systems (doubling; results.json grows per run)
#   knobs     megatrain at 16K with gpu_optimizer_layers "auto", and at 128K with liger_kernels, vs defaults
#   spec      megatrain at 16K with speculative_step on (default) and off (issue 13); specz3: ZeRO-3 at 16K
#   fair16k   fair peers at 16K (issue 13): ZeRO-3, whole-on-GPU, megatrain --host-only, megatrain (engine defaults),
#             each in its own h2h call, all with liger auto (on with liger-kernel on CUDA) and the same clip
#   fairbest  megatrain (engine defaults, liger auto) best batch from 64K to 256K tokens/step
#   check     the recompute check's cost at 16K (issue 25): check_recompute false / true / false (engine defaults)
#   small10g  10 GiB of the GPU free (--gpu-memory-limit 10), 8K, clip 1.0: megatrain host-only, defaults, ZeRO-3
#   checkall  the same, host-only with every layer recomputed (keep_activations 0): off, on, off, on
#   hu26a     issue 26: host_update_bench (native kernel exactness + Gparam/s), then 16K clip 1.0: ZeRO-3, host-only,
#             defaults;  hu26b: host-only and defaults at clip 1e9, host-only with host_kernel torch, ZeRO-3 clip 1e9
#   defer26   issue 26, deferred moments: host_update_bench --phases, then 16K clip 1.0: ZeRO-3, host-only, host-only
#             with deferred_moments false;  defer26b: the same at 8K with 10 GiB of GPU free (host-only, defaults,
#             ZeRO-3);  defer26c: 16K clip 1e9 and defaults at clip 1.0, then the GPU-marked tests;
#             defer26d: ZeRO-3 and host-only at clip 1e9
#   place     MODEL=qwen2.5-1.5b: the depth figure's deepest point under explicit placements (PLACES, below)
#   skip      the recompute's skipped down_proj on and off, alternating (ABBA), at MODEL and LAYERS (below)
#   wire26    the 10 GiB row with the bf16 wire streamed (stream_fp32_master false) and the fp32 master, ZeRO-3
#   same28    issue 28: host-only 16K clip 1.0 on the tree before the refactor (BEFORE=dir) and after, alternating
#             (ABBA: FIRST=before|after picks the first round's order); MODES="host defaults" adds the engine's
#             default placement, ROUNDS pairs (default 2); MODEL, LAYERS another shape and depth (the depth figure's:
#             MODEL=qwen2.5-1.5b LAYERS=84), LIMIT each run's seconds (default 95)
#   CLIP=1.0|1e9 (default 1e9) sets --clip for every system of fair16k/fairbest; the tags carry it (…_clip1e9)
# Results: OUTDIR/<phase>_<tag>.json (h2h results.json) and OUTDIR/<phase>.log.
set -u
phase=${1:?phase}; out=${2:?outdir}; model=${MODEL:-qwen2.5-3b}  # MODEL: another shape (same28)
source benchmarks/phase_lib.sh
free -g | tee -a "$log"

placed() {  # placed <phase>: what "auto" placed in each megatrain run of the phase (engine_auto.py)
  # (by the result's system, not the file's name: the place phase's files are named by placement, 2026-11-30)
  python3 -c "import glob, json; rs = [(f, json.load(open(f))['results'][0]) for f in sorted(glob.glob( \
      '$out/$1_*.json'))]; [print(f, r['settings'].get('auto_placed')) for f, r in rs if r['system'] == 'megatrain']" \
      | unplace | tee -a "$log"
}

small10g_call() {  # small10g_call <limit_s> <tag> <h2h args...>: issue 26's consumer-GPU row (10 GiB of GPU free,
  # 8K tokens/step, clip 1.0, 2 warm-up + 4 measured steps) for the system and options given
  local limit=$1 tag=$2; shift 2
  h2h_call "$limit" "$tag" "$@" --gpu-memory-limit 10 --clip 1.0 --tokens-per-step 8192 --warmup 2 --steps 4
}

case $phase in
  gputests)  # -rs: each skip's reason in the log (2026-11-30: "2 skipped" with no names)
    timeout ${GPUTEST_LIMIT:-560} python3 -m pytest -q -rs ${PYTEST_ARGS:-tests} 2>&1 | tail -n 30 | tee -a "$log" ;;
  best1) h2h_call 290 megatrain --systems megatrain --best-batch --min-tokens 16384 --max-tokens 262144 --warmup 1 --steps 3
         h2h_call 200 resident --systems resident --best-batch --min-tokens 8192 --max-tokens 131072 --warmup 1 --steps 3 ;;
  best2) h2h_call 500 zero3 --systems zero3 --best-batch --min-tokens 16384 --max-tokens 131072 --warmup 1 --steps 3 ;;
  knobs) h2h_call 130 host16k --systems megatrain --tokens-per-step 16384 --warmup 2 --steps 5
         h2h_call 130 auto16k --systems megatrain --megatrain-options '{"gpu_optimizer_layers": "auto"}' \
             --tokens-per-step 16384 --warmup 2 --steps 5
         h2h_call 150 host128k --systems megatrain --tokens-per-step 131072 --warmup 1 --steps 3
         h2h_call 150 liger128k --systems megatrain --megatrain-options '{"liger_kernels": true}' \
             --tokens-per-step 131072 --warmup 1 --steps 3 ;;
  spec) h2h_call 150 specon --systems megatrain --tokens-per-step 16384 --warmup 2 --steps 6
        h2h_call 150 specoff --systems megatrain --megatrain-options '{"speculative_step": false}' \
            --tokens-per-step 16384 --warmup 2 --steps 6 ;;
  specres) h2h_call 150 specon --systems megatrain --clip 1e9 --tokens-per-step 16384 --warmup 2 --steps 6 ;;
  specz3) h2h_call 400 zero3 --systems zero3 --tokens-per-step 16384 --warmup 2 --steps 6 ;;
  specnoclip)  # the harness's random-init data clips every step at 1.0: the same runs where clipping never fires
        h2h_call 150 specon --systems megatrain --clip 1e9 --tokens-per-step 16384 --warmup 2 --steps 6
        h2h_call 150 specoff --systems megatrain --clip 1e9 --megatrain-options '{"speculative_step": false}' \
            --tokens-per-step 16384 --warmup 2 --steps 6
        h2h_call 240 zero3 --systems zero3 --clip 1e9 --tokens-per-step 16384 --warmup 2 --steps 4 ;;
  fair16k)  # limits sum to 545 s: ZeRO-3 ~4 min with its build, whole-on-GPU and megatrain ~1.5 min each.
        # The harness's random data clips every step at 1.0, so megatrain's speculative step never engages at
        # CLIP=1.0; the default 1e9 never clips. Run the phase at both (CLIP=1.0 and CLIP=1e9) where time allows.
        clip=${CLIP:-1e9}; c=clip$clip
        h2h_call 245 zero3_$c --systems zero3 --clip $clip --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 100 resident_$c --systems resident --clip $clip --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 100 hostonly_$c --systems megatrain --host-only --clip $clip --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 100 megatrain_$c --systems megatrain --clip $clip --tokens-per-step 16384 --warmup 2 --steps 4 ;;
  fairclip1)  # clipping at 1.0 fires every step on the harness's random data: speculation off, the plain path
        h2h_call 245 zero3_clip1 --systems zero3 --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 100 hostonly_clip1 --systems megatrain --host-only --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 100 megatrain_clip1 --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4 ;;
  fairbest)  # 64K, 128K, 256K: ~40 s build + 6 steps each (a 256K step is ~11 s)
        clip=${CLIP:-1e9}; c=clip$clip
        h2h_call ${BEST_LIMIT:-540} megatrain_$c --systems megatrain --best-batch --min-tokens 65536 \
            --max-tokens ${MAX_TOKENS:-262144} \
            --clip $clip --warmup 2 --steps 4 ;;
  check)  # issue 25: the recompute check's cost (engine defaults, clip 1.0): off, on every step, off again
        h2h_call 150 checkoff --systems megatrain --clip 1.0 --megatrain-options '{"check_recompute": false}' \
            --tokens-per-step 16384 --warmup 2 --steps 5
        h2h_call 150 checkon --systems megatrain --clip 1.0 --megatrain-options '{"check_recompute": true}' \
            --tokens-per-step 16384 --warmup 2 --steps 5
        h2h_call 150 checkoff2 --systems megatrain --clip 1.0 --megatrain-options '{"check_recompute": false}' \
            --tokens-per-step 16384 --warmup 2 --steps 5 ;;
  checkall)  # the same with every layer recomputed and compared (host-only, keep_activations 0): its worst case
        for run in off1:false on1:true off2:false on2:true; do
          h2h_call 120 "${run%%:*}" --systems megatrain --host-only --clip 1.0 --tokens-per-step 16384 --warmup 2 \
              --steps 5 --megatrain-options "{\"check_recompute\": ${run##*:}, \"keep_activations\": 0}"
        done ;;
  small10g)  # issue 26's consumer-GPU row: 10 GiB of GPU free (--gpu-memory-limit), 8K tokens/step, clip 1.0
        small10g_call 150 hostonly --systems megatrain --host-only
        small10g_call 150 defaults --systems megatrain
        small10g_call 260 zero3 --systems zero3 ;;
  hu26a)  # issue 26: the native host update. Its exactness and Gparam/s on the box's CPU, then 3B/16K, clip 1.0
        # (fires every step on the harness's random data): ZeRO-3, megatrain host-only, megatrain defaults
        [ "${HOST_UPDATE:-1}" = 1 ] && python3 -m benchmarks.host_update_bench --threads 15 --repeats 3 --blocks 16777216 2>&1 \
            | grep -v -i warn | tee -a "$log"
        h2h_call 240 zero3 --systems zero3 --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 100 hostonly --systems megatrain --host-only --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 100 defaults --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4 ;;
  hu26b)  # the same with clipping that never fires (speculation engages), and the torch kernel for the ratio
        h2h_call 100 hostonly_clip1e9 --systems megatrain --host-only --clip 1e9 --tokens-per-step 16384 --warmup 2 \
            --steps 4
        h2h_call 100 defaults_clip1e9 --systems megatrain --clip 1e9 --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 100 hostonly_torchkernel --systems megatrain --host-only --clip 1.0 --tokens-per-step 16384 \
            --warmup 2 --steps 4 --megatrain-options '{"host_kernel": "torch"}'
        h2h_call 240 zero3_clip1e9 --systems zero3 --clip 1e9 --tokens-per-step 16384 --warmup 2 --steps 4 ;;
  defer26)  # issue 26: the update after the norm in two passes ([Note: deferred moments] in host_update.py)
        python3 -m benchmarks.host_update_bench --phases --native-threads 8,15 --repeats 3 2>&1 \
            | grep -v -i warn | tee -a "$log"
        python3 -m benchmarks.host_update_bench --phases --engine-buffers --h2d-load --native-threads 15 --repeats 3 \
            2>&1 | grep -v -i warn | tee -a "$log"
        h2h_call 240 zero3 --systems zero3 --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 100 hostonly --systems megatrain --host-only --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 100 hostonly_whole --systems megatrain --host-only --clip 1.0 --tokens-per-step 16384 --warmup 2 \
            --steps 4 --megatrain-options '{"deferred_moments": false}' ;;
  defer26b)  # the consumer-GPU row: 10 GiB of GPU free, 8K, clip 1.0
        small10g_call 120 hostonly --systems megatrain --host-only
        small10g_call 100 defaults --systems megatrain
        small10g_call 240 zero3 --systems zero3 ;;
  wire26)  # the consumer-GPU row streaming the bf16 wire (stream_fp32_master false: half the H2D bytes, whose fp32
            # masters, twice a step, nearly bind at 8K on 10 GiB) against the fp32 master (auto), and ZeRO-3
        small10g_call 110 hostonly --systems megatrain --host-only
        small10g_call 110 hostonly_wire --systems megatrain --host-only \
            --megatrain-options '{"stream_fp32_master": false}'
        small10g_call 110 defaults_wire --systems megatrain --megatrain-options '{"stream_fp32_master": false}'
        small10g_call 220 zero3 --systems zero3 ;;
  wire26b)  # wire26's megatrain runs with room for a cold machine's model build (~60 s on the CPU)
        small10g_call 200 hostonly_wire --systems megatrain --host-only \
            --megatrain-options '{"stream_fp32_master": false}'
        small10g_call 200 hostonly --systems megatrain --host-only ;;
  idle26)  # 16K clip 1.0: host-only and defaults (GPU idle of the exact-clipping floor)
        h2h_call 140 hostonly --systems megatrain --host-only --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 140 defaults --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4 ;;
  idle26z)  # idle26's peer, on the same warm machine
        h2h_call 280 zero3 --systems zero3 --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4 ;;
  defer26c)  # clipping that never fires (speculation), defaults at clip 1.0, then the GPU-marked tests;
#             defer26d: ZeRO-3 and host-only at clip 1e9
        h2h_call 100 hostonly_clip1e9 --systems megatrain --host-only --clip 1e9 --tokens-per-step 16384 --warmup 2 \
            --steps 4
        h2h_call 100 defaults --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4
        timeout 200 python3 -m pytest -q -m gpu tests 2>&1 | tail -n 8 | tee -a "$log"
        timeout 150 python3 -m pytest -q tests/engine/test_deferred_moments.py tests/unit/test_native_update.py tests/unit/test_host_update.py 2>&1 \
            | tail -n 8 | tee -a "$log" ;;
  defer26d)  # clipping that never fires: ZeRO-3 and megatrain host-only in the same lease
        h2h_call 240 zero3_clip1e9 --systems zero3 --clip 1e9 --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 100 hostonly_clip1e9 --systems megatrain --host-only --clip 1e9 --tokens-per-step 16384 --warmup 2 \
            --steps 4 ;;
  quiet26)  # defer26d with room for a cold machine, and the defaults beside: clipping that never fires
        h2h_call 150 hostonly_clip1e9 --systems megatrain --host-only --clip 1e9 --tokens-per-step 16384 --warmup 2 \
            --steps 4
        h2h_call 260 zero3_clip1e9 --systems zero3 --clip 1e9 --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 120 defaults_clip1e9 --systems megatrain --clip 1e9 --tokens-per-step 16384 --warmup 2 --steps 4 ;;
  same28)  # issue 28: the refactor changes no behaviour: megatrain host-only, 16K, clip 1.0, on the tree before it
        # (BEFORE: a folder holding that commit's megatrain_ds/ and benchmarks/, e.g. from git archive) and on this
        # one, alternating, then the rollback's Gparam/s (host_update_bench's last line)
        before=${BEFORE:?BEFORE: the tree before the change}; root=$PWD
        # MODES: "host" (--host-only, the default), "defaults" (the engine's own placement), or both
        for k in $(seq 1 "${ROUNDS:-2}"); do  # ROUNDS: before/after pairs (default 2)
          for mode in ${MODES:-host}; do
            flag=""; suffix=$k; [ "$mode" = host ] && flag="--host-only"; [ "$mode" = defaults ] && suffix=defaults$k
            # ABBA: odd rounds (and FIRST=before) run the old tree first, even rounds (or FIRST=after) the new one,
            # so neither tree always runs second
            first=${FIRST:-before}; [ $((k % 2)) = 0 ] && { [ "$first" = before ] && first=after || first=before; }
            for tree in $first $([ "$first" = before ] && echo after || echo before); do
              if [ "$tree" = before ]; then
                (cd "$before" && export PYTHONPATH="$root/.site:$PWD" && h2h_call "${LIMIT:-95}" before$suffix \
                    --systems megatrain $flag --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4 ${LAYERS:+--layers $LAYERS})
              else
                h2h_call "${LIMIT:-95}" after$suffix --systems megatrain $flag --clip 1.0 --tokens-per-step 16384 --warmup 2 \
                    --steps 4 ${LAYERS:+--layers $LAYERS}
              fi
            done
          done
        done
        [ "${HOST_UPDATE:-1}" = 1 ] && python3 -m benchmarks.host_update_bench --threads 15 --repeats 3 --blocks 16777216 2>&1 \
            | grep -v -i warn | tail -n 3 | tee -a "$log" ;;
  trace27)  # where the host-only 16K step idles: trace_gaps --timeline (3 steps after 4: every host thread's ranges and
            # the device spans, no torch.profiler) at clip 1e9 and 1.0, with liger; OUTDIR/trace27_<clip>/gaps.md,
            # timeline.csv. MEGATRAIN_OPTIONS (JSON) adds engine options.
        for clip in ${CLIPS:-1e9 1.0}; do
          opts=$(python3 -c "import json,os; d={'gpu_optimizer_layers': 0, 'liger_kernels': True, 'use_liger': True}; d.update(json.loads(os.environ.get('MEGATRAIN_OPTIONS') or '{}')); print(json.dumps(d))")
          timeout 200 python3 -m benchmarks.trace_gaps --model $model --tokens-per-step 16384 --clip $clip --warmup 4 \
              --steps 3 --timeline --out "$out/trace27_$clip" --megatrain-options "$opts" 2>&1 \
              | grep -v -e "is deprecated" -e "^\s*$" | tail -n 40 | tee -a "$log"
        done ;;
  res27a)  # the resident gradient's norm taken on the GPU, one pass in a speculating step: host-only at 16K, clip 1e9
           # ("auto"; deferred_moments true), clip 1.0, and ZeRO-3 at clip 1.0, in one lease
        h2h_call 150 hostonly_clip1e9 --systems megatrain --host-only --clip 1e9 --tokens-per-step 16384 --warmup 2 \
            --steps 4
        h2h_call 90 hostonly_clip1e9_defer --systems megatrain --host-only --clip 1e9 --tokens-per-step 16384 \
            --warmup 2 --steps 4 --megatrain-options '{"deferred_moments": true}'
        h2h_call 90 hostonly_clip1 --systems megatrain --host-only --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 250 zero3_clip1 --systems zero3 --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4 ;;
  res27b)  # res27a's machine, still warm: ZeRO-3 at clip 1e9, the defaults at both clips
        h2h_call 250 zero3_clip1e9 --systems zero3 --clip 1e9 --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 90 defaults_clip1e9 --systems megatrain --clip 1e9 --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 90 defaults_clip1 --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4 ;;
  auto27a)  # "auto" placing optimizer state first when the host update was exposed (engine_auto.py), and the host-only
            # timeline at clip 1e9; then host-only at clip 1e9 streaming the bf16 wire (stream_fp32_master false)
        CLIPS=1e9 bash benchmarks/run_3b.sh trace27 "$out" > /dev/null 2>&1; grep -h "^last step" "$out"/trace27_1e9/gaps.md | tee -a "$log"
        h2h_call 150 defaults_clip1 --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 3 --steps 4
        h2h_call 100 defaults_clip1e9 --systems megatrain --clip 1e9 --tokens-per-step 16384 --warmup 3 --steps 4
        h2h_call 100 hostonly_clip1e9_wire --systems megatrain --host-only --clip 1e9 --tokens-per-step 16384 \
            --warmup 2 --steps 4 --megatrain-options '{"stream_fp32_master": false}'
        placed auto27a ;;
  auto27b)  # auto27a's machine, still warm: the host-only rows and ZeRO-3 at clip 1.0
        h2h_call 90 hostonly_clip1 --systems megatrain --host-only --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 90 hostonly_clip1e9 --systems megatrain --host-only --clip 1e9 --tokens-per-step 16384 --warmup 2 \
            --steps 4
        h2h_call 250 zero3_clip1 --systems zero3 --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4 ;;
  final27a)  # this session's final tree, one lease (final27b/c follow on the same machine): host-only and defaults at
             # clip 1.0 and 1e9, whole-on-GPU at clip 1.0
        h2h_call 150 hostonly_clip1 --systems megatrain --host-only --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 90 hostonly_clip1e9 --systems megatrain --host-only --clip 1e9 --tokens-per-step 16384 --warmup 2 \
            --steps 4
        h2h_call 100 defaults_clip1 --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 3 --steps 4
        h2h_call 100 defaults_clip1e9 --systems megatrain --clip 1e9 --tokens-per-step 16384 --warmup 3 --steps 4
        h2h_call 100 resident_clip1 --systems resident --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4
        placed final27a ;;
  final27b)  # ZeRO-3 at clip 1.0: all optimizer state offloaded, and with the defaults' GPU share (F, offload ratio 1-F)
        h2h_call 250 zero3_clip1 --systems zero3 --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 280 zero3_clip1_gpu${ZERO3_F:-0.67} --systems zero3 --clip 1.0 --tokens-per-step 16384 --warmup 2 \
            --steps 4 --gpu-optimizer-fraction ${ZERO3_F:-0.67} ;;
  ab27)  # host-only 16K clip 1.0 on the tree before this session (BEFORE=dir, as same28) and on this one, on one warm
         # machine, then the GPU-marked tests
        before=${BEFORE:?BEFORE: the tree before the change}; root=$PWD
        (cd "$before" && export PYTHONPATH="$root/.site:$PWD" && h2h_call 95 before --systems megatrain --host-only \
            --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4)
        h2h_call 95 after --systems megatrain --host-only --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4
        timeout 240 python3 -m pytest -q -m gpu tests 2>&1 | tail -n 8 | tee -a "$log" ;;
  small27)  # the 10 GiB row with the placement made from the measured exposure: defaults against host-only
        small10g_call 200 hostonly --systems megatrain --host-only
        small10g_call 150 defaults --systems megatrain
        placed small27 ;;
  final28a)  # session 16's tree, one lease (final28b/c follow on the same machine): host-only at clip 1.0 and 1e9,
             # ZeRO-3 (all optimizer state offloaded) at clip 1.0
        h2h_call 150 hostonly_clip1 --systems megatrain --host-only --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4
        h2h_call 90 hostonly_clip1e9 --systems megatrain --host-only --clip 1e9 --tokens-per-step 16384 --warmup 2 \
            --steps 4
        h2h_call 250 zero3_clip1 --systems zero3 --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 4 ;;
  final28b)  # the host-only timelines at clip 1e9 and 1.0 (trace27), then the host's memory rates the floors use: the
             # native update of one 3B layer (85 M) in one pass and in two, alone and beside a 1 GiB H2D loop
        bash benchmarks/run_3b.sh trace27 "$out" > /dev/null 2>&1
        grep -h "^last step" "$out"/trace27_*/gaps.md | tee -a "$log"
        timeout 150 python3 -m benchmarks.host_update_bench --phases --engine-buffers --h2d-load --params 85e6 \
            --repeats 5 2>&1 | grep -v -i warn | tail -n 12 | tee -a "$log" ;;
  final28c)  # the defaults at clip 1.0 and 1e9 on final28a's machine
        h2h_call 150 defaults_clip1 --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 3 --steps 4
        h2h_call 100 defaults_clip1e9 --systems megatrain --clip 1e9 --tokens-per-step 16384 --warmup 3 --steps 4
        placed final28c ;;
  place)  # issue 48: the depth figure's deep point (MODEL=qwen2.5-1.5b; LAYERS, default 180) under each placement of
        # PLACES: "auto", or STATE:KEPT (gpu_optimizer_layers:keep_activations). 2026-11-30 at 180 layers "auto"
        # placed 148 state + 3 kept layers (no host wait, 177 layers recomputed; the rule before its margin: 96 + 31,
        # 0.18 s host wait); each layer's state 0.70 GiB, a kept layer 1.3 GiB, ~107 GiB for both
        for p in ${PLACES:-auto 124:15 110:23 96:30}; do
          if [ "$p" = auto ]; then opts='{}'
          else opts="{\"gpu_optimizer_layers\": ${p%%:*}, \"keep_activations\": ${p#*:}}"; fi
          h2h_call "${LIMIT:-120}" "L${LAYERS:-180}_${p/:/_}" --systems megatrain --layers "${LAYERS:-180}" \
            --megatrain-options "$opts" --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 3
        done
        placed place ;;
  skip)  # the recompute's skipped down_proj (recompute_skip.py) on and off, alternating (ABBA, ROUNDS pairs), at MODEL
        # and LAYERS (the depth figure's deepest: MODEL=qwen2.5-1.5b LAYERS=180), 16K clip 1.0; 3 warm-up steps: the
        # recompute check compares (and so does not skip) the first 3
        for k in $(seq 1 "${ROUNDS:-2}"); do
          if [ $((k % 2)) = 1 ]; then order="auto false"; else order="false auto"; fi
          for v in $order; do
            if [ "$v" = auto ]; then opts='{"skip_recompute_down_proj": "auto"}'
            else opts='{"skip_recompute_down_proj": false}'; fi
            h2h_call "${LIMIT:-120}" "skip_${v}_r$k" --systems megatrain ${LAYERS:+--layers "$LAYERS"} \
              --megatrain-options "$opts" --clip 1.0 --tokens-per-step 16384 --warmup 3 --steps 3
          done
        done ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
