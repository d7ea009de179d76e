"""Output folders that end whole or not at all: a command that fails or is interrupted leaves no half-written
folder, and a folder never mixes the files of two models."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replace_folder(folder: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """A scratch folder beside `folder` to write into; when the block completes it becomes `folder`.

    Checked before any work: `folder` must be new or empty, or `overwrite` must be set, in which case
    the old folder is replaced whole (not merged into). On an error the scratch folder is removed and
    `folder` is left as it was.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file: give a folder to write the output into")
    if folder.is_dir() and any(folder.iterdir()) and not overwrite:
        raise ValueError(f"{folder} is not empty: choose a new folder, or pass --overwrite (overwrite=True) to "
                         "replace it whole")
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        yield scratch
        if folder.exists():
            old = scratch.with_name(scratch.name + "-old")
            folder.rename(old)
            scratch.rename(folder)
            shutil.rmtree(old)
        else:
            scratch.rename(folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
