#!/usr/bin/env bash
# The depth figure (issue 48) on one H200 box: TFLOPS vs decoder layers at the Qwen2.5-1.5B width, 16K tokens/step,
# clip 1.0, bf16, liger for all, 2 warm-up + 3 measured steps; benchmarks/depth.py runs and records each point.
#
#   bash benchmarks/run_depth.sh a OUTDIR     megatrain_ds host-only and defaults, 28..180 layers (depth order)
#   bash benchmarks/run_depth.sh b OUTDIR     Gemini's row, then ZeRO-3 offload and FSDP2 (depth order)
#   bash benchmarks/run_depth.sh pre OUTDIR   ColossalAI's JIT kernels and DeepSpeed's CPU Adam, built before b on the
#                                             same warm machine (their caches are per machine), so no Gemini or
#                                             ZeRO-3 point spends its cap compiling
#   bash benchmarks/run_depth.sh gprobe OUTDIR   the kernels, then Gemini at 14 layers with pageable host chunks
#                                             (GEMINI_PIN=0) and pinned, each boost under cProfile (OUTDIR/boost_*.txt):
#                                             where its build and boost (161 s at 1.5B, over 7 min at 7B) go
#   bash benchmarks/run_depth.sh lease1|lease2|lease3 OUTDIR   the whole figure (megatrain_ds defaults and the three
#                                             peers) in three calls of one lease: below, at the phases
#   SYSTEMS=gemini-fp16 bash benchmarks/run_depth.sh b OUTDIR   Gemini fp16: HybridAdam's compiled host kernel (its
#                                             bf16 path is unfused: gemini_system.py), labelled as not the others' dtype
#   python3 -m benchmarks.depth --plot OUT_A/depth_a OUT_B/depth_b --out DIR      (here: depth.png, depth.md)
#
# The paper's own width on the 4-GPU box (512 GiB host; `megatrain-ds plan qwen2.5-7b --layers 165 --host-budget 480`
# fits, 180 layers does not without the NVMe tier): MODEL=qwen2.5-7b DEPTHS=28,56,84,120,165, one call per system
# and a few depths (SYSTEMS=megatrain DEPTHS=28,56,84 ..., then the rest).
# Each phase is one device `run` (carry .wheels: ../shared/tools/gpu-wheels.sh + benchmarks/gemini_wheels.sh) of at
# most DEADLINE seconds of runs (default 525; the setup takes ~20 s more). DEPTHS overrides the layer list, SYSTEMS
# the phase's systems, WARMUP the warm-up steps of every run (default 3 since 2026-11-30, for every system:
# megatrain_ds's recompute check compares, and so does not skip down_proj in, the first 3 steps; earlier leases 2).
set -u
phase=${1:?phase a|b}; out=${2:?outdir}
mkdir -p "$out"
source benchmarks/device_setup.sh
export TORCH_EXTENSIONS_DIR=$PWD/.site/ext  # DeepSpeed's JIT ops
export HOME=$PWD/.site/home; mkdir -p "$HOME"  # ColossalAI's (~/.cache/colossalai), kept as .site is on a warm machine
# Gemini without liger unless asked (GEMINI_LIGER=1 fails in RMSNorm's backward: gemini_system.py); a b phase
# that left it to gemini_system's default of 1 lost its first point to that error (2026-11-29)
export GEMINI_LIGER=${GEMINI_LIGER:-0}
free -g
depths=${DEPTHS:-28,56,84,120,180}
prebuild() {  # DeepSpeed's CPU Adam beside ColossalAI's kernels (2026-11-29: ZeRO-3's first point initialized in
  # 68 s, the next depth's in 24 s: the first built the op)
  timeout 560 python3 -m tests.ops_prebuild > "$out/pre_deepspeed.log" 2>&1 &
  timeout 560 python3 -m benchmarks.gemini_system --prebuild 2>&1 | grep -v -i warn | tail -n 8 | tee "$out/pre.log"
  wait; grep "ops_prebuild" "$out/pre_deepspeed.log"
}
unplace() {  # the machine's paths out of what is kept: the device's output folder as $OUT, the checkout as ./
  sed -e "s#${OUT:-/nonexistent}/#\$OUT/#g" -e "s#$PWD/#./#g"
}
sweep() {  # sweep SYSTEMS DEPTHS DEADLINE NAME: benchmarks.depth into OUTDIR/NAME (+ NAME.log)
  python3 -m benchmarks.depth --model "${MODEL:-qwen2.5-1.5b}" --systems "$1" --depths "$2" --order depth \
    --deadline-s "$3" --run-cap-s "${RUN_CAP:-300}" --warmup "${WARMUP:-3}" --out "$out/$4" 2>&1 \
    | grep -v -e "is deprecated" -e "^\s*$" | tail -n 60 | unplace | tee "$out/$4.log"
  unplace < "$out/$4/depth.json" > "$out/$4/depth.json.tmp" && mv "$out/$4/depth.json.tmp" "$out/$4/depth.json"
}
case $phase in
  pre) prebuild; exit 0 ;;
  gprobe) timeout 300 python3 -m benchmarks.gemini_system --prebuild 2>&1 | grep -v -i warn | tail -n 4 | tee "$out/pre.log"
       for pin in ${PINS:-0 1}; do  # PINS: which of pageable (0), pinned (1)
         GEMINI_PIN=$pin GEMINI_PROFILE=30 GEMINI_PROFILE_OUT=$out/boost_pin$pin.txt \
           python3 -m benchmarks.depth --systems gemini --depths "${DEPTHS:-14}" --deadline-s "${DEADLINE:-200}" \
           --run-cap-s "${RUN_CAP:-200}" --out "$out/gprobe_pin$pin" 2>&1 | grep -v -e "is deprecated" -e "^\s*$" \
           | tail -n 20 | tee "$out/gprobe_pin$pin.log"
         sed -i -e "s#$PWD/#./#g" "$out/gprobe_pin$pin/depth.json"
       done
       exit 0 ;;
  a) sweep "${SYSTEMS:-megatrain-host,megatrain}" "$depths" "${DEADLINE:-525}" depth_a ;;
  b) sweep "${SYSTEMS:-gemini,zero3,fsdp}" "$depths" "${DEADLINE:-525}" depth_b ;;  # Gemini first: an
     # import error costs seconds, a JIT build at most the cap
  # The one-lease figure in three calls back to back on one warm machine (2026-11-30), megatrain_ds
  # defaults with the peers (no host-only line: it is not a peer, and its ~200 s went to the peers'
  # 120-layer points). Each call fits one 600 s `run` by the 2026-11-29 lease's walls (each run ~19 s
  # more than its process_wall_s); depth.py leaves a run its system's last wall says will not finish.
  lease1) prebuild  # ~105 s; then a megatrain_ds point on the fresh machine (the engine's check and,
       # beside call 3's, a fresh machine's first minutes), then Gemini 28..120 (~370 s)
       sweep megatrain 28 110 check
       sweep gemini 28,56,84,120 "${DEADLINE:-400}" depth_gemini ;;
  lease2) sweep zero3,fsdp 28,56,84,120 "${DEADLINE:-555}" depth_peers ;;  # ~450 s to 84 layers
  lease3) sweep megatrain 28,56,84,120,180 "${DEADLINE:-300}" depth_megatrain  # ~265 s
       [ -n "${AFTER:-}" ] && sweep "${AFTER%%:*}" "${AFTER#*:}" "${AFTER_DEADLINE:-150}" depth_after ;;
       # AFTER=fsdp:120: the points call 2 left, in what is left of the call
  *) echo "unknown phase $phase"; exit 2 ;;
esac
