#!/usr/bin/env bash
# The 24 GiB GPU table (issue 48): 3B and 7B at 8K tokens/step, clip 1.0, each system seeing only 24 GiB of the
# H200 free (--gpu-memory-limit 24: one allocation holds the rest, benchmarks/common.py hold_gpu_memory; peak GPU
# memory leaves it out), 2 warm-up + 4 measured steps, liger for all. Each system is its own h2h call under its own
# limit (benchmarks/phase_lib.sh); results.md of each call has tokens/s, peak GPU and the GPU-idle share.
#
#   bash benchmarks/run_24gib.sh 3b OUTDIR    megatrain host-only, defaults, ZeRO-3, FSDP2        (~9 min)
#   bash benchmarks/run_24gib.sh 3b-gemini OUTDIR   Gemini's row (GEMINI_LIGER default 0; ColossalAI's kernels
#                                             built first, cached in .site/home: ~2 min on a fresh machine)
#   bash benchmarks/run_24gib.sh 7b OUTDIR    megatrain defaults, host-only, then ZeRO-3 and FSDP2's rows (the
#                                             harness's host pre-check records them as not fitting 128 GiB)
#   bash benchmarks/run_24gib.sh 7b-defaults OUTDIR   megatrain defaults alone
#   bash benchmarks/run_24gib.sh 7b-whole OUTDIR      defaults with deferred moments, then with one-pass updates
#                                             (deferred_moments false): at 7B/8K the host's two passes (36 B/param
#                                             moved) are the step (2026-11-29_h200_gemini_g24_auto); one pass moves
#                                             26; then defaults with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
#                                             (the 7B row's reserved peak was 5.9 GB above its allocated one, memory
#                                             "auto" could not place into)
#   bash benchmarks/run_24gib.sh 7b-expandable OUTDIR  that last run alone (LIMIT s, default 260)
#   bash benchmarks/run_24gib.sh 7b-alloc OUTDIR      megatrain defaults under caching-allocator settings and update
#                                             modes, each its own process (~65 s each since the fast CPU init):
#                                             VARIANTS (default "none expandable split512 whole whole-expandable"):
#                                             none (the allocator's own: the 7B row's 5 GiB reserved over allocated
#                                             sat in the compute stream's large pool, 36 segments:
#                                             2026-11-30_h200x2_7b_24gib_peers), expandable (expandable segments),
#                                             split512 / split128 (max_split_size_mb; a GC threshold acts only under
#                                             a per-process memory fraction, which the limit is not), whole
#                                             (deferred_moments false: one host pass, 26 B/param moved, not two, 36:
#                                             the step is the host's), whole-expandable, bf16wire (a bf16 wire
#                                             copy streams, not the fp32 master: the host writes 2 B/param more
#                                             and the two H2D reads move 4 less, 44 B/param of host memory
#                                             traffic a step against 46 at 7B/8K, where the step is the host's
#                                             bandwidth: a prediction, ~4% at most; measured +8.4% and +6.3%, the
#                                             PCIe side the prediction left out: 2026-11-30_h200x2_7b_24gib_every_peer),
#                                             tight (expandable segments, gpu_memory_reserve 0.03), tight-bf16wire
#                                             (those and the bf16 wire), cache / tight-bf16wire-cache (those with
#                                             weight_cache_layers "auto": what the placement leaves holds layers'
#                                             weights from forward to backward, one H2D a step for each, not two;
#                                             a prediction: ~1-2% at 7B/8K, 3 layers of 28 at 0.47 GiB;
#                                             measured 2026-11-30: +3.6% over none, -3.0% and -1.4% beside
#                                             tight-bf16wire, alternated: inside the spread; 79-81% of the 24 GiB
#                                             allocated), tighter-bf16wire-cache (that with 1% kept free: 82%,
#                                             2026-11-30_h200x2_7b_24gib_cache); ALLOC_LIMIT
#                                             s each (110)
# On the 2-GPU box (256 GiB host: ZeRO-3 needs ~191 GB and FSDP2 ~179 GB at 7B, Gemini ~145 GB), the 7B row's peers:
#   bash benchmarks/run_24gib.sh 7b-peers OUTDIR      megatrain_ds defaults, then ZeRO-3 and FSDP2, at 24 GiB, in one
#                                             call (the x2 box has 32 cores: its host update is not the 16-core box's,
#                                             so the row's ratios come from one call on one machine); RUNS="defaults
#                                             fsdp" runs those of them only (expandable: defaults with expandable
#                                             segments; tight: those and gpu_memory_reserve 0.03, 3% of the 24
#                                             GiB kept free, not 10%: 2026-11-30 7b-alloc left 4.1 GiB never
#                                             reserved, a layer's state is 3.45; 16k: defaults at 16K tokens a
#                                             step, whose compute doubles while the host update stays: a
#                                             prediction, ~6,000-7,000 tokens/s against 8K's 3,600-4,400);
#                                             LIMIT_DEFAULTS, LIMIT_PEERS: their limits (s)
#   bash benchmarks/run_24gib.sh 7b-gemini OUTDIR     ColossalAI's kernels, Gemini fp16 "auto" (its fastest: HybridAdam's
#                                             compiled host kernel, gemini_system.py; not the others' dtype), then
#                                             megatrain_ds defaults beside it (one call; a prediction: ~7 min on a
#                                             fresh x2 box, kernels ~2, Gemini ~3.5, megatrain_ds ~1.5; measured
#                                             2026-11-30: "auto" placement out of memory at 24 GiB, with or without
#                                             expandable segments, and again told the limit as ColossalAI's memory
#                                             fraction: HF's 4.64 GiB fp32 logits, 2026-11-30_h200x2_7b_24gib_cache)
#   bash benchmarks/run_24gib.sh 7b-gemini-static OUTDIR   Gemini fp16, static placement (every chunk on the host),
#                                             expandable segments: the Gemini setting that fits 24 GiB at 7B (LIMIT s)
set -u
phase=${1:?phase 3b|3b-gemini|7b|7b-defaults|7b-whole|7b-expandable|7b-alloc|7b-peers|7b-gemini|7b-gemini-static}; out=${2:?outdir}
source benchmarks/phase_lib.sh
free -g | tee -a "$log"
g24() {  # g24 <limit_s> <tag> <h2h args...>
  local limit=$1 tag=$2; shift 2
  h2h_call "$limit" "$tag" "$@" --gpu-memory-limit 24 --clip 1.0 --tokens-per-step 8192 --warmup 2 --steps 4
}
case $phase in
  3b) model=qwen2.5-3b
      g24 100 hostonly --systems megatrain --host-only
      g24 100 defaults --systems megatrain
      g24 190 zero3 --systems zero3
      g24 140 fsdp --systems fsdp ;;
  3b-gemini) model=qwen2.5-3b; export HOME=$PWD/.site/home; mkdir -p "$HOME"
      timeout 300 python3 -m benchmarks.gemini_system --prebuild 2>&1 | grep -v -i warn | tail -n 4 | tee -a "$log"
      GEMINI_LIGER=${GEMINI_LIGER:-0} g24 240 gemini --systems gemini ;;
  7b) model=qwen2.5-7b  # fp32 masters: ~115 GB host (ANCHORS 2026-11-27); the planner decides in initialize
      g24 200 defaults --systems megatrain
      g24 200 hostonly --systems megatrain --host-only
      g24 60 peers --systems zero3,fsdp ;;
  7b-defaults) model=qwen2.5-7b; g24 200 defaults --systems megatrain ;;
  7b-whole) model=qwen2.5-7b
      g24 260 deferred --systems megatrain
      g24 260 whole --systems megatrain --megatrain-options '{"deferred_moments": false}'
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True g24 260 expandable --systems megatrain ;;
  7b-expandable) model=qwen2.5-7b  # the last of 7b-whole alone (the 7B build alone took 78-110 s on these boxes)
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True g24 ${LIMIT:-260} expandable --systems megatrain ;;
  7b-alloc) model=${MODEL:-qwen2.5-7b}  # MODEL=qwen2.5-3b: the same variants at 3B
      whole='{"deferred_moments": false}'
      for variant in ${VARIANTS:-none expandable split512 whole whole-expandable}; do
        lim=${ALLOC_LIMIT:-110}
        case $variant in
          none) g24 "$lim" none --systems megatrain ;;
          expandable) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True g24 "$lim" expandable --systems megatrain ;;
          split512) PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512 g24 "$lim" split512 --systems megatrain ;;
          split128) PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128 g24 "$lim" split128 --systems megatrain ;;
          whole) g24 "$lim" whole --systems megatrain --megatrain-options "$whole" ;;
          whole-expandable) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
              g24 "$lim" whole_expandable --systems megatrain --megatrain-options "$whole" ;;
          bf16wire) g24 "$lim" bf16wire --systems megatrain \
              --megatrain-options '{"stream_fp32_master": false}' ;;
          tight) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True g24 "$lim" tight --systems megatrain \
              --megatrain-options '{"gpu_memory_reserve": 0.03}' ;;
          tight-bf16wire) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True g24 "$lim" tight_bf16wire \
              --systems megatrain --megatrain-options '{"gpu_memory_reserve": 0.03, "stream_fp32_master": false}' ;;
          cache) g24 "$lim" cache --systems megatrain --megatrain-options '{"weight_cache_layers": "auto"}' ;;
          tight-bf16wire-cache) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True g24 "$lim" tight_bf16wire_cache \
              --systems megatrain --megatrain-options \
              '{"gpu_memory_reserve": 0.03, "stream_fp32_master": false, "weight_cache_layers": "auto"}' ;;
          tighter-bf16wire-cache) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True g24 "$lim" \
              tighter_bf16wire_cache --systems megatrain --megatrain-options \
              '{"gpu_memory_reserve": 0.01, "stream_fp32_master": false, "weight_cache_layers": "auto"}' ;;
          *) echo "unknown variant $variant (none expandable split512 split128 whole whole-expandable" \
                  "bf16wire tight tight-bf16wire cache tight-bf16wire-cache tighter-bf16wire-cache)"
             exit 2 ;;
        esac
      done ;;
  7b-peers) model=qwen2.5-7b
      for run in ${RUNS:-defaults zero3 fsdp}; do
        case $run in
          defaults) g24 ${LIMIT_DEFAULTS:-150} defaults --systems megatrain ;;
          expandable) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True g24 150 expandable --systems megatrain ;;
          tight) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True g24 ${LIMIT_DEFAULTS:-150} tight \
              --systems megatrain --megatrain-options '{"gpu_memory_reserve": 0.03}' ;;
          16k) h2h_call ${LIMIT_DEFAULTS:-150} defaults16k --systems megatrain --gpu-memory-limit 24 --clip 1.0 \
              --tokens-per-step 16384 --warmup 2 --steps 4 ;;
          zero3) g24 ${LIMIT_PEERS:-215} zero3 --systems zero3 ;;
          fsdp) g24 ${LIMIT_PEERS:-215} fsdp --systems fsdp ;;
          *) echo "unknown run $run (defaults expandable tight 16k zero3 fsdp)"; exit 2 ;;
        esac
      done ;;
  7b-gemini) model=qwen2.5-7b; export HOME=$PWD/.site/home; mkdir -p "$HOME"
      timeout 300 python3 -m benchmarks.gemini_system --prebuild 2>&1 | grep -v -i warn | tail -n 4 | tee -a "$log"
      GEMINI_PRECISION=fp16 GEMINI_PLACEMENT=auto GEMINI_LIGER=${GEMINI_LIGER:-0} g24 220 gemini_fp16 --systems gemini
      g24 150 defaults --systems megatrain ;;
  7b-gemini-static) model=qwen2.5-7b; export HOME=$PWD/.site/home; mkdir -p "$HOME"
      # auto placement OOMs at 24 GiB (2026-11-30: 15.9 GiB allocated + 7.0 fragmented; with expandable
      # segments 19.2 allocated + the 4.64 GiB fp32 logits); static keeps every chunk on the host
      timeout 300 python3 -m benchmarks.gemini_system --prebuild 2>&1 | grep -v -i warn | tail -n 4 | tee -a "$log"
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True GEMINI_PRECISION=fp16 GEMINI_PLACEMENT=static \
        GEMINI_LIGER=${GEMINI_LIGER:-0} g24 ${LIMIT:-240} gemini_fp16_static --systems gemini ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
