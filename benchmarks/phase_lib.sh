# Sourced by benchmarks/run_3b.sh and run_14b.sh: one device command per phase, each system in its own
# benchmarks.h2h call under its own time limit (a slow or stuck system cannot take the others' results with it).
# Needs: model, phase, out set by the caller. Provides: h2h_call LIMIT TAG H2H-ARGS...
set -u
mkdir -p "$out"
source benchmarks/device_setup.sh
export TORCH_EXTENSIONS_DIR=$PWD/.site/ext  # DeepSpeed's JIT ops, built once per machine
work=$(mktemp -d)
log="$out/$phase.log"
trap 'rm -rf "$work"' EXIT

unplace() {  # the machine's paths out of what is kept: the scratch folder as $WORK, the output folder as $OUT
  sed -e "s#$work#\$WORK#g" -e "s#$out#\$OUT#g" -e "s#$PWD/#./#g"
}

h2h_call() {  # h2h_call <limit_s> <tag> <h2h args...>: OUTDIR/<phase>_<tag>.json is that call's results.json
  # A tag repeated in one command (an alternation: VARIANTS="a b b a") keeps every run: the second is
  # <phase>_<tag>_run2.json, and so on (2026-11-30: the repeats overwrote the first runs' JSON; the log kept them).
  local limit=$1 tag=$2 run=1 dir dest; shift 2
  dir="$work/$tag"; dest="$out/${phase}_$tag.json"
  while [ -e "$dest" ]; do run=$((run + 1)); dir="$work/${tag}_run$run"; dest="$out/${phase}_${tag}_run$run.json"; done
  echo "== $tag: h2h --model $model $* (limit ${limit}s)" | tee -a "$log"
  timeout --signal=INT --kill-after=20 "$limit" python3 -m benchmarks.h2h --model "$model" --out "$dir" "$@" \
    2>&1 | grep -v -e "is deprecated" -e "^\s*$" | tail -n 40 | unplace | tee -a "$log"
  # h2h rewrites results.json after every run, so a call cut off by its limit still leaves what it measured
  [ -f "$dir/results.json" ] && unplace < "$dir/results.json" > "$dest"
  return 0
}
