"""Verify cost against context length: with the KV cache a block costs the block, not the sequence.

    python scripts/bench_verify.py [--target smollm2-135m] [--build DIR] [--block 16]
                                   [--contexts 64,128,256,512,1024] [--repeats 5] [--json OUT]

For each context length P: prefill P tokens, then time `verify` of one block of S tokens (then
commit one, as a fully rejected round does) on the torch and the ONNX Runtime targets; the
baseline is what verifying costs without a cache: one forward over all P+S tokens. Prints a table
and writes JSON (default <build>/reports/bench_verify.json). Not a test: timings vary by machine.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _time(fn, repeats):
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


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
        rows.append({"context": P, "block": block, "kv_ms": _time(verify, repeats),
                     "step_ms": _time(lambda: verify(blk[:, :1]), repeats),  # one ar decoding step
                     "no_cache_ms": _time(lambda: target.prefill(full, torch.tensor([P + block])), repeats)})
    return rows


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--build", default=None, help="build folder with onnx/target (default build/<target>)")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--contexts", default="64,128,256,512,1024")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch

    from dflow_trt.backends.onnxruntime import OrtTarget
    from dflow_trt.errors import UserError
    from dflow_trt.export.manifest import read_manifest
    from dflow_trt.targets import load_target

    build = Path(a.build or Path("build") / a.target)
    try:
        m = read_manifest(build) if (build / "manifest.json").is_file() else None
        taps = tuple(m["target"]["tap_layers"]) if m else tuple(json.loads((build / "onnx/target/target_meta.json").read_text())["tap_layers"])
        ort_target = OrtTarget(build / "onnx" / "target")
    except (UserError, FileNotFoundError) as e:
        print(f"error: {e}; build it with `python scripts/build_engines.py --target {a.target}`", file=sys.stderr)
        return 2
    contexts = [int(x) for x in a.contexts.split(",")]
    results = {"target": a.target, "threads": torch.get_num_threads(), "block": a.block, "repeats": a.repeats}
    for name, target in (("torch", load_target(a.target, tap_layers=taps)), ("onnxruntime", ort_target)):
        print(f"benchmarking {name} ...", file=sys.stderr)
        results[name] = bench(target, a.block, contexts, a.repeats)
    head = (f"{'context':>8} | {'torch kv':>9} {'no-cache':>9} {'1-token':>8} | {'ort kv':>9} {'no-cache':>9} "
            f"{'1-token':>8}   (ms per verify of {a.block} tokens; 1-token = one ar step)")
    print(head)
    print("-" * len(head))
    for t, o in zip(results["torch"], results["onnxruntime"]):
        print(f"{t['context']:>8} | {t['kv_ms']:>9.1f} {t['no_cache_ms']:>9.1f} {t['step_ms']:>8.1f} | "
              f"{o['kv_ms']:>9.1f} {o['no_cache_ms']:>9.1f} {o['step_ms']:>8.1f}")
    for name in ("torch", "onnxruntime"):
        r = [x["kv_ms"] / x["step_ms"] for x in results[name]]
        print(f"{name}: a {a.block}-token verify costs {min(r):.1f}-{max(r):.1f} ar steps, so a round (verify + "
              f"draft) needs at least that τ to beat ar")
    out = Path(a.json or build / "reports" / "bench_verify.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
