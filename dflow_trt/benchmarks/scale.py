"""`dflow-trt bench scale`: round cost at realistic sizes, on a random-init target and drafter shaped
like Qwen3-8B and DFlash's.

τ needs trained weights; what a round costs does not. For each context length: one `ar` step
(verify 1 token), a verify of the anchor + k drafts, one drafter pass without flow (DFlash) and
with a full flow block (DFlow), and the speedup a given τ would give: τ · ar / (draft + verify).
Then `generate()` end to end for `ar` and `dflow` (the drafter is random, so τ ≈ 1): the loop's
own cost per round, host syncs included.
"""

from __future__ import annotations

import time

from ..errors import UserError
from . import report

# Target shapes from the public Qwen3 configs; drafter as DFlash's Qwen3-8B drafter (5 layers, 5 taps).
PRESETS = {
    "qwen3-8b": dict(target=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936),
                     drafter=dict(num_layers=5, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=12288),
                     taps=5),
    "qwen3-1.7b": dict(target=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                   num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936),
                       drafter=dict(num_layers=3, num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=6144),
                       taps=5),
    # a few-MB stand-in so the benchmark itself can be checked on a CPU in seconds
    "smoke": dict(target=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, vocab_size=1024),
                  drafter=dict(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256), taps=3),
}
TAUS = (2.0, 3.0, 4.0, 5.0, 6.6)  # 6.6: DFlash's published HumanEval τ on Qwen3-8B (block 16)
DTYPES = ("bfloat16", "float16", "float32")


def device_sync(device):
    """A function that waits for `device` to finish its queued work (nothing to wait for on a CPU)."""
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


def build(preset: str, device: str, dtype: str, block: int, seed: int = 0):
    """(target, drafter): random init, in `dtype`, on `device`."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ..drafter.config import DrafterConfig
    from ..drafter.io import build_drafter
    from ..drafter.runtime import TorchDrafter
    from ..targets.hf_target import HFTarget, default_tap_layers

    p = PRESETS[preset]
    cfg = Qwen3Config(**p["target"], max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False,
                      initializer_range=0.02)
    old = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg).eval()
        taps = default_tap_layers(cfg.num_hidden_layers, p["taps"])
        target = HFTarget(model, name=f"{preset}-random", tap_layers=taps)
        dcfg = DrafterConfig.for_target(target.info, mask_token_id=0, block_size=block, flow=True, **p["drafter"])
        drafter = TorchDrafter(build_drafter(target, dcfg, seed=seed))
    finally:
        torch.set_default_dtype(old)
    return target, drafter


def bench_context(target, drafter, P: int, B: int, repeats: int, sync=None, ks=None) -> dict:
    """One context length: ar step, verify of the anchor + k drafts (each k in `ks`), drafter passes,
    each the median of `repeats` (`report.time_ms`, waited for with `sync`)."""
    import torch

    from ..decoding.flow import carry_flow
    from ..decoding.sampling import SamplingParams

    def ms(fn, n):
        return report.time_ms(fn, n, sync)

    dev, S, V = target.device, drafter.block_size, target.info.vocab_size
    g = torch.Generator().manual_seed(P)
    ids = torch.randint(0, V, (B, P), generator=g)
    block = torch.randint(0, V, (B, S), generator=g).to(dev)
    lens = torch.full((B,), P)
    t0 = time.perf_counter()
    cache, out = target.prefill(ids, lens)
    prefill_ms = (time.perf_counter() - t0) * 1e3  # first call: includes warm-up

    def verify(k: int) -> None:
        target.verify(cache, block[:, : k + 1])
        target.commit(cache, torch.ones(B, dtype=torch.long))  # a fully rejected round commits one position

    ar_ms = ms(lambda: verify(0), repeats)
    ks = sorted(ks or {k for k in (1, 3, 7, S - 1) if 0 < k < S})
    verify_ms = {k: ms(lambda k=k: verify(k), repeats) for k in ks}
    vout = target.verify(cache, block)
    flow = carry_flow(block, vout.taps, vout.logits.argmax(-1), torch.zeros(B, dtype=torch.long, device=dev))
    target.commit(cache, torch.ones(B, dtype=torch.long))
    with torch.inference_mode():
        state = drafter.new_state(B)
        drafter.draft(state, out.taps, lens, block[:, 0], lens, None, SamplingParams())

        def draft(fl) -> None:  # context cached; one more committed position per round, as in decoding
            drafter.draft(state, out.taps[:, -1:], torch.ones(B, dtype=torch.long), block[:, 0], state.lens + 1, fl,
                          SamplingParams())

        dflash_ms = ms(lambda: draft(None), repeats)
        dflow_ms = ms(lambda: draft(flow), repeats) if drafter.uses_flow else None  # a DFlash drafter ignores flow
    full = (dflow_ms or dflash_ms) + verify_ms[S - 1]
    return {"context": P, "batch": B, "prefill_ms_first_call": prefill_ms, "ar_step_ms": ar_ms,
            "verify_ms": {str(k): v for k, v in verify_ms.items()}, "draft_ms_dflash": dflash_ms,
            "draft_ms_dflow": dflow_ms, "round_ms_dflow_full_block": full, "break_even_tau": full / ar_ms,
            "projected_speedup": {str(t): t * ar_ms / full for t in TAUS}}


def bench_generate(target, drafter, P: int, new_tokens: int, sync) -> dict:
    import torch

    from ..decoding.loop import generate

    from ..decoding.options import DecodeOptions

    sync = sync or (lambda: None)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, target.info.vocab_size, (P,), generator=g).tolist()
    res = {}
    for mode in ("ar", "dflow"):
        generate(target, drafter, [prompt], DecodeOptions(mode=mode, max_new_tokens=8))  # warm-up
        sync()
        r = generate(target, drafter, [prompt], DecodeOptions(mode=mode, max_new_tokens=new_tokens))
        sync()
        res[mode] = {"rounds": r.rounds, "tokens": len(r.token_ids[0]), "tau": r.tau,
                     "ms_per_round": (r.total_s - r.prefill_s) / max(1, r.rounds) * 1e3,
                     "tokens_per_s": r.tokens_per_s, "token_ids": r.token_ids[0]}
    res["dflow_matches_ar"] = res["dflow"].pop("token_ids") == res["ar"].pop("token_ids")
    return res


def run(preset: str = "qwen3-8b", device: str = "cuda", dtype: str = "bfloat16", contexts=(512, 2048),
        batch: int = 1, block: int = 16, repeats: int = 20, generate_tokens: int = 64,
        json_out: str | None = "build/reports/bench_scale.json", threads: int | None = None) -> int:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA GPU is visible; use a GPU host or --device cpu --preset smoke")
    report.set_threads(threads)
    dev = torch.device(device)
    sync = device_sync(dev)
    t0 = time.perf_counter()
    target, drafter = build(preset, device, dtype, block)
    build_s = time.perf_counter() - t0
    n_target = sum(p.numel() for p in target.model.parameters())
    n_drafter = sum(p.numel() for p in drafter.model.parameters())
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    con = report.console()
    con.print(f"{preset} random init, {dtype}, {card}: target {n_target / 1e6:.0f}M params, "
              f"drafter {n_drafter / 1e6:.0f}M trainable, built in {build_s:.0f} s")
    rows = [bench_context(target, drafter, P, batch, repeats, sync) for P in contexts]
    gen = bench_generate(target, drafter, contexts[0], generate_tokens, sync) if generate_tokens else None

    ks = list(rows[0]["verify_ms"])
    report.table(f"{preset}: ms per call, median of {repeats}",
                 ["context", "ar ms", *(f"v{k} ms" for k in ks), "dflash", "dflow", "b-even",
                  *(f"τ={t}" for t in TAUS)],
                 [[r["context"], f"{r['ar_step_ms']:.2f}", *(f"{r['verify_ms'][k]:.2f}" for k in ks),
                   f"{r['draft_ms_dflash']:.2f}", f"{r['draft_ms_dflow'] or float('nan'):.2f}",
                   f"{r['break_even_tau']:.2f}", *(f"{r['projected_speedup'][str(t)]:.2f}×" for t in TAUS)]
                  for r in rows], con)
    con.print("(v<k>: verify of anchor + k drafts; dflash/dflow: one drafter pass; b-even: τ at which a full-block "
              "DFlow round matches ar; τ=x: projected speedup over ar)")
    if gen:
        con.print(f"generate(), context {rows[0]['context']}, {generate_tokens} tokens: ar "
                  f"{gen['ar']['ms_per_round']:.2f} ms/step; dflow (random drafter, τ {gen['dflow']['tau']:.2f}) "
                  f"{gen['dflow']['ms_per_round']:.2f} ms/round; dflow matches ar: {gen['dflow_matches_ar']}")
    out = {"preset": preset, "dtype": dtype, "device": card, "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "target_params": n_target, "drafter_params": n_drafter,
           "block": block, "repeats": repeats, "rows": rows, "generate": gen}
    if json_out:
        con.print(f"wrote {report.write_json(json_out, out)}")
    return 0
