"""`dflow-trt bench hints`: how often DFlow's verifier hints are right, and which trust pays: the
measurement behind HINT_TRUST.

Decodes greedily with the DFlow drafter (the target's shipped one by default) and hints off,
recording each round's drafts, the drafter's confidences and the flow. `heldout` (the default) is
prompts of the training sources that no shipped drafter trained on (ids divisible by the data
sets' held-out stride, 20, below 5,376: every third, so every prompt pool is in it), never the
eval sets. For each draft k >= 2 whose
earlier drafts were all right, and whose flow slot k-1 read the same token as draft k-1 (a
*consistent* hint, `take_hints`' rule), it counts how often the hint and the draft name the target's
token. Then it replays every round with `take_hints` at several trusts and reports the mean
accepted length: an estimate, since taking a hint changes later rounds, which the bench measures.
"""

from __future__ import annotations

from tqdm import tqdm

from ..decoding.flow import HINT_TRUST, take_hints
from ..decoding.interfaces import Proposal
from ..decoding.loop import generate
from ..decoding.options import DecodeOptions
from ..drafter.defaults import load_target_and_drafter
from ..drafter.runtime import TorchDrafter
from ..errors import UserError
from ..evalsets import load_prompts
from ..prompting import encode_prompts
from . import report

TRUSTS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.9, 1.0)
SEEN_PROMPTS, HELDOUT_EVERY = 5376, 20  # the shipped drafters' data sets cover prompt ids below this


class Recorder:
    """The `Drafter` interface over a TorchDrafter, keeping what each round proposed and saw."""

    def __init__(self, inner: TorchDrafter):
        self.inner, self.block_size, self.uses_flow, self.rounds = inner, inner.block_size, inner.uses_flow, []

    def new_state(self, batch_size, generator=None, block_size=None):
        return self.inner.new_state(batch_size, generator, block_size)

    def draft(self, state, context_taps, context_lens, anchor_ids, anchor_pos, flow, sampler, verify_threshold=0.0):
        prop = self.inner.draft(state, context_taps, context_lens, anchor_ids, anchor_pos, flow, sampler,
                                verify_threshold)
        self.rounds.append((int(anchor_pos[0]), prop, flow))
        return prop


def _accepted(draft_ids: list[int], truth: list[int | None]) -> int:
    a = 0
    while a < len(draft_ids) and truth[a + 1] is not None and draft_ids[a] == truth[a + 1]:
        a += 1
    return a


def heldout_texts() -> list[str]:
    """Prompts of the training sources no shipped drafter trained on (see the module's docstring)."""
    from ..training.prompts import build_prompts

    return [p["prompt"] for p in build_prompts(SEEN_PROMPTS) if p["id"] % HELDOUT_EVERY == 0][::3]


def run(target: str = "smollm2-135m", drafter: str | None = None, dataset: str = "heldout", num_prompts: int = 64,
        max_new_tokens: int = 64, json_out: str | None = None) -> int:
    import torch

    con = report.console()
    texts = (heldout_texts() if dataset == "heldout" else load_prompts(dataset))[:num_prompts]
    t, model = load_target_and_drafter(target, drafter, "dflow", warn=lambda s: con.print(f"[yellow]{s}"))
    inner = TorchDrafter(model)
    if not inner.uses_flow:
        raise UserError(f"the drafter {drafter} was built without flow conditioning: it gets no verifier hints; "
                        f"pass a DFlow drafter (--drafter)")
    prompts = encode_prompts(t, texts, True, max_new_tokens,
                             [f"prompt {i + 1} of {dataset}" for i in range(len(texts))])
    rec = Recorder(inner)
    # per draft position k: consistent hints after a right prefix, and how often hint / draft were right
    by_k: dict[int, list[int]] = {}
    replay = {x: 0 for x in (0.0, *TRUSTS)}
    n_rounds = 0
    with torch.no_grad():
        for ids in tqdm(prompts, desc="decode", leave=False):
            rec.rounds.clear()
            out = generate(t, rec, [ids], DecodeOptions(mode="dflow", max_new_tokens=max_new_tokens,
                                                        hint_trust=0.0)).token_ids[0]
            for pos, prop, flow in rec.rounds:
                # truth[k]: the target's token at block position k (None past the end of the output)
                truth = [out[pos + k - len(ids)] if pos + k - len(ids) < len(out) else None
                         for k in range(rec.block_size)]
                d = prop.draft_ids[0].tolist()
                n_rounds += 1
                for x in replay:
                    taken = prop if flow is None or x == 0 else \
                        take_hints(Proposal(prop.draft_ids, None, prop.confidence), flow, x)
                    replay[x] += _accepted(taken.draft_ids[0].tolist(), truth)
                if flow is None:
                    continue
                for k in range(2, len(d) + 1):
                    if truth[k] is None or d[k - 2] != truth[k - 1] or not bool(flow.valid[0, k - 1]):
                        break
                    if int(flow.token_ids[0, k - 1]) == d[k - 2]:
                        s = by_k.setdefault(k, [0, 0, 0])
                        s[0] += 1
                        s[1] += int(flow.hint_ids[0, k - 1]) == truth[k]
                        s[2] += d[k - 1] == truth[k]
    n = sum(s[0] for s in by_k.values())
    out = {"dataset": dataset, "num_prompts": len(texts), "max_new_tokens": max_new_tokens, "rounds": n_rounds,
           "hint_trust": HINT_TRUST, "consistent_hints": n,
           "hint_right": sum(s[1] for s in by_k.values()) / max(1, n),
           "draft_right_there": sum(s[2] for s in by_k.values()) / max(1, n),
           "by_position": {k: {"n": s[0], "hint_right": s[1] / s[0], "draft_right": s[2] / s[0]}
                           for k, s in sorted(by_k.items())},
           "replay_tau": {str(x): 1 + v / max(1, n_rounds) for x, v in replay.items()}}
    con.print(f"{len(texts)} prompts ({dataset}), {n_rounds} rounds; consistent hints after a right prefix: "
              f"{n}, hint right {out['hint_right']:.3f}, draft right {out['draft_right_there']:.3f}")
    report.table("replayed τ by hint trust (0: hints off)", ["trust", "τ (replay)"],
                 [[k, f"{v:.4f}"] for k, v in out["replay_tau"].items()], con)
    if json_out:
        con.print(f"wrote {report.write_json(json_out, out)}")
    return 0
