#!/usr/bin/env bash
# The same zinf.torch job (examples/torch_gpt/train.py) on two ranks under mpirun (the MPI
# communicator) and under torchrun (the torch communicator over gloo), interleaved round by
# round; prints each run's mean step time and the median of the per-round ratios
# torchrun / mpirun. Usage: bench/python/launchers.sh [ROUNDS] [train.py arguments...]
# (default: 3 rounds of --stage 3 --layers 4 --width 256 --steps 30).
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
shift || true
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--stage 3 --layers 4 --width 256 --steps 30)
python=${ZINF_VENV:-build/venv}/bin/python
script=examples/torch_gpt/train.py
# The mean ms/step train.py prints with its last step.
ms_of() { grep -o '[0-9.]* ms/step' | tail -1 | cut -d' ' -f1; }
ratios=()
for round in $(seq "$rounds"); do
  mpi=$(OMP_NUM_THREADS=1 mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 \
        "$python" "$script" "${args[@]}" 2>/dev/null | ms_of)
  torch=$(env -u OMPI_COMM_WORLD_SIZE OMP_NUM_THREADS=1 "$python" -m torch.distributed.run \
          --nproc_per_node 2 --master_addr 127.0.0.1 --master_port $((29600 + round)) \
          "$script" "${args[@]}" 2>/dev/null | ms_of)
  ratio=$(python3 -c "print(f'{$torch / $mpi:.3f}')")
  echo "round $round: mpirun $mpi ms/step, torchrun $torch ms/step, torchrun/mpirun $ratio"
  ratios+=("$ratio")
done
python3 -c "import statistics, sys; print(f'median torchrun/mpirun: {statistics.median(map(float, sys.argv[1:])):.3f}')" "${ratios[@]}"
