"""Rebuild the demo corpus from text that ships on a Debian + Python machine, with no network.

Two pools, so training can balance them and the prompts can cover both:
  code: the Python standard library's own source (library modules, not its test suite);
  text: English documentation: the Python docs' reST sources (apt package python3.11-doc),
        rendered man pages, Node.js API docs, READMEs and other docs under /usr/share/doc,
        and /usr/share/common-licenses.

The held-out split is chosen per file from a hash of its path, so a file is never split across
train and held-out and the choice does not depend on which other files exist. Exact duplicates
are dropped before splitting so a held-out file cannot also appear in train under another name.

    python examples/reproduce/demo_pair/build_corpus.py            # writes examples/demo_pair/data/
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import subprocess
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

HERE = Path(__file__).resolve().parents[2] / "demo_pair"  # the shipped pair and its data
HELDOUT_PERCENT = 4
MAX_CHARS = 400_000  # skips generated tables and concatenations (e.g. a whole changelog)
MAN_SECTIONS = ("1", "2", "3", "5", "7", "8")

STDLIB_SKIP = re.compile(r"(^|/)(site-packages|test|tests|idle_test|pydoc_data|encodings|__pycache__)/")
DOC_SKIP = re.compile(r"changelog|/NEWS|/RelNotes/|/copyright$|/nodejs/changelogs/|/html/(?!_sources/)", re.I)
DOC_SUFFIXES = (".md", ".rst", ".txt")


def stdlib_files(stdlib: Path) -> Iterator[Path]:
    for path in sorted(stdlib.rglob("*.py")):
        if not STDLIB_SKIP.search(path.relative_to(stdlib).as_posix()):
            yield path


def doc_files(root: Path) -> Iterator[Path]:
    """Prose documents under /usr/share/doc, plain or gzipped; changelogs and copyright files are out."""
    for path in sorted(root.rglob("*")):
        name = path.name[:-3] if path.name.endswith(".gz") else path.name
        if path.is_symlink() or not path.is_file() or DOC_SKIP.search(path.as_posix()):
            continue
        if name.endswith(DOC_SUFFIXES) or name.upper().startswith("README"):
            yield path


def man_pages(root: Path) -> Iterator[Path]:
    """English man pages; gcloud's 16k generated pages are left out so they do not swamp the pool."""
    for section in MAN_SECTIONS:
        for path in sorted((root / f"man{section}").glob("*")):
            if not path.is_symlink() and path.is_file() and not path.name.startswith("gcloud"):
                yield path


def read_text(path: Path) -> str | None:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def render_man(path: Path) -> str | None:
    source = read_text(path)
    if source is None or source.lstrip().startswith(".so "):  # .so pages only point at another page
        return None
    env = dict(os.environ, MANWIDTH="80", GROFF_NO_SGR="1", MAN_KEEP_FORMATTING="")
    command = ["man", "--no-justification", "--no-hyphenation", "-l", "-E", "UTF-8", str(path)]
    out = subprocess.run(command, capture_output=True, env=env).stdout
    text = re.sub(r".\x08", "", out.decode("utf-8", errors="replace"))  # overstrike bold/underline
    return re.sub(r"\n{3,}", "\n\n", text)


def clean(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").split("\n")).strip() + "\n"


def is_heldout(key: str) -> bool:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def documents(stdlib: Path, doc_root: Path, man_root: Path, licenses: Path) -> Iterator[dict]:
    sources = [
        ("code", "stdlib", stdlib, stdlib_files(stdlib), read_text),
        ("text", "doc", doc_root, doc_files(doc_root), read_text),
        ("text", "license", licenses, (p for p in sorted(licenses.iterdir()) if p.is_file()), read_text),
        ("text", "man", man_root, man_pages(man_root), render_man),
    ]
    for pool, origin, root, paths, load in sources:
        for path in tqdm(list(paths), desc=origin, mininterval=5):
            text = load(path)
            if text and 200 <= len(text) <= MAX_CHARS:
                key = f"{origin}/{path.relative_to(root).as_posix()}"
                yield {"pool": pool, "path": key, "text": clean(text)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE / "data")
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--doc-root", type=Path, default=Path("/usr/share/doc"))
    parser.add_argument("--man-root", type=Path, default=Path("/usr/share/man"))
    parser.add_argument("--licenses", type=Path, default=Path("/usr/share/common-licenses"))
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    counts: Counter = Counter()
    digests = {"train": hashlib.sha256(), "heldout": hashlib.sha256()}
    with (args.out / "train.jsonl").open("w") as train, (args.out / "heldout.jsonl").open("w") as heldout, \
            (args.out / "manifest.tsv").open("w") as manifest:
        manifest.write("split\tpool\tpath\tchars\n")
        for doc in documents(args.stdlib, args.doc_root, args.man_root, args.licenses):
            digest = hashlib.sha256(doc["text"].encode()).hexdigest()
            if digest in seen:
                continue
            seen.add(digest)
            split = "heldout" if is_heldout(doc["path"]) else "train"
            (heldout if split == "heldout" else train).write(json.dumps(doc) + "\n")
            manifest.write(f"{split}\t{doc['pool']}\t{doc['path']}\t{len(doc['text'])}\n")
            digests[split].update(digest.encode())
            origin = doc["path"].split("/", 1)[0]
            counts[f"{split}/{origin}/files"] += 1
            counts[f"{split}/{origin}/chars"] += len(doc["text"])
    summary = {"counts": dict(sorted(counts.items())), "sha256": {k: v.hexdigest() for k, v in digests.items()}}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
