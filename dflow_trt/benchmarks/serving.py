"""`dflow-trt bench serving`: load against a running Triton server (or one it starts), a concurrency
sweep per mode: requests/s, output tokens/s, τ, time to first token and inter-token latency.

Writes JSON, CSV and a PNG (`serving.load.write_report`), and perf_analyzer's input file beside
them with its command line printed (the binary needs glibc >= 2.38, so it runs only on newer hosts).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import UserError
from . import report


def perf_analyzer_path(json_out: str | Path) -> Path:
    out = Path(json_out)
    return out.with_name(out.stem + "_perf_analyzer_input.json")


UNBATCHED = "dflow_alone"  # the `dflow` model with max_batch 1: every request decodes alone
UNBUDGETED = "dflow_whole_block"  # batched, but every row verifies its whole block (verify_budget 0)


def run(url: str | None = "127.0.0.1:8001", start: bool = False, models=("dflow",),
        modes=("ar", "dflash", "dflow"), concurrency=(1, 2, 4, 8), requests: int = 8, max_tokens: int = 32,
        dataset: str = "mtbench", json_out: str = "docs/serving_load.json", unbatched_baseline: bool = False) -> int:
    """Each (mode, concurrency) point runs on every model in turn, so models are compared within one
    run. `unbatched_baseline` (with `start`): serve the default `dflow` model, `dflow_alone` (the
    same with max_batch 1) and `dflow_whole_block` (batched without a verify budget) from one
    server, and compare the three."""
    from ..evalsets import load_prompts
    from ..serving.client import health
    from ..serving.load import held_state, perf_analyzer_inputs, run_point, write_report

    prompts = load_prompts(dataset)[:16]
    con = report.console()
    server = None
    if unbatched_baseline:
        if not start:
            raise UserError("--unbatched-baseline serves its own models: add --start")
        models = (UNBATCHED, UNBUDGETED, "dflow")
    if start:
        from ..serving.repository import write_repository
        from ..serving.server import DEFAULT_REPOSITORY, start_server

        repo = DEFAULT_REPOSITORY
        if unbatched_baseline:
            repo = write_repository("build/triton/bench_repo", models=("dflow",),
                                    variants={UNBATCHED: ("dflow", {"max_batch": "1"}),
                                              UNBUDGETED: ("dflow", {"verify_budget": "0"})})
        server = start_server(repo, log_path="build/triton/server.log")
        url = server.grpc_url
    try:
        for model in models:
            if not health(url, "grpc", model):
                raise UserError(f"no ready Triton server with the {model} model at {url} (grpc); start one with "
                                f"`python scripts/serve.py` or pass --start")
        points, rows = [], []

        def pct(d):
            return "/".join(f"{d[k]:.0f}" for k in ("p50", "p90", "p99"))

        for i, (mode, c) in enumerate((m, c) for m in modes for c in concurrency):
            for model in models[i % len(models):] + models[:i % len(models)]:  # turns rotate: no model always first
                p = run_point(url, prompts, mode, c, max(requests, c), max_tokens, model)
                points.append(p)
                con.print(f"{model} {mode} × {c}: {p.output_tokens_per_s:.1f} tokens/s", style="dim")
                rows.append([model, mode, c, f"{p.requests_per_s:.2f}", f"{p.output_tokens_per_s:.1f}",
                             f"{p.tau:.2f}", f"{p.batch_rows:.1f}", pct(p.ttft_ms), pct(p.itl_ms)])
        report.table(f"{', '.join(models)} at {url}: {max_tokens} tokens per request, {dataset} prompts",
                     ["model", "mode", "conc", "req/s", "tok/s", "tau", "rows", "TTFT p50/p90/p99 ms",
                      "ITL p50/p90/p99 ms"],
                     rows, con)
        held = {m: held_state(url, m) for m in models}  # every request has ended: nothing may be held
        con.print(f"held by the server after the run: {held}")
        for path in write_report(points, Path(json_out).with_suffix(""), {"held_after_run": held}):
            con.print(f"wrote {path}")
        cmd = perf_analyzer_inputs(prompts, "dflow", max_tokens, perf_analyzer_path(json_out))
        where = "found" if shutil.which("perf_analyzer") else "not installed here (needs glibc >= 2.38)"
        con.print(f"perf_analyzer ({where}):\n  {cmd}", soft_wrap=True)
    finally:
        if server:
            server.stop()
    return 0
