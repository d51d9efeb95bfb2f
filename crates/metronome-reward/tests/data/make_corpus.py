#!/usr/bin/env python3
"""Builds `corpus.jsonl`: labelled completions for a cross-check of Metronome's math
verifier and countdown checker by code that Metronome's authors did not write.

Problems come from reasoning-gym's generators (basic_arithmetic, chain_sum, products,
gsm_symbolic, fraction_simplification, decimal_arithmetic, decimal_chain_sum, countdown).
Each problem gets completions in many styles: right answers written many ways (plain,
`\boxed{}`, `<answer>` tags, "The answer is 42.", `1,234`, `1234.0`, `\frac{2468}{2}`,
more digits than a rounded reference), and near misses (off by one, sign flipped, a digit
dropped, added or swapped, half added, an intermediate result given as the final one, a
digit appended to an exact decimal; for countdown: subsets, reused numbers, numbers not
given, another target, the target alone).

Labels come from the public checkers, never from Metronome:

- math: math-verify (`verify(parse(reference), parse(completion))`) on the completion
  text, and reasoning-gym's own `score_answer` (1.0 means right) on the value the
  completion states. A completion is kept only when the two agree; disagreements are
  counted on stderr and left out, so every label has two independent votes.
- countdown: reasoning-gym's `score_answer` on the expression the completion states (it
  requires every given number exactly once and evaluates with sympy).

Run from anywhere (deterministic; a few seconds):

    pip install reasoning-gym==0.1.25 math-verify==0.9.0
    python crates/metronome-reward/tests/data/make_corpus.py

It writes `corpus.jsonl` next to itself, one JSON object a line with the fields `task`,
`style`, `completion`, `reference` (math; the countdown solution for countdown),
`metadata` (countdown: `numbers` as `3,7,25` and `target`), `label` and `checker`.
The Rust test `tests/it/corpus.rs` reads it; it needs no Python.
"""

import ast
import itertools
import json
import random
import re
import sys
from collections import Counter
from decimal import Decimal, localcontext
from fractions import Fraction
from pathlib import Path

import math_verify
import reasoning_gym

OUT = Path(__file__).with_name("corpus.jsonl")
SEED = 20

# (task, generator options, items): integer tasks with small and large answers.
MATH_TASKS = [
    ("basic_arithmetic", dict(min_digits=1, max_digits=4, min_terms=2, max_terms=5), 25),
    ("chain_sum", dict(min_digits=2, max_digits=6, min_terms=2, max_terms=5), 25),
    ("products", dict(min_digits=3, max_digits=6, min_terms=2, max_terms=2), 25),
    ("gsm_symbolic", dict(), 25),
    ("fraction_simplification", dict(), 25),
]
# Decimal tasks: decimal_arithmetic's references are rounded to 12 significant digits,
# decimal_chain_sum's are exact sums. The Rust test checks the first with the default
# verifier (decimal references taken as rounded) and the second with `exact = true`.
DECIMAL_TASKS = [
    ("decimal_arithmetic", dict(min_terms=2, max_terms=4), 25),
    ("decimal_chain_sum", dict(min_terms=2, max_terms=5), 25),
]
COUNTDOWN_ITEMS = 50

REASONING = "<think>Working step by step.</think>\n"


def thousands(n: int) -> str:
    return f"{n:,}"


def latex_fraction(x: Fraction) -> str:
    sign = "-" if x < 0 else ""
    return f"{sign}\\frac{{{abs(x.numerator)}}}{{{x.denominator}}}"


def plain(x: Fraction) -> str:
    """The value in the plain form the reasoning-gym scorers read."""
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def stated_styles(plain: str, boxed: str, stated, prefix: str = ""):
    """The styles every right answer is written in: plain, boxed, in `<answer>` tags and
    in a sentence; `boxed` is the form inside `\\boxed{}`."""
    return [
        (f"{prefix}plain", plain, stated),
        (f"{prefix}boxed", f"{REASONING}So the result is \\boxed{{{boxed}}}.", stated),
        (f"{prefix}answer_tag", f"{REASONING}<answer>{plain}</answer>", stated),
        (f"{prefix}sentence", f"{REASONING}The answer is {plain}.", stated),
    ]


def boxed_misses(misses: dict, value, boxed=str, stated=lambda w: w):
    """(style, completion, stated value) of each near miss (style: wrong value) that is
    not `value`, boxed as `boxed` writes it."""
    return [
        (style, f"{REASONING}So the result is \\boxed{{{boxed(w)}}}.", stated(w))
        for style, w in misses.items()
        if w != value
    ]


def digit_edits(n: int, rng: random.Random) -> dict:
    """Near misses of an integer that differ in its written digits."""
    sign, digits = ("-" if n < 0 else ""), str(abs(n))
    out = {}
    if len(digits) > 1:
        i = rng.randrange(len(digits))
        dropped = digits[:i] + digits[i + 1 :]
        out["digit_dropped"] = int(sign + dropped)
    i = rng.randrange(len(digits) + 1)
    added = digits[:i] + str(rng.randrange(10)) + digits[i:]
    out["digit_added"] = int(sign + added)
    if len(digits) > 1:
        pairs = [j for j in range(len(digits) - 1) if digits[j] != digits[j + 1]]
        if pairs:
            j = rng.choice(pairs)
            swapped = digits[:j] + digits[j + 1] + digits[j] + digits[j + 2 :]
            out["digits_swapped"] = int(sign + swapped)
    last = int(digits[-1])
    out["last_digit_changed"] = int(sign + digits[:-1] + str((last + 1 + rng.randrange(9)) % 10))
    return {k: v for k, v in out.items() if v != n}


def intermediate_of(entry: dict, task: str, value: Fraction):
    """A right intermediate result of the problem that is not its answer, if one is known."""
    if task in ("basic_arithmetic", "chain_sum"):
        expr = entry["metadata"]["expression"]
        tree = ast.parse(expr, mode="eval").body
        # The left operand of the last operation: everything but the final step.
        if isinstance(tree, ast.BinOp):
            left = Fraction(eval(compile(ast.Expression(tree.left), "<expr>", "eval")))  # noqa: S307
            if left != value:
                return left
    if task == "products":
        first = int(entry["metadata"]["expression"].split("*")[0])
        if first != value:
            return Fraction(first)
    if task == "gsm_symbolic":
        for v in entry["metadata"].get("variables", {}).values():
            if isinstance(v, int) and v != value:
                return Fraction(v)
    if task == "fraction_simplification":
        m = entry["metadata"]
        unreduced = Fraction(m["numerator"] + 1, m["denominator"])
        if unreduced != value:
            return unreduced
    return None


def math_styles(value: Fraction, task: str, entry: dict, rng: random.Random):
    """(style, completion, stated value) for one problem."""
    out = []
    if value.denominator == 1:
        n = value.numerator
        out += stated_styles(str(n), str(n), value)
        out += [
            ("hashes", f"{REASONING}#### {n}", value),
            ("bold_final", f"{REASONING}**Final Answer:** {n}", value),
            ("latex_inline", f"{REASONING}$\\boxed{{{n}}}$", value),
            ("thousands", f"{REASONING}The answer is {thousands(n)}.", value),
            ("thousands_boxed", f"{REASONING}\\boxed{{{thousands(n)}}}", value),
            ("trailing_zero", f"{REASONING}\\boxed{{{n}.0}}", value),
            # `\frac{2n}{2}` spelled out (a Fraction would reduce it).
            ("fraction", f"{REASONING}\\boxed{{{'-' if n < 0 else ''}\\frac{{{2 * abs(n)}}}{{2}}}}", value),
            ("wrong_then_right", f"{REASONING}First I got {n + 7}, but rechecking, the answer is \\boxed{{{n}}}.", value),
        ]
        misses = {
            "off_by_one_up": n + 1,
            "off_by_one_down": n - 1,
            **digit_edits(n, rng),
        }
        if n != 0:
            misses["sign_flipped"] = -n
        out += boxed_misses(misses, value, stated=Fraction)
        out.append(("off_by_one_sentence", f"{REASONING}The answer is {n + 1}.", Fraction(n + 1)))
        # `n.5`: half added to the magnitude (`-4.5` for -4).
        out.append(("plus_half", f"{REASONING}\\boxed{{{n}.5}}", Fraction(2 * n + (1 if n >= 0 else -1), 2)))
        out.append(("right_then_wrong", f"{REASONING}First I got {n}, but rechecking, the answer is \\boxed{{{n + 1}}}.",
                    Fraction(n + 1)))
    else:
        p, q = value.numerator, value.denominator
        out += stated_styles(f"{p}/{q}", latex_fraction(value), value)
        out.append(("dfrac", f"{REASONING}\\boxed{{\\dfrac{{{p}}}{{{q}}}}}", value))
        misses = {
            "numerator_off_by_one": Fraction(p + 1, q),
            "denominator_off_by_one": Fraction(p, q + 1),
            "reciprocal": Fraction(q, p),
            "sign_flipped": -value,
        }
        out += boxed_misses(misses, value, boxed=latex_fraction)
        rounded = round(p / q, 3)
        out.append(("rounded_decimal", f"{REASONING}\\boxed{{{rounded}}}", Fraction(str(rounded))))
    mid = intermediate_of(entry, task, value)
    if mid is not None:
        shown = f"{mid.numerator}" if mid.denominator == 1 else latex_fraction(mid)
        out.append(("intermediate_as_final", f"{REASONING}After the first steps we have {shown}, so \\boxed{{{shown}}}.", mid))
    return out


def exact_value(question: str) -> Fraction:
    """The exact value of decimal_arithmetic's expression (`1.664*0.443/1.229 = ?`)."""
    expr = question.strip().splitlines()[-1].split("=")[0]
    expr = re.sub(r"\d+\.\d+|\d+", lambda m: f"Fraction('{m.group()}')", expr)
    return eval(expr, {"Fraction": Fraction})  # noqa: S307 (numbers, operators, brackets)


def significant(x: Fraction, digits: int) -> str:
    with localcontext() as ctx:
        ctx.prec = digits
        return str(+(Decimal(x.numerator) / Decimal(x.denominator)))


def decimal_styles(reference: str, task: str, entry: dict, rng: random.Random):
    """(style, completion, stated value as text) for a decimal reference."""
    value = Decimal(reference)
    places = -value.as_tuple().exponent
    unit = Decimal(1).scaleb(-places)
    out = stated_styles(reference, reference, reference, prefix="dec_")
    out.append(("dec_trailing_zero", f"{REASONING}\\boxed{{{reference}0}}", reference + "0"))
    if task == "decimal_arithmetic":
        # The unrounded value, which rounds to the reference.
        longer = significant(exact_value(entry["question"]), 16)
        out.append(("dec_more_digits", f"{REASONING}\\boxed{{{longer}}}", longer))
    misses = {
        "dec_off_by_hundredth": value + Decimal("0.01"),
        "dec_off_by_one": value + 1,
        "dec_sign_flipped": -value,
        "dec_times_ten": value * 10,
    }
    if task == "decimal_chain_sum":
        # For an exact reference, a digit appended or the last digit changed is wrong.
        misses["dec_digit_appended"] = Decimal(reference + str(rng.randrange(1, 10)))
        misses["dec_last_digit_changed"] = value + unit * rng.choice([-2, -1, 1, 2])
        if places > 1:
            misses["dec_last_digit_dropped"] = Decimal(reference[:-1])
    out += boxed_misses(misses, value, stated=str)
    return out


def mv_view(completion: str) -> str:
    """What math-verify reads: it has no `<answer>` tag extractor, so the tags go."""
    return completion.replace("<answer>", "").replace("</answer>", "")


def math_label(dataset, entry: dict, completion: str, stated: str):
    """math-verify on the completion and reasoning-gym on the stated value, or `None`
    when they disagree."""
    gold = math_verify.parse(f"${entry['answer']}$")
    mv = bool(math_verify.verify(gold, math_verify.parse(mv_view(completion))))
    rg = dataset.score_answer(stated, entry) == 1.0
    return mv if mv == rg else None


def countdown_solutions(numbers, target, limit=1):
    """Expressions over a strict subset of `numbers` that hit `target` (hard negatives)."""
    found = []
    for k in range(2, len(numbers)):
        for subset in itertools.combinations(numbers, k):
            for perm in itertools.permutations(subset):
                for ops in itertools.product("+-*", repeat=k - 1):
                    expr = str(perm[0])
                    for op, x in zip(ops, perm[1:]):
                        expr = f"({expr}) {op} {x}"
                    if eval(expr) == target:  # noqa: S307 (digits and operators only)
                        found.append(expr)
                        if len(found) >= limit:
                            return found
    return found


def countdown_styles(entry: dict, rng: random.Random):
    """(style, completion, stated expression) for one countdown problem."""
    expr = entry["answer"]
    numbers = entry["metadata"]["numbers"]
    target = entry["metadata"]["target"]
    times = expr.replace("*", " \\times ")
    out = [
        ("cd_answer_tag", f"{REASONING}<answer>{expr}</answer>", expr),
        ("cd_boxed", f"{REASONING}The equation is \\boxed{{{expr}}}.", expr),
        ("cd_boxed_in_tag", f"{REASONING}<answer>\\boxed{{{expr}}}</answer>", expr),
        ("cd_with_target", f"{REASONING}<answer>{expr} = {target}</answer>", expr),
        ("cd_latex_times", f"{REASONING}<answer>{times}</answer>", expr),
        ("cd_last_line", f"{REASONING}So the answer is:\n{expr} = {target}", expr),
    ]
    tree = ast.parse(expr, mode="eval").body
    seg = lambda node: ast.get_source_segment(expr, node)  # noqa: E731
    if isinstance(tree, ast.BinOp) and isinstance(tree.op, ast.Sub):
        # `A - B` written `-B + A`: unary minus on a given number or group.
        right = seg(tree.right)
        right = right if isinstance(tree.right, (ast.Constant, ast.BinOp)) and not (
            isinstance(tree.right, ast.BinOp) and isinstance(tree.right.op, (ast.Add, ast.Sub))
        ) else f"({right})"
        unary = f"-{right} + {seg(tree.left)}"
        out.append(("cd_unary_minus", f"{REASONING}<answer>{unary}</answer>", unary))
    # Near misses.
    if isinstance(tree, ast.BinOp):
        left = seg(tree.left)
        out.append(("cd_subset", f"{REASONING}<answer>{left}</answer>", left))
        flipped = {ast.Add: "-", ast.Sub: "+", ast.Mult: "+", ast.Div: "*"}[type(tree.op)]
        other = f"{left} {flipped} {seg(tree.right) if isinstance(tree.right, ast.Constant) else '(' + seg(tree.right) + ')'}"
        out.append(("cd_wrong_target", f"{REASONING}<answer>{other}</answer>", other))
    reused = numbers[0]
    out.append(("cd_reused_number", f"{REASONING}<answer>{expr} + {reused} - {reused}</answer>", f"{expr} + {reused} - {reused}"))
    given = set(numbers)
    missing = next(x for x in range(2, 200) if x not in given)
    out.append(("cd_number_not_given", f"{REASONING}<answer>{expr} + {missing} - {missing}</answer>", f"{expr} + {missing} - {missing}"))
    out.append(("cd_target_only", f"{REASONING}<answer>{target}</answer>", str(target)))
    for sub in countdown_solutions(numbers, target):
        out.append(("cd_subset_hits_target", f"{REASONING}<answer>{sub}</answer>", sub))
    return out


def main() -> None:
    rng = random.Random(SEED)
    rows, dropped = [], Counter()
    for task, options, size in MATH_TASKS:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=SEED, **options)
        for entry in dataset:
            m = entry["metadata"]
            # fraction_simplification writes its answers `$\frac{a}{b}$`, `$a/b$` or `a/b`.
            value = (Fraction(m["simplified_numerator"], m["simplified_denominator"])
                     if task == "fraction_simplification" else Fraction(entry["answer"]))
            for style, completion, stated in math_styles(value, task, entry, rng):
                label = math_label(dataset, entry, completion, plain(stated))
                if label is None:
                    dropped[(task, style)] += 1
                    continue
                rows.append(dict(task=task, style=style, completion=completion, reference=entry["answer"],
                                 label=label, checker="math-verify+reasoning-gym"))
    for task, options, size in DECIMAL_TASKS:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=SEED, **options)
        for entry in dataset:
            for style, completion, stated in decimal_styles(entry["answer"], task, entry, rng):
                label = math_label(dataset, entry, completion, stated)
                if label is None:
                    dropped[(task, style)] += 1
                    continue
                rows.append(dict(task=task, style=style, completion=completion, reference=entry["answer"],
                                 label=label, checker="math-verify+reasoning-gym"))
    dataset = reasoning_gym.create_dataset("countdown", size=COUNTDOWN_ITEMS, seed=SEED, min_numbers=3,
                                           max_numbers=4, max_target=300)
    for entry in dataset:
        metadata = dict(numbers=",".join(map(str, entry["metadata"]["numbers"])),
                        target=str(entry["metadata"]["target"]))
        for style, completion, stated in countdown_styles(entry, rng):
            label = dataset.score_answer(stated, entry) == 1.0
            rows.append(dict(task="countdown", style=style, completion=completion, reference=entry["answer"],
                             metadata=metadata, label=label, checker="reasoning-gym"))
    with OUT.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
    labels = Counter((r["style"], r["label"]) for r in rows)
    print(f"{len(rows)} completions, {OUT.stat().st_size} bytes -> {OUT}", file=sys.stderr)
    for (style, label), n in sorted(labels.items()):
        print(f"  {style:24} {str(label):5} {n}", file=sys.stderr)
    print(f"left out where the two math checkers disagree: {sum(dropped.values())}", file=sys.stderr)
    for (task, style), n in sorted(dropped.items()):
        print(f"  {task:24} {style:24} {n}", file=sys.stderr)


if __name__ == "__main__":
    main()
