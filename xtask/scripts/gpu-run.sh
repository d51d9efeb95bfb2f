#!/usr/bin/env bash
# Runs the test executables that `cargo xtask gpu bundle` packed, on a machine with an
# NVIDIA GPU and CUDA's libraries in its Python packages (no Rust needed):
#
#   bash target/gpu/run.sh [FILTER ...]     # from the repository root; FILTER goes to every test binary
#   bash target/gpu/run.sh --bench          # every GPU test, then training tokens/s against PyTorch
#   bash target/gpu/run.sh --learn GGUF     # the SmolLM2 learning run of issue #32 (no tests)
#
# Every executable runs from its package directory, as `cargo test` runs it, with one
# rayon/candle thread per test (as `cargo xtask ci` does). Logs go to $OUT/gpu-tests.log
# when $OUT is set. Exits non-zero when any executable failed.
#
# `--bench` is the one device call of issues #30 and #31 (about 7 minutes on an H100): the GPU
# tests, then for SmolLM2-135M at 8x512, 32x512 and 16x1024 and Qwen2.5-0.5B and
# Qwen2.5-1.5B at 8x1024 (random weights, `crates/metronome-model/benches/llama_shapes.json`)
# Metronome's training step in bf16 with the chunked head, without and with checkpointed
# layers (`examples/throughput.rs`), and PyTorch's eager bf16 autocast and torch.compile
# (`benches/torch_gpu.py`), then `benches/gpu_report.py` merges everything, with the
# device, driver, commit and date, into $OUT/gpu.json (commit it as
# crates/metronome-model/benches/results/gpu.json). Every figure's command is in it.
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

bench=false
if [ "${1:-}" = "--bench" ]; then
    bench=true
    shift
fi

# `--learn GGUF` is issue #32's device call, without the tests: the SmolLM2 preset
# (configs/smollm2-gsm.toml) on the GGUF at that path, limited to LEARN_S seconds
# (default 330), held-out accuracy before, during and after; then `periodic` and
# `sync` for LEARN_COMPARE_PERIODS periods (default 3) on the same seed, their rewards
# side by side; then `metronome export` of the learned run and
# `examples/check_export.py` (transformers' greedy answers against Metronome's). Into
# $OUT: learn-metrics.jsonl, learn-summary.txt, compare.txt, export-check.txt.
if [ "${1:-}" = "--learn" ]; then
    gguf=${2:?usage: run.sh --learn PATH_TO_SmolLM2-135M-Instruct.Q4_1.gguf}
    out=${OUT:-$bin}
    runs=$bin/runs
    mkdir -p "$runs"
    metronome=("$bin/bin/metronome" run --config "$build_root/configs/smollm2-gsm.toml"
        --set "model.path=\"$gguf\"" --set "run.out_dir=\"$runs\"")
    echo "${metronome[*]}" >"$out/learn-summary.txt"
    start=$(date +%s)
    (cd "$build_root" && timeout "${LEARN_S:-330}" "${metronome[@]}" --set 'run.name="learn"') >"$bin/learn.log" 2>&1
    echo "learning run: exit $?, $(($(date +%s) - start)) s" | tee -a "$out/learn-summary.txt"
    learned=$(ls -d "$runs"/learn* 2>/dev/null | head -n 1)
    if [ -n "$learned" ]; then
        cp "$learned/metrics.jsonl" "$out/learn-metrics.jsonl" 2>/dev/null
        grep -iE 'held-out|accuracy|period [0-9]+' "$bin/learn.log" | tail -n 60 >>"$out/learn-summary.txt"
        # The final checkpoint, or the newest period's when the time limit cut the run.
        export=("$bin/bin/metronome" export "$learned" --out "$bin/hf" --questions 32)
        (cd "$build_root" && { timeout 120 "${export[@]}" || timeout 120 "${export[@]}" --checkpoint latest; } &&
            timeout 150 python3 crates/metronome-pipeline/examples/check_export.py "$bin/hf" --device cuda) \
            >"$out/export-check.txt" 2>&1
        echo "export check: exit $?" >>"$out/export-check.txt"
    else
        tail -n 40 "$bin/learn.log" >>"$out/learn-summary.txt"
    fi
    : >"$out/compare.txt"
    for schedule in periodic sync; do
        start=$(date +%s)
        (cd "$build_root" && timeout 150 "${metronome[@]}" --set "run.name=\"$schedule\"" \
            --set "run.schedule=\"$schedule\"" --set "run.periods=${LEARN_COMPARE_PERIODS:-3}" \
            --set eval.prompts=0) >"$bin/$schedule.log" 2>&1
        echo "== $schedule: exit $?, $(($(date +%s) - start)) s" >>"$out/compare.txt"
        dir=$(ls -d "$runs/$schedule"* 2>/dev/null | head -n 1)
        [ -n "$dir" ] && grep -E '"reward_mean"|"period"' "$dir/metrics.jsonl" | head -n 20 >>"$out/compare.txt"
    done
    exit 0
fi

log=${OUT:-$bin}/gpu-tests.log
: >"$log"
failed=()
while IFS=$'\t' read -r name dir; do
    one="$bin/$name.log"
    if ! (cd "$build_root/$dir" && timeout 180 "$bin/bin/$name" "$@") >"$one" 2>&1; then
        failed+=("$name")
    fi
    { echo "==> $name ($dir)"; cat "$one"; } >>"$log"
    echo "$name: $(grep -E '^test result' "$one" | tail -n 1) $(grep -c 'skipped:' "$one") skip notes"
    grep -E '^test .* FAILED|panicked' "$one" | head -n 5
done <"$bin/tests.tsv"

# The crate's own CUDA kernels under compute-sanitizer: memcheck (bad accesses) and
# initcheck (reads of memory never written: their outputs are allocated uninitialised),
# each failing with exit code 9; the tests' assertions check the answers meanwhile.
san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1 || true)
model_it=$(awk -F'\t' '$1 == "metronome-model-it" { print $2 }' "$bin/tests.tsv")
if [ -n "$san" ] && [ -n "$model_it" ]; then
    for tool in memcheck initcheck; do
        if ! (cd "$build_root/$model_it" && timeout 180 "$san" --tool "$tool" --error-exitcode 9 \
            "$bin/bin/metronome-model-it" cuda_kernel) >"$bin/sanitizer-$tool.log" 2>&1; then
            failed+=("compute-sanitizer-$tool")
        fi
        { echo "==> compute-sanitizer --tool $tool metronome-model-it cuda_kernel"; cat "$bin/sanitizer-$tool.log"; } >>"$log"
        echo "compute-sanitizer $tool (this crate's kernels): $(grep -E 'ERROR SUMMARY|^test result' "$bin/sanitizer-$tool.log" | tr '\n' ' ')"
    done
else
    echo "compute-sanitizer not found: the kernels ran without it"
fi

if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]} (log: $log)"
else
    echo "all GPU test executables passed (log: $log)"
fi
if ! $bench; then
    [ ${#failed[@]} -eq 0 ]
    exit
fi

# Training tokens/s, Metronome then PyTorch, shape by shape, on this GPU. Each command
# has a time limit so that the whole call stays inside the device lease: a shape that
# runs over is reported as missing, never waited for.
out=${OUT:-$bin}/bench
mkdir -p "$out"
echo "${#failed[@]}" >"$out/tests-failed.txt"
grep -E '^==> |^test result' "$log" >"$out/tests-summary.txt" || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$out/gpu.txt" 2>/dev/null || true
date -u +%Y-%m-%dT%H:%M:%SZ >"$out/date.txt"
cp "$here/commit.txt" "$out/commit.txt" 2>/dev/null || echo unknown >"$out/commit.txt"
bench_dir="$build_root/crates/metronome-model/benches"
for spec in smollm2-135m:8x512,32x512,16x1024:40 qwen2.5-0.5b:8x1024:40 qwen2.5-1.5b:8x1024:0; do
    IFS=: read -r shape train compile <<<"$spec"
    metronome=(
        "$bin/bin/throughput" --device cuda:0 --shape "$shape" --precision bf16 --train "$train"
        --memory chunked,chunked+checkpoint --generate '' --warmup 1 --reps 3 --json "$out/metronome-$shape.json"
    )
    echo "${metronome[*]}" >"$out/metronome-$shape.cmd"
    # Many threads for the host-side work (the random initialisation of 1.5 B weights).
    RAYON_NUM_THREADS=$(nproc) timeout 150 "${metronome[@]}" || echo "metronome $shape: exit $?"
    torch=(
        python3 "$bench_dir/torch_gpu.py" --shape "$shape" --train "$train" --warmup 1 --reps 3
        --json "$out/torch-$shape.json"
    )
    if [ "$compile" = 0 ]; then torch+=(--no-compile); else torch+=(--compile-budget-s "$compile"); fi
    echo "${torch[*]}" >"$out/torch-$shape.cmd"
    timeout 200 "${torch[@]}" || echo "torch $shape: exit $?"
done
# Generation tokens/s (issue #31): SmolLM2-135M, greedy, 64 and 256 sequences of
# 32 + 128 tokens; Metronome in f32 and in bf16 (the engine's default on a GPU), with
# the logits to the host and with the tokens drawn on the device, beside the memory
# roofline; then `transformers` `generate` (f32) on the same work.
for precision in f32 bf16; do
    gen=("$bin/bin/throughput" --device cuda:0 --shape smollm2-135m --precision "$precision" --train ''
        --generate 64,256 --json "$out/generate_metronome_$precision.json")
    echo "${gen[*]}" >"$out/generate_metronome_$precision.command"
    timeout 120 "${gen[@]}" || echo "metronome generate $precision: exit $?"
done
gen_torch=(python3 "$bench_dir/torch_gpu.py" --shape smollm2-135m --train '' --generate 64,256 --no-compile
    --json "$out/generate_torch.json")
echo "${gen_torch[*]}" >"$out/generate_torch.command"
timeout 120 "${gen_torch[@]}" || echo "torch generate: exit $?"
python3 "$bench_dir/gpu_report.py" "$out" >"${OUT:-$bin}/gpu.json" && echo "figures: ${OUT:-$bin}/gpu.json"
[ ${#failed[@]} -eq 0 ]
