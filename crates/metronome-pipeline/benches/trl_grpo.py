#!/usr/bin/env python3
"""TRL's side of benches/trl_compare.py: `GRPOTrainer` on the matched configuration.

Run by trl_compare.py inside its virtual environment; prints one JSON line with the
generated tokens and the seconds `trainer.train()` took (model building and imports
excluded, which favours TRL).

The configuration mirrors the Metronome run of trl_compare.py: the tiny Llama of
`ModelConfig::tiny()` (llama_shapes.json, random weights) with Metronome's character
vocabulary, the built-in arithmetic prompts ("12+7="), 4 prompts x G = 4 per step,
exactly 64 new tokens per answer (EOS suppressed until then, as `ignore_eos` does on
Metronome's side), temperature 1, a reference model with KL 0.04, one optimiser step
per batch of generations (on-policy, like `periodic`), on the CPU.
"""

import argparse
import json
import pathlib
import random
import time

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

SHAPES = pathlib.Path(__file__).resolve().parents[2] / "metronome-model" / "benches" / "llama_shapes.json"


def char_tokenizer():
    # metronome_model::CharTokenizer: pad 0, bos 1, eos 2, newline 3, then ' '..='~'.
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "\n": 3}
    vocab.update({chr(c): 4 + c - 32 for c in range(32, 127)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )


def arithmetic(n, seed):
    # The built-in task's shape: "a+b=" with one- or two-digit operands.
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return Dataset.from_list(rows)


def digits(completions, **_):
    # trl_compare.toml's reward: one point for each digit 0-7 in the answer (a random
    # model never answers correctly, and both sides should train every group).
    return [float(sum(d in c for d in "01234567")) for c in completions]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="/tmp/trl-compare")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    shape = json.loads(SHAPES.read_text())["tiny"]
    model = LlamaForCausalLM(LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    tokenizer = char_tokenizer()
    # GRPOTrainer builds its reference model from the policy's path: save both there.
    model_dir = pathlib.Path(args.out) / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    config = GRPOConfig(
        output_dir=args.out,
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.new_tokens,
        generation_kwargs={"min_new_tokens": args.new_tokens},
        temperature=1.0,
        beta=0.04,
        learning_rate=3e-4,
        max_steps=args.steps,
        num_iterations=1,
        gradient_accumulation_steps=1,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=args.seed,
        dataloader_num_workers=0,
        # Off, as on Metronome's side (TRL turns it on by default; a tiny model needs no
        # memory saving, and recomputing layers would only slow TRL down).
        gradient_checkpointing=False,
    )
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=digits,
        args=config,
        train_dataset=arithmetic(args.steps * args.prompts * 4, args.seed),
        processing_class=tokenizer,
    )
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    tokens = sum(lengths) * args.prompts * args.group if lengths else None
    zero = [h["frac_reward_zero_std"] for h in trainer.state.log_history if "frac_reward_zero_std" in h]
    print(json.dumps({
        "seconds": seconds, "tokens": tokens, "steps": args.steps, "threads": torch.get_num_threads(),
        "zero_advantage_groups": round(sum(zero) * args.prompts),
    }))


if __name__ == "__main__":
    main()
