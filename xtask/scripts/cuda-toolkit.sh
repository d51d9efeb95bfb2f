#!/usr/bin/env bash
# Copied from the team's shared tools (shared/tools/cuda-toolkit-from-pypi.sh) so that CI and
# `cargo xtask gpu` need nothing outside the repository.
#
# Assembles a CUDA 13.0 build toolkit (nvcc, headers, link libraries) from PyPI wheels, so that
# a crate using candle's `cuda` feature can be COMPILED on a machine without a GPU or a CUDA install
# (CI, the 2-core dev machines). The resulting binaries run on a machine with an NVIDIA driver >= 580.
#
# `cargo xtask gpu` runs this (into target/cuda-toolkit); by hand:
#   xtask/scripts/cuda-toolkit.sh DIR              # builds DIR (about 1.5 GB of wheels unpacked)
#   source DIR/env.sh                              # PATH, CUDA_HOME/CUDA_PATH/CUDA_ROOT, CUDA_COMPUTE_CAP=90
#   cargo build --release --features cuda ...
#
# What it works around (measured 2026-11-24 with candle 0.11.1, cudarc 0.19.10, cudaforge 0.1.6):
# - nvcc 13.0 must be paired with nvidia-nvvm 13.0.x: a newer cicc emits PTX .version 9.5 that
#   ptxas 13.0 and driver 580 reject.
# - candle-core enables cudarc's `dynamic-linking`, so the link step needs libcuda.so: no GPU
#   machine here has one, so DIR/lib/stubs/libcuda.so is an EMPTY stub (soname libcuda.so.1) built
#   from cudarc's function list. Never put lib/stubs on LD_LIBRARY_PATH at run time: use the driver's.
# - The wheels ship only versioned .so files; DIR/lib gets the unversioned links the linker wants.
# - cudarc picks its CUDA version from `nvcc --version`; cudaforge reads CUDA_COMPUTE_CAP (90 = H100/H200,
#   built as sm_90a).
# At run time on the GPU machine: LD_LIBRARY_PATH must reach libcublas.so.13, libcublasLt.so.13,
# libcurand.so.10, libcudart.so.13 (e.g. the nvidia/cu13/lib folders of that machine's Python
# packages, or DIR/lib copied along), and the real libcuda.so.1 from the driver.
set -euo pipefail
dir=${1:?usage: cuda-toolkit-from-pypi.sh DIR}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
py=${PYTHON:-python3}
wheels="$dir/wheels"
if [ ! -x "$wheels/nvidia/cu13/bin/nvcc" ]; then
  "$py" -m pip install -q --no-deps --target "$wheels" \
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 \
    nvidia-cuda-cccl==13.0.85 nvidia-cuda-crt==13.0.88 nvidia-cuda-nvrtc==13.0.88 \
    nvidia-cublas==13.0.0.19 nvidia-curand==10.4.0.35
fi
cu="$wheels/nvidia/cu13"
rm -rf "$dir/bin" && cp -r "$cu/bin" "$dir/bin"      # nvcc.profile finds nvvm relative to itself
ln -sfn "$cu/nvvm" "$dir/nvvm"
ln -sfn "$cu/include" "$dir/include"
mkdir -p "$dir/lib/stubs"
for f in "$cu"/lib/lib*.so.*; do
  base=$(basename "$f"); ln -sfn "$f" "$dir/lib/$base"; ln -sfn "$base" "$dir/lib/${base%%.so.*}.so"
done
[ -e "$cu/lib/libcudart_static.a" ] && ln -sfn "$cu/lib/libcudart_static.a" "$dir/lib/libcudart_static.a"
# The libcuda link stub: every driver entry point cudarc declares, as an empty function.
src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-*/src/driver/sys/mod.rs 2>/dev/null | tail -1 || true)
if [ -z "$src" ]; then
  echo "cudarc's sources are not in the cargo registry yet: run 'cargo fetch' in a workspace that enables candle's cuda feature, then run this again" >&2
  exit 1
fi
grep -o 'pub unsafe fn cu[A-Za-z0-9_]*' "$src" | awk '{print "void " $4 "(void){}"}' | sort -u > "$dir/lib/stubs/libcuda_stub.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$dir/lib/stubs/libcuda.so" "$dir/lib/stubs/libcuda_stub.c"
cat > "$dir/env.sh" <<ENV
export PATH="$dir/bin:\$PATH"
export CUDA_HOME="$dir" CUDA_PATH="$dir" CUDA_ROOT="$dir"
export CUDA_COMPUTE_CAP=\${CUDA_COMPUTE_CAP:-90}
ENV
"$dir/bin/nvcc" --version | tail -2
echo "toolkit ready: source $dir/env.sh"
