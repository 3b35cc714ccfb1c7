"""`dflow-trt bench round`: what one speculative round costs against one `ar` step, by how many
drafts are verified.

At a fixed context: the time of one `ar` step (verify 1 token), one drafter pass (the mode's
shipped drafter, block as trained; with a full block of verifier flow for DFlow), and a verify of
the anchor plus k drafts for k = 1..block-1, timed by `scale.bench_context` at batch 1 on the real
target. From these: the τ a round needs to match `ar` at each k ((draft + verify_k) / ar_step), and
the marginal cost of one more draft in ar steps, which is the acceptance chance a draft needs to be
worth verifying: the natural `--verify-threshold`. Also the target's MLP up-projection alone by
rows, to show how the CPU matrix multiply scales.
"""

from __future__ import annotations

from . import report
from .scale import bench_context


def _linear_us(target, block: int, repeats: int) -> dict[int, float]:
    """Median µs of the target's first MLP up-projection (the module, packed or not) for 1, 2, 4, ...,
    block rows: how the matrix multiply scales with the tokens in a call (the weights are read once
    either way)."""
    import torch

    lin = target.model.model.layers[0].mlp.up_proj  # [I, H]
    rows = sorted({1, 2, 4, 8, block})
    xs = {m: torch.randn(m, lin.in_features, dtype=lin.weight.dtype, device=lin.weight.device) for m in rows}
    return {m: report.time_ms(lambda m=m: lin(xs[m]), repeats) * 1e3 for m in rows}


def run(target: str = "smollm2-135m", mode: str = "dflash", drafter: str | None = None, context: int = 256,
        repeats: int = 7, plain_linear: bool = False, json_out: str | None = "docs/bench_round.json",
        threads: int | None = None) -> int:
    import torch

    from ..drafter.defaults import load_target_and_drafter
    from ..drafter.runtime import TorchDrafter

    report.set_threads(threads)
    con = report.console()
    t, model = load_target_and_drafter(target, drafter, mode, packed=not plain_linear,
                                       warn=lambda s: con.print(f"[yellow]{s}"))
    d = TorchDrafter(model)
    S, P = d.block_size, context
    with torch.inference_mode():
        r = bench_context(t, d, P, 1, repeats, ks=range(1, S))
        linear_us = _linear_us(t, S, repeats * 20)
    # the pass the mode runs in decoding: with the verifier's flow for a DFlow drafter
    ar_ms, draft_ms = r["ar_step_ms"], r["draft_ms_dflow"] or r["draft_ms_dflash"]
    verify_ms = {int(k): v for k, v in r["verify_ms"].items()}
    rows = [{"drafts": k, "verify_ms": v, "break_even_tau": (draft_ms + v) / ar_ms} for k, v in verify_ms.items()]
    marginal = (verify_ms[S - 1] - verify_ms[1]) / max(1, S - 2) / ar_ms
    out = {"target": target, "mode": mode, "drafter": model.config.extra.get("name", "untrained"),
           "context": P, "threads": torch.get_num_threads(), "packed_linear": not plain_linear,
           "repeats": repeats, "ar_step_ms": ar_ms,
           "draft_ms": draft_ms, "rows": rows, "marginal_draft_cost_in_ar_steps": marginal,
           "mlp_up_linear_us_by_rows": linear_us}
    kind = "plain PyTorch linear and attention" if plain_linear else "oneDNN-packed linear, grouped attention"
    report.table(f"{target}, context {P}, {torch.get_num_threads()} threads, {kind}: ar step {ar_ms:.1f} ms, "
                 f"drafter pass {draft_ms:.1f} ms (block {S})",
                 ["drafts", "verify ms", "round ms", "break-even τ"],
                 [[x["drafts"], f"{x['verify_ms']:.1f}", f"{draft_ms + x['verify_ms']:.1f}",
                   f"{x['break_even_tau']:.2f}"] for x in rows], con)
    con.print("the target's MLP up-projection alone, µs by rows (tokens): "
              + ", ".join(f"{m}: {us:.0f}" for m, us in linear_us.items()))
    con.print(f"one more draft costs {marginal:.3f} ar steps: verify a draft when its acceptance chance exceeds "
              f"that (--verify-threshold {marginal:.2f})")
    if json_out:
        con.print(f"wrote {report.write_json(json_out, out)}")
    return 0
