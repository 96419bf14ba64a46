"""Generate ListOps in the Long Range Arena release format.

The algorithm is the one of the LRA release script (Nangia & Bowman's ListOps as used by LRA): operators
MIN, MAX, MED, SM (sum mod 10) over digits 0-9; a tree starts at depth 1; below depth 10 a node is a
value leaf with probability 0.75 and otherwise an operator with randint(2, 10) children, each one level
deeper; at depth 10 every node is a leaf. The length counts operator, "]" and value tokens; only trees
with ``min_length < length < max_length`` are kept, duplicates are dropped, and the kept trees are split
into train/val/test in generation order.

Unlike the release script (whose set order depended on Python hash randomisation) the output is a pure
function of ``--seed`` and the split sizes, whatever the number of worker processes: candidate trees are
drawn in fixed-size chunks, chunk ``c`` from ``random.Random(f"{seed}-{c}")``, and chunks are consumed in
index order.

Usage::

    python scripts/prepare_data/listops.py --out data/lra_release/listops-1000 --train 96000 --val 2000 --test 2000

writes ``basic_train.tsv``, ``basic_val.tsv`` and ``basic_test.tsv`` with the header ``Source<TAB>Target`` and
one ``( ( ( [MAX 2 ) 9 ) ] )``-style expression and its value per line.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
VALUE_P = 0.25
MAX_DEPTH = 10
MAX_ARGS = 10
CHUNK = 500

# A tree is a leaf int or a tuple (operator, [children]).
Tree = int | tuple[str, list]


def generate_tree(rng: random.Random, depth: int = 1, max_depth: int = MAX_DEPTH, max_args: int = MAX_ARGS):
    """Draw one ListOps tree with the release distribution.

    Args:
        rng: the random source.
        depth: depth of this node (the root is at depth 1).
        max_depth: nodes at this depth are always value leaves.
        max_args: an operator takes ``randint(2, max_args)`` arguments.

    Returns:
        (tree, length): the tree (int leaf or ``(operator, children)``) and its token count (operators, "]" and
        values; parentheses are not counted).
    """
    r = rng.random() if depth < max_depth else 1.0
    if r > VALUE_P:
        return rng.choice(range(10)), 1
    n_args = rng.randint(2, max_args)
    children = []
    length = 2
    for _ in range(n_args):
        child, child_len = generate_tree(rng, depth + 1, max_depth, max_args)
        children.append(child)
        length += child_len
    return (rng.choice(OPERATORS), children), length


def evaluate(tree: Tree) -> int:
    """Value of a tree: MIN, MAX, MED (median truncated to int), SM (sum mod 10)."""
    if isinstance(tree, int):
        return tree
    op, children = tree
    values = [evaluate(c) for c in children]
    if op == "[MIN":
        return min(values)
    if op == "[MAX":
        return max(values)
    if op == "[MED":
        return int(statistics.median(values))
    if op == "[SM":
        return sum(values) % 10
    raise ValueError(f"unknown operator {op!r}")


def to_string(tree: Tree) -> str:
    """Release written form: left-nested pairs in parentheses, e.g. ``( ( ( [MAX 2 ) 9 ) ] )``."""
    if isinstance(tree, int):
        return str(tree)
    op, children = tree
    s = f"( {op} {to_string(children[0])} )"
    for child in children[1:]:
        s = f"( {s} {to_string(child)} )"
    return f"( {s} {END} )"


def parse(source: str) -> Tree:
    """Inverse of :func:`to_string` on the token level: parentheses are ignored, ``]`` closes an operator."""
    tokens = source.replace("(", " ").replace(")", " ").split()
    pos = 0

    def node() -> Tree:
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok in OPERATORS:
            children = []
            while tokens[pos] != END:
                children.append(node())
            pos += 1
            return (tok, children)
        return int(tok)

    tree = node()
    if pos != len(tokens):
        raise ValueError("trailing tokens after the expression")
    return tree


def _chunk(args: tuple[int, int, int, int]) -> list[tuple[str, int]]:
    seed, index, min_length, max_length = args
    rng = random.Random(f"{seed}-{index}")
    out = []
    for _ in range(CHUNK):
        tree, length = generate_tree(rng)
        if min_length < length < max_length:
            out.append((to_string(tree), evaluate(tree)))
    return out


def generate(
    n: int, seed: int, min_length: int = 500, max_length: int = 2000, workers: int | None = None, progress: bool = True
) -> list[tuple[str, int]]:
    """``n`` distinct (source, target) examples, deterministic in ``seed`` whatever ``workers`` is.

    Args:
        n: number of distinct examples.
        seed: the seed.
        min_length, max_length: keep trees with ``min_length < length < max_length`` tokens.
        workers: processes (default: every core).
        progress: show a progress bar.

    Returns:
        list of (expression string, value) in generation order.
    """
    workers = workers or os.cpu_count() or 1
    seen: set[str] = set()
    examples: list[tuple[str, int]] = []
    bar = tqdm(total=n, desc="listops", unit="ex", disable=not progress)

    def chunks() -> Iterator[tuple[int, int, int, int]]:
        index = 0
        while True:
            yield (seed, index, min_length, max_length)
            index += 1

    pool = mp.Pool(workers) if workers > 1 else None
    try:
        results = pool.imap(_chunk, chunks()) if pool else map(_chunk, chunks())
        for chunk in results:
            for source, target in chunk:
                if source in seen:
                    continue
                seen.add(source)
                examples.append((source, target))
                bar.update(1)
                if len(examples) == n:
                    return examples
    finally:
        bar.close()
        if pool:
            pool.terminate()
    return examples


def write_tsv(path: Path, rows: list[tuple[str, int]]) -> None:
    """Write the release TSV: header ``Source<TAB>Target`` then one example per line."""
    with open(path, "w") as f:
        f.write("Source\tTarget\n")
        for source, target in rows:
            f.write(f"{source}\t{target}\n")


def read_tsv(path: Path) -> list[tuple[str, int]]:
    """Rows of a release TSV (the header skipped) as (source, target)."""
    with open(path) as f:
        next(f)
        return [(src, int(tgt)) for src, tgt in (line.rstrip("\n").split("\t") for line in f)]


def first_operator_baseline(root: Path) -> dict[str, dict[str, float]]:
    """Accuracy of two rules that read no more than the first token, per split of the release files in ``root``.

    ``first_operator``: predict the most frequent training label of the root operator (MIN, MAX, MED, SM);
    ``majority``: the most frequent training label. A model that learned only the first rule scores what it scores;
    the split-to-split spread of this number shows how much a 2,000-example split alone moves an accuracy.

    Returns:
        {split: {"n", "first_operator", "majority"}} for the splits present (train must be).
    """
    paths = {s: root / f"basic_{s}.tsv" for s in ("train", "val", "test")}
    splits = {s: read_tsv(path) for s, path in paths.items() if path.exists()}
    if "train" not in splits:
        raise FileNotFoundError(f"{root / 'basic_train.tsv'} is missing")
    by_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for src, y in splits["train"]:
        by_op[root_operator(src)][y] += 1
    rule = {op: c.most_common(1)[0][0] for op, c in by_op.items()}
    majority = collections.Counter(y for _, y in splits["train"]).most_common(1)[0][0]
    out = {}
    for name, rows in splits.items():
        n = len(rows)
        out[name] = {
            "n": n,
            "first_operator": sum(rule.get(root_operator(s)) == y for s, y in rows) / n,
            "majority": sum(y == majority for _, y in rows) / n,
        }
    return out


def root_operator(source: str) -> str:
    """The operator of a written tree's root (its first operator token)."""
    for tok in source.split():
        if tok in OPERATORS:
            return tok
    raise ValueError(f"no operator in {source[:40]!r}")


def format_baseline(stats: dict[str, dict[str, float]]) -> str:
    """One line per split: size, first-operator rule and majority-class accuracy in percent."""
    return "\n".join(
        f"{name:5s} n={r['n']:6d}  first-operator rule {100 * r['first_operator']:.2f}%  majority class "
        f"{100 * r['majority']:.2f}%"
        for name, r in stats.items()
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="output folder (the release's listops-1000)")
    parser.add_argument("--train", type=int, default=96000)
    parser.add_argument("--val", type=int, default=2000)
    parser.add_argument("--test", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-length", type=int, default=500)
    parser.add_argument("--max-length", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=None, help="processes (default: every core)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="generate nothing: report the first-operator rule's accuracy on each split of --out",
    )
    parser.add_argument(
        "--baseline-json",
        type=Path,
        default=None,
        help="with --baseline: also write the numbers, with the command and date, to this file",
    )
    args = parser.parse_args(argv)
    if args.baseline:
        stats = first_operator_baseline(args.out)
        print(format_baseline(stats))
        if args.baseline_json:
            given = argv if argv is not None else sys.argv[1:]
            record = {
                "command": "python scripts/prepare_data/listops.py " + " ".join(given),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "splits": stats,
            }
            args.baseline_json.write_text(json.dumps(record, indent=1) + "\n")
        return

    total = args.train + args.val + args.test
    rows = generate(total, args.seed, args.min_length, args.max_length, args.workers, not args.no_progress)
    args.out.mkdir(parents=True, exist_ok=True)
    splits = {"train": rows[: args.train], "val": rows[args.train : args.train + args.val]}
    splits["test"] = rows[args.train + args.val :]
    for name, part in splits.items():
        write_tsv(args.out / f"basic_{name}.tsv", part)
    print(f"wrote {', '.join(f'{k}={len(v)}' for k, v in splits.items())} to {args.out}")


if __name__ == "__main__":
    main()
