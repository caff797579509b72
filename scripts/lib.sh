# Shared by scripts/test and scripts/demo: install what is missing, configure and build build/.
# Sourced, not run. Honours ZINF_BUILD_DIR (default build), ZINF_CMAKE_ARGS (extra configure args).

zinf_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
zinf_build=${ZINF_BUILD_DIR:-$zinf_root/build}

# Debian packages the build needs; docs/DEPENDENCIES.md says why each one is there.
zinf_packages=(cmake g++ make pkg-config liburing-dev libtbb-dev libfmt-dev nlohmann-json3-dev
               libcli11-dev libxxhash-dev libgtest-dev libgmock-dev libbenchmark-dev
               python3-dev python3-venv libopenmpi-dev openmpi-bin)

zinf_install_deps() {
  local missing=()
  for p in "${zinf_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "zinf: installing missing packages: ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      "${missing[@]}"
  fi
}

# Warns, before any work, when the filesystem that holds build/ has less room than a run needs:
# zinf_check_disk <MiB the whole run takes under build/> <what takes it>. What build/ already
# holds counts towards the run's need (a second run needs little more room); the tests' files,
# which a full disk fails with no_space naming the file, are part of the figure.
zinf_check_disk() {
  local need_mib=$1 what=$2 dir=$zinf_build have_mib=0 free_mib
  if [ -d "$dir" ]; then have_mib=$(du -sm "$dir" 2> /dev/null | cut -f1 || true); fi
  while [ ! -d "$dir" ]; do dir=$(dirname "$dir"); done
  free_mib=$(df -Pm "$dir" 2> /dev/null | awk 'NR == 2 {print $4}' || true)
  [[ $free_mib =~ ^[0-9]+$ ]] || return 0  # df printed no size: no warning rather than a guess
  [[ $have_mib =~ ^[0-9]+$ ]] || have_mib=0
  if [ $((free_mib + have_mib)) -lt "$need_mib" ]; then
    echo "zinf: warning: $free_mib MiB free for $zinf_build, which holds $have_mib MiB; this" \
      "run takes about $need_mib MiB there ($what): it may stop with no_space" >&2
  fi
}

# Configures build/ with the given extra arguments, then builds with all cores: every target, or
# only those named in the array zinf_targets or in ZINF_BUILD_TARGETS (space-separated) when set
# (scripts/demo builds just train_lm and what it links, not the tests, benchmarks and tools).
zinf_configure_and_build() {
  local extra=("$@")
  # nvcc lives outside PATH in a standard CUDA install; let CMake's AUTO detection see it.
  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
  # ccache where it is installed (ZINF_CCACHE=0: not); the arguments after these may override.
  # It caches a compile that uses a precompiled header (the library's and the tests') only with
  # these sloppiness settings (ccache's manual, "Precompiled headers").
  local launcher=()
  if [ "${ZINF_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null 2>&1; then
    launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
              -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
    export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}
  fi
  cmake -S "$zinf_root" -B "$zinf_build" -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" \
    "${extra[@]}" ${ZINF_CMAKE_ARGS:-}
  local target_args=()
  for t in "${zinf_targets[@]}" ${ZINF_BUILD_TARGETS:-}; do target_args+=(--target "$t"); done
  cmake --build "$zinf_build" -j "$(nproc)" "${target_args[@]}"
}

# The Python package (docs/PYTHON.md): a virtual environment in $zinf_build/venv with torch,
# transformers, pytest (and pytest-xdist: scripts/test runs the test files on every core),
# safetensors, accelerate (the Trainer's path to zinf.deepspeed_compat, tested by
# python/tests/test_hf_trainer.py) and peft (LoRA, python/tests/test_frozen.py) from
# PyPI (what is installed already stays), then the package built from python/ with warnings as
# errors. ZINF_PYTHON picks the interpreter that makes the environment (default python3);
# CMAKE_ARGS adds configure arguments (a compiler launcher). zinf_python_env alone makes the
# environment (scripts/test runs it beside the C++ build: it is mostly downloads and unpacking, on
# one core); zinf_python_install makes it where it is missing, then builds the package.
zinf_python_env() {
  zinf_venv="$zinf_build/venv"
  if [ ! -x "$zinf_venv/bin/python" ]; then
    "${ZINF_PYTHON:-python3}" -m venv "$zinf_venv"
  fi
  "$zinf_venv/bin/pip" install --quiet torch transformers pytest pytest-xdist safetensors numpy \
    accelerate peft scikit-build-core nanobind
}

zinf_python_install() {
  zinf_venv="$zinf_build/venv"
  [ "${zinf_python_env_done:-0}" = 1 ] || zinf_python_env
  # The build requirements are installed above, so pip need not make an isolated environment.
  # With ZINF_PYTHON_PREFIX (an installed static zinf), the package links that library instead of
  # compiling it again (python/CMakeLists.txt).
  local prefix_arg=""
  [ -n "${ZINF_PYTHON_PREFIX:-}" ] && prefix_arg="-DZINF_PREFIX=$ZINF_PYTHON_PREFIX"
  CMAKE_ARGS="-DZINF_WERROR=ON $prefix_arg ${CMAKE_ARGS:-}" "$zinf_venv/bin/pip" install --quiet \
    --no-build-isolation "$zinf_root/python"
}
