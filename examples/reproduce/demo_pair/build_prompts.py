"""Pick the demo's held-out prompts: beginnings of Python functions and of English doc paragraphs.

Prompts come only from the held-out split, so the demo and benchmarks never prompt the models
with text they were trained on. Picks are evenly spaced over a sorted candidate list, so the
file is the same on every rebuild of the same corpus.

    python examples/reproduce/demo_pair/build_prompts.py     # reads data/heldout.jsonl, writes heldout_{prompts,documents}.jsonl
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parents[2] / "demo_pair"  # the shipped pair and its data
WORD = re.compile(r"^[A-Za-z][a-z]*[,.;:]?$")


def function_openings(path: str, source: str) -> list[dict]:
    """The def line(s) of each function plus its first body line (often the docstring's first line).

    Prompts end at the end of a line, not after its newline: the BPE merges a newline with the
    next line's indent into one token, so a bare trailing newline would tell the model that the
    next line is not indented.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines(keepends=True)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 6:
            opening = textwrap.dedent("".join(lines[node.lineno - 1 : node.body[0].lineno])).rstrip()
            found.append({"text": opening, "pool": "code", "source": f"{path}:{node.lineno}"})
    return sorted(found, key=lambda p: (p["source"].split(":")[0], int(p["source"].split(":")[1])))


def paragraph_openings(path: str, text: str, words: int = 25) -> list[dict]:
    """The first `words` words of each plain-prose paragraph, keeping its line layout and indent."""
    found = []
    for paragraph in re.split(r"\n\s*\n", text):
        tokens = paragraph.split()
        if len(tokens) < 40 or sum(bool(WORD.match(t)) for t in tokens) < 0.8 * len(tokens):
            continue
        end = [m.end() for m in re.finditer(r"\S+", paragraph)][words - 1]
        found.append({"text": paragraph[:end].strip("\n"), "pool": "text", "source": path})
    return found


def spread(candidates: list[dict], count: int) -> list[dict]:
    if len(candidates) < count:
        raise SystemExit(f"only {len(candidates)} candidates for {count} prompts; is the held-out split empty?")
    return [candidates[i * len(candidates) // count] for i in range(count)]


def documents(docs: list[dict], per_pool: int = 4, chars: int = 10_000) -> list[dict]:
    """Whole held-out documents cut to `chars` (~2,600 tokens): the drift study's long contexts."""
    picked = []
    for pool in ("code", "text"):
        long_enough = [d for d in docs if d["pool"] == pool and len(d["text"]) >= chars]
        for d in spread(long_enough, per_pool):
            text = d["text"][:chars]
            picked.append({"text": text[: text.rfind("\n")], "pool": pool, "source": d["path"]})
    return picked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=HERE / "data")
    parser.add_argument("--out", type=Path, default=HERE / "heldout_prompts.jsonl")
    parser.add_argument("--documents", type=Path, default=HERE / "heldout_documents.jsonl")
    parser.add_argument("--per-kind", type=int, default=10, help="prompts per kind: Python, man page, other docs")
    args = parser.parse_args()
    with (args.data / "heldout.jsonl").open() as lines:
        docs = sorted(map(json.loads, lines), key=lambda d: d["path"])
    code = [p for d in docs if d["pool"] == "code" for p in function_openings(d["path"], d["text"])]
    man = [p for d in docs if d["path"].startswith("man/") for p in paragraph_openings(d["path"], d["text"])]
    other = [p for d in docs if d["path"].startswith(("doc/", "license/"))
             for p in paragraph_openings(d["path"], d["text"])]
    prompts = spread(code, 2 * args.per_kind) + spread(man, args.per_kind) + spread(other, args.per_kind)
    args.out.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print(f"{len(prompts)} prompts from {len(code)} functions, {len(man) + len(other)} paragraphs -> {args.out}")
    long = documents(docs)
    args.documents.write_text("".join(json.dumps(d) + "\n" for d in long))
    print(f"{len(long)} documents -> {args.documents}")


if __name__ == "__main__":
    main()
