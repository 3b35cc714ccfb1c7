"""`dflow-trt bench make-data`: how fast the target makes training data, the old way against the new.

One committed data shard's prompts are answered again (greedy, the data set's own response length)
by each way of batching, the ways taking turns in every round (`report.interleaved`):
- `eager, arrival order, 16`: what make-data did before 2026-12-07: the eager target, batches of 16
  prompts in the shard's order, each batch decoded until its last row ends;
- `eager, continuous`: `training.data.greedy_responses` on the eager target: prompts prefilled
  shortest first, `PREFILL_ROWS` at a time, decoded `--batch-size` wide, finished rows replaced;
- `static, continuous`: the same on the static back end (what make-data runs now).
Each way's responses are compared with the shard's committed ones: a faster way must make the same data.
"""

from __future__ import annotations

from pathlib import Path

from . import report

OLD_BATCH = 16  # make-data's batch before continuous batching
NEEDED = ("target", "target_fingerprint", "max_new_tokens")  # manifest fields the bench reads


def _ways(target, prompts: list[list[int]], max_new: int, batch_size: int) -> dict:
    from ..decoding.loop import generate
    from ..decoding.options import DecodeOptions
    from ..training.data import greedy_responses

    def arrival_order():
        options = DecodeOptions(mode="ar", max_new_tokens=max_new)
        return [r for j in range(0, len(prompts), OLD_BATCH)
                for r in generate(target, None, prompts[j:j + OLD_BATCH], options).token_ids]

    return {f"eager, arrival order, {OLD_BATCH}": arrival_order,
            f"eager, continuous, {batch_size}": lambda: greedy_responses(target, prompts, max_new, batch_size, "torch"),
            f"static, continuous, {batch_size}": lambda: greedy_responses(target, prompts, max_new, batch_size)}


def run(data_dir: str, target: str | None = None, shard: int = 0, num_prompts: int | None = None,
        batch_size: int = 32, repeats: int = 1, threads: int | None = None, json_out: str | None = None) -> int:
    """Exit 1 when the ways' responses differ from each other (on one machine they must not; the
    committed data, made on another CPU, may differ at a near tie, and is only reported)."""
    from ..atomic import read_json
    from ..backends.static import static_target
    from ..errors import UserError
    from ..targets import load_target
    from ..training.data import FORMAT, UNREADABLE, read_shard, shard_path

    report.set_threads(threads)
    d = Path(data_dir)
    fix = "point --data-dir at a data set made by make-data"
    m = read_json(d / "manifest.json", "format", FORMAT, fix)
    if not isinstance(m.get("shards"), list) or not all(k in m for k in NEEDED):
        raise UserError(f"{d / 'manifest.json'} lacks {', '.join(k for k in ('shards', *NEEDED) if k not in m)}; {fix}")
    names = [s for s in m["shards"] if shard_path(d, s).exists()]
    if not names:
        raise UserError(f"{d} has no complete shard yet; run make-data into it first")
    if shard >= len(names):
        raise UserError(f"{d} has {len(names)} complete shards, so --shard {shard} is out of range; use 0 to "
                        f"{len(names) - 1}")
    try:
        rows = read_shard(shard_path(d, names[shard]))[:num_prompts]
    except UNREADABLE as e:
        raise UserError(f"{shard_path(d, names[shard])} is unreadable ({type(e).__name__}); pick another --shard "
                        f"or make it again with make-data") from None
    spec = target or m["target"]
    target = load_target(spec, num_taps=0)
    if target.info.fingerprint != m["target_fingerprint"]:
        raise UserError(f"{d} was made by another target than {spec!r} (fingerprint {m['target_fingerprint']} vs "
                        f"{target.info.fingerprint}); pass its --target or use a data set of this one")
    static_target(target)  # a target the static back end cannot run is refused before any timing
    prompts = [r["prompt_ids"] for r in rows]
    made: dict[str, list] = {}
    ways = {k: (lambda k=k, f=f: made.__setitem__(k, f())) for k, f in _ways(target, prompts, m["max_new_tokens"],
                                                                             batch_size).items()}
    times = report.interleaved(ways, repeats)
    base = next(iter(ways))
    tokens = sum(len(r["response_ids"]) for r in rows)
    out = {"data_dir": str(d), "shard": names[shard], "prompts": len(rows), "response_tokens": tokens,
           "max_new_tokens": m["max_new_tokens"], "batch_size": batch_size, "repeats": repeats, "ways": {}}
    for k, ts in times.items():
        s = report.median(ts)
        out["ways"][k] = {"seconds": ts, "median_s": s, "sequences_per_s": len(rows) / s, "tokens_per_s": tokens / s,
                          "speedup": report.median(times[base]) / s,
                          "matches_data": sum(a == r["response_ids"] for a, r in zip(made[k], rows)),
                          "matches_first_way": sum(a == b for a, b in zip(made[k], made[base]))}
    report.table(f"make-data on {len(rows)} prompts of {names[shard]} ({m['max_new_tokens']} new tokens)",
                 ["way", "s", "sequences/s", "tokens/s", "speed-up", "equal to the first way", "equal to the data"],
                 [[k, f"{w['median_s']:.1f}", f"{w['sequences_per_s']:.2f}", f"{w['tokens_per_s']:.0f}",
                   f"{w['speedup']:.2f}x", f"{w['matches_first_way']}/{len(rows)}", f"{w['matches_data']}/{len(rows)}"]
                  for k, w in out["ways"].items()])
    if json_out:
        report.console().print(f"wrote {report.write_json(json_out, out)}")
    return 0 if all(w["matches_first_way"] == len(rows) for w in out["ways"].values()) else 1
