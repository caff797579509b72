#!/usr/bin/env bash
# A rank of an MPI job killed with SIGKILL during training: every other rank must exit non-zero
# by itself within collective_timeout_ms + 10 s, with an error naming the dead rank and the
# collective it waited in, and no process may be left. Each survivor, before it exits, reads its
# own swap files back (--verify-swap-on-error) and must find every written block matching its
# checksum: the death corrupted nothing outside the dead rank's directory.
#
# Each rank runs under a small shell that records train_lm's exit code and time, so that mpirun
# sees every rank's shell end normally and does not kill the job itself (its default when a
# process dies): the survivors have to notice the death on their own, through MpiComm's
# deadlines.
#   mpi_rank_death_test.sh TRAIN_LM MPIRUN WORLD VICTIM WORK_DIR
set -euo pipefail
bin=$1
mpirun=$2
world=$3
victim=$4
work=$5
timeout_ms=3000
rm -rf "$work"
mkdir -p "$work"

cat >"$work/rank.sh" <<'SH'
#!/usr/bin/env bash
# One rank: train_lm in the background (its pid for the test to kill), then its exit code.
work=$1
shift
rank=$OMPI_COMM_WORLD_RANK
"$@" 2>"$work/stderr.$rank" >"$work/stdout.$rank" &
echo $! >"$work/pid.$rank"
set +e
wait $!
code=$?
echo "$code $(date +%s%N)" >"$work/exit.$rank"
SH
chmod +x "$work/rank.sh"

# Long enough that the kill lands while the ranks train; the steps are short, so it lands inside
# one (forward, backward, gather, reduce or the optimizer step).
# orte_allowed_exit_without_sync: a process that ends without MPI_Finalize (the killed one, and
# the survivors, which skip it after a failure) does not make mpirun end the job itself.
"$mpirun" --allow-run-as-root --oversubscribe --bind-to none \
  --mca orte_allowed_exit_without_sync 1 -np "$world" \
  "$work/rank.sh" "$work" "$bin" --params 200k --layers 2 --batch 8 --seq-len 16 --steps 100000 \
  --eval-every 100000 --stage 3 --param-dtype bf16 --offload-optimizer nvme \
  --collective-timeout-ms "$timeout_ms" --no-progress --step-times --comm mpi --verify-swap-on-error \
  --out "$work/out" --nvme-path "$work/nvme" >"$work/mpirun.txt" 2>&1 &
mpirun_pid=$!

# Wait until the ranks train (rank 0 printed its fifth step's line), then kill the victim.
for _ in $(seq 600); do
  [ -f "$work/pid.$victim" ] && grep -q "^step 5:" "$work/stderr.0" 2>/dev/null && break
  sleep 0.1
done
# What each rank and mpirun said, for a failure's output (a passing run's directory is removed).
show_logs() {
  for f in "$work"/stderr.* "$work/mpirun.txt"; do
    [ -f "$f" ] || continue
    echo "--- last lines of $f"
    tail -n 15 "$f"
  done
}
grep -q "^step 5:" "$work/stderr.0" ||
  { echo "the ranks did not start training within 60 s"; show_logs; exit 1; }
victim_pid=$(cat "$work/pid.$victim")
kill_ns=$(date +%s%N)
# A victim that already ended (a rank that failed by itself) is not this test's scenario: say so.
if ! kill -KILL "$victim_pid" 2>/dev/null; then
  echo "rank $victim (pid $victim_pid) had ended before the kill: $(cat "$work/exit.$victim" 2>/dev/null)"
  show_logs
  exit 1
fi
echo "killed rank $victim (pid $victim_pid)"

# mpirun ends when every rank's shell has; give it the timeout and 10 s, and a little more to see.
deadline=$(( $(date +%s) + timeout_ms / 1000 + 20 ))
while kill -0 "$mpirun_pid" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.2; done
status=0
if kill -0 "$mpirun_pid" 2>/dev/null; then
  echo "mpirun still runs $((timeout_ms / 1000 + 20)) s after the kill: a rank hangs"
  status=1
fi
for rank in $(seq 0 $((world - 1))); do
  if [ ! -f "$work/exit.$rank" ]; then
    echo "rank $rank never exited"
    status=1
    continue
  fi
  read -r code end_ns <"$work/exit.$rank"
  if [ "$rank" -eq "$victim" ]; then
    [ "$code" -eq 137 ] || { echo "the victim exited $code, not 137 (SIGKILL)"; status=1; }
    continue
  fi
  took_ms=$(( (end_ns - kill_ns) / 1000000 ))
  message=$(grep "train_lm: error" "$work/stderr.$rank" || true)
  echo "rank $rank: exit $code after $took_ms ms: $message"
  if [ "$code" -eq 0 ]; then echo "rank $rank exited 0"; status=1; fi
  if [ "$took_ms" -gt $((timeout_ms + 10000)) ]; then
    echo "rank $rank took $took_ms ms, over collective_timeout_ms + 10 s"
    status=1
  fi
  # The error names this rank, the collective, and the dead rank (directly, or through the
  # notice of the rank that timed out first).
  echo "$message" | grep -q "rank $rank" || { echo "rank $rank: no rank in its error"; status=1; }
  echo "$message" | grep -Eq "all_gather|reduce_scatter|all_reduce|broadcast|barrier" ||
    { echo "rank $rank: no collective named"; status=1; }
  echo "$message" | grep -Eq "rank\(s\) ([0-9]+, )*$victim\b" ||
    { echo "rank $rank: the dead rank $victim is not named"; status=1; }
  # Its swap files (optimizer state on NVMe, written every step) read back intact.
  verified=$(grep "train_lm: rank $rank: swap " "$work/stderr.$rank" || true)
  echo "rank $rank: $verified"
  echo "$verified" | grep -Eq "swap verified: [1-9][0-9]* blocks" ||
    { echo "rank $rank: its swap files were not verified"; status=1; }
done
# No process of this job is left.
sleep 0.5
if pgrep -f "$work/" >/dev/null; then
  echo "processes left:"
  pgrep -af "$work/"
  status=1
fi
if [ "$status" -eq 0 ]; then
  rm -rf "$work"
else
  show_logs
fi
exit "$status"
