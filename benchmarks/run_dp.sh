#!/usr/bin/env bash
# Data parallel over the GPUs of one box (issue 14), on the lent nvidia-h200-x2: every system with N ranks
# (benchmarks.h2h --gpus N; torchrun, one process per GPU, each rank on its own 16K-token micro-batch).
#
#   bash benchmarks/run_dp.sh PHASE OUTDIR      PHASE: 3b | 7b | scale | 14b | 14b1 | nodes | smoke
#
#   3b     Qwen2.5-3B, 16K tokens per rank: megatrain --host-only on 1 GPU and N (--scaling), ZeRO-3 ×N,
#          megatrain (engine defaults) on 1 GPU and N (--scaling), whole-on-GPU ×N (DDP)     (~6 min; limits 560 s)
#   7b     Qwen2.5-7B, 16K tokens per rank: megatrain (defaults) on 1 GPU and N (--scaling), ZeRO-3 ×N,
#          megatrain --host-only ×N                                                          (~7 min; limits 550 s)
#          The whole-on-GPU run is not in it (device time; prediction, not measured: 16 B/param of fp32 weights,
#          gradients and Adam moments × 7.6 B = 122 GB before activations, on a 141 GB GPU); to try it:
#          h2h --model qwen2.5-7b --systems resident --gpus 2 --resident-mode auto (DDP, else 1 GPU × 2 as a bound)
#   14b    issue 40: Qwen2.5-14B, fp32 masters, 16K tokens per rank, clip 1.0, megatrain (defaults) on N GPUs: the
#          resident parameters' state held once per host (embedding on rank 0, head on rank 1) and gradient_hold
#          "auto" (the plan: ~181 GiB for 2 ranks, was 232 GiB, refused). The 14B models are built with
#          --init fast (h2h's default from 14 B parameters: one layer held until the engine copies it)   (~8 min)
#   14b1   the same on one GPU (the scaling ratio, in the same lease: run it right after 14b)            (~5 min)
#   nodes  issue 40: two "nodes" on this box (h2h --nodes 2: torchrun --nnodes 2 over 127.0.0.1, one GPU each,
#          NCCL between them through its socket transport, as between hosts without InfiniBand), Qwen2.5-3B, 16K
#          tokens per rank: megatrain on one node of 2 GPUs (the reference), on 2 nodes with host_sharding "node"
#          (a copy of the host state per node: host RSS about twice), and "job" (one copy over both)      (~6 min)
#   smoke  the tiny shape on CUDA, every system ×N, 1 + 2 steps: checks the NCCL paths before the long phases
#          (~2 min with ZeRO-3's cpu_adam build; optional; DEVICE=cpu runs it on a CPU box, gloo, to check this script)
#
# GPUS=N (default 2), CLIP=1.0|1e9 (default 1e9: clipping never fires, as the fair16k/fair7b phases),
# HOST_MEM_GIB=G (default 240): the host memory h2h checks each system's need against. The x2 VM's MemAvailable
# reads ~31 GiB when it starts and grows as memory is used (.library/device/KINDS.md), while its limit is 256 GiB
# from the start; HOST_MEM_GIB=0 uses MemAvailable.
# Each system is its own h2h call under its own limit (benchmarks/phase_lib.sh): OUTDIR/<phase>_<tag>.json is that
# call's results.json (per system: tokens/s summed over ranks, TFLOPS per GPU, host RSS summed, rank 0's
# breakdown, every rank's numbers under per_rank, the torchrun command under launch), OUTDIR/<phase>.log the
# commands and output, OUTDIR/<phase>_report.md the tables of all of them (benchmarks.report) with the
# N-GPU / 1-GPU scaling of megatrain and its ratio to ZeRO-3 ×N.
set -u
phase=${1:?phase}; out=${2:?outdir}; model=qwen2.5-3b
gpus=${GPUS:-2}; clip=${CLIP:-1e9}; c=clip$clip
source benchmarks/phase_lib.sh
mem=${HOST_MEM_GIB:-240}; [ "$mem" = 0 ] && mem=
echo "== bash benchmarks/run_dp.sh $phase OUTDIR (GPUS=$gpus CLIP=$clip HOST_MEM_GIB=${mem:-MemAvailable})" | tee -a "$log"
free -g | tee -a "$log"
have=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
echo "GPUs visible: $have" | tee -a "$log"
if [ "${DEVICE:-cuda}" = cuda ] && [ "$have" -lt "$gpus" ]; then echo "needs $gpus GPUs, $have visible (CUDA_VISIBLE_DEVICES?)" | tee -a "$log"; exit 3; fi
dp="--gpus $gpus --clip $clip --warmup 2 --steps 3 ${mem:+--host-mem-gib $mem}"

case $phase in
  3b)  # ZeRO-3 ×2 builds in ~1.5 min (one rank: 87 s to its first step on the H200); megatrain ~30-40 s a run
       h2h_call 140 hostonly_$c --systems megatrain --host-only --scaling --tokens-per-step 16384 $dp
       h2h_call 230 zero3_$c --systems zero3 --tokens-per-step 16384 $dp
       h2h_call 120 megatrain_$c --systems megatrain --scaling --tokens-per-step 16384 $dp
       h2h_call 70 resident_$c --systems resident --resident-mode ddp --tokens-per-step 16384 $dp ;;
  7b)  model=qwen2.5-7b  # ZeRO-3 one rank: 2:15 to its first step, 191 GB host (fair7b); megatrain ~45 s a run
       h2h_call 150 megatrain_$c --systems megatrain --scaling --tokens-per-step 16384 $dp
       h2h_call 300 zero3_$c --systems zero3 --tokens-per-step 16384 $dp
       h2h_call 100 hostonly_$c --systems megatrain --host-only --tokens-per-step 16384 $dp ;;
  scale) # issue 39 (the 4-GPU box, GPUS=4): megatrain_ds's scaling alone, host-only and defaults (1 GPU, then N)
       h2h_call 150 hostonly_$c --systems megatrain --host-only --scaling --tokens-per-step 16384 $dp
       h2h_call 130 megatrain_$c --systems megatrain --scaling --tokens-per-step 16384 $dp ;;
  14b) model=qwen2.5-14b  # one rank of 14B: ~4 min to its first step (fast init, 180 GiB of host state to fill)
       h2h_call 560 megatrain_clip1.0 --systems megatrain --tokens-per-step 16384 --gpus $gpus --clip 1.0 \
           --warmup 2 --steps 3 ${mem:+--host-mem-gib $mem} ;;
  14b1) model=qwen2.5-14b
       h2h_call 330 megatrain_g1_clip1.0 --systems megatrain --tokens-per-step 16384 --gpus 1 --clip 1.0 \
           --warmup 2 --steps 3 ${mem:+--host-mem-gib $mem} ;;
  nodes) node="--gpus 2 --clip $clip --warmup 2 --steps 3 ${mem:+--host-mem-gib $mem}"
       h2h_call 150 one_node_$c --systems megatrain --tokens-per-step 16384 $node
       h2h_call 170 nodes_node_$c --systems megatrain --tokens-per-step 16384 --nodes 2 $node
       h2h_call 170 nodes_job_$c --systems megatrain --tokens-per-step 16384 --nodes 2 $node \
           --megatrain-options '{"host_sharding": "job"}' ;;
  smoke) model=tiny
       h2h_call 240 smoke --systems megatrain,zero3,resident --scaling --seq 256 --tokens-per-step 1024 \
           --gpus $gpus --warmup 1 --steps 2 --device ${DEVICE:-cuda} ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
python3 -m benchmarks.report "$out" > "$out/${phase}_report.md" 2>&1
cat "$out/${phase}_report.md" | head -n 30 | tee -a "$log"
