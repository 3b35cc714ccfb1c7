"""A bounded load generator for the decoupled `dflow` model, reporting what perf_analyzer's LLM
mode reports: requests/s, output tokens/s, time to first token, inter-token latency, p50/p90/p99."""

from __future__ import annotations

import csv
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .client import generate_grpc


@dataclass
class LoadPoint:
    model: str
    mode: str
    concurrency: int
    requests: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    tau: float
    ttft_ms: dict
    itl_ms: dict
    latency_ms: dict
    batch_rows: float = 1.0  # mean over requests of the most rows each shared a round with (server stats)


def _pct(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(xs) * 1000.0
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def run_point(url: str, prompts: list[str], mode: str, concurrency: int, requests: int, max_tokens: int,
              model: str = "dflow", chat: bool = True) -> LoadPoint:
    """`concurrency` workers keep one request each in flight until `requests` have completed."""
    lock, nxt, results = threading.Lock(), [0], []

    def worker():
        while True:
            with lock:
                if nxt[0] >= requests:
                    return
                i = nxt[0]
                nxt[0] += 1
            t0 = time.perf_counter()
            r = generate_grpc(url, model, prompt=prompts[i % len(prompts)], mode=mode, max_tokens=max_tokens, chat=chat)
            with lock:
                results.append((r, time.perf_counter() - t0))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dur = time.perf_counter() - t0
    ttft, itl, lat, toks, taus, rows = [], [], [], 0, [], []
    for r, total in results:
        lat.append(total)
        rows.append(r.stats.get("batch_rows", 1))
        toks += len(r.token_ids)
        taus.append(r.stats.get("tau", 0.0))
        if r.chunk_times:
            ttft.append(r.chunk_times[0])
            if len(r.token_ids) > 1:  # per-token gap after the first token (rounds deliver several at once)
                itl.append((r.chunk_times[-1] - r.chunk_times[0]) / (len(r.token_ids) - 1))
    return LoadPoint(model, mode, concurrency, len(results), dur, len(results) / dur, toks / dur,
                     float(np.mean(taus)) if taus else 0.0, _pct(ttft), _pct(itl), _pct(lat),
                     float(np.mean(rows)) if rows else 1.0)


def held_state(url: str, model: str = "dflow") -> dict | None:
    """What the decoding model holds after a run (its scheduler's rows, batches and waiting
    requests), read from the stats of one 1-token request; None where it does not batch."""
    return generate_grpc(url, model, prompt="hi", mode="ar", max_tokens=1).stats.get("scheduler")


def write_report(points: list[LoadPoint], out: str | Path, extra: dict | None = None) -> list[Path]:
    """JSON (with `extra` beside the points) + CSV + PNG (tokens/s and p90 ITL against concurrency,
    per model and mode)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [p.__dict__ for p in points]
    out.with_suffix(".json").write_text(json.dumps({**(extra or {}), "points": rows}, indent=2) + "\n")
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "mode", "concurrency", "requests", "requests_per_s", "output_tokens_per_s", "tau",
                    "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "batch_rows"])
        for p in points:
            w.writerow([p.model, p.mode, p.concurrency, p.requests, f"{p.requests_per_s:.3f}", f"{p.output_tokens_per_s:.2f}",
                        f"{p.tau:.3f}", *(p.ttft_ms[k] for k in ("p50", "p90", "p99")),
                        *(p.itl_ms[k] for k in ("p50", "p90", "p99")), f"{p.batch_rows:.2f}"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for model, mode in dict.fromkeys((p.model, p.mode) for p in points):
        ps = [p for p in points if (p.model, p.mode) == (model, mode)]
        label = f"{model} {mode}"
        ax[0].plot([p.concurrency for p in ps], [p.output_tokens_per_s for p in ps], "o-", label=label)
        ax[1].plot([p.concurrency for p in ps], [p.itl_ms["p90"] or 0 for p in ps], "o-", label=label)
    ax[0].set(xlabel="concurrency", ylabel="output tokens/s", title="throughput", xscale="log", xticks=sorted({p.concurrency for p in points}), xticklabels=sorted({p.concurrency for p in points}))
    ax[1].set(xlabel="concurrency", ylabel="p90 inter-token latency (ms)", title="latency")
    ax[0].legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    plt.close(fig)
    return [out.with_suffix(s) for s in (".json", ".csv", ".png")]


def perf_analyzer_inputs(prompts: list[str], mode: str, max_tokens: int, path: str | Path) -> str:
    """Write perf_analyzer's --input-data file; return the command line for a host where it runs."""
    data = {"data": [{"text_input": [p], "max_tokens": [max_tokens], "mode": [mode], "chat": [True]} for p in prompts]}
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return (f"perf_analyzer -m dflow -i grpc --streaming --async -u 127.0.0.1:8001 --input-data {path} "
            "--shape text_input:1 --shape max_tokens:1 --shape mode:1 --shape chat:1 "
            "--concurrency-range 1:8:2 --measurement-mode count_windows --measurement-request-count 8 "
            "-f perf_analyzer.csv")
