"""A drafter folder's training log: one JSON record per step (`train_log.jsonl`), or the same
gzip-compressed (`train_log.jsonl.gz`).

Why two forms: the log carries every stage of a drafter's lineage (a fine-tune extends its
parent's log), so a shipped drafter's log grows with each stage; the shipped drafters keep it
compressed (10× smaller) so the repository stays small enough to travel to a GPU host. Runs write
plain text. Every reader goes through `read`, which takes either. No torch here: the plots read logs.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

from ..atomic import write_bytes
from ..errors import UserError

NAME = "train_log.jsonl"
NAMES = (NAME, NAME + ".gz")


def compact_record(rec: dict) -> dict:
    """Floats to 5 significant digits: no reader (plots, lineage, fits) looks past the 4th."""
    return {k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in rec.items()}


def to_text(rows: list[dict]) -> str:
    return "".join(json.dumps(compact_record(r)) + "\n" for r in rows)


def find(folder: str | Path) -> Path | None:
    """The log file in `folder` (plain or compressed), or None."""
    return next((p for p in (Path(folder) / n for n in NAMES) if p.is_file()), None)


def read(folder: str | Path, required: bool = True) -> list[dict]:
    """Every record of `folder`'s log; [] when there is none and it is not `required`."""
    path = find(folder)
    if path is None:
        if not required:
            return []
        raise UserError(f"{folder} has no {NAME}; pass a drafter folder written by `dflow-trt train`")
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise UserError(f"{path} is not a readable gzip file ({e}); fetch or write the log again") from None
    rows = []
    for i, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise UserError(f"{path}:{i} is not JSON; pass a log written by `dflow-trt train`") from None
    return rows


def wall_seconds(rows: list[dict]) -> float:
    """Training wall time of `rows`: each stage (process) restarts its `elapsed_s` clock at 0, so
    the time is summed over stages instead of read off the last record."""
    wall, prev = 0.0, None
    for r in rows:
        e = r.get("elapsed_s")
        if isinstance(e, (int, float)):
            wall += e - prev if prev is not None and e >= prev else e
            prev = e
    return wall


def write(folder: str | Path, rows: list[dict], compress: bool = False) -> Path:
    """Write `rows` as the folder's only log (the other form, if any, is removed)."""
    folder = Path(folder)
    path = folder / (NAMES[1] if compress else NAME)
    data = to_text(rows).encode()
    write_bytes(path, gzip.compress(data, mtime=0) if compress else data)
    for other in NAMES:
        if folder / other != path:
            (folder / other).unlink(missing_ok=True)
    return path
