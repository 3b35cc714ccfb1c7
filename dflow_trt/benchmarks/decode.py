"""`dflow-trt bench decode`: τ, per-position acceptance, tokens/s and speedup per mode and dataset.

Every mode runs greedy on the same prompts, interleaved prompt by prompt so that drift in the
machine's speed cancels out of the speedups; each mode's tokens are checked against `ar`'s
(lossless), and the result is a table, a JSON file and a PNG plot.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table
from tqdm import tqdm

from ..atomic import atomic_file
from ..decoding.flow import HINT_TRUST
from ..decoding.loop import generate
from ..decoding.options import MODES, DecodeOptions
from ..drafter.defaults import load_target_and_drafter
from ..errors import UserError
from ..evalsets import load_prompts
from ..loading import load_modes
from ..prompting import encode_prompts
from ..targets import check_device
from .report import console as wide_console, standard_error, write_json



@dataclass
class ModeRun:
    tokens: list[list[int]]
    acceptance: list[int]  # committed tokens per target forward, all prompts' rounds
    seconds: float
    drafter: str
    block_size: int
    verified: int = 0  # drafts sent to the target over all rounds
    rounds_per_prompt: list[int] = field(default_factory=list)  # slices `acceptance` by prompt
    draft_seconds: float = 0.0  # the drafter's share of `seconds` (the loop's draft_s)
    verify_seconds: float = 0.0  # the target's verify passes and acceptance (the loop's verify_s)
    alternatives_taken: int = 0  # rounds that committed a first-draft alternative (`generate(alternatives=)`)

    def add(self, other: "ModeRun") -> None:
        """Append another run's prompts (same mode and drafter)."""
        self.tokens += other.tokens
        self.acceptance += other.acceptance
        self.rounds_per_prompt += other.rounds_per_prompt
        self.seconds += other.seconds
        self.verified += other.verified
        self.alternatives_taken += other.alternatives_taken
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds

    def prompt_taus(self) -> list[float | None]:
        out, i = [], 0
        for n in self.rounds_per_prompt:
            out.append(sum(self.acceptance[i:i + n]) / n if n else None)  # None: done at prefill, no round
            i += n
        return out

    @property
    def tau(self) -> float:
        return sum(self.acceptance) / max(1, len(self.acceptance))

    @property
    def tau_se(self) -> float:
        """Standard error of τ over rounds (rounds of one prompt are not independent: a lower bound)."""
        return standard_error(self.acceptance)

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t) for t in self.tokens) / self.seconds if self.seconds > 0 else 0.0

    def position_rates(self) -> list[float]:
        """P(draft position k is accepted), k = 1..block-1: a round with length a accepted a-1 drafts."""
        n = max(1, len(self.acceptance))
        return [sum(a - 1 >= k for a in self.acceptance) / n for k in range(1, self.block_size)]


def run_modes(target_name: str, drafters: dict[str, str | None], modes: list[str], prompts: list[list[int]],
              options: DecodeOptions, warn=print, target=None, desc: str = "", backend: str = "torch"
              ) -> dict[str, ModeRun]:
    """Decode every prompt in every mode, interleaved: prompt by prompt, each mode in turn (the
    order rotating per prompt), so a machine that speeds up or slows down while the bench runs
    moves every mode's tokens/s alike and the speedups stay comparable. `options` for every mode
    (its own `mode` replaced). `backend`: torch or static (the same weights through backends/static.py)."""
    modes = list(dict.fromkeys(modes))  # a mode named twice runs once
    loaded, runs = load_modes(target_name, backend, drafters, tuple(modes), target=target, log=warn), {}
    for m in modes:
        drafter = loaded[m].drafter
        if m == "dflow" and not drafter.uses_flow:  # refused before any prompt is decoded
            raise UserError(f"the dflow drafter {drafters.get(m)} was built without flow conditioning; "
                            f"pass a DFlow drafter (--dflow-drafter) or drop dflow from --modes")
        name = "-" if drafter is None else drafter.config.extra.get("name", Path(drafters.get(m) or "untrained").name)
        runs[m] = ModeRun([], [], 0.0, name, (options.block_size or drafter.block_size) if drafter else 1)
    for i, p in enumerate(tqdm(prompts, desc=desc or ",".join(modes), leave=False)):
        for m in modes[i % len(modes):] + modes[:i % len(modes)]:
            t, drafter = loaded[m].target, loaded[m].drafter
            r = generate(t, drafter, [p], dataclasses.replace(options, mode=m))
            acc = r.acceptance_lengths[0]
            runs[m].add(ModeRun([r.token_ids[0]], acc, r.total_s, "", 0, r.verified_drafts, [len(acc)], r.draft_s,
                                r.verify_s, r.alternatives_taken))
    return runs


def _summary(runs: dict[str, ModeRun]) -> dict:
    ar = runs.get("ar")
    out = {}
    for mode, r in runs.items():
        out[mode] = {"tau": r.tau, "tau_se": r.tau_se, "tokens_per_s": r.tokens_per_s,
                     "speedup_vs_ar": r.tokens_per_s / ar.tokens_per_s if ar and ar.tokens_per_s else None,
                     "matches_ar": (r.tokens == ar.tokens) if ar else None,
                     "acceptance_by_position": r.position_rates(), "rounds": len(r.acceptance),
                     "prompt_taus": r.prompt_taus(),  # per prompt, in order: pairs runs made separately
                     "new_tokens": sum(len(t) for t in r.tokens), "seconds": r.seconds,
                     "drafts_verified_per_round": r.verified / max(1, len(r.acceptance)),
                     "draft_ms_per_round": 1e3 * r.draft_seconds / max(1, len(r.acceptance)),
                     "verify_ms_per_round": 1e3 * r.verify_seconds / max(1, len(r.acceptance)),
                     "alternatives_taken_per_round": r.alternatives_taken / max(1, len(r.acceptance)),
                     "drafter": r.drafter, "block_size": r.block_size}
    return out


def _paired(runs: dict[str, ModeRun]) -> dict | None:
    """DFlow against DFlash on the same prompts: both decode the same tokens, so the per-prompt
    τ difference is a paired sample; its standard error is over prompts, which are independent.
    A prompt done at its first token (no round) has no τ and is left out."""
    a, b = runs.get("dflash"), runs.get("dflow")
    if a is None or b is None or len(a.rounds_per_prompt) != len(b.rounds_per_prompt):
        return None
    d = [y - x for x, y in zip(a.prompt_taus(), b.prompt_taus()) if x is not None and y is not None]
    n = len(d)
    if n == 0:
        return None
    return {"tau_diff_mean": sum(d) / n, "tau_diff_se": standard_error(d), "prompts": n,
            "dflow_ahead": sum(x > 0 for x in d), "dflash_ahead": sum(x < 0 for x in d)}


def _merge(per_dataset: dict[str, dict[str, ModeRun]]) -> dict[str, ModeRun]:
    merged: dict[str, ModeRun] = {}
    for runs in per_dataset.values():
        for mode, r in runs.items():
            merged.setdefault(mode, ModeRun([], [], 0.0, r.drafter, r.block_size)).add(r)
    return merged


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(report["datasets"])
    modes = [m for m in report["modes"] if m != "ar"]
    w = 0.8 / max(1, len(modes))
    for i, m in enumerate(modes):
        ax1.bar([j + i * w for j in range(len(names))], [report["datasets"][d]["modes"][m]["tau"] for d in names],
                w, label=m)
        rates = report["modes"][m]["acceptance_by_position"]
        ax2.plot(range(1, len(rates) + 1), rates, marker="o", label=m)
    ax1.set_xticks([j + w * (len(modes) - 1) / 2 for j in range(len(names))], names)
    ax1.set_ylabel("τ (tokens per target forward)")
    ax1.set_title("mean acceptance length per dataset")
    ax1.legend()
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("acceptance rate")
    ax2.set_title("acceptance by position (all datasets)")
    ax2.legend()
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def run_bench(target: str, drafters: dict[str, str | None], modes: list[str], datasets: list[str], num_prompts: int,
              chat: bool, options: DecodeOptions, json_out: str | None, plot_out: str | None = None,
              first_prompt: int = 0, device: str = "cpu", backend: str = "torch") -> int:
    console = wide_console()
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise UserError(f"unknown mode(s) {bad}; use a comma list of {','.join(MODES)}")
    if "ar" not in modes:
        modes = ["ar", *modes]  # speedup and the lossless check are both measured against ar
    texts = {}  # every data set's prompts, read and checked before the target loads
    for ds in datasets:
        every = load_prompts(ds)
        texts[ds] = every[first_prompt:first_prompt + num_prompts]
        if not texts[ds]:
            raise UserError(f"{ds} has {len(every)} prompts; --first-prompt {first_prompt} leaves none to bench")
    loaded, _ = load_target_and_drafter(target, None, "ar", device=check_device(device))
    max_new_tokens, verify_threshold = options.max_new_tokens, options.verify_threshold
    hint_trust, alternatives = options.hint_trust, options.alternatives
    ids = {ds: encode_prompts(loaded, t, chat, max_new_tokens,
                              [f"prompt {first_prompt + i + 1} of {ds}" for i in range(len(t))])
           for ds, t in texts.items()}  # every prompt fits the context before the first is decoded
    per_dataset: dict[str, dict[str, ModeRun]] = {}
    for ds in datasets:
        name = Path(ds).stem if ds.endswith(".jsonl") else ds
        per_dataset[name] = run_modes(target, drafters, modes, ids[ds], options,
                                      warn=lambda s: console.print(f"[yellow]{s}"), target=loaded, desc=name,
                                      backend=backend)
    merged = _merge(per_dataset)
    report = {"target": target, "device": device, "backend": backend, "first_prompt": first_prompt, "num_prompts": num_prompts, "max_new_tokens": max_new_tokens, "chat": chat,
              "decoding": "greedy", "verify_threshold": verify_threshold, "hint_trust": hint_trust,
              "alternatives": alternatives, "modes": _summary(merged),
              "dflow_vs_dflash": _paired(merged),
              "datasets": {d: {"modes": _summary(r), "dflow_vs_dflash": _paired(r)} for d, r in per_dataset.items()}}
    for d, r in [*report["datasets"].items(), ("all", report)]:
        verify = f" · verify threshold {verify_threshold:g}" if verify_threshold else ""
        verify += f" · hint trust {hint_trust:g}" if hint_trust != HINT_TRUST else ""
        verify += f" · {alternatives} alternatives" if alternatives else ""
        which = f"prompts {first_prompt + 1}–{first_prompt + num_prompts}" if first_prompt else f"{num_prompts} prompts"
        t = Table(title=f"{target} · {d} · greedy · {which} × {max_new_tokens} tokens{verify}"
                        + (f" · --backend {backend}" if backend != "torch" else ""))
        for c in ("mode", "drafter", "block", "verified", "τ ± se", "accept pos 1..4", "tokens/s", "speedup", "matches ar"):
            t.add_column(c, justify="right")
        for m, s in r["modes"].items():
            pos = " ".join(f"{x:.2f}" for x in s["acceptance_by_position"][:4]) or "-"
            t.add_row(m, s["drafter"], str(s["block_size"]), f"{s['drafts_verified_per_round']:.1f}", f"{s['tau']:.3f} ± {s['tau_se']:.3f}",
                      pos, f"{s['tokens_per_s']:.1f}", f"{s['speedup_vs_ar']:.2f}x", "yes" if s["matches_ar"] else "NO")
        console.print(t)
        if r.get("dflow_vs_dflash"):
            pd = r["dflow_vs_dflash"]
            console.print(f"dflow − dflash, per prompt: τ {pd['tau_diff_mean']:+.3f} ± {pd['tau_diff_se']:.3f}; "
                          f"dflow ahead on {pd['dflow_ahead']} of {pd['prompts']} prompts, dflash on {pd['dflash_ahead']}")
    if json_out:
        out = write_json(json_out, report)
        _plot(report, Path(plot_out) if plot_out else out.with_suffix(".png"))
        console.print(f"wrote {out} and {Path(plot_out) if plot_out else out.with_suffix('.png')}")
    lossless = all(s["matches_ar"] for s in report["modes"].values())
    if not lossless:
        console.print("[red]a mode's greedy tokens differ from ar: the decoding is not lossless")
    return 0 if lossless else 1
