#!/usr/bin/env python3
"""How much of a period the allocator and page zeroing take, from a CPU profile.

    python3 crates/metronome-pipeline/benches/alloc_profile.py                 # this HEAD
    python3 crates/metronome-pipeline/benches/alloc_profile.py --against OLD   # and another build

Runs the TRL-matched configuration (`trl_compare.toml`, the one `trl_compare.py`
compares with TRL) under `perf record` twice, for 20 and for 80 periods, and counts
the samples of each kind of symbol in the 60 periods between them: start-up, model
building and the run directory's plots are in both runs and drop out of the
difference, so the shares are of what the period loop costs. The kinds:

- `allocator`: mimalloc's own code (`mi_*`, `_mi_*`) and glibc's malloc, should a
  build use it;
- `page_zeroing`: the kernel zeroing pages it maps afresh (`clear_page*`), what an
  allocator that hands memory back to the system and takes it again costs;
- `memset` and `memcpy` (with `memmove`): zero fills and copies, for context.

With `--against BINARY` the rounds alternate between this build and the other one (a
build of an older commit, say), so that both see the same machine. Each round's shares
are kept and their medians reported.

Needs `perf` and the right to profile (root, or `kernel.perf_event_paranoid` <= 1).
Results go to `crates/metronome-pipeline/benches/results/alloc_profile.json` (or
`--out NAME`) with the command, the machine, the commit and every round. Not part of CI.
"""

import argparse
import json
import pathlib
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from trl_compare import ROOT, build_metronome, cpu_flags, metronome_args  # noqa: E402

SHORT, LONG = 20, 80
KINDS = {
    "allocator": re.compile(r"^(_?mi_|malloc$|free$|cfree$|realloc$|calloc$|_int_malloc$|_int_free|_int_realloc$)"),
    "page_zeroing": re.compile(r"^clear_page"),
    "memset": re.compile(r"memset"),
    "memcpy": re.compile(r"mem(cpy|move)"),
}
LINE = re.compile(r"^\s*[\d.]+%\s+(\d+)\s+\[.\]\s+(\S+)")


def profile(binary, periods):
    """Samples in all and by kind for one run of `periods` periods."""
    with tempfile.TemporaryDirectory() as tmp:
        data = pathlib.Path(tmp) / "perf.data"
        cmd = ["perf", "record", "-q", "-F", "4000", "-o", str(data), str(binary),
               *metronome_args(pathlib.Path(tmp) / "run"), "--set", f"run.periods={periods}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"`{' '.join(cmd)}` failed ({done.returncode}):\n{done.stderr[-4000:]}")
        report = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", "sym",
                                 "-n", "-g", "none"], capture_output=True, text=True, check=True).stdout
    counts = {"all": 0, **{k: 0 for k in KINDS}}
    for line in report.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        samples, sym = int(m.group(1)), m.group(2)
        counts["all"] += samples
        kind = next((k for k, pattern in KINDS.items() if pattern.search(sym)), None)
        if kind:
            counts[kind] += samples
    return counts


def round_of(binary):
    short, long = profile(binary, SHORT), profile(binary, LONG)
    period = {k: long[k] - short[k] for k in long}
    if period["all"] <= 0:
        sys.exit(f"the {LONG}-period run took no more samples than the {SHORT}-period one: too noisy to read")
    shares = {k: 100 * period[k] / period["all"] for k in KINDS}
    return {"period_samples": period["all"], "percent": shares}


def medians(rounds):
    return {k: statistics.median(r["percent"][k] for r in rounds) for k in KINDS}


def show(name, r):
    p = r["percent"]
    return (f"{name}: allocator {p['allocator']:.2f}%, page zeroing {p['page_zeroing']:.2f}%, "
            f"memset {p['memset']:.2f}%, memcpy {p['memcpy']:.2f}% of {r['period_samples']} samples")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--against", type=pathlib.Path, help="another `metronome` binary, profiled in alternate rounds")
    ap.add_argument("--no-write", action="store_true", help="print the results without writing the file")
    ap.add_argument("--out", help="the results file's name under results/ (default: alloc_profile.json)")
    args = ap.parse_args()
    if shutil.which("perf") is None:
        sys.exit("`perf` is not installed (e.g. `apt-get install linux-perf`)")
    if args.against and not args.against.is_file():
        sys.exit(f"--against {args.against}: no such file")

    binary = build_metronome(avx2=False)
    builds = {"this": binary, **({"against": args.against} if args.against else {})}
    rounds = {name: [] for name in builds}
    for i in range(args.rounds):
        for name, b in builds.items():
            r = round_of(b)
            rounds[name].append(r)
            print(f"round {i + 1}, {show(name, r)}")

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout)
    result = {
        "command": " ".join(["python3", "crates/metronome-pipeline/benches/alloc_profile.py"]
                            + (["--against", str(args.against)] if args.against else [])
                            + (["--out", args.out] if args.out else [])),
        "commit": commit + ("-dirty" if dirty else ""),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {**cpu_flags(), "platform": platform.platform()},
        "config": "crates/metronome-pipeline/benches/trl_compare.toml",
        "periods": [SHORT, LONG],
        "rounds": rounds,
        "median_percent": {name: medians(rs) for name, rs in rounds.items()},
    }
    for name, m in result["median_percent"].items():
        print(f"median, {name}: allocator {m['allocator']:.2f}%, page zeroing {m['page_zeroing']:.2f}%, "
              f"memset {m['memset']:.2f}%, memcpy {m['memcpy']:.2f}%")
    if not args.no_write:
        out = HERE / "results" / (args.out or "alloc_profile.json")
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
