#!/usr/bin/env bash
# TRL 1.16's own scripts (trl/scripts/sft.py, grpo.py, unmodified) on one GPU of the lent box: real DeepSpeed ZeRO-3
# offload against MEGATRAIN_DS=1 with the same accelerate config and files (issue 38, item 5).
#
#   bash benchmarks/run_trl.sh PHASE OUTDIR       PHASE: sft | grpo | smoke
#
#   sft    Qwen2.5-3B shape (random init), 16 × 1024 tokens/step (no packing: every row is longer than 1024 and
#          truncated), --use_liger_kernel --bf16 --gradient_checkpointing, clip 1.0, 8 steps, then TRL's own final
#          save_model (a full ZeRO-3 checkpoint: stage3_gather_16bit_weights_on_model_save is false)
#   grpo   Qwen2.5-1.5B shape, 8 generations per prompt (transformers generate, no vLLM), 64-token completions,
#          reward benchmarks.trl_bench.length_reward, 8 steps (the median is over steps 3-8: the first two are
#          megatrain_ds's measuring steps, before its placement)
#   smoke  the tiny shape, both scripts, 3 steps (checks this script; DEVICE=cpu runs it on a CPU box)
#
# Needs the wheels of TRL=1 bash ../shared/tools/gpu-wheels.sh (carry .wheels). Each run:
# OUTDIR/<phase>_<system>.json (benchmarks.trl_bench timed: the Trainer's per-step records with their times, median
# step, train_runtime, the final save's seconds, peak host RSS) and OUTDIR/<phase>_<system>.log; OUTDIR/<phase>.md
# the table. Accelerate config: benchmarks/trl/accelerate_zero3.yaml -> benchmarks/trl/ds_zero3_offload.json (ZeRO-3,
# params and optimizer offloaded to pinned CPU memory, DeepSpeed's AdamW (DeepSpeedCPUAdam), WarmupLR, "auto"
# values filled by the Trainer from the script's arguments; zero3_init_flag true).
set -u
phase=${1:?phase}; out=${2:?outdir}
mkdir -p "$out"
if [ "${DEVICE:-cuda}" = cuda ]; then
  source benchmarks/device_setup.sh
  export TORCH_EXTENSIONS_DIR=$PWD/.site/ext
  # the switch's one line (setup.py writes it as megatrain_ds_switch.pth into site-packages when the package is
  # installed; here the repo is only on PYTHONPATH, where no .pth is read, so sitecustomize carries it). Without it
  # MEGATRAIN_DS=1 changes nothing: seen 2026-11-28, both "systems" were real DeepSpeed.
  echo "import os; os.environ.get('MEGATRAIN_DS') == '1' and __import__('compat.switch')" > .site/sitecustomize.py
  prec="--bf16 True --use_liger_kernel True"
else
  export PYTHONPATH=$PWD:${PYTHONPATH:-}; prec="--bf16 False --use_cpu True"
fi
python3 -c "import trl; print('trl', trl.__version__)"
work=${WORK_DIR:-$(mktemp -d)}
scripts=$(python3 -c "import trl, os; print(os.path.join(os.path.dirname(trl.__file__), 'scripts'))")
acc="accelerate launch --config_file benchmarks/trl/accelerate_zero3.yaml"
common="--logging_steps 1 --max_grad_norm 1.0 --learning_rate 1e-5 --save_strategy no --report_to none $prec"

one() {  # one SYSTEM TAG LIMIT SCRIPT ARGS...: one system's run of one TRL script
  local system=$1 tag=$2 limit=$3 script=$4; shift 4
  local env=""; [ "$system" = megatrain ] && env="MEGATRAIN_DS=1"
  rm -rf "$work/out"; df -h "$work" | tail -n 1
  echo "== $tag/$system: $env accelerate launch ... trl/scripts/$script $* (limit ${limit}s)"
  env $env timeout --signal=INT --kill-after=20 "$limit" python3 -m benchmarks.trl_bench timed --skip 2 \
      --json "$out/${tag}_$system.json" -- $acc "$scripts/$script" --output_dir "$work/out" "$@" \
      > "$out/${tag}_$system.log" 2>&1
  grep -e "^== rc" -e "Error" "$out/${tag}_$system.log" | tail -n 3
  if [ "$system" = megatrain ] && ! grep -q "the engine is megatrain_ds" "$out/${tag}_$system.log"; then
    echo "!! $tag/megatrain: the switch's line is not in the log: this run was NOT megatrain_ds"; fi
  du -sh "$work/out" 2>/dev/null
}

case $phase in
  sft)  python3 -m benchmarks.trl_bench prepare --shape qwen2.5-3b --out "$work" --rows 256 --seq 1024
        a="--model_name_or_path $work/model --dataset_name $work/sft --per_device_train_batch_size 16 --max_length 1024
           --max_steps 8 --gradient_checkpointing True $common"
        one megatrain sft 240 sft.py $a
        one deepspeed sft 330 sft.py $a ;;
  grpo) python3 -m benchmarks.trl_bench prepare --shape qwen2.5-1.5b --out "$work" --rows 256 --seq 64
        a="--model_name_or_path $work/model --dataset_name $work/grpo --reward_funcs benchmarks.trl_bench.length_reward
           --per_device_train_batch_size 8 --num_generations 8 --max_completion_length 64 --max_steps 8
           --gradient_checkpointing True $common"
        one megatrain grpo 240 grpo.py $a
        one deepspeed grpo 270 grpo.py $a ;;
  smoke) python3 -m benchmarks.trl_bench prepare --shape tiny --out "$work" --rows 64 --seq 128
        one megatrain sft 300 sft.py --model_name_or_path $work/model --dataset_name $work/sft \
            --per_device_train_batch_size 4 --max_length 128 --max_steps 3 $common
        one megatrain grpo 300 grpo.py --model_name_or_path $work/model --dataset_name $work/grpo \
            --reward_funcs benchmarks.trl_bench.length_reward --per_device_train_batch_size 4 --num_generations 4 \
            --max_completion_length 8 --max_steps 2 $common ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
python3 -m benchmarks.trl_bench table "$out" "$phase" | tee "$out/$phase.md"
