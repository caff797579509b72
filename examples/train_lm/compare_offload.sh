#!/usr/bin/env bash
# What each offload option costs: runs train_lm's demo model for a few steps under each placement,
# round by round (so that the machine's load hits every placement alike), and prints for each the
# median step time, its median ratio to everything-on-the-device, and the bytes on each tier.
#   examples/train_lm/compare_offload.sh [BUILD_DIR] [ROUNDS] [extra train_lm args...]
set -euo pipefail
# shellcheck source=examples/train_lm/compare_common.sh
source "$(dirname "$0")/compare_common.sh"
compare_init offload "$@"
placements=(
  "none none"
  "cpu none"
  "nvme none"
  "nvme cpu"
  "nvme nvme"
)
common=(--steps 60 --eval-every 1000 --no-progress --quiet "${extra_args[@]}")
run_variant() {
  local opt param
  read -r opt param <<<"${placements[$1]}"
  "$bin" "${common[@]}" --offload-optimizer "$opt" --offload-param "$param" --out "$2" \
    --nvme-path "$work/nvme" >"$2.txt"
}
compare_rounds "${#placements[@]}"
# summary.txt rows: "total  <ms>", "optimizer step [(waited for)]  <ms>", tiers "device (HostDevice)  <bytes>".
python3 - "$work" "$rounds" "${#placements[@]}" "${placements[@]}" <<'PY'
import re, statistics, sys
work, rounds, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
names = sys.argv[4:4 + count]
def read(i, r):
    text = open(f"{work}/{i}.{r}/summary.txt").read()
    row = lambda label: re.search(r"^" + label + r"\s+(.*)$", text, re.M).group(1).strip()
    # Overlapped (the default) the row is "optimizer step (waited for)".
    step = row(r"optimizer step(?: \(waited for\))?")
    return {"total": float(row("total").split()[0]), "step": float(step.split()[0]),
            "device": row(re.escape("device (HostDevice)")),
            "host": row(re.escape("host (pinned pool, host tier)")),
            "nvme": row(re.escape("NVMe (swap files)"))}
runs = [[read(i, r) for r in range(1, rounds + 1)] for i in range(count)]
print(f"{'optimizer/param':16} {'ms/step':>8} {'x none':>7} {'step ms':>8}  {'device':>10} {'host':>10} {'nvme':>10}")
for i, name in enumerate(names):
    total = statistics.median(x["total"] for x in runs[i])
    ratio = statistics.median(runs[i][r]["total"] / runs[0][r]["total"] for r in range(rounds))
    step = statistics.median(x["step"] for x in runs[i])
    last = runs[i][-1]
    print(f"{name.replace(' ', '/'):16} {total:8.1f} {ratio:7.2f} {step:8.1f}  {last['device']:>10} {last['host']:>10} {last['nvme']:>10}")
PY
