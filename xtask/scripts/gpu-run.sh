#!/usr/bin/env bash
# Runs the test executables that `cargo xtask gpu bundle` packed, on a machine with an
# NVIDIA GPU and CUDA's libraries in its Python packages (no Rust needed):
#
#   bash target/gpu/run.sh [FILTER ...]     # from the repository root; FILTER goes to every test binary
#   bash target/gpu/run.sh --bench          # training and generation tokens/s against PyTorch
#
# Every executable runs from its package directory, as `cargo test` runs it, with one
# rayon/candle thread per test (as `cargo xtask ci` does). Logs go to $OUT/gpu-tests.log
# when $OUT is set. Exits non-zero when any executable failed.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

# The executables were built in @BUILD_ROOT@ and find their fixtures through that
# path (`env!("CARGO_MANIFEST_DIR")`): point it at this checkout when it differs.
build_root='@BUILD_ROOT@'
if [ "$root" != "$build_root" ] && [ ! -e "$build_root" ]; then
    mkdir -p "$(dirname "$build_root")" && ln -s "$root" "$build_root"
fi

# cuBLAS, cuRAND and the CUDA runtime from the Python packages; libcuda from the driver.
sp=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null || true)
if [ -n "$sp" ] && [ -d "$sp/nvidia" ]; then
    libs=$(find "$sp/nvidia" -maxdepth 3 -type d -name lib | paste -sd: -)
    export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-1} CANDLE_NUM_THREADS=${CANDLE_NUM_THREADS:-1}

bin=${METRONOME_GPU_DIR:-/tmp/metronome-gpu}
rm -rf "$bin" && mkdir -p "$bin"
tar -xJf "$here/bundle.tar.xz" -C "$bin"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

if [ "${1:-}" = "--bench" ]; then
    # Training and generation tokens/s, Metronome then PyTorch, same shapes, same GPU.
    shift
    train=${TRAIN:-8x512,32x512} generate=${GENERATE:-1,16,64,256}
    "$bin/bin/throughput" --device cuda:0 --shape smollm2-135m --train "$train" --generate "$generate"
    python3 "$build_root/crates/metronome-model/benches/torch_gpu.py" --train "$train" --generate "$generate"
    exit
fi

log=${OUT:-$bin}/gpu-tests.log
: >"$log"
failed=()
while IFS=$'\t' read -r name dir; do
    one="$bin/$name.log"
    if ! (cd "$build_root/$dir" && "$bin/bin/$name" "$@") >"$one" 2>&1; then
        failed+=("$name")
    fi
    { echo "==> $name ($dir)"; cat "$one"; } >>"$log"
    echo "$name: $(grep -E '^test result' "$one" | tail -n 1) $(grep -c 'skipped:' "$one") skip notes"
    grep -E '^test .* FAILED|panicked' "$one" | head -n 5
done <"$bin/tests.tsv"

if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]} (log: $log)"
    exit 1
fi
echo "all GPU test executables passed (log: $log)"
