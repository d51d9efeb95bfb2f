#!/usr/bin/env python3
"""The PyTorch side of the GPU comparison with `examples/throughput.rs`: the same model
shapes (`llama_shapes.json`, random weights), the same work, measured the same way, on
the same GPU. `cargo xtask gpu bundle` packs the Rust side and `bash target/gpu/run.sh
--bench` runs both; alone:

    python3 crates/metronome-model/benches/torch_gpu.py --shape qwen2.5-0.5b --train 8x1024 --json out.json

Training: forward and backward of the summed next-token log-probs of plain causal rows
(log-softmax over the predicting positions, in f32), median of `--reps` steps after
`--warmup`, Hugging Face's model with its default attention, `sdpa` (PyTorch's fused
scaled-dot-product attention: what a user gets; `--attention eager` for the unfused
one):

- `eager_bf16`: PyTorch eager under bf16 autocast (f32 parameters and gradients, bf16
  matmuls), the figure Metronome is compared with;
- `compile_bf16`: the same step through `torch.compile` (for reference), compiled once
  per row shape and skipped once `--compile-budget-s` of compiling is spent;
- `eager_f32` with `--f32` (TF32 off, f32 as f32).

Each figure carries the peak device memory in use (total minus free, polled every
millisecond, as the Rust side polls it) and PyTorch's own peaks
(`max_memory_allocated`, `max_memory_reserved`). A shape that runs out of memory is
reported as such. Generation (`--generate N,...`): Hugging Face `generate`, greedy, a
32-token prompt and exactly 128 new tokens per sequence, with the weights in each of
`--generate-precision` (default bf16) and each of `--generate-cache` (default `dynamic`,
transformers' default, and `static`, its preallocated cache; a cache this transformers
does not support is reported as an error, not a lost run). Also measures the bf16
and f32 matmul peaks of the GPU (8192^3, median of ten), the denominators of the
utilisation figures. `--json PATH` writes every figure.
"""

import argparse
import json
import pathlib
import statistics
import threading
import time

import torch
import transformers

PROMPT = 32
NEW_TOKENS = 128


def model_config(name, attention):
    """The shape `name` of llama_shapes.json (`smollm2-135m`, `qwen2.5-0.5b`, ...)."""
    shapes = json.loads((pathlib.Path(__file__).parent / "llama_shapes.json").read_text())
    shape = dict(shapes[name.lower().replace("-", "_").replace(".", "_")])
    if shape.pop("model_type", "llama") == "qwen2":
        return transformers.Qwen2Config(**shape, attn_implementation=attention), transformers.Qwen2ForCausalLM
    return transformers.LlamaConfig(**shape, attn_implementation=attention), transformers.LlamaForCausalLM


def timed(fn, warmup=2, reps=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class DeviceMemory:
    """The largest device memory in use (total minus free) while the block runs."""

    def __enter__(self):
        self.peak, self.done = 0, False
        torch.cuda.reset_peak_memory_stats()

        def poll():
            while not self.done:
                free, total = torch.cuda.mem_get_info()
                self.peak = max(self.peak, total - free)
                time.sleep(0.001)

        self.thread = threading.Thread(target=poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done = True
        self.thread.join()
        self.allocated = torch.cuda.max_memory_allocated()
        self.reserved = torch.cuda.max_memory_reserved()
        return False


def matmul_peak(dtype):
    a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    b = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    secs = timed(lambda: a @ b, warmup=3, reps=10)
    return 2 * 8192**3 / secs / 1e12


def step_fn(model, bf16):
    def step(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
            logits = model.lm_head(hidden).float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).sum()
        (-logp).backward()

    return step


def measure(step, ids, params, warmup, reps):
    try:
        with DeviceMemory() as mem:
            secs = timed(lambda: step(ids), warmup=warmup, reps=reps)
        tps = ids.numel() / secs
        return {
            "tokens_per_s": tps,
            "step_ms": secs * 1e3,
            "tflops_6n": 6 * params * tps / 1e12,
            "peak_device_bytes": mem.peak,
            "max_allocated_bytes": mem.allocated,
            "max_reserved_bytes": mem.reserved,
            "error": None,
        }
    except torch.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        return {"tokens_per_s": None, "error": f"out of memory: {str(e).splitlines()[0]}"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--train", default="8x512")
    ap.add_argument("--generate", default="")
    ap.add_argument("--generate-precision", default="bf16", help="comma list of bf16, f32")
    ap.add_argument("--generate-cache", default="dynamic,static", help="comma list of dynamic, static")
    ap.add_argument("--generate-reps", type=int, default=2)
    ap.add_argument("--attention", default="sdpa", help="sdpa (transformers' default) or eager")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--f32", action="store_true", help="also time eager f32 (TF32 off)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-budget-s", type=float, default=float("inf"))
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # f32 as f32, as Metronome computes it
    config, cls = model_config(args.shape, args.attention)
    with torch.device("cuda"):  # initialised on the GPU: a 1.5 B model's CPU init takes long
        model = cls(config).float()
    model.train()
    params = sum(p.numel() for p in model.parameters())
    report = {
        "shape": args.shape,
        "parameters": params,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attention": args.attention,
        "device": torch.cuda.get_device_name(),
        "matmul_peak_tflops": {"bf16": matmul_peak(torch.bfloat16), "f32": matmul_peak(torch.float32)},
        "warmup": args.warmup,
        "reps": args.reps,
        "train": [],
        "generate": [],
    }
    peak = report["matmul_peak_tflops"]
    print(
        f"torch {torch.__version__}, {report['device']}, {args.shape} {params / 1e6:.1f} M parameters; "
        f"matmul peak: bf16 {peak['bf16']:.0f} TFLOP/s, f32 {peak['f32']:.1f} TFLOP/s"
    )
    kinds = [("eager_bf16", step_fn(model, True))]
    if args.f32:
        kinds.append(("eager_f32", step_fn(model, False)))
    compiled = None if args.no_compile else torch.compile(step_fn(model, True), dynamic=False)
    compile_spent = 0.0
    for shape in (s for s in args.train.split(",") if s):
        rows, length = (int(x) for x in shape.split("x"))
        ids = torch.randint(3, config.vocab_size, (rows, length), device="cuda")
        runs = list(kinds)
        if compiled is not None:
            runs.append(("compile_bf16", compiled))
        for kind, step in runs:
            if kind == "compile_bf16" and compile_spent > args.compile_budget_s:
                figure = {"tokens_per_s": None, "error": f"skipped: compile budget of {args.compile_budget_s} s spent"}
            else:
                try:
                    start = time.perf_counter()
                    if kind == "compile_bf16":
                        try:
                            step(ids)  # compiles for this shape, outside the timing
                        except torch.OutOfMemoryError:
                            pass
                        compile_spent += time.perf_counter() - start
                    figure = measure(step, ids, params, args.warmup, args.reps)
                except Exception as e:  # a compiler failure is a figure missing, not a run lost
                    figure = {"tokens_per_s": None, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            figure.update({"rows": rows, "len": length, "kind": kind})
            report["train"].append(figure)
            # Written after every figure: a run cut short by its time limit keeps what it measured.
            if args.json:
                pathlib.Path(args.json).write_text(json.dumps(report, indent=2))
            if figure["tokens_per_s"] is None:
                print(f"torch train {shape} {kind}: {figure['error']}")
            else:
                print(
                    f"torch train {shape} {kind}: {figure['tokens_per_s']:.0f} tokens/s (step {figure['step_ms']:.1f} ms, "
                    f"{figure['tflops_6n']:.1f} TFLOP/s by 6N, {100 * figure['tflops_6n'] / peak['bf16']:.1f}% of bf16 peak, "
                    f"peak device memory {figure['peak_device_bytes'] / 2**30:.1f} GiB)"
                )
    model.eval()
    dtypes = {"bf16": torch.bfloat16, "f32": torch.float32}
    for precision in (p for p in args.generate_precision.split(",") if p):
        model.to(dtypes[precision])
        for cache in (c for c in args.generate_cache.split(",") if c):
            for n in (int(x) for x in args.generate.split(",") if x):
                ids = torch.randint(3, config.vocab_size, (n, PROMPT), device="cuda")
                mask = torch.ones_like(ids)
                extra = {} if cache == "dynamic" else {"cache_implementation": cache}

                def gen():
                    with torch.no_grad():
                        model.generate(
                            input_ids=ids,
                            attention_mask=mask,
                            do_sample=False,
                            max_new_tokens=NEW_TOKENS,
                            min_new_tokens=NEW_TOKENS,
                            pad_token_id=0,
                            **extra,
                        )

                figure = {"sequences": n, "precision": precision, "cache": cache}
                try:
                    secs = timed(gen, warmup=1, reps=args.generate_reps)
                    figure["tokens_per_s"] = n * NEW_TOKENS / secs
                    print(
                        f"torch generate {n} seqs: {figure['tokens_per_s']:.0f} tokens/s "
                        f"(prompt {PROMPT}, {NEW_TOKENS} new, {precision}, {cache} cache)"
                    )
                except Exception as e:  # an unsupported cache is a figure missing, not a run lost
                    figure.update(tokens_per_s=None, error=f"{type(e).__name__}: {str(e)[:300]}")
                    print(f"torch generate {n} seqs {precision} {cache}: {figure['error']}")
                report["generate"].append(figure)
                if args.json:
                    pathlib.Path(args.json).write_text(json.dumps(report, indent=2))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
