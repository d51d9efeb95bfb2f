#!/usr/bin/env python3
"""End-to-end GRPO throughput against TRL's `GRPOTrainer`, side by side on this machine.

    python3 crates/metronome-pipeline/benches/trl_compare.py            # AVX-512 where present
    METRONOME_SIMD=avx2 python3 crates/metronome-pipeline/benches/trl_compare.py   # AVX2 only

The matched configuration (both sides): the tiny Llama of `ModelConfig::tiny()` with
random weights and Metronome's character vocabulary, the built-in arithmetic prompts,
4 prompts x G = 4 per step, exactly 64 new tokens per answer, temperature 1, KL 0.04
against a reference model, 20 optimiser steps, on-policy (`periodic` on Metronome's
side, which equals synchronous GRPO). Each side generates 20 x 16 x 64 = 20,480 tokens.

Measured: generated tokens per second of the training loop, on each side from the
first step to the last: TRL's `trainer.train()`, Metronome's periods (the sum of
`period_s` in metrics.jsonl). Beside it, Metronome's whole `metronome run` process
(start-up, model building, the run directory's plots), against the same TRL loop.
The two run alternately, `--pairs` times (3 by default), and the median of the pairs'
ratios is reported, beside each side's median.

TRL's side runs in a virtual environment this script creates on first use
(`target/bench-venv/trl`, pinned versions below, about 4 GB with PyTorch's wheels).
Metronome's side is built in release: with `METRONOME_SIMD=avx2` without the `avx512`
feature (so gemm stays at AVX2) into `target/avx2`, and run with the variable set (so
the fused kernels do too).

Results go to `crates/metronome-pipeline/benches/results/trl_compare[_avx2].json` (or
`--out NAME` there) with the command, the machine, the commit and every pair. Not part
of CI.
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[3]
HERE = pathlib.Path(__file__).resolve().parent
PINS = ["torch==2.15.0", "transformers==5.24.0", "trl==1.16.0", "datasets==5.2.0", "accelerate==1.15.0"]

STEPS, PROMPTS, GROUP, NEW_TOKENS = 20, 4, 4, 64


def venv_python(venv):
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating {venv} and installing {' '.join(PINS)} (once)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", *PINS], check=True)
    return python


def build_metronome(avx2):
    cmd = ["cargo", "build", "--release", "-p", "metronome-cli"]
    target = ROOT / "target"
    if avx2:
        cmd += ["--no-default-features", "--features", "nats,http"]
        target = ROOT / "target" / "avx2"
        cmd += ["--target-dir", str(target)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return target / "release" / "metronome"


def metronome_args(out_dir):
    return ["run", "--config", str(HERE / "trl_compare.toml"), "--set", f"run.out_dir={out_dir}"]


def run_metronome(binary, env):
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        done = subprocess.run([str(binary), *metronome_args(out)], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"metronome run failed ({done.returncode}):\n{done.stderr}")
        seconds = time.perf_counter() - start
        periods = [json.loads(l) for l in (pathlib.Path(out) / "trl-compare" / "metrics.jsonl").read_text().splitlines()]
    return {
        "seconds": seconds,
        # The training loop alone (the sum of the periods), as TRL's clock measures it.
        "loop_seconds": sum(p["period_s"] for p in periods),
        "tokens": sum(p["generated_tokens"] for p in periods),
        # Groups whose backward was skipped (all rewards equal): the work TRL did and we did not.
        "zero_advantage_groups": sum(p["step"]["zero_advantage_groups"] for p in periods if p.get("step")),
        "groups": sum(p["groups"] for p in periods),
    }


def run_trl(python, env):
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run(
            [str(python), str(HERE / "trl_grpo.py"), "--steps", str(STEPS), "--prompts", str(PROMPTS),
             "--group", str(GROUP), "--new-tokens", str(NEW_TOKENS), "--out", out],
            env=env, capture_output=True, text=True,
        )
        if done.returncode != 0:
            sys.exit(f"TRL's side failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cpu_flags():
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    def field(name):
        return next((l.split(":", 1)[1].strip() for l in text.splitlines() if l.split(":", 1)[0].strip() == name), "")

    flags = field("flags").split()
    # A virtual machine's "model name" can be as vague as "AMD EPYC": the family and
    # model numbers tell the generations apart (AMD: family 25 model 17 is Zen 4,
    # family 26 Zen 5), and with them how AVX-512 executes.
    return {"model": field("model name"), "family": field("cpu family"), "model_number": field("model"),
            "cores": os.cpu_count(),
            "avx512": [f for f in flags if f.startswith("avx512") or f.startswith("amx")]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--venv", type=pathlib.Path, default=ROOT / "target" / "bench-venv" / "trl")
    ap.add_argument("--no-write", action="store_true", help="print the results without writing the file")
    ap.add_argument("--out", help="the results file's name under results/ (default: trl_compare[_avx2].json), "
                    "e.g. to keep another machine's figures beside this one's")
    args = ap.parse_args()

    avx2 = os.environ.get("METRONOME_SIMD", "").strip().lower() in ("avx2", "x86-v3")
    python = venv_python(args.venv)
    binary = build_metronome(avx2)
    env = dict(os.environ)

    pairs = []
    for i in range(args.pairs):
        trl = run_trl(python, env)
        ours = run_metronome(binary, env)
        trl["tokens_per_s"] = (trl["tokens"] or STEPS * PROMPTS * GROUP * NEW_TOKENS) / trl["seconds"]
        ours["tokens_per_s"] = ours["tokens"] / ours["loop_seconds"]
        ours["process_tokens_per_s"] = ours["tokens"] / ours["seconds"]
        pair = {
            "trl": trl,
            "metronome": ours,
            "ratio": ours["tokens_per_s"] / trl["tokens_per_s"],
            "process_ratio": ours["process_tokens_per_s"] / trl["tokens_per_s"],
        }
        pairs.append(pair)
        print(f"pair {i + 1}: TRL {trl['tokens_per_s']:.0f} tok/s ({trl['seconds']:.2f} s), "
              f"Metronome {ours['tokens_per_s']:.0f} tok/s ({ours['loop_seconds']:.2f} s; "
              f"{ours['seconds']:.2f} s as a process): {pair['ratio']:.2f}x ({pair['process_ratio']:.2f}x)")

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout)
    result = {
        "command": " ".join(["METRONOME_SIMD=avx2"] * avx2 + ["python3", "crates/metronome-pipeline/benches/trl_compare.py"]
                            + (["--out", args.out] if args.out else [])),
        "path": "avx2" if avx2 else "native",
        "commit": commit + ("-dirty" if dirty else ""),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {**cpu_flags(), "platform": platform.platform()},
        "config": {"steps": STEPS, "prompts": PROMPTS, "group": GROUP, "new_tokens": NEW_TOKENS, "kl": 0.04},
        "trl_versions": PINS,
        "pairs": pairs,
        "median_ratio": statistics.median(p["ratio"] for p in pairs),
        "median_process_ratio": statistics.median(p["process_ratio"] for p in pairs),
        "median_trl_tokens_per_s": statistics.median(p["trl"]["tokens_per_s"] for p in pairs),
        "median_metronome_tokens_per_s": statistics.median(p["metronome"]["tokens_per_s"] for p in pairs),
    }
    print(f"median: {result['median_ratio']:.2f}x TRL, {result['median_process_ratio']:.2f}x counting "
          f"Metronome's whole process ({result['path']})")
    if not args.no_write:
        out = HERE / "results" / (args.out or f"trl_compare{'_avx2' if avx2 else ''}.json")
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
