#!/usr/bin/env bash
# Debian's packages the system tests (tests/system) start as real services: ssh + pdsh for DeepSpeed's multi-node
# runner, munge + slurm for srun, util-linux/e2fsprogs for the loop-mounted filesystems. Idempotent.
set -euo pipefail
pkgs=(openssh-server openssh-client pdsh munge slurm-wlm e2fsprogs util-linux procps)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
