# shellcheck shell=bash
# Sourced by compare_offload.sh and compare_activations.sh: their shared arguments and their runs
# of train_lm round by round (so that the machine's load hits every variant alike).
#   <script> [BUILD_DIR] [ROUNDS] [extra train_lm args...]

# compare_init NAME "$@": sets bin (BUILD_DIR/bin/train_lm, BUILD_DIR defaulting to build),
# rounds (default 3), extra_args (the rest) and work, a fresh directory removed at exit.
# shellcheck disable=SC2034  # bin, rounds and extra_args are the sourcing script's.
compare_init() {
  local name=$1
  shift
  local build=${1:-build}
  rounds=${2:-3}
  shift $(($# > 2 ? 2 : $#))
  extra_args=("$@")
  bin="$build/bin/train_lm"
  work=$(mktemp -d "${TMPDIR:-/tmp}/train_lm_${name}.XXXXXX")
  trap 'rm -rf "$work"' EXIT
}

# compare_rounds COUNT: calls run_variant I OUT for each round and each variant I in
# 0..COUNT-1, OUT being "$work/I.ROUND" (the caller's function writes its run there).
compare_rounds() {
  local count=$1 round i
  for round in $(seq "$rounds"); do
    for ((i = 0; i < count; i++)); do
      run_variant "$i" "$work/$i.$round"
    done
  done
}
