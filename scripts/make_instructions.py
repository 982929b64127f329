"""Write ``hf_paged/data/instructions.jsonl``: short instruction/response pairs for the ``hf-paged train`` demo.

Every pair comes from a fixed template (sums, differences, reversing words, capitals, upper case, counting
words, next letters, sorting digits) filled from a seeded random generator, so the file is the same on
every run and its patterns are simple enough that a tiny model learns them within a minute on a CPU.

Usage: ``python scripts/make_instructions.py [--out PATH] [--per-task N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from collections.abc import Callable, Iterator
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "hf_paged" / "data" / "instructions.jsonl"

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Japan": "Tokyo",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Canada": "Ottawa",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Greece": "Athens",
    "Poland": "Warsaw",
    "Austria": "Vienna",
    "Ireland": "Dublin",
    "Cuba": "Havana",
    "India": "New Delhi",
    "China": "Beijing",
}

WORDS = ("red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "river", "stone", "bird", "fish", "cloud")
WORDS += ("rain", "snow", "wind", "fire", "book", "lamp", "door", "road", "ship", "star", "leaf", "seed", "milk")
WORDS += ("bread", "salt", "gold", "iron", "glass")

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

Pair = dict[str, str]


def addition(rng: random.Random) -> Pair:
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    return {"instruction": f"What is {a} + {b}?", "response": str(a + b)}


def subtraction(rng: random.Random) -> Pair:
    a = rng.randint(0, 50)
    b = rng.randint(0, a)
    return {"instruction": f"What is {a} - {b}?", "response": str(a - b)}


def reverse_words(rng: random.Random) -> Pair:
    words = rng.sample(WORDS, rng.randint(2, 4))
    return {"instruction": "Reverse the words: " + " ".join(words), "response": " ".join(reversed(words))}


def capital(rng: random.Random) -> Pair:
    country = rng.choice(sorted(CAPITALS))
    return {"instruction": f"What is the capital of {country}?", "response": CAPITALS[country]}


def upper_case(rng: random.Random) -> Pair:
    words = rng.sample(WORDS, rng.randint(1, 3))
    text = " ".join(words)
    return {"instruction": f"Write in upper case: {text}", "response": text.upper()}


def count_words(rng: random.Random) -> Pair:
    words = [rng.choice(WORDS) for _ in range(rng.randint(1, 9))]
    return {"instruction": "How many words are in: " + " ".join(words), "response": NUMBER_WORDS[len(words)]}


def next_letter(rng: random.Random) -> Pair:
    letter = rng.choice(string.ascii_lowercase[:-1])
    follower = string.ascii_lowercase[string.ascii_lowercase.index(letter) + 1]
    return {"instruction": f"Which letter comes after {letter}?", "response": follower}


def sort_digits(rng: random.Random) -> Pair:
    digits = [rng.choice(string.digits) for _ in range(rng.randint(3, 6))]
    return {"instruction": "Sort the digits: " + " ".join(digits), "response": " ".join(sorted(digits))}


TASKS: tuple[Callable[[random.Random], Pair], ...] = (
    addition,
    subtraction,
    reverse_words,
    capital,
    upper_case,
    count_words,
    next_letter,
    sort_digits,
)


def pairs(per_task: int, seed: int) -> Iterator[Pair]:
    """``per_task`` distinct pairs of every task, interleaved task by task (deterministic for a seed)."""
    if per_task < 1:
        raise ValueError(f"per_task must be at least 1, got {per_task}")
    rng = random.Random(seed)
    columns = []
    for task in TASKS:
        seen: dict[str, Pair] = {}
        for _ in range(per_task * 50):
            if len(seen) == per_task:
                break
            pair = task(rng)
            seen.setdefault(pair["instruction"], pair)
        columns.append(list(seen.values()))
    for row in range(per_task):
        for column in columns:
            if row < len(column):
                yield column[row]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSONL file to write")
    parser.add_argument("--per-task", type=int, default=40, help="pairs per task (fewer where a task has fewer)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random generator")
    args = parser.parse_args(argv)
    rows = list(pairs(args.per_task, args.seed))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as file:
        for row in rows:
            file.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} pairs to {args.out}")


if __name__ == "__main__":
    main()
