"""Load against a running server (or one this script starts): concurrency sweep per mode.

    python scripts/bench_serving.py [--url 127.0.0.1:8001 | --start] [--modes ar,dflow] [--concurrency 1,2,4,8]
        [--requests 8] [--max-tokens 32] [--out docs/serving_load]

Prints a table and writes JSON, CSV and a PNG; also writes perf_analyzer's input file and prints
its command line (the binary needs glibc >= 2.38, so it runs only on newer hosts).
"""

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dflow_trt.evalsets import load_prompts  # noqa: E402
from dflow_trt.serving.load import perf_analyzer_inputs, run_point, write_report  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--start", action="store_true", help="start scripts/serve.py's server for the run")
    ap.add_argument("--model", default="dflow")
    ap.add_argument("--modes", default="ar,dflash,dflow")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=8, help="requests per point")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dataset", default="mtbench")
    ap.add_argument("--out", default="docs/serving_load")
    a = ap.parse_args(argv)
    prompts = load_prompts(a.dataset)[:16]
    server = None
    if a.start:
        from dflow_trt.serving.server import start_server

        server = start_server(log_path="build/triton/server.log")
        a.url = server.grpc_url
    try:
        points = []
        print(f"{'mode':7} {'conc':>4} {'req/s':>7} {'tok/s':>7} {'tau':>5} {'TTFT p50/p90/p99 ms':>24} "
              f"{'ITL p50/p90/p99 ms':>22}")
        for mode in a.modes.split(","):
            for c in map(int, a.concurrency.split(",")):
                p = run_point(a.url, prompts, mode, c, max(a.requests, c), a.max_tokens, a.model)
                points.append(p)
                f = lambda d: "/".join(f"{d[k]:.0f}" for k in ("p50", "p90", "p99"))  # noqa: E731
                print(f"{mode:7} {c:>4} {p.requests_per_s:7.2f} {p.output_tokens_per_s:7.1f} {p.tau:5.2f} "
                      f"{f(p.ttft_ms):>24} {f(p.itl_ms):>22}", flush=True)
        for path in write_report(points, a.out):
            print(path)
        cmd = perf_analyzer_inputs(prompts, "dflow", a.max_tokens, a.out + "_perf_analyzer_input.json")
        where = "found" if shutil.which("perf_analyzer") else "not installed here (needs glibc >= 2.38)"
        print(f"perf_analyzer ({where}):\n  {cmd}")
    finally:
        if server:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
