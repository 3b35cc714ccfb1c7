"""Round cost at realistic sizes: a random-init target and drafter shaped like Qwen3-8B and DFlash's.

    python scripts/bench_scale.py [--preset qwen3-8b] [--device cuda] [--dtype bfloat16]
                                  [--contexts 512,2048] [--batch 1] [--repeats 20] [--json OUT]

τ needs trained weights; what a round costs does not. For each context length: one `ar` step
(verify 1 token), a verify of the anchor + k drafts, one drafter pass without flow (DFlash) and
with a full flow block (DFlow), and the speedup a given τ would give: τ · ar / (draft + verify).
Then `generate()` end to end for `ar` and `dflow` (the drafter is random, so τ ≈ 1): the loop's
own cost per round, host syncs included. Prints a table and writes JSON. Not a test.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_verify import _time  # noqa: E402  (scripts/ is on sys.path)

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
    # a few-MB stand-in so the script itself can be checked on a CPU in seconds
    "smoke": dict(target=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, vocab_size=1024),
                  drafter=dict(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256), taps=3),
}
TAUS = (2.0, 3.0, 4.0, 5.0, 6.6)  # 6.6: DFlash's published HumanEval τ on Qwen3-8B (block 16)


def _sync(device):
    """A function that waits for `device` to finish its queued work (nothing to wait for on a CPU)."""
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _timer(sync):
    """bench_verify's median-of-repeats timer, each call waited for on the device."""
    return lambda fn, repeats: _time(lambda: (fn(), sync()), repeats)


def build(preset: str, device: str, dtype: str, block: int, seed: int = 0):
    """(target, drafter): random init, in `dtype`, on `device`."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflow_trt.drafter.config import DrafterConfig
    from dflow_trt.drafter.io import build_drafter
    from dflow_trt.drafter.runtime import TorchDrafter
    from dflow_trt.targets.hf_target import HFTarget, default_tap_layers

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


def bench_context(target, drafter, P: int, B: int, repeats: int, ms, ks=None) -> dict:
    """One context length: ar step, verify of the anchor + k drafts (each k in `ks`), drafter passes."""
    import torch

    from dflow_trt.decoding.flow import carry_flow
    from dflow_trt.decoding.sampling import SamplingParams

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
    verify_ms = {k: ms(lambda k=k: verify(k), repeats) for k in sorted(ks or {1, 3, 7, S - 1})}
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

    from dflow_trt.decoding.loop import generate

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, target.info.vocab_size, (P,), generator=g).tolist()
    res = {}
    for mode in ("ar", "dflow"):
        generate(target, drafter, [prompt], mode=mode, max_new_tokens=8)  # warm-up
        sync()
        r = generate(target, drafter, [prompt], mode=mode, max_new_tokens=new_tokens)
        sync()
        res[mode] = {"rounds": r.rounds, "tokens": len(r.token_ids[0]), "tau": r.tau,
                     "ms_per_round": (r.total_s - r.prefill_s) / max(1, r.rounds) * 1e3,
                     "tokens_per_s": r.tokens_per_s, "token_ids": r.token_ids[0]}
    res["dflow_matches_ar"] = res["dflow"].pop("token_ids") == res["ar"].pop("token_ids")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-8b", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--generate-tokens", type=int, default=64, help="0 skips the end-to-end generate() timing")
    ap.add_argument("--json", default="build/reports/bench_scale.json")
    a = ap.parse_args(argv)
    import torch

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA GPU is visible; use a GPU host or --device cpu --preset smoke",
              file=sys.stderr)
        return 2
    dev = torch.device(a.device)
    sync = _sync(dev)
    ms = _timer(sync)
    t0 = time.perf_counter()
    target, drafter = build(a.preset, a.device, a.dtype, a.block)
    build_s = time.perf_counter() - t0
    n_target = sum(p.numel() for p in target.model.parameters())
    n_drafter = sum(p.numel() for p in drafter.model.parameters())
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"{a.preset} random init, {a.dtype}, {card}: target {n_target / 1e6:.0f}M params, "
          f"drafter {n_drafter / 1e6:.0f}M trainable, built in {build_s:.0f} s")
    rows = [bench_context(target, drafter, int(P), a.batch, a.repeats, ms) for P in a.contexts.split(",")]
    gen = bench_generate(target, drafter, int(a.contexts.split(",")[0]), a.generate_tokens, sync) \
        if a.generate_tokens else None

    ks = list(rows[0]["verify_ms"])
    print(f"{'context':>7} {'ar ms':>7} " + " ".join(f"{'v' + k + ' ms':>7}" for k in ks)
          + f" {'dflash':>7} {'dflow':>7} {'b-even':>6} " + " ".join(f"{'τ=' + str(t):>6}" for t in TAUS))
    for r in rows:
        print(f"{r['context']:>7} {r['ar_step_ms']:>7.2f} " + " ".join(f"{r['verify_ms'][k]:>7.2f}" for k in ks)
              + f" {r['draft_ms_dflash']:>7.2f} {r['draft_ms_dflow'] or float('nan'):>7.2f} {r['break_even_tau']:>6.2f} "
              + " ".join(f"{r['projected_speedup'][str(t)]:>5.2f}×" for t in TAUS))
    print("(v<k>: verify of anchor + k drafts; dflash/dflow: one drafter pass; b-even: τ at which a full-block "
          "DFlow round matches ar; τ=x: projected speedup over ar)")
    if gen:
        print(f"generate(), context {rows[0]['context']}, {a.generate_tokens} tokens: ar {gen['ar']['ms_per_round']:.2f}"
              f" ms/step; dflow (random drafter, τ {gen['dflow']['tau']:.2f}) {gen['dflow']['ms_per_round']:.2f} "
              f"ms/round; dflow matches ar: {gen['dflow_matches_ar']}")
    report = {"preset": a.preset, "dtype": a.dtype, "device": card, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "target_params": n_target, "drafter_params": n_drafter,
              "block": a.block, "repeats": a.repeats, "rows": rows, "generate": gen}
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
