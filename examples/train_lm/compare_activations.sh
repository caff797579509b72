#!/usr/bin/env bash
# What activation checkpointing costs and saves: runs train_lm round by round (so that the
# machine's load hits every variant alike) without checkpointing, with --checkpoint-activations
# alone, and with the checkpoints offloaded to pinned host memory and to NVMe, and prints for each
# the median step time (validation excluded), its median ratio to the run without checkpointing
# and to checkpointing alone, and the device's peak activation bytes (the engine's MemoryReport).
#   examples/train_lm/compare_activations.sh [BUILD_DIR] [ROUNDS] [extra train_lm args...]
set -euo pipefail
# shellcheck source=examples/train_lm/compare_common.sh
source "$(dirname "$0")/compare_common.sh"
compare_init activations "$@"
variants=(
  ""
  "--checkpoint-activations"
  "--checkpoint-activations --offload-activations cpu"
  "--checkpoint-activations --offload-activations nvme"
)
common=(--steps 8 --eval-every 1000 --eval-tokens 256 --no-progress "${extra_args[@]}")
run_variant() {
  # shellcheck disable=SC2086
  "$bin" "${common[@]}" ${variants[$1]} --out "$2" --nvme-path "$work/nvme" >"$2.txt"
}
compare_rounds "${#variants[@]}"
python3 - "$work" "$rounds" "${#variants[@]}" "${variants[@]}" <<'PY'
import re, statistics, sys
work, rounds, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
names = [n or "no checkpointing" for n in sys.argv[4:4 + count]]
def read(i, r):
    text = open(f"{work}/{i}.{r}/summary.txt").read()
    out = open(f"{work}/{i}.{r}.txt").read()
    row = lambda label: float(re.search(r"^" + re.escape(label) + r"\s+(\S+)", text, re.M).group(1))
    peak = int(re.search(r"activation_device_bytes_peak=(\d+)", out).group(1))
    return {"ms": row("total") - row("validation"), "peak": peak,
            "csv": [l.rsplit(",", 1)[0] for l in open(f"{work}/{i}.{r}/loss.csv")]}
runs = [[read(i, r) for r in range(1, rounds + 1)] for i in range(count)]
print(f"{'variant':52} {'ms/step':>8} {'x none':>7} {'x ckpt':>7} {'act peak':>12} {'fall':>6}  loss.csv")
for i, name in enumerate(names):
    ms = statistics.median(x["ms"] for x in runs[i])
    x0 = statistics.median(runs[i][r]["ms"] / runs[0][r]["ms"] for r in range(rounds))
    x1 = statistics.median(runs[i][r]["ms"] / runs[1][r]["ms"] for r in range(rounds))
    peak = runs[i][-1]["peak"]
    fall = 1 - peak / runs[0][-1]["peak"]
    same = "equal" if all(runs[i][r]["csv"] == runs[0][r]["csv"] for r in range(rounds)) else "DIFFERS"
    print(f"{name:52} {ms:8.1f} {x0:7.2f} {x1:7.2f} {peak:12d} {fall:6.1%}  {same}")
PY
