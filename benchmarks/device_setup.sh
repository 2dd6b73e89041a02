#!/usr/bin/env bash
# Source at the start of a device `run` (carry .wheels): installs the wheels the GPU box lacks
# (DeepSpeed, liger-kernel; built here by ../shared/tools/gpu-wheels.sh) and puts the repo on PYTHONPATH.
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .wheels/*.whl >/dev/null 2>&1 \
  || echo "wheel install failed"
export PYTHONPATH=$PWD/.site:$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cpus', __import__('os').cpu_count())"
