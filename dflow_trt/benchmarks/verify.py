"""`dflow-trt bench verify`: verify cost against context length. With the KV cache a block costs
the block, not the sequence.

For each context length P: prefill P tokens, then time `verify` of one block of S tokens (then
commit one, as a fully rejected round does) on the torch and the ONNX Runtime targets; the
baseline is what verifying costs without a cache: one forward over all P+S tokens.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from . import report


def bench(target, block: int, contexts: list[int], repeats: int, seed: int = 0) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    V = target.info.vocab_size
    rows = []
    for P in contexts:
        ids = torch.randint(0, V, (1, P), generator=g)
        blk = torch.randint(0, V, (1, block), generator=g)
        cache, _ = target.prefill(ids, torch.tensor([P]))

        def verify(b=blk):
            target.verify(cache, b)
            target.commit(cache, torch.tensor([1]))

        full = torch.cat([ids, blk], 1)
        rows.append({"context": P, "block": block, "kv_ms": report.time_ms(verify, repeats),
                     "step_ms": report.time_ms(lambda: verify(blk[:, :1]), repeats),  # one ar decoding step
                     "no_cache_ms": report.time_ms(lambda: target.prefill(full, torch.tensor([P + block])), repeats)})
    return rows


def default_json(target: str, build: str | None) -> Path:
    return Path(build or Path("build") / target) / "reports" / "bench_verify.json"


def run(target: str = "smollm2-135m", build: str | None = None, block: int = 16,
        contexts=(64, 128, 256, 512, 1024), repeats: int = 5, json_out: str | None = None,
        threads: int | None = None) -> int:
    import torch

    from ..backends.onnx_io import TARGET_META
    from ..backends.onnxruntime import OrtTarget
    from ..targets import load_target

    report.set_threads(threads)
    folder = Path(build or Path("build") / target)
    if not (folder / "onnx" / "target" / TARGET_META).is_file():
        raise UserError(f"{folder} holds no exported target (onnx/target/{TARGET_META}); `bench verify` times a "
                        f"build's ONNX Runtime target: make one with `dflow-trt build --target {target} --out "
                        f"{folder}` or pass --build")
    ort_target = OrtTarget(folder / "onnx" / "target")
    torch_target = load_target(target, tap_layers=ort_target.info.tap_layers)
    if torch_target.info.fingerprint != ort_target.info.fingerprint:  # another model's graphs: no comparison
        raise UserError(f"{folder} holds a build of {ort_target.info.name}, not of --target {target}; pass the "
                        f"build's --target or another --build")
    con = report.console()
    results = {"target": target, "threads": torch.get_num_threads(), "block": block, "repeats": repeats}
    for name, t in (("torch", torch_target), ("onnxruntime", ort_target)):
        con.print(f"benchmarking {name} ...", style="dim")
        results[name] = bench(t, block, list(contexts), repeats)
    report.table(f"{target}: ms per verify of {block} tokens (kv: with the cache; no-cache: a forward over "
                 f"context + block; 1-token: one ar step), median of {repeats}",
                 ["context", "torch kv", "no-cache", "1-token", "ort kv", "no-cache", "1-token"],
                 [[t["context"], *(f"{x[k]:.1f}" for x in (t, o) for k in ("kv_ms", "no_cache_ms", "step_ms"))]
                  for t, o in zip(results["torch"], results["onnxruntime"])], con)
    for name in ("torch", "onnxruntime"):
        r = [x["kv_ms"] / x["step_ms"] for x in results[name]]
        con.print(f"{name}: a {block}-token verify costs {min(r):.1f}-{max(r):.1f} ar steps, so a round (verify + "
                  f"draft) needs at least that τ to beat ar")
    out = report.write_json(json_out or default_json(target, build), results)
    con.print(f"wrote {out}")
    return 0
