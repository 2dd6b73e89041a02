#!/usr/bin/env bash
# Long context on one GPU: ONE sequence of 512K tokens per step (micro batch 1), megatrain_ds only, warm-up 0 +
# 1 measured step, in one <= 10-minute device command:
#
#   bash benchmarks/run_long_context.sh [MODEL] [OUTDIR]      MODEL: qwen2.5-3b (default), qwen2.5-7b, ...
#
# Env (defaults in brackets):
#   SEQ [524288]      tokens in the sequence (= tokens per step)
#   TILED [auto]      megatrain.tiled_mlp: auto | true | false | rows per chunk (auto tiles at this length)
#   OFFLOAD [model]   megatrain.offload_activations: false for qwen2.5-3b and smaller (36 x 2 GiB of saved layer
#                     inputs fit beside the step on a 141 GB H200, and the 1-GPU box's 128 GiB of host memory
#                     could not hold them with the host state), true for larger shapes (7B: 28 x 3.5 GiB, pinned
#                     in host memory: run it on a box with >= 256 GiB of host memory)
#   LIGER [auto]      h2h --liger (auto: on with CUDA and liger-kernel)
#   CLIP [1.0]        gradient_clipping
#   LIMIT [585]       seconds the h2h call may take (the run is cut off there and recorded as interrupted)
#   DEVICE [cuda]     cpu: a smoke test of this script (e.g. SEQ=256 TILED=64 ... tiny OUTDIR)
#   PYTORCH_CUDA_ALLOC_CONF [expandable_segments:True]  (many 2-4 GiB tensors come and go per layer)
# Results: OUTDIR/longctx_<model>_s<SEQ>.json (h2h's results.json: peak_gpu_bytes = the training step's peak,
# model TFLOPS by benchmarks/shapes.py), OUTDIR/longctx_<model>.log, and one summary line (also in the log).
set -u
model=${1:-qwen2.5-3b}; out=${2:-${OUT:?give OUTDIR or set OUT}}
phase=longctx_$model
seq=${SEQ:-524288}
case $model in
  tiny|qwen2.5-1.5b|qwen2.5-3b) offload=${OFFLOAD:-false} ;;
  *) offload=${OFFLOAD:-true} ;;
esac
tiled=${TILED:-auto}
[ "$tiled" = auto ] && tiled='"auto"'
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
source benchmarks/phase_lib.sh
free -g | tee -a "$log"

options="{\"offload_activations\": $offload, \"tiled_mlp\": $tiled}"
tag=s$seq
h2h_call "${LIMIT:-585}" "$tag" --systems megatrain --seq "$seq" --tokens-per-step "$seq" --warmup 0 --steps 1 \
  --closing-step tiny --liger "${LIGER:-auto}" --clip "${CLIP:-1.0}" --megatrain-options "$options" \
  --device "${DEVICE:-cuda}"

python3 - "$out/${phase}_$tag.json" <<'EOF' 2>&1 | tee -a "$log"
import json, sys
try:
    with open(sys.argv[1]) as f:
        runs = json.load(f)["results"]
except OSError as exc:
    sys.exit(f"no result: {exc}")
for r in runs:
    s = r.get("settings") or {}
    line = f"{r.get('model')} seq {r.get('seq')} x {r.get('micro_batch')}: {r.get('status')}"
    if r.get("status") == "ok":
        line += (f", step {r['median_step_s']:.1f} s, {r['tokens_per_s']:,.0f} tokens/s, {r['tflops']:.1f} model TFLOPS"
                 f" (6N + 6Lhs, causal), peak GPU {r['peak_gpu_bytes'] / 2**30:.1f} GiB allocated"
                 f" / {r.get('peak_gpu_reserved_bytes', 0) / 2**30:.1f} GiB reserved, host RSS"
                 f" {r['peak_host_rss_bytes'] / 2**30:.1f} GiB, loss {r['losses'][0]:.3f}")
    else:
        line += f" ({str(r.get('error', ''))[-300:]})"
    em = s.get("engine_megatrain") or {}
    line += (f" | tiled_mlp={em.get('tiled_mlp')} ({len(s.get('tiled_modules') or [])} template modules),"
             f" offload_activations={em.get('offload_activations')}, kernels={s.get('kernels')}")
    print(line)
EOF
