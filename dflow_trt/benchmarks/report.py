"""What every `dflow-trt bench <what>` shares: timers, statistics, a printed table, the machine it
ran on and the JSON report, so each benchmark measures and reports the same way."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Hashable

from rich.console import Console
from rich.table import Table

from ..atomic import write_text

# the CPU features a matmul's speed turns on; the full flag list is hundreds of names
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "neon", "asimd", "sve")


def console() -> Console:
    """rich wraps a wide table at 80 columns when stdout is not a terminal; a log file gets it whole."""
    return Console(width=None if sys.stdout.isatty() else 160)


def time_ms(fn: Callable[[], object], repeats: int, sync: Callable[[], object] | None = None) -> float:
    """Median wall time of `fn` in ms over `repeats` calls, after one warm-up call. `sync` waits for
    a device's queued work after each call (a CUDA kernel launch returns before it runs)."""
    call = (lambda: (fn(), sync())) if sync else fn
    call()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def interleaved(cases: dict[Hashable, Callable[[], object]], repeats: int,
                warmup: int = 0) -> dict[Hashable, list[float]]:
    """Seconds per call of every case, the cases taking turns in each of `warmup + repeats` rounds
    (warm-up rounds untimed): a machine that speeds up or slows down meanwhile moves every case
    alike, so their ratios hold where separate runs' would not."""
    times: dict[Hashable, list[float]] = {k: [] for k in cases}
    for r in range(warmup + repeats):
        for k, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[k].append(dt)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def standard_error(xs: list[float]) -> float:
    """Standard error of the mean of xs (sample variance; 0 for fewer than two values)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mean = sum(xs) / n
    return (sum((x - mean) ** 2 for x in xs) / (n - 1) / n) ** 0.5


def _cpu() -> tuple[str, list[str]]:
    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model") and model is None:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:  # not Linux: the platform's word for it
        pass
    return model or platform.processor() or platform.machine(), [f for f in SIMD_FLAGS if f in flags]


def machine() -> dict:
    """Where a measurement was made: timings compare only within one of these."""
    cpu, flags = _cpu()
    out = {"cpu": cpu, "cpu_flags": flags, "cpu_count": os.cpu_count(), "python": platform.python_version(),
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    if "torch" in sys.modules:  # a benchmark that never loaded torch is not made to
        import torch

        out.update(threads=torch.get_num_threads(), torch=torch.__version__,
                   gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    return out


def set_threads(threads: int | None) -> None:
    """`--threads`: torch's intra-op threads for the run (None: torch's default, one per core)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def table(title: str, columns: list[str], rows: list[list], out: Console | None = None) -> None:
    """Print rows (values already formatted, or numbers shown as they are) under right-justified columns."""
    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(*(x if isinstance(x, str) else str(x) for x in r))
    (out or console()).print(t)


def write_json(path: str | Path, report: dict) -> Path:
    """The report as indented JSON, written atomically, with the `machine` it was measured on added."""
    report = {**report, "machine": report.get("machine") or machine()}
    return write_text(path, json.dumps(report, indent=2) + "\n")
