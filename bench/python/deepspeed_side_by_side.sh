#!/usr/bin/env bash
# Runs bench/python/deepspeed_side_by_side.py: zinf.torch and DeepSpeed ZeRO-3 on the same model
# and config, optimizer state and parameters on NVMe, interleaved rounds (docs/BENCHMARKS.md).
#
#   bench/python/deepspeed_side_by_side.sh [arguments of deepspeed_side_by_side.py]
#
# DeepSpeed is a benchmark dependency only (docs/DEPENDENCIES.md): it goes into its own venv,
# build/venv-ds, layered over the test venv (ZINF_VENV, default build/venv, which scripts/test
# makes with torch and the zinf package): build/venv-ds sees that venv's packages through a .pth
# file, so both sides run on the same torch, and the test venv stays as it was. DeepSpeed's
# async_io op needs libaio's headers (Debian: libaio-dev); its CPU ops are compiled on first use
# (JIT, into build/venv-ds/torch_extensions: several minutes on 2 cores).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
base=${ZINF_VENV:-$root/build/venv}
ds=$root/build/venv-ds
deepspeed_version=${ZINF_DEEPSPEED_VERSION:-0.19.8}
if [ ! -x "$base/bin/python" ] || ! "$base/bin/python" -c "import torch, zinf" 2> /dev/null; then
  echo "$0: $base has no torch or zinf: run scripts/test first (or set ZINF_VENV)" >&2
  exit 2
fi
if [ ! -e /usr/include/libaio.h ]; then
  echo "$0: DeepSpeed's async_io op needs libaio's headers: apt-get install -y libaio-dev" >&2
  exit 2
fi
if [ ! -x "$ds/bin/python" ]; then
  "${ZINF_PYTHON:-python3}" -m venv "$ds"
fi
# Every site-packages directory the base venv sees (its own and those its .pth files add).
site=$("$ds/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
"$base/bin/python" -c "import sys; print('\n'.join(p for p in sys.path if p.endswith('site-packages')))" \
  > "$site/zinf-base.pth"
if ! "$ds/bin/python" -c "import deepspeed" 2> /dev/null; then
  # DeepSpeed is an sdist whose setup.py imports torch: build it against the torch above
  # instead of letting pip fetch another into an isolated build environment.
  "$ds/bin/pip" install --quiet setuptools wheel
  "$ds/bin/pip" install --quiet --no-build-isolation "deepspeed==$deepspeed_version"
fi
export DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$ds/torch_extensions}
exec "$ds/bin/python" "$root/bench/python/deepspeed_side_by_side.py" "$@"
