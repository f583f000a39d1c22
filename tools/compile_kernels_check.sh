#!/usr/bin/env bash
# Compiles every CUDA source in csrc/ for sm_80 and sm_90, compile only (no GPU
# needed), and fails on any error, warning or register spill.
#   --bindings  also syntax-checks csrc/bindings.cpp against the installed PyTorch's
#               headers (about a minute of CPU: torch/extension.h is heavy).
# NVCC (default: nvcc on PATH, else $CUDA_HOME/bin/nvcc) picks the compiler.
set -euo pipefail
cd "$(dirname "$0")/.."

nvcc_bin=${NVCC:-$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")}
if [[ ! -x "$nvcc_bin" ]]; then
  echo "nvcc not found: put the CUDA toolkit's bin/ on PATH or set NVCC" >&2
  exit 2
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# The same half/bfloat16 macros PyTorch's extension build defines, so code that
# compiles here compiles there. The commas belong to nvcc's -gencode syntax.
# shellcheck disable=SC2054
flags=(
  -std=c++17 -O3 -Icsrc --expt-relaxed-constexpr
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
  -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
  -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90
  --threads 0  # the two architectures compile in parallel, one thread per core
  -Werror=all-warnings -Xcompiler=-Wall -Xcompiler=-Werror -Xptxas=--warn-on-spills
)

"$nvcc_bin" --version | tail -n 1
start=$SECONDS
for source in csrc/*.cu; do
  file_start=$SECONDS
  "$nvcc_bin" "${flags[@]}" -c "$source" -o "$out/$(basename "$source").o"
  echo "ok  $source ($((SECONDS - file_start)) s)"
done
echo "compiled all .cu files for sm_80 and sm_90 in $((SECONDS - start)) s"

if [[ "${1:-}" == "--bindings" ]]; then
  python_includes=$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
  mapfile -t torch_includes < <(python -c \
    "import torch.utils.cpp_extension as c; print('\n'.join('-I' + p for p in c.include_paths()))")
  # CPU wheels ship the c10/cuda headers but not this generated one; its only macro
  # matters when linking.
  shim="$out/shim/c10/cuda/impl"
  mkdir -p "$shim"
  echo '#define C10_CUDA_BUILD_SHARED_LIBS' >"$shim/cuda_cmake_macros.h"
  # nvcc may be a wrapper script outside the toolkit; look for the headers themselves.
  cuda_include=""
  for toolkit in "${CUDA_HOME:-}" "$(dirname "$(dirname "$(readlink -f "$nvcc_bin")")")" /usr/local/cuda; do
    if [[ -n "$toolkit" && -f "$toolkit/include/cuda_runtime_api.h" ]]; then
      cuda_include="$toolkit/include"
      break
    fi
  done
  if [[ -z "$cuda_include" ]]; then
    echo "CUDA headers not found: set CUDA_HOME to the toolkit" >&2
    exit 2
  fi
  file_start=$SECONDS
  "${CXX:-g++}" -std=c++20 -fsyntax-only -Wall -Werror -DTORCH_EXTENSION_NAME=_fused_cuda \
    -isystem "$out/shim" "${torch_includes[@]/#-I/-isystem}" -isystem "$python_includes" \
    -isystem "$cuda_include" -Icsrc csrc/bindings.cpp
  echo "ok  csrc/bindings.cpp syntax ($((SECONDS - file_start)) s)"
fi
