"""What one speculative round costs against one `ar` step, by how many drafts are verified.

    python scripts/bench_round.py [--target smollm2-135m] [--mode dflash] [--context 256]
                                  [--repeats 7] [--json docs/bench_round.json]

At a fixed context: the time of one `ar` step (verify 1 token), one drafter pass (the mode's
shipped drafter, block as trained; with a full block of verifier flow for DFlow), and a verify of
the anchor plus k drafts for k = 1..block-1, timed by `bench_scale.bench_context` at batch 1 on the
real target. From these: the τ a round needs to match `ar` at each k ((draft + verify_k) /
ar_step), and the marginal cost of one more draft in ar steps, which is the acceptance chance a
draft needs to be worth verifying: the natural `--verify-threshold`. Also the target's MLP
up-projection alone by rows, to show how the CPU matrix multiply scales. Prints a table and writes
JSON. Not a test.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_scale import bench_context  # noqa: E402  (scripts/ is on sys.path)
from bench_verify import _time as _ms  # noqa: E402  (the median-of-repeats timer)


def _linear_us(target, block: int, repeats: int) -> dict[int, float]:
    """Median µs of the target's first MLP up-projection (the module, packed or not) for 1, 2, 4, ...,
    block rows: how the matrix multiply scales with the tokens in a call (the weights are read once
    either way)."""
    import torch

    lin = target.model.model.layers[0].mlp.up_proj  # [I, H]
    rows = sorted({1, 2, 4, 8, block})
    xs = {m: torch.randn(m, lin.in_features, dtype=lin.weight.dtype, device=lin.weight.device) for m in rows}
    return {m: _ms(lambda m=m: lin(xs[m]), repeats) * 1e3 for m in rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--mode", default="dflash", choices=["dflash", "dflow"])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--plain-linear", action="store_true",
                    help="PyTorch's default CPU linear layers and transformers' own attention instead of "
                         "backends.torch_cpu (oneDNN-packed weights, grouped K/V), for comparison")
    ap.add_argument("--json", default="docs/bench_round.json")
    a = ap.parse_args(argv)
    import torch

    from dflow_trt.drafter.defaults import load_target_and_drafter
    from dflow_trt.drafter.runtime import TorchDrafter
    from dflow_trt.errors import UserError

    try:
        target, model = load_target_and_drafter(a.target, None, a.mode, packed=not a.plain_linear)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    drafter = TorchDrafter(model)
    S, P = drafter.block_size, a.context
    with torch.inference_mode():
        r = bench_context(target, drafter, P, 1, a.repeats, _ms, ks=range(1, S))
        linear_us = _linear_us(target, S, a.repeats * 20)
    # the pass the mode runs in decoding: with the verifier's flow for a DFlow drafter
    ar_ms, draft_ms = r["ar_step_ms"], r["draft_ms_dflow"] or r["draft_ms_dflash"]
    verify_ms = {int(k): v for k, v in r["verify_ms"].items()}
    rows = [{"drafts": k, "verify_ms": v, "break_even_tau": (draft_ms + v) / ar_ms} for k, v in verify_ms.items()]
    marginal = (verify_ms[S - 1] - verify_ms[1]) / max(1, S - 2) / ar_ms
    report = {"target": a.target, "mode": a.mode, "drafter": model.config.extra.get("name", "untrained"),
              "context": P, "threads": torch.get_num_threads(), "packed_linear": not a.plain_linear,
              "repeats": a.repeats, "ar_step_ms": ar_ms,
              "draft_ms": draft_ms, "rows": rows, "marginal_draft_cost_in_ar_steps": marginal,
              "mlp_up_linear_us_by_rows": linear_us}
    kind = "plain PyTorch linear and attention" if a.plain_linear else "oneDNN-packed linear, grouped attention"
    print(f"{a.target}, context {P}, {torch.get_num_threads()} threads, {kind}: ar step {ar_ms:.1f} ms, "
          f"drafter pass {draft_ms:.1f} ms (block {S})")
    print(f"{'drafts':>6} {'verify ms':>10} {'round ms':>9} {'break-even τ':>13}")
    for r in rows:
        print(f"{r['drafts']:>6} {r['verify_ms']:>10.1f} {draft_ms + r['verify_ms']:>9.1f} {r['break_even_tau']:>13.2f}")
    print("the target's MLP up-projection alone, µs by rows (tokens): "
          + ", ".join(f"{m}: {us:.0f}" for m, us in linear_us.items()))
    print(f"one more draft costs {marginal:.3f} ar steps: verify a draft when its acceptance chance exceeds that "
          f"(--verify-threshold {marginal:.2f})")
    out_path = Path(a.json)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out_path)
    print(f"wrote {out_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
