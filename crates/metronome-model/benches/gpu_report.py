#!/usr/bin/env python3
"""Merges what `bash target/gpu/run.sh --bench` measured into one machine-readable
report on stdout (the run writes it to $OUT/gpu.json; it is committed as
`crates/metronome-model/benches/results/gpu.json` and the README's GPU table is taken
from it):

    python3 crates/metronome-model/benches/gpu_report.py BENCH_DIR > gpu.json

BENCH_DIR holds, per shape, `metronome-SHAPE.json` (`examples/throughput.rs --json`)
and `torch-SHAPE.json` (`benches/torch_gpu.py --json`) with the commands that wrote
them (`*.cmd`), and `gpu.txt` (nvidia-smi's name, driver, memory), `date.txt`,
`commit.txt` (the bundle's) and the GPU tests' summary. Each training row pairs
Metronome's figures (bf16, chunked head, with and without checkpointed layers) with
PyTorch eager bf16 autocast and torch.compile on the same shape and rows, and gives
Metronome's faster setting over eager, and each figure's model FLOP utilisation: 6N
FLOPs per token against the bf16 matmul peak PyTorch measured on the same GPU.
Generation rows pair Metronome's greedy decoding (f32 and bf16, logits to the host and
drawn on the device, its memory roofline) with `transformers` `generate`; `periodic`
against `sync` gives each run's wall time and per-period table; `profile` (when run.sh
profiled a step) sums Nsight Compute's per-kernel times by kernel name.
"""

import collections
import csv
import json
import pathlib
import sys


def read(path, default=None):
    try:
        return path.read_text().strip()
    except OSError:
        return default


def load(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def profile(bench):
    """Nsight Compute's per-kernel summary of one training step (`profile.csv`, written
    on request by run.sh), summed by kernel name: the step's GPU time, its launches, and
    the kernels that took the most of it."""
    lines = (read(bench / "profile.csv", "") or "").splitlines()
    rows = [r for r in csv.reader(lines) if len(r) > 14 and r[0].isdigit()]
    if not rows:
        return None
    time_ns, launches = collections.Counter(), collections.Counter()
    for r in rows:
        n, mean = int(r[8]), float(r[14].replace(",", ""))
        time_ns[r[3]] += n * mean
        launches[r[3]] += n
    total = sum(time_ns.values())
    return {
        "command": read(bench / "profile.cmd"),
        "gpu_time_ms": total / 1e6,
        "launches": sum(launches.values()),
        "top_kernels": [
            {"kernel": k, "ms": t / 1e6, "share": t / total, "launches": launches[k]}
            for k, t in time_ns.most_common(15)
        ],
    }


def main():
    bench = pathlib.Path(sys.argv[1])
    gpu = (read(bench / "gpu.txt", "") or "").split(", ")
    report = {
        "device": gpu[0] if gpu and gpu[0] else None,
        "driver": gpu[1] if len(gpu) > 1 else None,
        "memory_total": gpu[2] if len(gpu) > 2 else None,
        "commit": read(bench / "commit.txt"),
        "date": read(bench / "date.txt"),
        "command": read(bench / "command.txt", "bash target/gpu/run.sh --bench"),
        "gpu_tests": {
            "failed_executables": int(read(bench / "tests-failed.txt", "-1")),
            "summary": (read(bench / "tests-summary.txt", "") or "").splitlines(),
        },
        "matmul_peak_tflops": None,
        "torch": None,
        "training": [],
        "generation": [],
    }
    shapes = sorted({p.stem.split("-", 1)[1] for p in bench.glob("*-*.cmd")})
    for shape in shapes:
        ours, theirs = load(bench / f"metronome-{shape}.json"), load(bench / f"torch-{shape}.json")
        commands = {k: read(bench / f"{k}-{shape}.cmd") for k in ("metronome", "torch")}
        peak = None
        if theirs:
            peak = theirs["matmul_peak_tflops"]["bf16"]
            report["matmul_peak_tflops"] = report["matmul_peak_tflops"] or theirs["matmul_peak_tflops"]
            report["torch"] = report["torch"] or {k: theirs[k] for k in ("torch", "transformers")}
        sizes = {(f["rows"], f["len"]) for f in (ours or {}).get("train", []) + (theirs or {}).get("train", [])}
        for rows, length in sorted(sizes):
            row = {"shape": shape, "rows": rows, "len": length, "commands": commands}
            row["parameters"] = (ours or theirs or {}).get("parameters")
            for f in (ours or {}).get("train", []):
                if (f["rows"], f["len"]) == (rows, length):
                    row[f"metronome_bf16_{f['memory'].replace('+', '_')}"] = f
            for f in (theirs or {}).get("train", []):
                if (f["rows"], f["len"]) == (rows, length):
                    row[f"torch_{f['kind']}"] = f
            for key, f in list(row.items()):
                if isinstance(f, dict) and f.get("tflops_6n") is not None and peak:
                    f["mfu_bf16_peak"] = f["tflops_6n"] / peak
            ours_best = max(
                (f["tokens_per_s"] for k, f in row.items() if k.startswith("metronome_") and f.get("tokens_per_s")),
                default=None,
            )
            eager = row.get("torch_eager_bf16", {}).get("tokens_per_s")
            row["metronome_best_over_torch_eager"] = ours_best / eager if ours_best and eager else None
            report["training"].append(row)
    # Generation: Metronome (f32 and bf16) with the logits to the host and drawn on the
    # device, its memory roofline, and `transformers` `generate` in bf16 with its dynamic
    # and static caches, per number of sequences; each ratio is against transformers'
    # faster cache.
    theirs = load(bench / "generate_torch.json")
    torch_figures = [f for f in (theirs or {}).get("generate", []) if isinstance(f, dict)]
    report["generation_torch_attention"] = (theirs or {}).get("attention")
    for precision in ("f32", "bf16"):
        ours = load(bench / f"generate_metronome_{precision}.json")
        commands = {
            "metronome": read(bench / f"generate_metronome_{precision}.command"),
            "torch": read(bench / "generate_torch.command"),
        }
        host = dict((ours or {}).get("generate", []))
        drawn = dict((ours or {}).get("generate_drawn", []))
        graphed = dict((ours or {}).get("generate_graphed", []))
        top_p = dict((ours or {}).get("generate_top_p", []))
        graph_stats = dict((ours or {}).get("generate_graph_stats", []))
        roofline = dict((ours or {}).get("generate_roofline", []))
        for n in sorted(set(host) | set(drawn) | set(graphed)):
            row = {
                "sequences": n,
                "precision": precision,
                "metronome_logits_to_host": host.get(n),
                "metronome_drawn_on_device": drawn.get(n),
                "metronome_cuda_graphs": graphed.get(n),
                # Sampled from the top-p 0.9 nucleus at T = 1: the truncated draw's cost.
                "metronome_drawn_top_p": top_p.get(n),
                "cuda_graph_stats": graph_stats.get(n),
                "roofline": roofline.get(n),
                "copy_bandwidth_gbps": (ours or {}).get("copy_bandwidth_gbps"),
                "commands": commands,
            }
            for f in torch_figures:
                if f["sequences"] == n:
                    row[f"transformers_{f['precision']}_{f['cache']}"] = f.get("tokens_per_s")
            best = max((x for x in (host.get(n), drawn.get(n), graphed.get(n)) if x), default=None)
            theirs_best = max(
                (f["tokens_per_s"] for f in torch_figures if f["sequences"] == n and f["precision"] == "bf16" and f.get("tokens_per_s")),
                default=None,
            )
            row["transformers_bf16_best"] = theirs_best
            row["metronome_best_over_transformers_bf16"] = best / theirs_best if best and theirs_best else None
            row["metronome_best_over_roofline"] = best / roofline[n] if best and roofline.get(n) else None
            report["generation"].append(row)
    # Publication to an engine of the same process: through the host against device to
    # device (`throughput --publish`), and one raw device copy of the weights.
    published = load(bench / "publish.json")
    report["publication"] = (
        dict(published["publish"], command=read(bench / "publish.command"))
        if published and published.get("publish")
        else None
    )
    # `periodic` against `sync` on the default run: each one's wall seconds and the run's
    # own per-period table (generation and training busy seconds, overlap); `-streams`:
    # the same with each stage on a CUDA stream of its own (METRONOME_CUDA_STAGE_STREAMS=1);
    # `-graphs`: the engine's decode steps as CUDA graphs (METRONOME_CUDA_GRAPHS=1).
    report["periodic_vs_sync"] = {}
    for schedule in ("sync", "periodic", "sync-streams", "periodic-streams", "sync-graphs", "periodic-graphs"):
        lines = (read(bench / f"overlap-{schedule}.txt", "") or "").splitlines()
        if lines:
            report["periodic_vs_sync"][schedule] = {"command": lines[0], "wall_s": lines[1], "summary": lines[2:]}
    report["profile"] = profile(bench)
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
