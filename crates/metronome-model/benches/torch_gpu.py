#!/usr/bin/env python3
"""The PyTorch side of the GPU comparison with `examples/throughput.rs`: the same model
shape (SmolLM2-135M, random weights), the same work, measured the same way, on the same
GPU. `cargo xtask gpu bundle` packs the Rust side; run both back to back there:

    python3 crates/metronome-model/benches/torch_gpu.py --train 8x512,32x512 --generate 1,16,64,256

Training: PyTorch eager (`attn_implementation="eager"`), forward and backward of the
summed next-token log-probs of plain causal rows (log-softmax over the predicting
positions), median of five steps after two warm-ups, in f32 (what Metronome runs) and
bf16 autocast (for reference). Generation: Hugging Face `generate`, greedy, a 32-token
prompt and exactly 128 new tokens per sequence. Also measures the bf16 and f32 matmul
peaks of the GPU (8192^3, median of ten) for the utilisation figures.
"""

import argparse
import json
import pathlib
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

PROMPT = 32
NEW_TOKENS = 128


def smollm2_135m():
    # SmolLM2-135M's shape (`--shape smollm2-135m` of `examples/throughput.rs`).
    shape = json.loads((pathlib.Path(__file__).parent / "llama_shapes.json").read_text())["smollm2_135m"]
    return LlamaConfig(**shape, attn_implementation="eager")


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


def matmul_peak(dtype):
    a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    b = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    secs = timed(lambda: a @ b, warmup=3, reps=10)
    return 2 * 8192**3 / secs / 1e12


def train_step(model, ids, bf16):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
        logits = model.lm_head(hidden).float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).sum()
    (-logp).backward()
    model.zero_grad(set_to_none=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", default="8x512")
    ap.add_argument("--generate", default="1,16,64,256")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # f32 as f32, as Metronome computes it
    model = LlamaForCausalLM(smollm2_135m()).cuda().float()
    params = sum(p.numel() for p in model.parameters())
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {params / 1e6:.1f} M parameters")
    print(f"matmul peak: bf16 {matmul_peak(torch.bfloat16):.0f} TFLOP/s, f32 {matmul_peak(torch.float32):.1f} TFLOP/s")
    model.train()
    for shape in args.train.split(","):
        rows, length = (int(x) for x in shape.split("x"))
        ids = torch.randint(3, 49152, (rows, length), device="cuda")
        for bf16 in (False, True):
            secs = timed(lambda: train_step(model, ids, bf16))
            tps = rows * length / secs
            kind = "bf16 autocast" if bf16 else "f32"
            print(
                f"torch train {shape} {kind}: {tps:.0f} tokens/s (step {secs * 1e3:.1f} ms, "
                f"{6 * params * tps / 1e12:.1f} TFLOP/s by 6N)"
            )
    model.eval()
    for n in (int(x) for x in args.generate.split(",")):
        ids = torch.randint(3, 49152, (n, PROMPT), device="cuda")
        mask = torch.ones_like(ids)

        def gen():
            with torch.no_grad():
                model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                    pad_token_id=0,
                )

        secs = timed(gen, warmup=1, reps=3)
        print(f"torch generate {n} seqs: {n * NEW_TOKENS / secs:.0f} tokens/s (prompt {PROMPT}, {NEW_TOKENS} new, f32)")


if __name__ == "__main__":
    main()
