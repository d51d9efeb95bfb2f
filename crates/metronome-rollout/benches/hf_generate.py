#!/usr/bin/env python3
"""Opt-in comparison: Hugging Face `transformers` `generate` on the tiny architecture.

Builds a randomly initialised Llama with the shape of `ModelConfig::tiny()` (vocabulary
99, hidden 128, MLP 384, 2 layers, 4 query / 2 key-value heads, head_dim 32), and
measures generated tokens per second for the same workloads as `benches/rollout.rs`'s
`slots/<n>` group: 64 responses of 32 new tokens from 12-token prompts, sampled at
temperature 1, in static batches of `n` (transformers has no continuous batching in
`generate`), with one CPU thread. Compare with `cargo bench -p metronome-rollout --bench
rollout -- slots` run with `RAYON_NUM_THREADS=1 CANDLE_NUM_THREADS=1` on the same machine,
or let that bench run this script between its own rounds (`METRONOME_HF_PYTHON=python3`),
which reports the ratio per round, side by side.

`--long-tail` instead emulates the `batching/*` workload: response lengths drawn like
the Rust bench's (stop with probability 2/99 per token, capped at 160), in static
batches of 16; `generate` with end-of-sequence stopping runs each batch until its
longest response ends, so each batch is generated to its maximum length and only the
responses' own tokens are counted as useful. Compare with `batching/continuous`.

Needs `pip install torch transformers`. Not run by CI.
"""

import argparse
import json
import pathlib
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--responses", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long-tail", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # `ModelConfig::tiny()`'s shape, as the model crate's PyTorch scripts build it.
    shapes = pathlib.Path(__file__).resolve().parents[2] / "metronome-model" / "benches" / "llama_shapes.json"
    shape = json.loads(shapes.read_text())["tiny"]
    cfg = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    prompt_len = 12
    print(f"torch {torch.__version__}, threads {args.threads}")
    if args.long_tail:
        long_tail(model, args.repeats, prompt_len)
        return
    for batch in args.batches:
        rounds = args.responses // batch

        def run():
            for _ in range(rounds):
                sample(model, batch, prompt_len, args.new_tokens)

        best = best_seconds(args.repeats, run)
        tokens = rounds * batch * args.new_tokens
        print(f"transformers generate batch {batch:>3}: {tokens / best:9.0f} tokens/s ({tokens} tokens in {best:.3f} s)")


def sample(model, batch: int, prompt_len: int, new_tokens: int) -> None:
    """Samples exactly `new_tokens` tokens at temperature 1 after `batch` random prompts."""
    ids = torch.randint(4, 99, (batch, prompt_len))
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )


def best_seconds(repeats: int, run) -> float:
    """The shortest wall time of `repeats` calls of `run`, without autograd."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.inference_mode():
            run()
        best = min(best, time.perf_counter() - start)
    return best


def long_tail(model, repeats: int, prompt_len: int, responses: int = 64, batch: int = 16) -> None:
    gen = torch.Generator().manual_seed(11)
    p_stop, cap = 2 / 99, 160
    lengths = []
    for _ in range(responses):
        n = 1
        while n < cap and torch.rand((), generator=gen).item() >= p_stop:
            n += 1
        lengths.append(n)
    useful = sum(lengths)

    def run():
        for b in range(0, responses, batch):
            sample(model, batch, prompt_len, max(lengths[b : b + batch]))

    best = best_seconds(repeats, run)
    print(f"transformers generate, long tail, static batches of {batch}: {useful / best:9.0f} useful tokens/s "
          f"({useful} tokens, mean length {useful / responses:.1f}, in {best:.3f} s)")


if __name__ == "__main__":
    main()
