"""`dflow-trt bench training`: the trainer's throughput (blocks/s, tokens/s and the fraction of this
CPU's matmul FLOP/s a step reaches) per objective.

The measurement is `dflow_trt.training.throughput.measure` (the trainer owns what a step is); this
module checks it is there, prints its numbers and writes them as a report like every other
benchmark's: {"results": [one per objective], "cpu_flags_bf16", "when", "machine"}.
"""

from __future__ import annotations

import json
import time

from ..errors import UserError
from ..training.throughput import measure
from . import report


def parse_overrides(pairs: list[str]) -> dict:
    """`--set KEY=VALUE ...`: TrainConfig fields, each value read as JSON where it is (else text);
    TrainConfig checks names and ranges when `measure` builds it."""
    out = {}
    for kv in pairs:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise UserError(f"--set takes KEY=VALUE, got {kv!r}")
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def run(objectives=("dflash", "dflow"), steps: int = 8, warmup: int = 2, threads: int | None = None,
        data_dir: str | None = None, overrides: dict | None = None, peak: bool = True,
        json_out: str | None = None, drafter: str | None = None) -> int:
    rows = [measure({**(overrides or {}), **({"objective": "dflow", "train_part": "relay"} if o == "relay" else
                                             {"objective": o})}, steps=steps, warmup=warmup, threads=threads,
                    data_dir=data_dir, drafter=drafter, peak=peak) for o in objectives]

    def g(r, k):
        return f"{r[k] / 1e9:.1f}" if r.get(k) is not None else "-"

    con = report.console()
    report.table(f"trainer throughput: {steps} steps after {warmup} warm-up (step_s: median)",
                 ["objective", "blocks/s", "trained/s", "tokens/s", "step_s", "GFLOP/s", "peak", "fraction", "dtype"],
                 [[r["objective"], f"{r['blocks_per_s']:.1f}", f"{r['trained_blocks_per_s']:.1f}",
                   f"{r['tokens_per_s']:.0f}", f"{r['step_s']:.3f}", g(r, "achieved_flops"), g(r, "peak_flops"),
                   f"{100 * r['fraction']:.1f}%" if "fraction" in r else "-", str(r.get("compute_dtype", "-"))]
                  for r in rows], con)
    if json_out:
        machine = report.machine()
        out = {"results": rows, "cpu_flags_bf16": bool({"avx512_bf16", "amx_bf16"} & set(machine["cpu_flags"])),
               "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine}
        con.print(f"wrote {report.write_json(json_out, out)}")
    return 0
