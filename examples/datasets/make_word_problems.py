"""Write word_problems.jsonl: small arithmetic word problems with their answers, for the "dataset"
task's tests and its example run (examples/dataset.toml).

    python examples/datasets/make_word_problems.py [--count 600] [--seed 0] [--out FILE]

Deterministic: the same seed and count write the same file, byte for byte. Each line is
{"question": ..., "answer": ...}; the answer is an integer written as text, so the "exact" and
"numeric" checkers both apply. One step (a sum, a difference, a product, a fair share) or two
steps (buy, then pay), with numbers small enough that a 135M model solves some before training.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "word_problems.jsonl"
INSTRUCTION = "Answer with just the number."
NAMES = ("Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jon", "Kemi",
         "Liam", "Mia", "Noor", "Omar", "Priya")
THINGS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards")

Problem = tuple[str, int]


def more(rng: random.Random) -> Problem:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    have, extra = rng.randint(2, 40), rng.randint(2, 40)
    return (f"{name} has {have} {thing} and gets {extra} more. How many {thing} does {name} have "
            "now?", have + extra)


def fewer(rng: random.Random) -> Problem:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    have = rng.randint(10, 60)
    given = rng.randint(1, have - 1)
    return (f"{name} had {have} {thing} and gave away {given}. How many {thing} are left?",
            have - given)


def boxes(rng: random.Random) -> Problem:
    thing = rng.choice(THINGS)
    count, each = rng.randint(2, 9), rng.randint(2, 12)
    return (f"There are {count} boxes with {each} {thing} in each box. How many {thing} are there "
            "in all?", count * each)


def share(rng: random.Random) -> Problem:
    thing = rng.choice(THINGS)
    friends, each = rng.randint(2, 8), rng.randint(2, 10)
    return (f"{friends * each} {thing} are shared equally among {friends} friends. How many "
            f"{thing} does each friend get?", each)


def change(rng: random.Random) -> Problem:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    count, price = rng.randint(2, 6), rng.randint(1, 9)
    paid = rng.choice([bill for bill in (10, 20, 50, 100) if bill >= count * price])
    return (f"{name} buys {count} {thing} at {price} dollars each and pays with a {paid} dollar "
            f"bill. How many dollars of change does {name} get?",
            paid - count * price)


def walk(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    days, km = rng.randint(2, 7), rng.randint(2, 15)
    return (f"{name} walks {km} kilometres every day for {days} days. How many kilometres does "
            f"{name} walk in total?", days * km)


TEMPLATES: tuple[Callable[[random.Random], Problem], ...] = (more, fewer, boxes, share, change,
                                                              walk)


def word_problems(count: int, seed: int) -> list[dict[str, str]]:
    """`count` distinct problems, templates in turn, from one seeded generator."""
    rng = random.Random(seed)
    rows: dict[str, str] = {}
    while len(rows) < count:
        question, answer = TEMPLATES[len(rows) % len(TEMPLATES)](rng)
        rows.setdefault(f"{question} {INSTRUCTION}", str(answer))
    return [{"question": question, "answer": answer} for question, answer in rows.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    arguments = parser.parse_args()
    with arguments.out.open("w", encoding="utf-8") as out:
        for row in word_problems(arguments.count, arguments.seed):
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
