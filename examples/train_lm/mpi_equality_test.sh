#!/usr/bin/env bash
# train_lm as a job of one process per rank against the same world size as threads: the loss
# columns of loss.csv (step, train_loss, val_loss; tokens_per_s is a timing) must be the same text
# in every row. ZeRO-3, bf16 parameters, AdamW state on NVMe (one swap directory per rank), 60
# steps.
#   mpi_equality_test.sh TRAIN_LM MPIRUN WORLD WORK_DIR [extra train_lm args...]
set -euo pipefail
bin=$1
mpirun=$2
world=$3
work=$4
shift 4
rm -rf "$work"
mkdir -p "$work"
common=(--params 60k --layers 2 --batch 8 --seq-len 16 --steps 60 --eval-every 20
        --eval-tokens 512 --stage 3 --param-dtype bf16 --offload-optimizer nvme
        --sub-group-size 4096 --no-progress --quiet "$@")

"$bin" "${common[@]}" --world-size "$world" --out "$work/local" --nvme-path "$work/nvme-local" \
  >"$work/local.txt" 2>&1 || { cat "$work/local.txt"; exit 1; }
"$mpirun" --allow-run-as-root --oversubscribe --bind-to none -np "$world" \
  "$bin" "${common[@]}" --comm mpi --out "$work/mpi" --nvme-path "$work/nvme-mpi" \
  >"$work/mpi.txt" 2>&1 || { cat "$work/mpi.txt"; exit 1; }

rows=$(wc -l <"$work/local/loss.csv")
if [ "$rows" -ne 61 ]; then
  echo "expected 60 steps and a header in $work/local/loss.csv, got $rows lines"
  exit 1
fi
if ! diff <(cut -d, -f1-3 "$work/local/loss.csv") <(cut -d, -f1-3 "$work/mpi/loss.csv"); then
  echo "loss.csv differs between --comm local and --comm mpi at world size $world"
  exit 1
fi
# Only rank 0 wrote outputs and printed the summary.
if [ "$(grep -c '^final_val_loss=' "$work/mpi.txt")" -ne 1 ]; then
  echo "expected one summary line (rank 0's) in the mpirun output:"
  cat "$work/mpi.txt"
  exit 1
fi
grep -q "one process per rank (MpiComm)" "$work/mpi/summary.txt" || {
  echo "$work/mpi/summary.txt does not describe an MpiComm run:"
  cat "$work/mpi/summary.txt"
  exit 1
}
echo "world $world: $((rows - 1)) rows of loss.csv equal (local vs mpi); last row:"
tail -1 "$work/mpi/loss.csv"
rm -rf "$work"
