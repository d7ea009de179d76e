"""Output folders that end whole or not at all: a command that fails or is interrupted leaves no half-written
folder, and a folder never mixes the files of two models."""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path


def check_keeps_source(folder: Path, source: str | Path | None) -> None:
    """Refuse to replace `source` itself or a folder that holds it: replacing deletes what it holds."""
    if source is None or not Path(source).exists():  # a Hub id: nothing local to lose
        return
    source = Path(source).resolve()
    if folder.resolve() in (source, *source.parents):
        raise ValueError(f"{folder} is the source {source} or holds it: replacing it would delete the source; "
                         "choose another output folder")


@contextlib.contextmanager
def replace_folder(folder: str | Path, overwrite: bool = False, source: str | Path | None = None) -> Iterator[Path]:
    """A scratch folder beside `folder` to write into; when the block completes it becomes `folder`.

    Checked before any work: `folder` must be new or empty, or `overwrite` must be set, in which case
    the old folder is replaced whole (not merged into); it must not be (or hold) the `source` being read.
    On an error the scratch folder is removed and `folder` is left as it was. The scratch folder is
    made with the usual permissions (the umask's), since it becomes the output.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a file: give a folder to write the output into")
    if folder.is_dir() and any(folder.iterdir()) and not overwrite:
        raise ValueError(f"{folder} is not empty: choose a new folder, or pass --overwrite (overwrite=True) to "
                         "replace it whole")
    check_keeps_source(folder, source)
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = folder.with_name(f".{folder.name}-{uuid.uuid4().hex[:8]}")
    scratch.mkdir()
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


@contextlib.contextmanager
def removed_on_failure(folder: str | Path, resumable: Callable[[Path], bool]) -> Iterator[None]:
    """If the block fails, remove what it created in `folder` (and `folder`, if it created that), unless
    `resumable(folder)`: a run that left something to resume from (checkpoints, paid-for answers) keeps it.

    For commands that write their output as they go and can resume: a replaced folder (`replace_folder`)
    could not be resumed from. What `folder` held before the block is never touched.
    """
    folder = Path(folder)
    before = set(folder.iterdir()) if folder.is_dir() else None
    try:
        yield
    except BaseException:
        if folder.is_dir() and not resumable(folder):
            for entry in set(folder.iterdir()) - (before or set()):
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            if before is None:
                folder.rmdir()
        raise
