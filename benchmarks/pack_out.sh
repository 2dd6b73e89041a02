#!/usr/bin/env bash
# The last step of a device command whose results may be more than the device returns (at most 8 files, at most 2
# folders down: the device notes): every file under OUTDIR into OUTDIR/results.tgz (its paths as they were), the
# originals removed, so nothing measured is left on the machine. The phases print their tables to stdout as before.
# 2026-11-30: the skip A/B's JSON and three per-run files stayed there (call 1: 17 files).
#
#   bash benchmarks/pack_out.sh OUTDIR        # OUTDIR/results.tgz; here: tar xzf results.tgz
set -u
out=${1:?outdir}
cd "$out" || exit 2
files=$(find . -type f ! -name results.tgz | sort)
[ -z "$files" ] && { echo "pack_out: nothing under $out"; exit 0; }
n=$(printf '%s\n' "$files" | wc -l)
# shellcheck disable=SC2086  # the file names are the harness's own (no spaces)
tar czf results.tgz $files && rm -f $files && find . -mindepth 1 -type d -empty -delete
echo "pack_out: $n files into results.tgz ($(du -h results.tgz | cut -f1))"
