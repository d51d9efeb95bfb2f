#!/usr/bin/env python3
"""Opt-in PyTorch baseline for benches/model.rs: the same tiny configuration, the same
shapes, measured the same way (tokens/s), on this machine.

    pip install torch transformers
    python3 crates/metronome-model/benches/torch_compare.py --threads 1
    RAYON_NUM_THREADS=1 cargo bench -p metronome-model --bench model

Training: forward + backward of the summed next-token log-probs over rows of 256
tokens (the LM head and log-softmax run on the 255 predicting positions, as
Model::target_logprobs does). Decode: a KV-cache step for a batch of slots prefilled
with 16 tokens. Not part of CI.
"""

import argparse
import json
import pathlib
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SEQ = 256
PROMPT = 16
DECODE_STEPS = 32


def tiny():
    # `ModelConfig::tiny()`'s shape, shared with the other PyTorch scripts.
    shape = json.loads((pathlib.Path(__file__).parent / "llama_shapes.json").read_text())["tiny"]
    return LlamaConfig(**shape, attn_implementation="eager")


def train_step(model, ids):
    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    logits = model.lm_head(hidden)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).sum()
    (-logp).backward()
    model.zero_grad(set_to_none=True)


def bench_train(model, rows, reps):
    ids = torch.randint(3, 99, (rows, SEQ))
    for _ in range(3):  # the same warm-up as the Rust bench
        train_step(model, ids)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(reps):
        train_step(model, ids)
    tokens = reps * rows * SEQ
    # CPU time as well: on a shared machine it excludes time the process waited for a core.
    return tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu)


@torch.no_grad()
def bench_decode(model, batch):
    ids = torch.randint(3, 99, (batch, PROMPT))
    out = model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    tok = ids[:, -1:]
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        out = model(input_ids=tok, past_key_values=past, use_cache=True)
        past = out.past_key_values
    return batch * DECODE_STEPS / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny()).float()
    model.train()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for rows in (1, 4):
        wall, cpu = bench_train(model, rows, 10)
        print(f"train fwd+bwd {rows}x{SEQ}: {wall:.0f} tokens/s, {cpu:.0f} tokens per CPU-second")
    model.eval()
    for batch in (1, 8, 32, 64):
        bench_decode(model, batch)
        print(f"decode batch {batch}: {bench_decode(model, batch):.0f} tokens/s")


if __name__ == "__main__":
    main()
