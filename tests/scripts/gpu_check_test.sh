#!/usr/bin/env bash
# Tests scripts/gpu-check against a fake bundle: shell scripts standing in for the bundle's
# binaries, printing what the real ones print (gtest blocks with skip messages, probe lines,
# benchmark rows and errors, train_lm's loss.csv). Checks what the script decides from that:
#   - each test binary runs exactly once, and the skip reasons in the table and the JSON are the
#     ones that run printed (no second run to find them);
#   - a dry run passes with every GPU step a SKIP row carrying the reason;
#   - on a "GPU" only the 2-GPU tests may skip; a benchmark that reports an error fails the
#     check (exit 1) even though the table has its rows; without the error it passes.
# Usage: tests/scripts/gpu_check_test.sh <repo root>
set -uo pipefail
root=${1:?repo root}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0
check() {  # check DESCRIPTION COMMAND...
  local what=$1; shift
  if "$@"; then echo "ok: $what"; else echo "FAILED: $what"; fails=$((fails + 1)); fi
}

b="$work/bundle"
mkdir -p "$b/bin" "$b/data" "$work/path"
echo "commit: fake" >"$b/MANIFEST"
echo "In the beginning" >"$b/data/kjv_pentateuch.txt"
touch "$b/libnccl.so.2"
cp "$root/scripts/gpu-check" "$b/gpu-check"

printf '#!/usr/bin/env bash\necho "zinf: usage"\n' >"$b/bin/zinf"
cat >"$b/bin/zinf_gpu_probe" <<'S'
#!/usr/bin/env bash
if [ "$FAKE_MODE" = gpu ]; then
  echo "probe | cuda device | PASS | 1 device(s); 0: Fake H200, sm_90"
  echo "probe | O_DIRECT | FALLBACK | refused: buffered I/O"
  exit 0
fi
echo "probe | cuda device | NO_GPU | no GPU: cudaGetDeviceCount failed: fake"
echo "probe | O_DIRECT | PASS | 1 MiB written and read back with O_DIRECT"
exit 3
S
cat >"$b/bin/zinf_kernels_test" <<'S'
#!/usr/bin/env bash
echo "[ RUN      ] Cast.Ref"
echo "[       OK ] Cast.Ref (0 ms)"
S
cat >"$b/bin/zinf_gpu_test" <<'S'
#!/usr/bin/env bash
# What a real binary's cubins record: -arch sm_80 -arch sm_90
echo run >>"$FAKE_COUNTER"
echo "[==========] Running 3 tests from 2 test suites."
echo "[ RUN      ] CudaDevice.RoundTrip"
if [ "$FAKE_MODE" = gpu ]; then
  echo "[       OK ] CudaDevice.RoundTrip (3 ms)"
else
  printf 'tests/gpu/cuda_device_test.cpp:40: Skipped\nno CUDA device: cudaGetDeviceCount failed: fake reason\n'
  echo "[  SKIPPED ] CudaDevice.RoundTrip (0 ms)"
fi
echo "[ RUN      ] NcclMultiGpu.CollectivesAcrossRanks"
if [ "$FAKE_MODE" = gpu ]; then
  printf 'tests/gpu/nccl_multi_gpu_test.cpp:95: Skipped\nneeds 2 GPUs, found 1\n'
else
  printf 'tests/gpu/nccl_multi_gpu_test.cpp:93: Skipped\nno CUDA device: cudaGetDeviceCount failed: fake reason\n'
fi
echo "[  SKIPPED ] NcclMultiGpu.CollectivesAcrossRanks (0 ms)"
echo "[ RUN      ] TcpBootstrap.Works"
echo "[       OK ] TcpBootstrap.Works (1 ms)"
echo "[==========] 3 tests from 2 test suites ran. (4 ms total)"
echo "[  PASSED  ] 1 test."
echo "[  SKIPPED ] 2 tests, listed below:"
echo "[  SKIPPED ] NcclMultiGpu.CollectivesAcrossRanks"
S
for bench in bench_gpu_copy bench_gpu_kernels; do
  cat >"$b/bin/$bench" <<S
#!/usr/bin/env bash
if [ "\$FAKE_MODE" != gpu ]; then echo "$bench: skipped: no CUDA device: fake reason"; exit 0; fi
echo "zinf-gpu-bench | cast 64Mi |   402.7 MB |   3000.0 GB/s | D2D copy | 3100.0 GB/s | 0.968"
if [ "\$FAKE_BENCH_ERROR" = 1 ] && [ "$bench" = bench_gpu_kernels ]; then
  echo "$bench: benchmark error: BM_Adam/64: setup failed" >&2
  exit 1
fi
S
done
cat >"$b/bin/train_lm" <<'S'
#!/usr/bin/env bash
device=""; out=""
while [ $# -gt 0 ]; do
  case "$1" in --device) device=$2; shift ;; --out) out=$2; shift ;; esac
  shift
done
if [ "$device" = cuda ] && [ "$FAKE_MODE" != gpu ]; then
  echo "train_lm: error: --device cuda: unsupported: make_cuda_device: fake" >&2; exit 1
fi
mkdir -p "$out"
printf 'step,train_loss,val_loss,tokens_per_s\n1,5.5,,100\n60,2.4,2.43,%s\n' "$RANDOM" >"$out/loss.csv"
echo "final_val_loss=2.43"
S
cat >"$work/path/nvidia-smi" <<'S'
#!/usr/bin/env bash
[ "$FAKE_MODE" = gpu ] || { echo "NVIDIA-SMI has failed" >&2; exit 9; }
echo "Fake H200, 580.00, 143771 MiB, 9.0"
S
chmod +x "$b"/bin/* "$b/gpu-check" "$work/path/nvidia-smi"

run_check() {  # run_check OUT MODE BENCH_ERROR ARGS...
  local out=$1 mode=$2 bench_error=$3
  shift 3
  : >"$work/counter.$out"
  env FAKE_MODE="$mode" FAKE_BENCH_ERROR="$bench_error" FAKE_COUNTER="$work/counter.$out" \
    ZINF_NCCL_LIBRARY="$b/libnccl.so.2" ZINF_GPU_CHECK_SCRATCH="$work/scratch" \
    PATH="$work/path:/usr/bin:/bin" "$b/gpu-check" --out "$work/$out" "$@" >"$work/$out.stdout" 2>&1
}
json() {  # json OUT PYTHON-EXPRESSION over d (the parsed gpu-check.json)
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if ($2) else 1)" \
    "$work/$1/gpu-check.json"
}
step() {  # step OUT NAME RESULT
  json "$1" "any(s['name'] == '$2' and s['result'] == '$3' for s in d['steps'])"
}

# 1. Dry run, no GPU.
run_check dry nogpu 0 --dry-run
rc=$?
check "dry run exits 0" [ $rc -eq 0 ]
check "zinf_gpu_test ran exactly once in the dry run" [ "$(wc -l <"$work/counter.dry")" -eq 1 ]
check "dry run: zinf_gpu_test is SKIP" step dry zinf_gpu_test SKIP
check "dry run: the skip reason is the run's own" \
  json dry "[s['reason'] for s in d['skipped_tests']] == ['no CUDA device: cudaGetDeviceCount failed: fake reason'] * 2"
check "dry run: the table shows the reason" \
  grep -q '2 no CUDA device: cudaGetDeviceCount failed: fake reason' "$work/dry/gpu-check.txt"
check "dry run: the probe reports no GPU" step dry "probe: cuda device" SKIP
check "dry run: the benchmarks skip with the reason" step dry bench_gpu_kernels SKIP
check "dry run: train_lm --device cuda gives the device error" step dry "train_lm --device cuda" SKIP
check "dry run: train_lm --device host runs" step dry "train_lm --device host" PASS
check "dry run: NCCL located and named" \
  json dry "d['nccl']['found_by'] == 'ZINF_NCCL_LIBRARY' and d['passed']"

# 2. Without --dry-run on a machine with no GPU: the check fails.
run_check nogpu nogpu 0
check "no GPU without --dry-run exits 1" [ $? -eq 1 ]
check "no GPU: zinf_gpu_test is FAIL" step nogpu zinf_gpu_test FAIL

# 3. A (fake) GPU, every benchmark fine: passes; the 2-GPU skip is allowed.
run_check gpu gpu 0
rc=$?
check "GPU run passes" [ $rc -eq 0 ]
check "GPU run: zinf_gpu_test ran once and passed with the 2-GPU skip" \
  bash -c "[ \$(wc -l <'$work/counter.gpu') -eq 1 ] && grep -q 'needs 2 GPUs, found 1' '$work/gpu/gpu-check.txt'"
check "GPU run: zinf_gpu_test PASS" step gpu zinf_gpu_test PASS
check "GPU run: O_DIRECT refused is a fallback, not a failure" step gpu "probe: O_DIRECT" PASS
check "GPU run: train_lm losses compared" step gpu "train_lm host = cuda" PASS
check "GPU run: benchmark rows in the JSON" json gpu "len(d['benchmarks']) == 2"
check "GPU run: the fat binary has this GPU's sm_90" step gpu "fat binary" PASS

# 4. The same with a benchmark error: the check fails although the rows are there.
run_check bencherr gpu 1
rc=$?
check "a benchmark error fails the check (exit 1)" [ $rc -eq 1 ]
check "a benchmark error: bench_gpu_kernels FAIL naming it" \
  json bencherr "any(s['name'] == 'bench_gpu_kernels' and s['result'] == 'FAIL' and 'BM_Adam/64' in s['detail'] for s in d['steps'])"
check "a benchmark error: bench_gpu_copy still PASS" step bencherr bench_gpu_copy PASS

if [ $fails -ne 0 ]; then
  echo "--- dry run output"; cat "$work/dry.stdout"
  echo "--- GPU run output"; cat "$work/gpu.stdout"
  echo "$fails checks failed"
  exit 1
fi
echo "all checks passed"
