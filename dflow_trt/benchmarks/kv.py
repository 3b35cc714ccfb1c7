"""What the in-place KV cache saves: one target forward of 1, 2, 3, 5 and 16 tokens on a context,
with transformers' DynamicCache (concatenating every layer's cache per forward) and with
`targets.kv_cache` (writing into a grown buffer), interleaved, each verify followed by a commit
of one token (the cache grows as in decoding, and a crop follows every multi-token verify).

    python scripts/bench_kv_cache.py [--target smollm2-135m] [--context 256 1024] [--repeats 15]
                                     [--json docs/bench_kv_cache.json]

Prints a table and writes JSON. Not a test.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dflow_trt.drafter.defaults import load_target_and_drafter  # noqa: E402
from dflow_trt.targets import hf_target  # noqa: E402
from dflow_trt.targets.kv_cache import new_kv_cache  # noqa: E402

SIZES = (1, 2, 3, 5, 16)


def _time_context(target, context: int, repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, target.info.vocab_size, (1, context), generator=g)
    kinds = {"DynamicCache": lambda c: DynamicCache(config=c), "in place": new_kv_cache}
    caches = {}
    for name, make in kinds.items():
        hf_target.new_kv_cache = make  # what prefill builds its cache with
        caches[name] = target.prefill(ids, torch.tensor([context]))[0]
    hf_target.new_kv_cache = new_kv_cache
    times = {name: {k: [] for k in SIZES} for name in kinds}
    with torch.inference_mode():
        for r in range(repeats + 2):  # two warm-up rounds
            for k in SIZES:
                for name, cache in caches.items():  # interleaved: the machine's drift hits both alike
                    blk = torch.randint(100, target.info.vocab_size, (1, k), generator=g)
                    t0 = time.perf_counter()
                    target.verify(cache, blk)
                    target.commit(cache, torch.tensor([1]))
                    if r >= 2:
                        times[name][k].append(time.perf_counter() - t0)
    return [{"context": context, "tokens": k, **{name: 1e3 * statistics.median(times[name][k]) for name in kinds}}
            for k in SIZES]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--context", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target, _ = load_target_and_drafter(a.target, None, "ar")
    rows = [row for ctx in a.context for row in _time_context(target, ctx, a.repeats)]
    print(f"{a.target}, {a.threads} threads: ms per verify + commit (median; each context grows by "
          f"{(a.repeats + 2) * len(SIZES)} during its run)")
    print(f"{'context':>7} {'tokens':>6} {'DynamicCache':>13} {'in place':>9}")
    for row in rows:
        print(f"{row['context']:>7} {row['tokens']:>6} {row['DynamicCache']:>13.1f} {row['in place']:>9.1f}")
    if a.json:
        out = Path(a.json)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps({"target": a.target, "contexts": a.context, "threads": a.threads,
                                   "repeats": a.repeats, "rows": rows}, indent=2) + "\n")
        os.replace(tmp, out)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
