"""`dflow-trt bench training`: the trainer's throughput (blocks/s) on a training configuration.

The measurement itself is `dflow_trt.training.throughput.measure(cfg: TrainConfig) -> dict` (the
trainer owns what one step is); this module checks it is there, prints its numbers and writes them
as a report like every other benchmark's.
"""

from __future__ import annotations

from ..errors import UserError
from . import report


def _measure():
    try:
        from ..training.throughput import measure
    except ModuleNotFoundError as e:
        if e.name != "dflow_trt.training.throughput":
            raise
        raise UserError("this install has no trainer throughput measurement (dflow_trt.training.throughput); "
                        "update dflow_trt") from None
    return measure


def run(cfg, json_out: str | None = None) -> int:
    """`cfg`: the TrainConfig to time, as `dflow-trt train` would run it."""
    measure = _measure()
    out = dict(measure(cfg))
    con = report.console()
    report.table(f"trainer throughput: {cfg.target}, {cfg.objective}",
                 ["measure", "value"],
                 [[k, f"{v:.4g}" if isinstance(v, float) else str(v)] for k, v in out.items()
                  if isinstance(v, (int, float, str)) or v is None], con)
    if json_out:
        con.print(f"wrote {report.write_json(json_out, out)}")
    return 0
