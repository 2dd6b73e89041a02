#!/usr/bin/env bash
# Adds to ./.wheels (beside ../shared/tools/gpu-wheels.sh's) what the lent GPU box needs for the Gemini peer
# (benchmarks/gemini_system.py): ColossalAI built from its sdist with BUILD_EXT=0 (a pure-Python wheel; its CPU Adam
# and CUDA kernels JIT-build on the box at first use) and the modules its import of Booster, GeminiPlugin and
# HybridAdam needs that the box lacks, for Python 3.12 x86_64. No dependency resolution: colossalai 0.5.0 (the
# newest release) declares torch>=2.2.0,<=2.5.1 and transformers==4.51.3, which the box (torch 2.11, transformers
# 5.x) does not meet; it is installed --no-deps as every carried wheel is (benchmarks/device_setup.sh).
# Checked on the 2-core machine (torch 2.13 cpu, transformers 5.17): the import succeeds with these; a step needs CUDA.
#
# Usage (from the project root):  bash ../shared/tools/gpu-wheels.sh && bash benchmarks/gemini_wheels.sh
set -euo pipefail
COLOSSALAI_VERSION=${COLOSSALAI_VERSION:-0.5.0}
mkdir -p .wheels
grep -qx '/.wheels/' .git/info/exclude 2>/dev/null || echo '/.wheels/' >> .git/info/exclude
BUILD_EXT=0 CUDA_EXT=0 python3 -m pip wheel -q --no-deps "colossalai==${COLOSSALAI_VERSION}" -w .wheels
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
python3 -m pip download -q --no-deps $plat -d .wheels \
  peft==0.21.2 galore-torch==1.0 bitsandbytes==0.50.2 rich==15.0.0 markdown-it-py==4.0.0 mdurl==0.1.2 pygments==2.20.0
ls -la .wheels
