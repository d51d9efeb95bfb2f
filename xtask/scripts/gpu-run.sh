#!/usr/bin/env bash
# Runs the test executables that `cargo xtask gpu bundle` packed, on a machine with an
# NVIDIA GPU and CUDA's libraries in its Python packages (no Rust needed):
#
#   bash target/gpu/run.sh [FILTER ...]     # from the repository root; FILTER goes to every test binary
#   bash target/gpu/run.sh --bench          # every GPU test, then training tokens/s against PyTorch
#   bash target/gpu/run.sh --learn GGUF     # the SmolLM2 learning run of issue #32 (no tests)
#   bash target/gpu/run.sh --trl GGUF WHEELS  # TRL's GRPOTrainer on the same data (#32)
#
# Every executable runs from its package directory, as `cargo test` runs it, with one
# rayon/candle thread per test (as `cargo xtask ci` does). Logs go to $OUT/gpu-tests.log
# when $OUT is set. Exits non-zero when any executable failed.
#
# `--bench` is the one device call of issues #30 and #31 (at most BENCH_S seconds, default
# 540, on an H100): the GPU tests (`cuda_*`) and the kernels under compute-sanitizer, then
# the figures, most wanted first: Metronome's bf16 training step (chunked head, without
# and with checkpointed layers; `examples/throughput.rs`) against PyTorch eager bf16
# autocast and torch.compile (`benches/torch_gpu.py`) for SmolLM2-135M at 8x512, 32x512
# and 16x1024; generation in bf16 at 1-256 sequences against `transformers` `generate`;
# publication of the weights to an engine through the host against device to device, and
# `periodic` against `sync` on the default run; Qwen2.5-0.5B and 1.5B at 8x1024 (random
# weights, `crates/metronome-model/benches/llama_shapes.json`); f32 generation. Then
# `benches/gpu_report.py` merges everything, with the device, driver, commit and date,
# into $OUT/gpu.json (commit it as crates/metronome-model/benches/results/gpu.json) and
# the raw figures into $OUT/bench.tar. Every figure's command is in it.
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

script_start=$(date +%s)
bench=false
if [ "${1:-}" = "--bench" ]; then
    bench=true
    shift
    # The GPU tests only (every one is named `cuda_*`): the rest is what CI runs.
    [ $# -eq 0 ] && set -- cuda
fi

# `--learn GGUF` is issue #32's device call, without the tests: the SmolLM2 preset
# (configs/smollm2-gsm.toml) on the GGUF at that path, limited to LEARN_S seconds
# (default 330), held-out accuracy before, during and after; then `periodic` and
# `sync` for LEARN_COMPARE_PERIODS periods (default 3) on the same seed, their rewards
# side by side; then `metronome export` of the learned run and
# `examples/check_export.py` (transformers' greedy answers against Metronome's). Into
# $OUT: learn-metrics.jsonl, learn.log, learn-plots/ (reward, held-out accuracy and
# throughput), learn-summary.txt, compare.txt, export-check.txt. Arguments after the GGUF go to every `metronome run` (e.g. `--set
# run.seed=1` for a second seed); LEARN_EXPORT=0 and LEARN_COMPARE_PERIODS=0 skip the
# export check and the comparison, so a call holds the learning run alone.
if [ "${1:-}" = "--learn" ]; then
    gguf=${2:?usage: run.sh --learn PATH_TO_SmolLM2-135M-Instruct.Q4_1.gguf [--set KEY=VALUE ...]}
    shift 2
    out=${OUT:-$bin}
    runs=$bin/runs
    mkdir -p "$runs"
    metronome=("$bin/bin/metronome" run --config "$build_root/configs/smollm2-gsm.toml"
        --set "model.path=\"$gguf\"" --set "run.out_dir=\"$runs\"" "$@")
    echo "${metronome[*]}" >"$out/learn-summary.txt"
    start=$(date +%s)
    (cd "$build_root" && timeout "${LEARN_S:-330}" "${metronome[@]}" --set 'run.name="learn"') >"$bin/learn.log" 2>&1
    echo "learning run: exit $?, $(($(date +%s) - start)) s" | tee -a "$out/learn-summary.txt"
    learned=$(ls -d "$runs"/learn* 2>/dev/null | head -n 1)
    if [ -z "$learned" ]; then
        tail -n 40 "$bin/learn.log" >>"$out/learn-summary.txt"
        exit 0
    fi
    cp "$learned/metrics.jsonl" "$out/learn-metrics.jsonl" 2>/dev/null
    # Not timeline.svg (about 1 MB): $OUT brings back 8 files at most.
    mkdir -p "$out/learn-plots" && cp "$learned"/{reward,heldout,throughput}.svg "$out/learn-plots/" 2>/dev/null
    cp "$bin/learn.log" "$out/learn.log"
    grep -iE 'held-out|accuracy|period [0-9]+' "$bin/learn.log" | tail -n 60 >>"$out/learn-summary.txt"
    if [ "${LEARN_EXPORT:-1}" != 0 ]; then
        # The final checkpoint, or the newest period's when LEARN_S killed the run; 20
        # questions, as transformers' unbatched greedy decoding took about 5 s each there.
        export=("$bin/bin/metronome" export "$learned" --out "$bin/hf" --questions 20)
        (cd "$build_root" && { timeout 120 "${export[@]}" || timeout 120 "${export[@]}" --checkpoint latest; } &&
            timeout 150 python3 crates/metronome-pipeline/examples/check_export.py "$bin/hf" --device cuda) \
            >"$out/export-check.txt" 2>&1
        echo "export check: exit $?" >>"$out/export-check.txt"
    fi
    [ "${LEARN_COMPARE_PERIODS:-3}" = 0 ] && exit 0
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

# `--trl GGUF WHEELS` is issue #32's comparison with TRL: GRPOTrainer on the preset's
# data and settings (benches/trl_gsm.py), its base model exported by Metronome
# (`metronome export --checkpoint base`) and its prompts written by `metronome prompts`
# (TRL_STEPS periods' batches, 64 held-out prompts). The machine has no trl and no
# datasets: WHEELS is a folder of their wheels (and of whatever else they need that it
# lacks), installed offline into $bin/pylib. Into $OUT: trl-gsm.json, trl.log.
if [ "${1:-}" = "--trl" ]; then
    gguf=${2:?usage: run.sh --trl PATH_TO_SmolLM2-135M-Instruct.Q4_1.gguf WHEELS_DIR}
    wheels=$(cd "${3:?usage: run.sh --trl GGUF WHEELS_DIR}" && pwd)
    out=${OUT:-$bin}
    base=$bin/runs/base
    mkdir -p "$base"
    # --no-deps: the machine's own packages (transformers, accelerate, pyarrow, ...) stay
    # the ones used; WHEELS holds exactly what it lacks.
    python3 -m pip install --quiet --no-index --no-deps --target "$bin/pylib" "$wheels"/*.whl \
        >"$out/trl.log" 2>&1
    (cd "$build_root" && "$bin/bin/metronome" config --config configs/smollm2-gsm.toml \
        --set "model.path=\"$gguf\"" >"$base/config.toml" &&
        "$bin/bin/metronome" export "$base" --checkpoint base --out "$bin/smol-hf" --questions 0 &&
        "$bin/bin/metronome" prompts --config configs/smollm2-gsm.toml --set "model.path=\"$gguf\"" \
            --periods "${TRL_STEPS:-40}" --heldout 64 --out "$bin/gsm.jsonl" &&
        PYTHONPATH="$bin/pylib" timeout "${TRL_S:-400}" python3 crates/metronome-pipeline/benches/trl_gsm.py \
            --model "$bin/smol-hf" --prompts "$bin/gsm.jsonl" --steps "${TRL_STEPS:-40}" \
            --eval-every "${TRL_EVAL_EVERY:-10}" --out "$out/trl-gsm.json") \
        >>"$out/trl.log" 2>&1
    echo "trl: exit $?" >>"$out/trl.log"
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
    # With --bench, initcheck runs last, if the figures leave time for it.
    tools=(memcheck initcheck)
    $bench && tools=(memcheck)
    for tool in "${tools[@]}"; do
        if ! (cd "$build_root/$model_it" && timeout 120 "$san" --tool "$tool" --error-exitcode 9 \
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

# The figures, most wanted first, each step with its own time limit and all of them
# inside BENCH_S seconds (default 540) from the script's start, so that the whole call
# stays inside the device lease: a step that no longer fits is recorded as skipped,
# never waited for. After every step the raw figures are packed into $OUT/bench.tar and
# merged into $OUT/gpu.json, so a call cut short still returns what it measured (and
# stays within the 8 files a call brings back).
out=$bin/bench
mkdir -p "$out"
report=${OUT:-$bin}
echo "${#failed[@]}" >"$out/tests-failed.txt"
grep -E '^==> |^test result|^test .* FAILED' "$log" >"$out/tests-summary.txt" || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$out/gpu.txt" 2>/dev/null || true
date -u +%Y-%m-%dT%H:%M:%SZ >"$out/date.txt"
echo "BENCH_ONLY='${BENCH_ONLY:-}' TORCH_COMPILE_S=${TORCH_COMPILE_S:-25} BENCH_S=${BENCH_S:-540} bash target/gpu/run.sh --bench" \
    >"$out/command.txt"
cp "$here/commit.txt" "$out/commit.txt" 2>/dev/null || echo unknown >"$out/commit.txt"
bench_dir="$build_root/crates/metronome-model/benches"
step() { # step NAME LIMIT_S COMMAND...: runs it if it fits, then packs what there is
    local name=$1 limit=$2 left=$((deadline - $(date +%s)))
    shift 2
    if [ "$left" -lt 20 ]; then
        echo "$name: skipped ($left s left)" | tee -a "$out/skipped.txt"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "==> $name (limit $limit s)"
    timeout "$limit" "$@" || echo "$name: exit $?" | tee -a "$out/exits.txt"
    tar -cf "$report/bench.tar" -C "$bin" bench
    python3 "$bench_dir/gpu_report.py" "$out" >"$report/gpu.json"
}
train() { # train SHAPE ROWSxLEN,... COMPILE_BUDGET_S: Metronome's step, then PyTorch's
    local shape=$1 sizes=$2 compile=$3
    local ours=("$bin/bin/throughput" --device cuda:0 --shape "$shape" --precision bf16 --train "$sizes"
        --memory chunked,chunked+checkpoint,chunked+flash,chunked+checkpoint+flash --generate '' --warmup 1 --reps 3 --json "$out/metronome-$shape.json")
    echo "${ours[*]}" >"$out/metronome-$shape.cmd"
    # Many threads for the host-side work (the random initialisation of 1.5 B weights).
    RAYON_NUM_THREADS=$(nproc) step "metronome train $shape" 120 "${ours[@]}"
    local theirs=(python3 "$bench_dir/torch_gpu.py" --shape "$shape" --train "$sizes" --warmup 1 --reps 3
        --generate '' --json "$out/torch-$shape.json")
    if [ "$compile" = 0 ]; then theirs+=(--no-compile); else theirs+=(--compile-budget-s "$compile"); fi
    echo "${theirs[*]}" >"$out/torch-$shape.cmd"
    step "torch train $shape" 150 "${theirs[@]}"
}
generate() { # generate PRECISION SEQUENCES: Metronome's engine-style greedy decoding
    local ours=("$bin/bin/throughput" --device cuda:0 --shape smollm2-135m --precision "$1" --train ''
        --generate "$2" --json "$out/generate_metronome_$1.json")
    echo "${ours[*]}" >"$out/generate_metronome_$1.command"
    step "metronome generate $1" 120 "${ours[@]}"
}
overlap() { # overlap SCHEDULE [STREAMS] [GRAPHS]: the default run on the GPU, 4 periods, no warm start, no evaluation
    # With STREAMS=1 each stage has a GPU handle and CUDA stream of its own (METRONOME_CUDA_STAGE_STREAMS);
    # with GRAPHS=1 the engine replays its decode steps as CUDA graphs (METRONOME_CUDA_GRAPHS).
    local name=$1
    [ "${2:-0}" = 1 ] && name+=-streams
    [ "${3:-0}" = 1 ] && name+=-graphs
    local run=("$bin/bin/metronome" run --set 'model.device="cuda:0"' --set run.periods=4 --set sft.steps=0
        --set eval.prompts=0 --set "run.schedule=\"$1\"" --set "run.out_dir=\"$bin/runs\"" --set "run.name=\"$name\"")
    local start=$(date +%s.%N)
    (cd "$build_root" && METRONOME_CUDA_STAGE_STREAMS=${2:-0} METRONOME_CUDA_GRAPHS=${3:-0} step "overlap $name" 60 "${run[@]}") >"$bin/overlap-$name.log" 2>&1
    { echo "METRONOME_CUDA_STAGE_STREAMS=${2:-0} METRONOME_CUDA_GRAPHS=${3:-0} ${run[*]}"; awk "BEGIN { print $(date +%s.%N) - $start }"
        tail -n 12 "$bin/overlap-$name.log"; } >"$out/overlap-$name.txt"
    tail -n 12 "$bin/overlap-$name.log"
}
longtail() { # longtail NAME SETTINGS...: the long-tail bench's run (issue #34) on the GPU
    local name=$1
    shift
    local run=("$bin/bin/metronome" run --config crates/metronome-pipeline/configs/longtail_copy.toml
        --set 'model.device="cuda:0"' --set run.periods=40 --set data.release.batch_size=8 --set run.group_size=16
        --set rollout.max_num_seqs=128 --set eval.prompts=400 --set eval.every=40 --set "run.out_dir=\"$bin/runs\""
        --set "run.name=\"longtail-$name\"" "$@")
    (cd "$build_root" && step "longtail $name" 90 "${run[@]}") >"$bin/longtail-$name.log" 2>&1
    cp "$bin/runs/longtail-$name/metrics.jsonl" "$out/longtail-$name.jsonl" 2>/dev/null || true
    # Generated tokens per second of the periods' wall time, as the CPU bench counts them.
    { echo "${run[*]}"; python3 -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("tokens/s", sum(r["generated_tokens"] for r in rows) / sum(r["period_s"] for r in rows))' \
        "$out/longtail-$name.jsonl" 2>&1; grep 'held-out accuracy:' "$bin/longtail-$name.log"; } >"$out/longtail-$name.txt"
    cat "$out/longtail-$name.txt"
}
deadline=$((script_start + ${BENCH_S:-540}))
# When this crate's kernels failed their tests, the figures are taken without them.
if grep -qE '^test .*cuda_kernel.* FAILED' "$log"; then
    echo "the CUDA kernels failed their tests: the figures below are taken with METRONOME_CUDA_KERNELS=0" |
        tee "$out/kernels-off.txt"
    export METRONOME_CUDA_KERNELS=0
fi
# The steps, in this order; BENCH_ONLY="NAME ..." runs those alone (e.g. after a kernel
# change, `BENCH_ONLY="smollm2 profile"`). TORCH_COMPILE_S (default 25) bounds
# torch.compile's compiling for the SmolLM2 shapes (0: eager alone).
on_request=" profile longtail overlap-profile "
wanted() { [ -z "${BENCH_ONLY:-}" ] && [[ "$on_request" != *" $1 "* ]] || [[ " ${BENCH_ONLY:-} " == *" $1 "* ]]; }
# Training (issue #30): SmolLM2-135M at 8x512, 32x512, 16x1024; Qwen2.5-0.5B and 1.5B at
# 8x1024 (random weights, llama_shapes.json); bf16 with the chunked head, without and with
# checkpointed layers, rows attended whole (the default) and per segment by the flash
# kernels (`+flash`, last: a kernel fault cannot cost the figures before it), against
# PyTorch eager bf16 autocast and torch.compile.
wanted smollm2 && train smollm2-135m 8x512,32x512,16x1024 "${TORCH_COMPILE_S:-25}"
# Generation (issue #31): greedy, 32-token prompt + 128 new, in bf16 (the engine's
# default on a GPU) at 1, 16, 64 and 256 sequences, logits to the host, drawn on the
# device, and drawn with the decode steps replayed as CUDA graphs (opt-in,
# `KvCache::set_cuda_graphs`; what the graphs did is in the report), beside the memory roofline, against `transformers` `generate` in bf16 (its
# dynamic cache: its static one, made for torch.compile, ran past two minutes in eager
# on an H100); then `periodic` against `sync` on the default run.
if wanted generate; then
    generate bf16 1,16,64,256
    gen_torch=(python3 "$bench_dir/torch_gpu.py" --shape smollm2-135m --train '' --generate 1,16,64,256 --no-compile
        --generate-cache dynamic --json "$out/generate_torch.json")
    echo "${gen_torch[*]}" >"$out/generate_torch.command"
    step "torch generate" 100 "${gen_torch[@]}"
fi
if wanted overlap; then
    # Publication to an engine of the same process (issue #31): through the host against
    # device to device, SmolLM2-135M's f32 weights into a bf16 engine on its own stream.
    publish=("$bin/bin/throughput" --device cuda:0 --shape smollm2-135m --precision bf16 --train ''
        --generate '' --publish --reps 5 --json "$out/publish.json")
    echo "${publish[*]}" >"$out/publish.command"
    step "metronome publish" 60 "${publish[@]}"
    overlap sync
    overlap periodic
    # Issue #31: the engine and the trainer on streams of their own.
    overlap sync 1
    overlap periodic 1
    # Issue #31: the engine's decode steps as CUDA graphs (opt-in: does a capture beside
    # the trainer survive, and what do they save end to end?).
    overlap sync 0 1
    overlap periodic 0 1
fi
# On request only (and then before the larger shapes, which a short call may not
# reach): where a SmolLM2 8x512 bf16 training step spends its GPU time, per
# kernel (Nsight Compute's duration of every launch of one step, summed by name), and
# the step's wall time beside it: GPU time well below the wall time means the host's
# launches, not the kernels, set the pace.
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1 || true)
if wanted profile && [ -n "$ncu_bin" ]; then
    prof=("$ncu_bin" --metrics gpu__time_duration.sum --print-summary per-kernel --csv --cache-control none
        --clock-control none "$bin/bin/throughput" --device cuda:0 --shape smollm2-135m --precision bf16
        --train 8x512 --memory chunked --generate '' --warmup 0 --reps 1)
    echo "${prof[*]}" >"$out/profile.cmd"
    step "profile" 120 "${prof[@]}" >"$out/profile.csv" 2>"$bin/profile.err"
    tail -n 5 "$bin/profile.err"
fi
wanted qwen0.5 && train qwen2.5-0.5b 8x1024 0
wanted qwen1.5 && train qwen2.5-1.5b 8x1024 0
# On request only: where the host's time goes when the two stages share the GPU
# (issue #31: `periodic` ran slower than `sync` on one H100, its training busy time
# growing 0.74 -> 2.14 s when overlapped). Nsight Systems' summaries of the default run
# under each schedule: the CUDA API calls (a synchronising copy, allocation or free
# blocks the host thread that makes it; a synchronous free waits for the whole
# device), the kernels and the copies, so the two can be compared call by call.
nsys_bin=$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda*/bin/nsys 2>/dev/null | head -n 1 || true)
if wanted overlap-profile && [ -n "$nsys_bin" ]; then
    for schedule in sync periodic; do
        run=("$nsys_bin" profile --trace cuda,osrt --stats true --force-overwrite true
            --output "$bin/overlap-$schedule" "$bin/bin/metronome" run --set 'model.device="cuda:0"'
            --set run.periods=4 --set sft.steps=0 --set eval.prompts=0 --set "run.schedule=\"$schedule\""
            --set "run.out_dir=\"$bin/runs\"" --set "run.name=\"profile-$schedule\"")
        echo "${run[*]}" >"$out/overlap-profile-$schedule.txt"
        (cd "$build_root" && step "overlap profile $schedule" 90 "${run[@]}") >>"$out/overlap-profile-$schedule.txt" 2>&1
        grep -A 12 -E 'cuda_api_sum|cuda_gpu_kern_sum' "$out/overlap-profile-$schedule.txt" | head -n 30
    done
fi
# On request only: the long-tail bench's schedules on the GPU engine (issue #34: partial
# rollouts against `stale:2` without them; `cargo bench -p metronome-pipeline --bench
# longtail` is the CPU's side by side).
if wanted longtail; then
    stale=(--set 'run.schedule="stale:2"' --set trainer.loss.tis_cap=2.0)
    longtail sync --set 'run.schedule="sync"'
    longtail stale2 "${stale[@]}"
    longtail partial-rebuilt "${stale[@]}" --set rollout.partial_rollouts=true --set 'rollout.partial_cache="rebuild"'
    longtail partial-kept "${stale[@]}" --set rollout.partial_rollouts=true --set 'rollout.partial_cache="keep"'
fi
# Then what an earlier call measured before: f32 generation, and the kernels under initcheck.
wanted f32 && generate f32 64,256
if wanted initcheck && [ -n "$san" ] && [ -n "$model_it" ]; then
    (cd "$build_root/$model_it" && step "compute-sanitizer initcheck" 90 "$san" --tool initcheck --error-exitcode 9 \
        "$bin/bin/metronome-model-it" cuda_kernel) >"$bin/sanitizer-initcheck.log" 2>&1
    grep -E 'ERROR SUMMARY|^test result|exit' "$bin/sanitizer-initcheck.log" | tee "$out/initcheck.txt"
fi
echo "figures: $report/gpu.json, raw: $report/bench.tar"
[ ${#failed[@]} -eq 0 ]
