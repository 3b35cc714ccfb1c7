"""FP8 accuracy check: the fake-quantized FP8 models against the full-precision ones on held-out prompts.

Metrics (prompts: MT-Bench and HumanEval, never used for calibration):
- `top1_agreement`: fraction of prompt positions where both targets' argmax agree;
- `kl_mean`: mean KL(p_full || p_fp8) of the next-token distributions there (nats);
- `greedy_match_mean`: mean length of the common prefix of both targets' greedy generations
  (as a fraction of `max_new_tokens` in `greedy_match_frac`);
- `tau[mode][pair]`: mean acceptance length for pairs full/full, fp8/fp8 and fp8 target with the
  full-precision drafter, and `tau_ratio` = worst FP8 pair / full pair.
Thresholds come from measurement on smollm2-135m (docs/export.md); a failed one fails the check.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..atomic import write_text
from ..decoding.loop import pad_left, generate
from ..decoding.options import DecodeOptions
from ..drafter.model import DFlowDrafter
from ..drafter.runtime import TorchDrafter
from ..targets.hf_target import HFTarget


@dataclass(frozen=True)
class Thresholds:
    """Measured on smollm2-135m, per-tensor FP8 (2026-12-03, 16 prompts x 32 tokens): top-1 0.885,
    KL 0.056, greedy common prefix 0.26 of the tokens, τ ratio 1.01-1.02. The limits leave a margin
    for prompt-to-prompt noise and fail a broken quantization (a wrong scale or a missed calibration
    puts top-1 far below 0.85)."""

    top1_agreement_min: float = 0.85
    kl_mean_max: float = 0.10
    greedy_match_frac_min: float = 0.15
    tau_ratio_min: float = 0.90


@dataclass
class Fp8Report:
    target: str
    num_prompts: int
    max_new_tokens: int
    top1_agreement: float
    kl_mean: float
    greedy_match_mean: float
    greedy_match_frac: float
    tau: dict = field(default_factory=dict)  # mode -> {"full": .., "fp8_target_fp8_drafter": .., ...}
    tau_ratio: dict = field(default_factory=dict)  # mode -> worst fp8 pair / full
    thresholds: dict = field(default_factory=dict)
    checks: list = field(default_factory=list)  # [{"name", "value", "op", "limit", "pass"}]
    drafters: dict = field(default_factory=dict)  # mode -> "trained: path" | "untrained (seeded)"

    @property
    def passed(self) -> bool:
        return all(c["pass"] for c in self.checks)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "passed": self.passed}, indent=2) + "\n"

    def table(self) -> str:
        rows = [("check", "value", "limit", "result")]
        for c in self.checks:
            rows.append((c["name"], f"{c['value']:.4f}", f"{c['op']} {c['limit']}", "PASS" if c["pass"] else "FAIL"))
        for mode, pairs in self.tau.items():
            for pair, v in pairs.items():
                rows.append((f"tau[{mode}] {pair}", f"{v:.3f}", "", ""))
        w = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(x.ljust(w[i]) for i, x in enumerate(r)) for r in rows]
        lines.insert(1, "  ".join("-" * x for x in w))
        return "\n".join(lines)


def heldout_prompts(target: HFTarget, n: int) -> list[list[int]]:
    """Chat-formatted MT-Bench and HumanEval prompts, alternating (random ids for tokenizer-less targets)."""
    tok = target.tokenizer
    if tok is None:
        g = torch.Generator().manual_seed(99)
        return [torch.randint(0, target.info.vocab_size, (40,), generator=g).tolist() for _ in range(n)]
    from ..evalsets import humaneval_prompts, mtbench_prompts

    texts = [t for pair in zip(mtbench_prompts(), humaneval_prompts()) for t in pair][:n]
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"][:384] for t in texts]


@torch.inference_mode()
def logit_metrics(full: HFTarget, fp8: HFTarget, prompts: list[list[int]], batch_size: int = 8) -> tuple[float, float]:
    agree = kl = n = 0.0
    for i in range(0, len(prompts), batch_size):
        ids, lens = pad_left(prompts[i:i + batch_size], pad_id=0)
        ca, a = full.prefill(ids, lens)
        cb, b = fp8.prefill(ids, lens)
        m = ca.valid  # [B, T]
        la, lb = a.logits[m].log_softmax(-1), b.logits[m].log_softmax(-1)  # [N, V]
        agree += float((la.argmax(-1) == lb.argmax(-1)).sum())
        kl += float((la.exp() * (la - lb)).sum())
        n += int(m.sum())
    return agree / n, kl / n


def _common_prefix(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def run_check(full: HFTarget, fp8: HFTarget, drafters: dict[str, tuple[DFlowDrafter, DFlowDrafter]],
              prompts: list[list[int]], max_new_tokens: int = 32, thresholds: Thresholds = Thresholds(),
              drafter_sources: dict[str, str] | None = None, batch_size: int = 8, log=print) -> Fp8Report:
    """`drafters`: mode -> (full-precision drafter, FP8 drafter), built against `full`'s taps."""
    log(f"fp8-check: logits on {len(prompts)} held-out prompts")
    top1, kl = logit_metrics(full, fp8, prompts, batch_size)
    log("fp8-check: greedy generations")
    gen = lambda t, d, mode: [r for i in range(0, len(prompts), batch_size) for r in generate(  # noqa: E731
        t, d, prompts[i:i + batch_size], DecodeOptions(mode=mode, max_new_tokens=max_new_tokens, stop_token_ids=())
    ).token_ids]
    ar_full, ar_fp8 = gen(full, None, "ar"), gen(fp8, None, "ar")
    match = sum(_common_prefix(a, b) for a, b in zip(ar_full, ar_fp8)) / len(prompts)
    tau, ratio = {}, {}
    for mode, (d_full, d_fp8) in drafters.items():
        log(f"fp8-check: tau for {mode}")
        pairs = {"full": (full, d_full), "fp8_target_fp8_drafter": (fp8, d_fp8), "fp8_target_full_drafter": (fp8, d_full)}
        tau[mode] = {}
        for name, (t, d) in pairs.items():
            res = [generate(t, TorchDrafter(d), prompts[i:i + batch_size],
                            DecodeOptions(mode=mode, max_new_tokens=max_new_tokens, stop_token_ids=()))
                   for i in range(0, len(prompts), batch_size)]
            flat = [a for r in res for row in r.acceptance_lengths for a in row]
            tau[mode][name] = sum(flat) / len(flat)
        ratio[mode] = min(tau[mode]["fp8_target_fp8_drafter"], tau[mode]["fp8_target_full_drafter"]) / tau[mode]["full"]
    th = thresholds
    checks = [("top1_agreement", top1, ">=", th.top1_agreement_min), ("kl_mean", kl, "<=", th.kl_mean_max),
              ("greedy_match_frac", match / max_new_tokens, ">=", th.greedy_match_frac_min)]
    checks += [(f"tau_ratio[{m}]", r, ">=", th.tau_ratio_min) for m, r in ratio.items()]
    checks = [{"name": n, "value": v, "op": op, "limit": lim, "pass": bool(v >= lim if op == ">=" else v <= lim)}
              for n, v, op, lim in checks]
    return Fp8Report(target=full.info.name, num_prompts=len(prompts), max_new_tokens=max_new_tokens,
                     top1_agreement=top1, kl_mean=kl, greedy_match_mean=match, greedy_match_frac=match / max_new_tokens,
                     tau=tau, tau_ratio=ratio, thresholds=asdict(th), checks=checks,
                     drafters=drafter_sources or {})


def write_report(report: Fp8Report, path: str | Path) -> Path:
    return write_text(path, report.to_json())
