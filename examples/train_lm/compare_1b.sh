#!/usr/bin/env bash
# train_lm at 1B parameters (docs/DEMO.md's command, optimizer state on NVMe) in interleaved
# rounds, for figures that compare two builds or the two step schedules: each round runs every
# variant once, the order reversed in even rounds, and the `--step-times` lines of steps 2-4,
# peak RSS and the load are kept; then compare_1b.py prints per-round ratios and their medians.
#   examples/train_lm/compare_1b.sh OUT_FILE VARIANT... 
# A variant is NAME=BINARY[:train_lm flags, comma-separated], for example
#   old=/tmp/before/build/bin/train_lm
#   off=build/bin/train_lm:--overlap-step,off
#   on=build/bin/train_lm:--overlap-step,on
# ROUNDS (default 3), STEPS (default 4; the last step also runs the final validation, which the
# figures leave out), DIR (default /tmp/zinf-1b: 11.2 GiB of NVMe state a run; deleted after
# each run), ROUND_CMD (a command run at the start of each round, before its variants, with
# ROUND=N in its environment, its output appended to OUT_FILE after a line "round N command";
# for example `zinf plan --step-only --measure --json`, the machine's rates in that round). Run
# it under the big-run lock when others share the machine.
set -euo pipefail
out=${1:?usage: compare_1b.sh OUT_FILE NAME=BINARY[:flags] ...}
shift
[ $# -ge 1 ] || { echo "compare_1b.sh: give at least one variant NAME=BINARY[:flags]" >&2; exit 2; }
variants=("$@")
dir=${DIR:-/tmp/zinf-1b}
: >"$out"
for ((round = 1; round <= ${ROUNDS:-3}; round++)); do
  order=("${variants[@]}")
  if [ $((round % 2)) -eq 0 ]; then
    mapfile -t order < <(printf '%s\n' "${variants[@]}" | tac)
  fi
  if [ -n "${ROUND_CMD:-}" ]; then
    echo "round $round command $(date +%T): $ROUND_CMD" >>"$out"
    ROUND=$round bash -c "$ROUND_CMD" >>"$out" 2>&1
  fi
  for variant in "${order[@]}"; do
    name=${variant%%=*}
    spec=${variant#*=}
    bin=${spec%%:*}
    flags=()
    [ "$spec" != "$bin" ] && IFS=, read -r -a flags <<<"${spec#*:}"
    rm -rf "$dir"
    mkdir -p "$dir"
    echo "round $round $name load $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T) $bin ${flags[*]}" >>"$out"
    /usr/bin/time -f "wall %e s maxrss %M kB" "$bin" --params 1B --steps "${STEPS:-4}" --batch 1 \
      --seq-len 16 --eval-every 100000 --eval-tokens 64 --out "$dir/out" --nvme-path "$dir/nvme" \
      --step-times --no-progress "${flags[@]}" 2>&1 | grep -E "^step [0-9]+:|^wall|^final_" >>"$out"
  done
done
rm -rf "$dir"
python3 "$(dirname "$0")/compare_1b.py" "$out"
