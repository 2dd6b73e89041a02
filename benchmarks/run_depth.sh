#!/usr/bin/env bash
# The depth figure (issue 48) on one H200 box: TFLOPS vs decoder layers at the Qwen2.5-1.5B width, 16K tokens/step,
# clip 1.0, bf16, liger for all, 2 warm-up + 3 measured steps; benchmarks/depth.py runs and records each point.
#
#   bash benchmarks/run_depth.sh a OUTDIR     megatrain_ds host-only and defaults, 28..180 layers (depth order)
#   bash benchmarks/run_depth.sh b OUTDIR     Gemini's row, then ZeRO-3 offload and FSDP2 (depth order)
#   bash benchmarks/run_depth.sh pre OUTDIR   ColossalAI's JIT kernels, built before b on the same warm machine (its
#                                             cache is per machine), so no Gemini point spends its cap compiling
#   python3 -m benchmarks.depth --plot OUT_A/depth_a OUT_B/depth_b --out DIR      (here: depth.png, depth.md)
#
# Each phase is one device `run` (carry .wheels: ../shared/tools/gpu-wheels.sh + benchmarks/gemini_wheels.sh) of at
# most DEADLINE seconds of runs (default 525; the setup takes ~20 s more). DEPTHS overrides the layer list, SYSTEMS
# the phase's systems.
set -u
phase=${1:?phase a|b}; out=${2:?outdir}
mkdir -p "$out"
source benchmarks/device_setup.sh
export TORCH_EXTENSIONS_DIR=$PWD/.site/ext  # DeepSpeed's and ColossalAI's JIT ops
free -g
depths=${DEPTHS:-28,56,84,120,180}
case $phase in
  pre) timeout 560 python3 -m benchmarks.gemini_system --prebuild 2>&1 | grep -v -i warn | tail -n 8 | tee "$out/pre.log"
       exit 0 ;;
  a) systems=${SYSTEMS:-megatrain-host,megatrain} ;;
  b) systems=${SYSTEMS:-gemini,zero3,fsdp} ;;  # Gemini first: an import error costs seconds, a JIT build at most the cap
  *) echo "unknown phase $phase"; exit 2 ;;
esac
python3 -m benchmarks.depth --systems "$systems" --depths "$depths" --order depth --deadline-s "${DEADLINE:-525}" \
  --run-cap-s "${RUN_CAP:-300}" \
  --out "$out/depth_$phase" 2>&1 | grep -v -e "is deprecated" -e "^\s*$" | tail -n 60 | tee "$out/depth_$phase.log"
sed -i -e "s#$PWD/#./#g" "$out/depth_$phase/depth.json"
