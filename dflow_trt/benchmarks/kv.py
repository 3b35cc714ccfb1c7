"""`dflow-trt bench kv`: what the in-place KV cache saves. One target forward of 1, 2, 3, 5 and 16
tokens on a context, with transformers' DynamicCache (concatenating every layer's cache per forward)
and with `targets.kv_cache` (writing into a grown buffer), interleaved, each verify followed by a
commit of one token (the cache grows as in decoding, and a crop follows every multi-token verify).
"""

from __future__ import annotations

from . import report

SIZES = (1, 2, 3, 5, 16)
WARMUP = 2  # rounds


def _time_context(target, context: int, repeats: int) -> list[dict]:
    import torch
    from transformers import DynamicCache

    from ..targets import hf_target
    from ..targets.kv_cache import new_kv_cache

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, target.info.vocab_size, (1, context), generator=g)
    kinds = {"DynamicCache": lambda c: DynamicCache(config=c), "in place": new_kv_cache}
    caches = {}
    try:
        for name, make in kinds.items():
            hf_target.new_kv_cache = make  # what prefill builds its cache with
            caches[name] = target.prefill(ids, torch.tensor([context]))[0]
    finally:
        hf_target.new_kv_cache = new_kv_cache
    # every call's block, drawn up front in the order the calls run (rounds, sizes, caches)
    blocks = iter([torch.randint(100, target.info.vocab_size, (1, k), generator=g)
                   for _ in range(repeats + WARMUP) for k in SIZES for _ in kinds])

    def step(cache):
        def call():
            target.verify(cache, next(blocks))
            target.commit(cache, torch.tensor([1]))
        return call

    with torch.inference_mode():  # interleaved: the machine's drift hits both caches alike
        times = report.interleaved({(k, name): step(cache) for k in SIZES for name, cache in caches.items()},
                                   repeats, WARMUP)
    return [{"context": context, "tokens": k, **{name: 1e3 * report.median(times[k, name]) for name in kinds}}
            for k in SIZES]


def run(target: str = "smollm2-135m", contexts=(256, 1024), repeats: int = 15, threads: int | None = 2,
        json_out: str | None = None) -> int:
    import torch

    from ..drafter.defaults import load_target_and_drafter

    report.set_threads(threads)
    t, _ = load_target_and_drafter(target, None, "ar")
    rows = [row for ctx in contexts for row in _time_context(t, ctx, repeats)]
    threads = torch.get_num_threads()
    con = report.console()
    report.table(f"{target}, {threads} threads: ms per verify + commit (median; each context grows by "
                 f"{(repeats + WARMUP) * len(SIZES)} during its run)",
                 ["context", "tokens", "DynamicCache", "in place"],
                 [[r["context"], r["tokens"], f"{r['DynamicCache']:.1f}", f"{r['in place']:.1f}"] for r in rows], con)
    if json_out:
        out = report.write_json(json_out, {"target": target, "contexts": list(contexts), "threads": threads,
                                           "repeats": repeats, "rows": rows})
        con.print(f"wrote {out}")
    return 0
