#!/usr/bin/env python3
"""Loads the checkpoint written by the smollm2_grpo example in transformers and
compares its logits with Metronome's for the same input.

    cargo run -p metronome-pipeline --example smollm2_grpo -- --out target/smollm2_grpo
    python3 crates/metronome-pipeline/examples/smollm2_check.py target/smollm2_grpo

Needs `pip install torch transformers`. Prints the largest absolute logit
difference and whether the greedy next tokens agree at every position; exits
non-zero when the difference exceeds the tolerance (default 1e-3: 30 layers of
float32 in two libraries that sum in different orders).
"""

import json
import pathlib
import sys

import torch
from transformers import AutoModelForCausalLM


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "target/smollm2_grpo")
    tolerance = float(sys.argv[2]) if len(sys.argv) > 2 else 1e-3
    ckpt = root / "hf"
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    expected = json.loads((ckpt / "expected.json").read_text())
    ids = torch.tensor(expected["input_ids"])
    want = torch.tensor(expected["logits"])
    with torch.no_grad():
        got = model(ids).logits
    diff = (got - want).abs().max().item()
    scale = want.abs().max().item()
    same_argmax = bool((got.argmax(-1) == want.argmax(-1)).all())
    params = sum(p.numel() for p in model.parameters())
    print(f"{type(model).__name__} with {params} parameters from {ckpt}")
    print(f"{ids.shape[1]} positions x {want.shape[-1]} logits: max |diff| = {diff:.3g} (max |logit| {scale:.3g})")
    print(f"greedy next token equal at every position: {same_argmax}")
    ok = diff <= tolerance and same_argmax
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
