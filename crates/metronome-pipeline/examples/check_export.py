#!/usr/bin/env python3
"""Checks a folder written by `metronome export` in transformers: the weights load
with AutoModelForCausalLM, and greedy decoding from the same prompt token ids gives
the same answers as Metronome's (metronome_greedy.json beside the weights).

    metronome export runs/<name> --questions 32            # writes runs/<name>/export
    python3 crates/metronome-pipeline/examples/check_export.py runs/<name>/export [--device cuda]

Needs `pip install torch transformers`. For each question it generates greedily in
float32 from Metronome's prompt ids, up to the answer's length (Metronome's answer
ends at a stop token or at the run's max_new_tokens), and compares:

- the final answer (the number after the last `####`, else the last number), which
  must be equal for every question: that is the check, and the exit status;
- the tokens: how many answers are identical token for token, and for the others
  where the first difference falls (two float32 implementations summing in different
  orders may part at a near-tie late in a long answer; reported, not failed, unless
  `--tokens` asks for identical tokens too).

When the folder holds a tokenizer, it also checks that it encodes each prompt's text
to Metronome's prompt ids.
"""

import argparse
import json
import pathlib
import re
import sys

import torch
from transformers import AutoModelForCausalLM

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(text):
    """The number after the last `####` (GSM8K's marker), else the last number."""
    marked = text.rsplit("####", 1)
    tail = marked[1].split("\n", 1)[0] if len(marked) == 2 else text
    numbers = NUMBER.findall(tail) or NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=pathlib.Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", action="store_true", help="also require identical answer tokens")
    args = parser.parse_args()

    record = json.loads((args.folder / "metronome_greedy.json").read_text())
    questions = record["questions"]
    if not questions:
        sys.exit("metronome_greedy.json holds no questions: export with --questions N")
    # Full float32 matmuls on a GPU too: TF32 would change greedy choices at near-ties.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32).to(args.device).eval()
    stops = record["stop_token_ids"]
    print(f"{type(model).__name__}, {sum(p.numel() for p in model.parameters())} parameters, on {args.device}")

    tokenizer = None
    if (args.folder / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.folder)

    same_answer = same_tokens = encodes = 0
    for q in questions:
        ids = torch.tensor([q["prompt_ids"]], device=args.device)
        want = q["answer_ids"]
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max(len(want), 1),
                do_sample=False,
                eos_token_id=stops or None,
                pad_token_id=(stops or [0])[0],
            )
        got = out[0, ids.shape[1]:].tolist()
        # generate stops at a stop token and includes it, as Metronome's answer does.
        equal = got == want
        same_tokens += equal
        if tokenizer is not None:
            encodes += tokenizer(q["prompt"], add_special_tokens=False)["input_ids"] == q["prompt_ids"]
            got_text = tokenizer.decode(got, skip_special_tokens=True)
        else:
            got_text = None
        # Without a tokenizer, equal tokens are equal answers; different tokens count as
        # different answers (nothing to decode them with).
        if equal:
            agrees = True
        elif got_text is not None:
            agrees = final_answer(got_text) == final_answer(q["answer"])
        else:
            agrees = False
        same_answer += agrees
        if not equal:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            verdict = "same final answer" if agrees else "DIFFERENT final answer"
            print(f"question {q['id']}: tokens part at {first} of {len(want)}; {verdict}")

    n = len(questions)
    print(f"{n} held-out questions: {same_answer} same final answer, {same_tokens} identical tokens", end="")
    print(f", the tokenizer encodes {encodes} prompts to Metronome's ids" if tokenizer is not None else "")
    ok = same_answer == n and (not args.tokens or same_tokens == n) and (tokenizer is None or encodes == n)
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
