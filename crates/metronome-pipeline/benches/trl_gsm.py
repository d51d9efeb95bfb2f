#!/usr/bin/env python3
"""TRL's `GRPOTrainer` on the data and settings of a Metronome learning run (issue #32):
tokens/s end to end and held-out accuracy per step, for the side-by-side comparison
with `configs/smollm2-gsm.toml` on one GPU.

The inputs are made by Metronome, so both sides see the same model and prompts:

    # the base model as a Hugging Face folder: a run of no period, exported
    metronome run --config configs/smollm2-gsm.toml --set run.periods=0 --set run.name=base
    metronome export runs/base --out /tmp/smol-hf --questions 0
    # the prompts, rendered with the chat template: the run's batches, then held-out ones
    metronome prompts --config configs/smollm2-gsm.toml --periods 40 --heldout 64 --out /tmp/gsm.jsonl
    python3 crates/metronome-pipeline/benches/trl_gsm.py --model /tmp/smol-hf --prompts /tmp/gsm.jsonl

Matched to the preset: 64 prompts x G = 8 per optimiser step, in the order the run
releases them (`shuffle_dataset=False`); temperature 0.7; at most 192 new tokens; no KL;
learning rate 1e-5 with 5 warm-up steps; bf16 compute with f32 weights; one optimiser
step per batch of generations (on-policy, as `periodic`). The reward is the preset's:
1 when the final answer (`#### N`, else "the answer is N", else the last number; the
text cut at the preset's stop strings, which `generate` here does not stop at) equals
the reference, a port of the extraction order of metronome-reward's math verifier
without its LaTeX and unit normalisation (the generator's answers are plain integers).
Held-out accuracy: greedy answers to the held-out prompts before the first step and
every `--eval-every` steps, scored the same way.

Prints one JSON object (and writes it to `--out`): seconds of `trainer.train()`
(evaluation excluded), generated tokens, tokens/s, and the accuracy and mean reward
per step. Needs torch, transformers, accelerate, trl and datasets; not part of CI.
"""

import argparse
import json
import pathlib
import re
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

STOP_STRINGS = ["\nProblem:", "\nExample problem:"]
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(text):
    for stop in STOP_STRINGS:
        text = text.split(stop, 1)[0]
    marked = text.rsplit("####", 1)
    if len(marked) == 2 and NUMBER.search(marked[1]):
        return NUMBER.search(marked[1]).group()
    said = re.findall(r"answer is\s*\$?(-?\d[\d,]*(?:\.\d+)?)", text, flags=re.IGNORECASE)
    if said:
        return said[-1]
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def correct(text, reference):
    answer = final_answer(text)
    if answer is None:
        return False
    try:
        return float(answer.replace(",", "")) == float(str(reference).replace(",", ""))
    except ValueError:
        return False


def reward(completions, reference, **_):
    return [1.0 if correct(c, r) else 0.0 for c, r in zip(completions, reference)]


@torch.no_grad()
def heldout_accuracy(model, tokenizer, rows, new_tokens, batch=32):
    model.eval()
    right = 0
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        enc = tokenizer([r["text"] for r in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
        enc = {k: v.to(model.device) for k, v in enc.items()}
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=model.device.type == "cuda"):
            out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        right += sum(correct(t, r["reference"]) for t, r in zip(texts, chunk))
    model.train()
    return right / max(len(rows), 1)


class Accuracy(TrainerCallback):
    """Greedy held-out accuracy every `every` steps, its time kept out of the run's."""

    def __init__(self, tokenizer, rows, new_tokens, every):
        self.tokenizer, self.rows, self.new_tokens, self.every = tokenizer, rows, new_tokens, every
        self.points, self.eval_seconds = [], 0.0

    def measure(self, model, step):
        start = time.perf_counter()
        self.points.append({"step": step, "accuracy": heldout_accuracy(model, self.tokenizer, self.rows, self.new_tokens)})
        self.eval_seconds += time.perf_counter() - start
        print(json.dumps(self.points[-1]), flush=True)

    def on_train_begin(self, args, state, control, model=None, **_):
        self.measure(model, 0)

    def on_step_end(self, args, state, control, model=None, **_):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self.measure(model, state.global_step)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="the base model as a Hugging Face folder (metronome export)")
    ap.add_argument("--prompts", required=True, help="metronome prompts' JSON lines")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64, help="prompts per optimiser step")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=64, help="answers per forward and backward")
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="trl-gsm.json")
    args = ap.parse_args()

    lines = [json.loads(l) for l in pathlib.Path(args.prompts).read_text().splitlines() if l.strip()]
    train = [l for l in lines if l["split"] == "train"][: args.steps * args.batch]
    heldout = [l for l in lines if l["split"] == "heldout"]
    if len(train) < args.steps * args.batch:
        raise SystemExit(f"{args.prompts}: {len(train)} training prompts, {args.steps} steps need {args.steps * args.batch}")
    cuda = torch.cuda.is_available()
    accumulation, rest = divmod(args.batch * args.group, args.micro_batch)
    if rest or accumulation == 0:
        raise SystemExit(f"--micro-batch {args.micro_batch} must divide --batch x --group = {args.batch * args.group}")
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    # The prompt text is rendered already (chat template included): TRL sees plain strings.
    dataset = Dataset.from_list([{"prompt": l["text"], "reference": l["reference"]} for l in train])
    config = GRPOConfig(
        output_dir=str(pathlib.Path(args.out).with_suffix("")) + "-trainer",
        # One generation batch of `batch` x `group` answers per optimiser step, trained
        # in micro-batches (TRL's steps_per_generation follows gradient accumulation): a
        # single forward over all 512 answers would hold [tokens, vocab] logits of ~45 GB.
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=accumulation,
        num_generations=args.group,
        max_completion_length=args.new_tokens,
        temperature=args.temperature,
        beta=0.0,
        learning_rate=args.lr,
        warmup_steps=5,
        lr_scheduler_type="constant_with_warmup",
        max_steps=args.steps,
        num_iterations=1,
        shuffle_dataset=False,
        bf16=cuda,
        use_cpu=not cuda,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=args.seed,
        gradient_checkpointing=False,
    )
    accuracy = Accuracy(tokenizer, heldout, args.new_tokens, args.eval_every)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[accuracy],
    )
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start - accuracy.eval_seconds
    history = trainer.state.log_history
    lengths = [h["completions/mean_length"] for h in history if "completions/mean_length" in h]
    tokens = sum(lengths) * args.batch * args.group
    result = {
        "command": "python3 crates/metronome-pipeline/benches/trl_gsm.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        ),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "versions": {m.__name__: m.__version__ for m in (torch, __import__("transformers"), __import__("trl"))},
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "reward_per_step": [h["reward"] for h in history if "reward" in h],
        "heldout_accuracy": accuracy.points,
    }
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "reward_per_step"}))


if __name__ == "__main__":
    main()
