#!/usr/bin/env bash
# The nvcc of `cargo xtask gpu check`. clippy type-checks the `cuda` build and never
# links or loads a kernel, so compiling candle-kernels' CUDA sources there checks
# nothing of ours: they are pinned by Cargo.lock, and its build script (the PTX of
# every op, and the quantised and MoE kernels as a static library) took 22 of the
# check's 24 minutes on a fresh clone on 2 cores (`gpu bundle`, which links them,
# still compiles them with the real nvcc).
# So this answers each compile of a source outside the repository with an empty
# output of the name asked for, and runs the real nvcc ($METRONOME_NVCC) for
# everything else: this repository's own kernels (metronome-model's build.rs), and
# the version and architecture probes of the build scripts.
set -euo pipefail
real=${METRONOME_NVCC:?set by cargo xtask gpu check}
root=$(realpath -- "${METRONOME_ROOT:?set by cargo xtask gpu check}")

args=("$@")
out="" outdir="" ptx=0 lib=0 foreign=()
for ((i = 0; i < ${#args[@]}; i++)); do
    case ${args[i]} in
        -o) out=${args[i + 1]:-} ;;
        --output-directory) outdir=${args[i + 1]:-} ;;
        --ptx | -ptx) ptx=1 ;;
        --lib | -lib) lib=1 ;;
        *.cu)
            path=$(realpath -m -- "${args[i]}")
            # A source of this repository: compiled for real.
            [[ $path == "$root"/* ]] && exec "$real" "$@"
            foreign+=("$path")
            ;;
    esac
done

if ((lib)) && [[ -n $out ]]; then
    # The static library of the sources answered below: an empty archive.
    printf '!<arch>\n' >"$out"
elif ((${#foreign[@]})) && [[ -n $out ]]; then
    : >"$out"
elif ((${#foreign[@]})) && ((ptx)) && [[ -n $outdir ]]; then
    for f in "${foreign[@]}"; do
        name=$(basename -- "$f")
        : >"$outdir/${name%.cu}.ptx"
    done
else
    exec "$real" "$@"
fi
