"""`dflow-trt bench static`: the eager Hugging Face target against the static back end
(`backends/static.py`), on the same weights, interleaved.

At one context, per back end: an `ar` step (verify 1 token + commit), a verify of a whole block
(+ commit of one token, as a fully rejected round), and a whole round (drafter pass + block verify
+ commit); the drafter pass alone once (it is the same PyTorch drafter for both). Every call commits
one position, so the contexts grow alike. Then `generate()` end to end for `ar` and the mode, with
a check that both back ends give the same tokens. `--size qwen3-8b` runs a random-init Qwen3-8B-shaped
target and drafter (`scale.py`; a GPU) with `--compile` / `--cuda-graphs` variants; `--size smoke`
checks that path on a CPU in seconds. `--pad-block` adds a static target that verifies every call
as one block (`pad_block`), and pads the graph variant too: `generate()` reports whether each back
end's drafting mode equals its own `ar` token for token (in bf16 on a GPU the unpadded ones may not).
Each per-call figure stands beside its bandwidth floor: the bytes of weights a decode step reads
over this device's measured copy bandwidth.
"""

from __future__ import annotations

import os
import time

from ..errors import UserError
from . import report

WARMUP = 2  # interleaved rounds, untimed
PROMPT = "Write a Python function that checks whether a number is prime."


def _load(target: str, size: str | None, mode: str, device: str, dtype: str, block: int | None):
    """(eager target, TorchDrafter, block)."""
    if size:
        from .scale import build

        t, d = build(size, device, dtype, block or 16)
        return t, d, d.block_size
    from ..drafter.defaults import load_target_and_drafter
    from ..drafter.runtime import TorchDrafter

    if device != "cpu":
        raise UserError("--device cuda runs the random-init --size presets; drop --device or pass --size qwen3-8b")
    t, model = load_target_and_drafter(target, None, mode, warn=lambda m: None)
    d = TorchDrafter(model)
    return t, d, block or d.block_size


def _variants(eager, max_len: int, compile: bool, graphs: bool, pad: int) -> dict:
    from ..backends.static import StaticTarget

    out = {"eager": eager, "static": StaticTarget(eager, max_len=max_len)}
    if pad:
        out["static+pad"] = StaticTarget(eager, max_len=max_len, pad_block=pad)
    if compile:
        out["static+compile"] = StaticTarget(eager, max_len=max_len, compile=True)
    if graphs:
        out["static+graphs" + ("+pad" if pad else "")] = StaticTarget(eager, max_len=max_len, cuda_graphs=True,
                                                                       pad_block=pad)
    return out


def step_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter but an untied input embedding (of
    which it gathers one row)."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - (emb.numel() * emb.element_size() if emb.data_ptr() != head.data_ptr() else 0)


def copy_bandwidth(device, sync, mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second one device-to-device copy moves (read + write), the best of `repeats`."""
    import torch

    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        if sync:
            sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best


def _calls(targets: dict, drafter, P: int, S: int, sync) -> dict:
    """Per back end: ar step, block verify and round closures on their own caches (one prefill each),
    plus the drafter pass alone."""
    import torch

    from ..decoding.sampling import SamplingParams

    dev, V = drafter.device, drafter.config.target.vocab_size
    g = torch.Generator().manual_seed(P)
    ids = torch.randint(0, V, (1, P), generator=g)
    lens = torch.tensor([P])
    block = torch.randint(0, V, (1, S), generator=g).to(dev)
    one = torch.ones(1, dtype=torch.long, device=dev)
    greedy = SamplingParams()
    cases = {}

    def done(fn):
        return (lambda: (fn(), sync())) if sync else fn

    for name, t in targets.items():
        cache, out = t.prefill(ids, lens)
        state = drafter.new_state(1, None, S)
        drafter.draft(state, out.taps, lens.to(dev), block[:, 0], lens.to(dev), None, greedy)
        last = {"taps": out.taps[:, -1:]}

        def step(k, t=t, cache=cache):
            t.verify(cache, block[:, :k])
            t.commit(cache, one)

        def round_(t=t, cache=cache, state=state, last=last):
            drafter.draft(state, last["taps"], one, block[:, 0], state.lens + 1, None, greedy)
            o = t.verify(cache, block)
            t.commit(cache, one)
            last["taps"] = o.taps[:, :1]

        cases[name, "ar step"] = done(lambda step=step: step(1))
        cases[name, f"verify {S}"] = done(lambda step=step: step(S))
        cases[name, "round"] = done(round_)
        if name == "eager":
            dstate = drafter.new_state(1, None, S)
            drafter.draft(dstate, out.taps, lens.to(dev), block[:, 0], lens.to(dev), None, greedy)
            tap1 = out.taps[:, -1:]
            cases["drafter", "pass"] = done(lambda s=dstate, tap1=tap1: drafter.draft(
                s, tap1, one, block[:, 0], s.lens + 1, None, greedy))
    return cases


def _generate(targets: dict, drafter, prompt: list[int], mode: str, S: int, new_tokens: int, sync) -> dict:
    from ..decoding.loop import generate
    from ..decoding.options import DecodeOptions

    res = {}
    for m in ("ar", mode):
        o = DecodeOptions(mode=m, block_size=S if m != "ar" else None, max_new_tokens=new_tokens, stop_token_ids=())
        for name, t in targets.items():
            d = drafter if m != "ar" else None
            generate(t, d, [prompt], DecodeOptions(mode=m, block_size=o.block_size, max_new_tokens=4))  # warm-up
            r = generate(t, d, [prompt], o)
            if sync:
                sync()
            res[m, name] = {"tokens_per_s": r.tokens_per_s, "tau": r.tau, "rounds": r.rounds,
                            "ms_per_round": (r.total_s - r.prefill_s) / max(1, r.rounds) * 1e3,
                            "token_ids": r.token_ids[0]}
    for m in ("ar", mode):
        ref = res[m, "eager"]["token_ids"]
        for name in targets:
            res[m, name]["same_tokens_as_eager"] = res[m, name]["token_ids"] == ref
            res[m, name]["equals_own_ar"] = res[m, name]["token_ids"] == res["ar", name]["token_ids"]
    return res


def run(target: str = "smollm2-135m", size: str | None = None, mode: str = "dflow", device: str = "cpu",
        dtype: str = "float32", context: int = 256, block: int | None = None, repeats: int = 10,
        new_tokens: int = 48, compile: bool = False, cuda_graphs: bool = False, threads: int | None = None,
        json_out: str | None = "docs/bench_static.json", pad_block: bool = False) -> int:
    import torch

    from .scale import device_sync

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA GPU is visible; use a GPU host or --device cpu --size smoke")
    if cuda_graphs and not device.startswith("cuda"):
        raise UserError("--cuda-graphs needs --device cuda (CUDA graphs do not exist on a CPU); drop it")
    report.set_threads(threads)
    con = report.console()
    load_before = os.getloadavg()[0]  # a shared machine: the other work that ran meanwhile
    eager, drafter, S = _load(target, size, mode, device, dtype, block)
    sync = device_sync(torch.device(device))
    calls_per_case = WARMUP + repeats + 1
    max_len = context + 4 * calls_per_case + new_tokens + S + 8  # every timed call commits one position
    t0 = time.perf_counter()
    targets = _variants(eager, max_len, compile, cuda_graphs, S if pad_block else 0)
    setup_s = time.perf_counter() - t0
    weights = step_bytes(eager.model)
    bandwidth = copy_bandwidth(torch.device(device), sync)
    floor_ms = 1e3 * weights / bandwidth
    with torch.inference_mode():
        cases = _calls(targets, drafter, context, S, sync)
        t0 = time.perf_counter()
        for fn in cases.values():  # first calls: compilation and graph capture happen here, untimed
            fn()
        first_s = time.perf_counter() - t0
        times = report.interleaved(cases, repeats, WARMUP)
    ms = {k: 1e3 * report.median(v) for k, v in times.items()}
    se = {k: 1e3 * report.standard_error(v) for k, v in times.items()}
    kinds = ["ar step", f"verify {S}", "round"]
    rows = [{"backend": name, **{kind: ms[name, kind] for kind in kinds},
             **{f"{kind} se": se[name, kind] for kind in kinds}} for name in targets]
    label = size or target
    card = torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu, {torch.get_num_threads()} threads"
    report.table(f"{label} ({card}), context {context}, block {S}: ms per call, median of {repeats} interleaved; "
                 f"drafter pass {ms['drafter', 'pass']:.2f} ms; bandwidth floor {floor_ms:.2f} ms "
                 f"({weights / 2**20:.0f} MiB of weights at {bandwidth / 1e9:.0f} GB/s copy)",
                 ["backend", *kinds, *(f"{k} vs eager" for k in kinds), "ar step / floor"],
                 [[r["backend"], *(f"{r[k]:.2f} ± {r[k + ' se']:.2f}" for k in kinds),
                   *(f"{rows[0][k] / r[k]:.2f}×" for k in kinds), f"{r['ar step'] / floor_ms:.1f}×"]
                  for r in rows], con)
    gen = None
    if new_tokens:
        tok = getattr(eager, "tokenizer", None)
        if tok is not None and getattr(tok, "chat_template", None):
            prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
        else:
            prompt = torch.randint(0, eager.info.vocab_size, (context,), generator=torch.Generator().manual_seed(1)).tolist()
        gen = _generate(targets, drafter, prompt, mode, S, new_tokens, sync)
        report.table(f"generate(), {len(prompt)}-token prompt, {new_tokens} new tokens, block {S}",
                     ["mode", "backend", "tokens/s", "τ", "ms/round", "same tokens as eager", "equals own ar"],
                     [[m, name, f"{r['tokens_per_s']:.1f}", f"{r['tau']:.2f}", f"{r['ms_per_round']:.2f}",
                       str(r["same_tokens_as_eager"]), str(r["equals_own_ar"])] for (m, name), r in gen.items()], con)
        gen = [{"mode": m, "backend": name, **{k: v for k, v in r.items() if k != "token_ids"}}
               for (m, name), r in gen.items()]
    out = {"target": label, "mode": mode, "device": card, "dtype": dtype if size else str(eager.model.dtype),
           "context": context, "block": S, "repeats": repeats, "pool_max_len": max_len,
           "setup_s": setup_s, "first_calls_s": first_s, "drafter_pass_ms": ms["drafter", "pass"],
           "step_weight_bytes": weights, "copy_bandwidth_bytes_per_s": bandwidth, "bandwidth_floor_ms": floor_ms,
           "rows": rows, "generate": gen, "load_average_1m": [load_before, os.getloadavg()[0]]}
    if json_out:
        con.print(f"wrote {report.write_json(json_out, out)}")
    return 0
