#!/usr/bin/env bash
# The NVMe tier on one GPU box, in one <= 10-minute device command:
#
#   bash benchmarks/run_nvme.sh [MODEL] [OUTDIR]       MODEL: qwen2.5-7b (default)
#
# 1. the disk: free space, and both I/O backends (benchmarks.nvme_io: threads over O_DIRECT, DeepSpeed's aio op);
# 2. megatrain-ds plan for the model, host-only (expected: does not fit a 128 GiB host) and with the NVMe tier;
# 3. h2h, megatrain only, fp32 masters (bf16 compute), all optimizer state on the host, the moments of as many
#    trailing layers on NVMe as the host budget needs (megatrain.nvme_layers "auto"): tokens/s and the breakdown
#    (CPU optimizer, NVMe read wait, bytes moved), peak host RSS against the plan.
# 4. the same run without the tier (HOST_ONLY=1): does the host state fit in RAM, and what did plan.py say.
# Env: NVME_DIR [./.nvme_swap on the repo's disk], TOKENS [16384], SEQ [1024], STEPS [3], WARMUP [1],
#      BACKEND [auto], BUFFERS [4], BUDGET [auto] (megatrain.host_memory_budget, GiB), LIMIT [300], LIMIT_HOST [240]
set -u
model=${1:-qwen2.5-7b}; out=${2:-${OUT:?give OUTDIR or set OUT}}
phase=nvme_$model
source benchmarks/phase_lib.sh
nvme_dir=${NVME_DIR:-$PWD/.nvme_swap}
mkdir -p "$nvme_dir"
{ free -g; df -h "$nvme_dir" /tmp; nproc; } 2>&1 | tee -a "$log"
python3 -m benchmarks.nvme_io --path "$nvme_dir" --region-gib 1.75 --regions 3 --out "$out/nvme_io.json" 2>&1 \
  | grep nvme_io | tee -a "$log"
tokens=${TOKENS:-16384}; seq=${SEQ:-1024}
ds_nvme="{\"zero_optimization\": {\"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"$nvme_dir\",
  \"buffer_count\": ${BUFFERS:-4}, \"pipeline_read\": true, \"pipeline_write\": true}},
  \"aio\": {\"block_size\": 1048576, \"queue_depth\": 8, \"intra_op_parallelism\": 1}}"
base="{\"train_micro_batch_size_per_gpu\": $((tokens / seq)), \"bf16\": {\"enabled\": true},
  \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-4}}, \"megatrain\": {\"gpu_optimizer_layers\": 0}}"
echo "$base" > "$work/host_only.json"
python3 - "$work/host_only.json" "$ds_nvme" "$work/nvme.json" <<'EOF'
import json, sys
cfg = json.load(open(sys.argv[1])); extra = json.loads(sys.argv[2])
cfg["zero_optimization"] = extra["zero_optimization"]; cfg["aio"] = extra["aio"]
json.dump(cfg, open(sys.argv[3], "w"))
EOF
for which in host_only nvme; do
  echo "== plan ($which)" | tee -a "$log"
  python3 -m megatrain_ds.cli plan "$model" --config "$work/$which.json" --seq "$seq" ${BUDGET:+--host-budget $BUDGET} --json \
    > "$out/plan_${model}_$which.json" 2>>"$log"
  python3 -m megatrain_ds.cli plan "$model" --config "$work/$which.json" --seq "$seq" ${BUDGET:+--host-budget $BUDGET} 2>&1 | tail -n 25 | tee -a "$log"
done
h2h_call "${LIMIT:-300}" train --systems megatrain --tokens-per-step "$tokens" --seq "$seq" \
  --steps "${STEPS:-3}" --warmup "${WARMUP:-1}" --host-only --closing-step tiny \
  --megatrain-options "{\"nvme_backend\": \"${BACKEND:-auto}\", \"host_memory_budget\": ${BUDGET:-\"auto\"}}" \
  --ds-config "$ds_nvme"
if [ "${HOST_ONLY:-1}" = 1 ]; then  # the same run without the tier (the harness's own guard lifted: the engine's
  h2h_call "${LIMIT_HOST:-240}" host_only --systems megatrain --tokens-per-step "$tokens" --seq "$seq" \
    --steps "${STEPS:-3}" --warmup "${WARMUP:-1}" --host-only --closing-step tiny --host-mem-gib 1000
fi  # check, plan.py, refuses up front when the state cannot fit)
for f in "$out/${phase}_train.json" "$out/${phase}_host_only.json"; do [ -f "$f" ] || continue
python3 - "$f" <<'EOF' 2>&1 | tee -a "$log"
import json, sys
try:
    runs = json.load(open(sys.argv[1]))["results"]
except OSError as exc:
    sys.exit(f"no result: {exc}")
for r in runs:
    s, b = r.get("settings") or {}, r.get("breakdown") or {}
    line = f"{r.get('model')} {r.get('layers')} layers, {r.get('tokens_per_step')} tokens/step: {r.get('status')}"
    if r.get("status") == "ok":
        line += (f", {r['tokens_per_s']:,.0f} tokens/s, {r['tflops']:.1f} TFLOPS, step {r['median_step_s']:.2f} s,"
                 f" peak GPU {r['peak_gpu_bytes'] / 2**30:.1f} GiB, peak host RSS {r['peak_host_rss_bytes'] / 2**30:.1f}"
                 f" GiB, engine host state {r.get('engine_host_state_bytes', 0) / 2**30:.1f} GiB")
        line += " | breakdown: " + ", ".join(f"{k} {v:.3f}" for k, v in b.items() if k.endswith("_s"))
    else:
        line += f" ({str(r.get('error', ''))[-400:]})"
    print(line)
    print("nvme:", json.dumps(s.get("nvme")))
EOF
done
rm -rf "$nvme_dir"
