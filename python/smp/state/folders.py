"""A checkpoint directory: its folders, which of them is newest, and how a save publishes one.

A save writes into `<tag>[_partial].incomplete` and renames it when every rank's files are synced;
`newest` (a text file, replaced atomically) names the last complete one only after that, and
`partial_checkpoints` lists the kept partial tags in the order they were written. A job killed
at any moment leaves the newest complete checkpoint whole and named; what it was writing stays
behind as an `.incomplete` folder, never read (the next save of that tag removes it).
"""

from __future__ import annotations

import os
import shutil
import warnings

NEWEST = "newest"
INCOMPLETE = ".incomplete"
REPLACED = ".replaced"
LEDGER = "partial_checkpoints"


def newest_tag(path: str, caller: str) -> str | None:
    """The tag `newest` names in `path` (None when there is no checkpoint: a fresh start); a save
    left torn by a kill is named in a warning."""
    torn = sorted(name for name in _listing(path) if name.endswith(INCOMPLETE))
    filename = os.path.join(path, NEWEST)
    tag = None
    if os.path.exists(filename):
        with open(filename) as f:
            tag = f.read().strip() or None
    if torn:
        where = f"resuming from {tag!r}" if tag is not None else "no complete checkpoint to resume from"
        warnings.warn(
            f"{caller}: {', '.join(torn)} in {path} is a save that was killed before it completed; it "
            f"is ignored ({where})",
            stacklevel=3,
        )
    return tag


def _listing(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def folder(tag: str, partial: bool) -> str:
    return f"{tag}_partial" if partial else tag


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(folder: str, final: str) -> None:
    """Renames the complete `folder` to `final`; an older `final` (the same tag saved again) is
    moved aside first and removed after, so one of the two exists at every moment."""
    replaced = final + REPLACED
    shutil.rmtree(replaced, ignore_errors=True)
    if os.path.exists(final):
        os.rename(final, replaced)
    os.rename(folder, final)
    fsync_dir(os.path.dirname(final) or ".")
    shutil.rmtree(replaced, ignore_errors=True)


def replace_text(filename: str, text: str) -> None:
    """Writes a small file atomically: a reader sees the old content or the new, never a part."""
    tmp = filename + INCOMPLETE
    with open(tmp, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, filename)
    fsync_dir(os.path.dirname(filename) or ".")


def _folder(tag: str, partial: bool) -> str:
    return f"{tag}_partial" if partial else tag


def prune(path: str, newest: str, keep: int) -> None:
    """Deletes the oldest partial checkpoints beyond `keep` (by the order they were written)."""
    ledger = os.path.join(path, LEDGER)
    tags = open(ledger).read().split() if os.path.exists(ledger) else []
    tags = [t for t in tags if t != newest] + [newest]
    replace_text(ledger, "\n".join(tags[-keep:]))  # first: a kill now only leaves extra folders
    for old in tags[:-keep]:
        shutil.rmtree(os.path.join(path, folder(old, True)), ignore_errors=True)
