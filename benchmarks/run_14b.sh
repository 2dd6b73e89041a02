#!/usr/bin/env bash
# The paper's 14B comparison (issue 7): qwen2.5-14b shape, seq 1024, megatrain_ds vs DeepSpeed ZeRO-3 CPU offload,
# on a box with >= 512 GiB host memory (the lent nvidia-h200-x4; one of its GPUs is used).
#
#   bash benchmarks/run_14b.sh PHASE OUTDIR      PHASE: paperA | paperB | paperC | paperD | big40 | paper7a | paper7b | paper7c | paper7d | paper7e | paper7g | 16k | 32k | 64k | 96k | auto | adam | sweepA | sweepB | sweepC | 7b | 7bhost | 7bstate
#
# Each phase fits one 10-minute device command (benchmarks/phase_lib.sh: each system its own h2h call and time
# limit); results: OUTDIR/<phase>_<tag>.json (that call's results.json) and OUTDIR/<phase>.log.
# GEMINI_LIGER (Gemini's runs; default 0): 0 = no liger, activations = SwiGLU, RoPE and cross-entropy (gemini_system.py).
# Steps: 2 warm-up + 3 measured at 16K, 1 + 2 at 32K and above (a 14B step at 96K takes 22 s). The depth sweep at
# the 14B width (sweepA/B/C, 16K tokens/step) adds 24, 72 and 96 layers to the 48 of the 16k phase for megatrain
# (96 layers = 28 B params, ~470 GB of host memory) and 24 for ZeRO-3 (72 layers would need ~540 GB).
set -u
phase=${1:?phase}; out=${2:?outdir}; model=qwen2.5-14b
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}  # one GPU of the box
source benchmarks/phase_lib.sh
free -g | tee -a "$log"

case $phase in
  16k)   h2h_call 250 megatrain --systems megatrain --tokens-per-step 16384 --warmup 2 --steps 3
         h2h_call 330 zero3 --systems zero3 --tokens-per-step 16384 --warmup 2 --steps 3 ;;
  96k)   h2h_call 230 megatrain --systems megatrain --tokens-per-step 98304 --warmup 1 --steps 2
         h2h_call 350 zero3 --systems zero3 --tokens-per-step 98304 --warmup 1 --steps 2 ;;
  64k)   h2h_call 250 megatrain --systems megatrain --tokens-per-step 65536 --warmup 1 --steps 2
         h2h_call 320 zero3 --systems zero3 --tokens-per-step 65536 --warmup 1 --steps 2 ;;
  32k)   h2h_call 270 zero3 --systems zero3 --tokens-per-step 32768 --warmup 1 --steps 2
         h2h_call 190 megatrain --systems megatrain --tokens-per-step 32768 --warmup 1 --steps 2 ;;
  auto)  auto='{"gpu_optimizer_layers": "auto"}'   # optimizer state of the leading layers on the GPU
         h2h_call 250 megatrain16k --systems megatrain --megatrain-options "$auto" --tokens-per-step 16384 --warmup 2 --steps 3
         h2h_call 250 megatrain32k --systems megatrain --megatrain-options "$auto" --tokens-per-step 32768 --warmup 1 --steps 2 ;;
  adam)  python3 -m benchmarks.host_adam --gparams 2 --threads 8,16,32,64 2>&1 | grep -v -i warning | tee -a "$log" ;;
  # depth sweep at the 14B width, 16K tokens/step (48 layers = the 16k phase); ZeRO-3 at 72 layers is skipped by
  # the harness's host-memory check (~27 B/param), recorded with its numbers
  sweepA) h2h_call 320 megatrainL96 --systems megatrain --layers 96 --tokens-per-step 16384 --warmup 1 --steps 2
          h2h_call 100 megatrainL24 --systems megatrain --layers 24 --tokens-per-step 16384 --warmup 1 --steps 2
          h2h_call 30 zero3L72 --systems zero3 --layers 72 --tokens-per-step 16384 --warmup 1 --steps 2 ;;
  # ZeRO-3 at 24 layers builds for 2:13 (a 150 s limit in sweepA cut it after its first step)
  sweepB) h2h_call 220 zero3L24 --systems zero3 --layers 24 --tokens-per-step 16384 --warmup 1 --steps 2 ;;
  sweepC) h2h_call 280 megatrainL72 --systems megatrain --layers 72 --tokens-per-step 16384 --warmup 1 --steps 2 ;;
  # Qwen2.5-7B (issue 6; ZeRO-3 needs ~190 GB of host memory, more than the one-GPU boxes have)
  7b)    model=qwen2.5-7b
         h2h_call 110 megatrain --systems megatrain --tokens-per-step 16384 --warmup 1 --steps 2
         h2h_call 200 zero3 --systems zero3 --tokens-per-step 16384 --warmup 1 --steps 2 ;;
  # issue 26: 7B with fp32 masters on a 128 GiB box (bf16 gradients landed: 14 host bytes/param), clip 1.0; then
  # bf16-master mode (12)
  7bhost) model=qwen2.5-7b
         h2h_call 300 fp32masters --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 1 --steps 3
         h2h_call 270 bf16masters --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 1 --steps 3 \
             --ds-config '{"bf16": {"enabled": true, "bf16_master_weights_and_grads": true}}' ;;
  # issue 26, item 6: bf16-master mode (its resident state now "auto"-placed on the GPU) and compact moments
  # (bf16.bf16_optimizer_states: 8 host bytes/param), each with fp32 masters on the same machine; the per-pass rates
  7bstate) model=qwen2.5-7b
         python3 -m benchmarks.host_update_bench --phases --engine-buffers --state fp32-master,bf16-master,bf16-state \
             --repeats 3 2>&1 | grep -v -i warning | tee -a "$log"
         bf16='"enabled": true, "bf16_master_weights_and_grads": true'
         h2h_call 200 bf16masters --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 1 --steps 3 \
             --ds-config "{\"bf16\": {$bf16}}"
         h2h_call 200 bf16state --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 1 --steps 3 \
             --ds-config "{\"bf16\": {$bf16, \"bf16_optimizer_states\": true}}"
         h2h_call 200 fp32masters --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 1 --steps 3 ;;
  # the 7B steady state: deferred moments against whole updates, 6 measured steps each (the first measured step of
  # 7bstate ran ~0.5 s faster than the next two)
  7bdefer) model=qwen2.5-7b
         h2h_call 180 fp32_deferred --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 1 --steps 6
         h2h_call 180 fp32_whole --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 1 --steps 6 \
             --megatrain-options '{"deferred_moments": false}'
         bf16='"enabled": true, "bf16_master_weights_and_grads": true'
         h2h_call 180 bf16state_whole --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 1 --steps 6 \
             --ds-config "{\"bf16\": {$bf16, \"bf16_optimizer_states\": true}}" \
             --megatrain-options '{"deferred_moments": false}' ;;
  # 7bdefer after the whole-layer fallback's removal: the three states, 6 measured steps each
  7bsteady) model=qwen2.5-7b
         bf16='"enabled": true, "bf16_master_weights_and_grads": true'
         h2h_call 180 fp32 --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 1 --steps 6
         h2h_call 180 bf16masters --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 1 --steps 6 \
             --ds-config "{\"bf16\": {$bf16}}"
         h2h_call 180 bf16state --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 1 --steps 6 \
             --ds-config "{\"bf16\": {$bf16, \"bf16_optimizer_states\": true}}" ;;
  # 7B with bf16 state in both systems: DeepSpeed's bf16 master weights and optimizer states with ZeRO-3 CPU offload
  # (fits 128 GiB where its fp32 state does not) against megatrain_ds's compact moments, clip 1.0, same lease
  7bbf16) model=qwen2.5-7b
         state='{"bf16": {"enabled": true, "bf16_master_weights_and_grads": true, "bf16_optimizer_states": true}}'
         h2h_call 300 zero3 --systems zero3 --clip 1.0 --tokens-per-step 16384 --warmup 1 --steps 2 \
             --zero3-ds-config "$state"
         h2h_call 160 megatrain --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 1 --steps 3 \
             --ds-config "$state" ;;
  # issue 26, item 2: 7B with fp32 masters and the gradients held on the GPU until the norm (gradient_hold "gpu": 12
  # host bytes/param, one-pass updates) against the host landing (14, deferred moments), clip 1.0, one lease; then the
  # hold's GPU test
  7bhold) model=qwen2.5-7b
         h2h_call 240 hold --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 1 --steps 4 \
             --megatrain-options '{"gradient_hold": "gpu"}'
         h2h_call 240 host --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 1 --steps 4
         timeout 100 python3 -m pytest -q -m gpu tests/engine/test_grad_hold.py 2>&1 | tail -n 4 | tee -a "$log" ;;
  # issue 39 (2026-11-28): the paper's comparison with today's engine, clip 1.0, liger for every system, one lease:
  # paperA = ZeRO-3 (all optimizer state offloaded) and megatrain_ds host-only; paperB = megatrain_ds defaults
  paperA) h2h_call 330 zero3 --systems zero3 --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 3
          h2h_call 230 hostonly --systems megatrain --host-only --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 3 ;;
  paperB) h2h_call 220 defaults --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 3 ;;
  # issue 48, item 6: the 14B row's other peers (4-GPU box, one GPU): Gemini after its kernels build (the call's
  # remainder), then FSDP2 in a call of its own
  paperC) export HOME=$PWD/.site/home; mkdir -p "$HOME"
          timeout 300 python3 -m benchmarks.gemini_system --prebuild 2>&1 | grep -v -i warn | tail -n 4 | tee -a "$log"
          left=$((580 - SECONDS))
          [ "$left" -gt 240 ] && GEMINI_LIGER=${GEMINI_LIGER:-0} h2h_call "$left" gemini --systems gemini --clip 1.0 \
              --tokens-per-step 16384 --warmup 2 --steps 3 ;;
  # issue 48, item 6: the largest exact model of the 4-GPU box (512 GiB host): the 14B width at 140 layers, 40.1 B
  # parameters, fp32 masters; `megatrain-ds plan qwen2.5-14b --layers 140 --host-budget 480` puts its host state at
  # 462 GiB with the gradients held on the GPU until the norm (the plan's gradient_hold "auto")
  big40) h2h_call 570 L140 --systems megatrain --layers 140 --clip 1.0 --tokens-per-step 16384 --warmup 1 --steps 2 ;;
  paperD) h2h_call 560 fsdp --systems fsdp --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 3 ;;
  # the paper's 7B comparison (issue 48) on one GPU of the 2-GPU box (its 256 GiB hold every peer's state), 16K, clip
  # 1.0, liger for all but Gemini (its offloaded norm weights break liger's RMSNorm backward: gemini_system.py)
  paper7a) model=qwen2.5-7b
          h2h_call 170 defaults --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 3
          h2h_call 150 hostonly --systems megatrain --host-only --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 3
          h2h_call 260 zero3 --systems zero3 --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 3 ;;
  # ColossalAI's JIT kernels, built outside any timed run; its cache (~/.cache/colossalai) is kept in .site/home,
  # which a warm machine keeps between calls (run paper7c at once). On a fresh x2 box the fused CUDA build outlasted
  # a 370 s run cap. What the call has left after the build goes to Gemini's 7B run.
  paper7b) export HOME=$PWD/.site/home; mkdir -p "$HOME"; model=qwen2.5-7b
          timeout 540 python3 -m benchmarks.gemini_system --prebuild 2>&1 | grep -v -i warn | tail -n 8 | tee -a "$log"
          left=$((580 - SECONDS))
          [ "$left" -gt 240 ] && GEMINI_LIGER=${GEMINI_LIGER:-0} h2h_call "$left" gemini --systems gemini --clip 1.0 \
              --tokens-per-step 16384 --warmup 2 --steps 3 ;;
  # Gemini's 7B row beside megatrain_ds in one call, on a machine whose paper7b built ColossalAI's kernels (Gemini
  # with liger on activations only: GEMINI_LIGER=activations, gemini_system.py)
  paper7d) export HOME=$PWD/.site/home; mkdir -p "$HOME"; model=qwen2.5-7b
          GEMINI_LIGER=${GEMINI_LIGER:-activations} h2h_call 300 gemini --systems gemini --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 3
          h2h_call 120 defaults --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 3
          h2h_call 130 hostonly --systems megatrain --host-only --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 3 ;;
  # Gemini's other placements at 7B (after paper7b's kernel build): "auto" (its memory tracer places chunks), and
  # static with the bf16 parameters on the GPU (GEMINI_OFFLOAD_PARAM=0), the optimizer state on the host as ZeRO-3's
  paper7e) export HOME=$PWD/.site/home; mkdir -p "$HOME"; model=qwen2.5-7b; export GEMINI_LIGER=${GEMINI_LIGER:-0}
          GEMINI_PLACEMENT=auto h2h_call 280 gemini_auto --systems gemini --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 3
          GEMINI_OFFLOAD_PARAM=0 h2h_call 280 gemini_gpuparams --systems gemini --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 3 ;;
  # Gemini's host AdamW: HybridAdam's CPU kernel skips bf16 gradients (gemini_system.PRECISIONS); after the build,
  # the probe (fp32 / fp16 / bf16 gradients, torch's fused AdamW beside), Gemini fp16 in "auto", megatrain_ds defaults
  paper7g) export HOME=$PWD/.site/home; mkdir -p "$HOME"; model=qwen2.5-7b; export GEMINI_LIGER=${GEMINI_LIGER:-0}
          timeout 300 python3 -m benchmarks.gemini_system --prebuild 2>&1 | grep -v -i warn | tail -n 4 | tee -a "$log"
          timeout 90 python3 -m benchmarks.gemini_system --adam-probe 2e8 2>&1 | grep -v -i warn | tail -n 4 | tee -a "$log"
          GEMINI_PRECISION=fp16 GEMINI_PLACEMENT=${GEMINI_PLACEMENT:-auto} h2h_call 230 gemini_fp16 --systems gemini \
              --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 3
          h2h_call 110 defaults --systems megatrain --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 3 ;;
  paper7c) export HOME=$PWD/.site/home; mkdir -p "$HOME"; model=qwen2.5-7b
          GEMINI_LIGER=${GEMINI_LIGER:-0} h2h_call 370 gemini --systems gemini --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 3
          h2h_call 200 fsdp --systems fsdp --clip 1.0 --tokens-per-step 16384 --warmup 2 --steps 3 ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
