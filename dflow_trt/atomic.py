"""Atomic artefact writes, the rule that nothing but our own output is ever deleted, and the
check every JSON artefact we wrote gets when it is read back (`read_json`).

Every artefact (a folder or a file) is written under a temporary sibling named
`.<name>.dflow-tmp-<random>` and renamed into place, so a reader never sees half of one. A
temporary left by an interrupted run is removed only when the same artefact is written again,
and only if it carries that exact name: nothing else under an output folder is touched.
An output folder is taken over only when it is new, empty, or already holds this kind of run's
own files (`claim_dir`), checked before any work starts.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import UserError

TMP_MARK = ".dflow-tmp-"


def _sweep(dest: Path) -> None:
    """Remove temporaries an interrupted earlier write of `dest` left beside it (ours by name)."""
    for stale in dest.parent.glob(f".{dest.name}{TMP_MARK}*"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


@contextmanager
def atomic_dir(dest: str | Path, sweep: bool = True) -> Iterator[Path]:
    """Yield an empty temporary folder; on success it replaces `dest` whole, on error it is removed.
    `sweep=False` for a cache several processes may fill at once (Triton's model stubs, DDP ranks):
    their temporaries are then in use, not stale, and are left alone."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if sweep:
        _sweep(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}{TMP_MARK}", dir=dest.parent))
    try:
        yield tmp
        if dest.is_dir() and not dest.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}{TMP_MARK}", dir=dest.parent))
            os.replace(dest, old / dest.name)  # out of the way first, so dest is never half-replaced
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_file(dest: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `dest` for a writer to create (`save_file`, `savefig`, ...); on
    success it replaces `dest`, on error it is removed. The writer creates the file, so it gets the
    usual permissions (as if written at `dest` directly)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _sweep(dest)
    tmp = dest.parent / f".{dest.name}{TMP_MARK}{secrets.token_hex(6)}"
    try:
        yield tmp
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | Path, text: str) -> Path:
    """Write a text file atomically (temporary sibling, then rename)."""
    return write_bytes(path, text.encode())


def write_bytes(path: str | Path, data: bytes) -> Path:
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def claim_dir(path: str | Path, what: str, own: tuple[str, ...]) -> Path:
    """Check, before any work, that `path` may hold a `what`: it is new, empty, or already holds one
    of the entries `own` that only such a run writes. A folder of other files is refused, so a
    command never overwrites or deletes what it did not write. Also checks it can be written."""
    path = Path(path)
    check_writable(path, what)
    if path.is_dir():
        entries = {p.name for p in path.iterdir()}
        if entries and not entries & set(own):
            raise UserError(f"{path} holds files that are not a {what} ({', '.join(sorted(entries)[:3])}"
                            f"{', ...' if len(entries) > 3 else ''}); pass a new or empty folder")
    return path


def check_writable(path: str | Path, what: str, folder: bool = True) -> None:
    """Refuse an output path that cannot be written, before the work that would fill it. A nameless
    temporary file is created where the output will go (os.access lets root "write" even to /proc),
    so nothing is left behind. `folder`: the output is a folder (else a file at `path`)."""
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        raise UserError(f"the {what} {path} is a {'file' if folder else 'folder'}; pass a "
                        f"{'folder' if folder else 'file path'}")
    where = next((q for q in ((path, *path.parents) if folder else path.parents) if q.exists()), Path("."))
    if not where.is_dir():
        raise UserError(f"cannot write the {what} at {path}: {where} is a file; pass another path")
    try:
        tempfile.TemporaryFile(dir=where).close()
    except OSError as e:
        raise UserError(f"cannot write the {what} at {path}: {where} takes no new files ({e.strerror}); "
                        f"pass another path") from None


def read_json(path: str | Path, field: str, expected, fix: str) -> dict:
    """A JSON artefact this project wrote (a manifest, a graph's meta file), recognised by one
    field's value; refused in one line ending with `fix` when missing, unreadable or foreign."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} is missing; {fix}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not readable JSON ({type(e).__name__}); {fix}") from None
    if not isinstance(data, dict) or data.get(field) != expected:
        got = data.get(field) if isinstance(data, dict) else None
        raise UserError(f"{path} has {field} {got!r}, expected {expected!r}; {fix}")
    return data
