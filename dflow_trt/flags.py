"""The argument checks every `dflow-trt` command shares: one-line refusals, finite bounded numbers,
outputs checked writable before the work that fills them."""

from __future__ import annotations

import argparse
import math

from .atomic import check_writable

MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed's range, as decoding.sampling's (not imported: it loads torch)


class Parser(argparse.ArgumentParser):
    """argparse whose refusals end like every other one: a single `error: ...` line, exit 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def number(kind: type = int, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, hi_open: bool = False):
    """An argparse `type=`: a finite int or float within lo..hi (an open end excludes the bound)."""
    what = "an integer" if kind is int else "a finite number"
    if lo is not None and hi is not None:
        what += f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    elif lo is not None:
        what += f" {'>' if lo_open else '>='} {lo}"

    def parse(text: str):
        try:
            x = kind(text)
            ok = (kind is int or math.isfinite(x)) and (lo is None or (x > lo if lo_open else x >= lo)) \
                and (hi is None or (x < hi if hi_open else x <= hi))
        except ValueError:
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return x

    return parse


COUNT = number(int, 1)  # sizes and counts
START = number(int, 0)  # offsets
BLOCK = number(int, 2)  # anchor + at least one draft
SEED = number(int, 0, MAX_SEED)
THREADS = COUNT  # torch's intra-op threads


def number_list(check):
    """An argparse `type=`: a comma list of values each passing `check` (a `number(...)`), in order."""
    def parse(text: str):
        items = [x.strip() for x in text.split(",")]
        if not all(items):
            raise argparse.ArgumentTypeError(f"must be a comma list of numbers, got {text!r}")
        return [check(x) for x in items]

    return parse


def check_output(path: str | None, what: str, folder: bool = False) -> None:
    """Refuse an output path that cannot be written, before the work that would fill it."""
    if path is not None:
        check_writable(path, what, folder)
