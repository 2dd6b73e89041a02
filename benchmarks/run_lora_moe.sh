#!/usr/bin/env bash
# LoRA at 72B and a mixture-of-experts model (issue 15), megatrain_ds vs DeepSpeed ZeRO-3 CPU offload, on a box with
# 256 GiB of host memory and one H200 (the lent nvidia-h200-x2, one of its GPUs used). Each phase is one <= 10-minute
# device command (carry .wheels); every system is its own h2h call under its own time limit (benchmarks/phase_lib.sh).
#
#   bash benchmarks/run_lora_moe.sh PHASE OUTDIR      PHASE: smoke | 72b | 72b-zero3 | moe | moe-megatrain | moe-zero3
#
#   smoke      tiny shapes on CUDA, 1 + 2 steps: LoRA r4 (megatrain, ZeRO-3) and tiny-moe full fine-tuning (both):
#              the bf16 LoRA and MoE paths of both systems before the big phases. Estimate: ~2 min (ZeRO-3's
#              cpu_adam JIT build ~1 min, cached in .site/ext for the later phases of the same machine).
#              DEVICE=cpu runs it on a CPU box (gloo) to check this script.
#   72b        Qwen2.5-72B shape, LoRA r16 (alpha 32, q,k,v,o,gate,up,down), megatrain, seq 1024, 16K tokens/step,
#              1 warm-up + 3 measured steps (+1 to close the breakdown). Estimate, not measured: fast init ~20 s,
#              engine initialize ~1.5 min (140 GB of bf16 base into host memory; the VM grants memory at ~2.7 GB/s),
#              steps ~12 s each (compute-bound: ~7e15 FLOP incl. recompute per step; weights streamed twice,
#              290 GB at ~50 GB/s = 6 s, overlapped) -> ~3.5 min; limit 480 s.
#   72b-zero3  the same with DeepSpeed ZeRO-3 (zero.Init in bf16: the base partitioned into pinned host memory as
#              it is constructed, ~162 GB with the caching host allocator's power-of-two rounding). Estimate, not
#              measured: build ~2-3 min, steps 20-40 s each -> 4-6 min; limit 530 s. It may not finish or not fit:
#              the harness records "oom", "killed (host OOM)" (with the peak RSS it saw and the phase reached), or
#              what it measured before the limit.
#   moe        olmoe-1b-7b (6.9 B parameters, 1.3 B active; router aux loss in the loss), full fine-tuning with
#              fp32 masters, 16K tokens/step, 1 + 3 steps, --liger off (megatrain_ds runs an MoE model's own loss,
#              full logits, so both systems get the model's own kernels and loss): megatrain then ZeRO-3.
#              Estimate, not measured: megatrain ~2.5 min (111 GB of host state), ZeRO-3 ~4 min (~187 GB host);
#              limits 200 + 320 s (worst case with each call's 20 s kill grace and the wheel install: ~590 s of a
#              600 s device command; moe-megatrain / moe-zero3 run one system each, limits 300 / 530 s).
#
# CLIP=1.0|1e9 (default 1.0, ANCHORS), TOKENS (default 16384), HOST_MEM_GIB=G (default 240: the x2 VM's
# MemAvailable reads ~31 GiB at start and grows as memory is used, its limit is 256 GiB from the start;
# HOST_MEM_GIB=0 uses MemAvailable). Results: OUTDIR/<phase>_<tag>.json (h2h results.json: per system tokens/s,
# TFLOPS by the LoRA / MoE formulas of benchmarks/shapes.py, trainable and base params, host bytes per base param,
# build and initialize seconds, phases with host RSS), OUTDIR/<phase>.log, OUTDIR/<phase>_report.md.
set -u
phase=${1:?phase}; out=${2:?outdir}; model=qwen2.5-72b
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}  # one GPU of the box
source benchmarks/phase_lib.sh
clip=${CLIP:-1.0}; c=clip$clip; tokens=${TOKENS:-16384}
mem=${HOST_MEM_GIB:-240}; [ "$mem" = 0 ] && mem=
common="--clip $clip --seq 1024 --tokens-per-step $tokens --warmup 1 --steps 3 ${mem:+--host-mem-gib $mem}"
echo "== bash benchmarks/run_lora_moe.sh $phase OUTDIR (CLIP=$clip TOKENS=$tokens HOST_MEM_GIB=${mem:-MemAvailable})" \
  | tee -a "$log"
free -g | tee -a "$log"

case $phase in
  smoke) model=tiny
       dev="--device ${DEVICE:-cuda}"
       h2h_call 150 lora_tiny --systems megatrain,zero3 --lora 4 --seq 256 --tokens-per-step 1024 --warmup 1 \
           --steps 2 $dev
       model=tiny-moe
       h2h_call 120 moe_tiny --systems megatrain,zero3 --liger off --seq 256 --tokens-per-step 1024 --warmup 1 \
           --steps 2 $dev ;;
  72b) h2h_call 480 megatrain_lora16_$c --systems megatrain --lora 16 $common ;;
  72b-zero3) h2h_call 530 zero3_lora16_$c --systems zero3 --lora 16 $common ;;
  moe) model=olmoe-1b-7b
       h2h_call 200 megatrain_$c --systems megatrain --liger off $common
       h2h_call 320 zero3_$c --systems zero3 --liger off $common ;;
  moe-megatrain) model=olmoe-1b-7b; h2h_call 300 megatrain_$c --systems megatrain --liger off $common ;;
  moe-zero3) model=olmoe-1b-7b; h2h_call 530 zero3_$c --systems zero3 --liger off $common ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
python3 -m benchmarks.report "$out" > "$out/${phase}_report.md" 2>&1
head -n 40 "$out/${phase}_report.md" | tee -a "$log"
