"""How often DFlow's verifier hints are right, and which trust pays: the measurement behind HINT_TRUST.

    python scripts/hint_stats.py [--dataset heldout|humaneval|mtbench|FILE.jsonl] [--num-prompts 64]
                                 [--max-new-tokens 64] [--json docs/hint_stats.json]

Decodes greedily with the shipped DFlow drafter and hints off, recording each round's drafts, the
drafter's confidences and the flow. `heldout` (the default) is prompts of the training sources that
no shipped drafter trained on (ids divisible by the data sets' held-out stride, 20, below 5,376:
every third, so every prompt pool is in it), never the eval sets. For each draft k >= 2 whose
earlier drafts were all right, and whose flow slot k-1 read the same token as draft k-1 (a
*consistent* hint, `take_hints`' rule), it counts how often the hint and the draft name the target's
token. Then it replays every round with `take_hints` at several trusts and reports the mean
accepted length: an estimate, since taking a hint changes later rounds, which the bench measures.
Prints a table and writes JSON. Not a test.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dflow_trt.decoding.flow import HINT_TRUST, take_hints  # noqa: E402
from dflow_trt.decoding.interfaces import Proposal  # noqa: E402
from dflow_trt.decoding.loop import generate  # noqa: E402
from dflow_trt.drafter.defaults import load_target_and_drafter  # noqa: E402
from dflow_trt.drafter.runtime import TorchDrafter  # noqa: E402
from dflow_trt.evalsets import load_prompts  # noqa: E402
from dflow_trt.prompting import encode_prompt  # noqa: E402

TRUSTS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.9, 1.0)
SEEN_PROMPTS, HELDOUT_EVERY = 5376, 20  # the shipped drafters' data sets cover prompt ids below this


class Recorder:
    """The `Drafter` interface over a TorchDrafter, keeping what each round proposed and saw."""

    def __init__(self, inner: TorchDrafter):
        self.inner, self.block_size, self.uses_flow, self.rounds = inner, inner.block_size, inner.uses_flow, []

    def new_state(self, batch_size, generator=None):
        return self.inner.new_state(batch_size, generator)

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="heldout")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    target, model = load_target_and_drafter("smollm2-135m", None, "dflow")
    if a.dataset == "heldout":
        from dflow_trt.training.prompts import build_prompts

        texts = [p["prompt"] for p in build_prompts(SEEN_PROMPTS) if p["id"] % HELDOUT_EVERY == 0][::3]
    else:
        texts = load_prompts(a.dataset)
    texts = texts[:a.num_prompts]
    drafter = Recorder(TorchDrafter(model))
    # per draft position k: consistent hints after a right prefix, and how often hint / draft were right
    by_k: dict[int, list[int]] = {}
    replay = {t: 0 for t in (0.0, *TRUSTS)}
    n_rounds = 0
    for text in tqdm(texts, desc="decode"):
        ids = encode_prompt(target.tokenizer, text, True)
        drafter.rounds.clear()
        out = generate(target, drafter, [ids], "dflow", a.max_new_tokens, hint_trust=0.0).token_ids[0]
        for pos, prop, flow in drafter.rounds:
            # truth[k]: the target's token at block position k (None past the end of the output)
            truth = [out[pos + k - len(ids)] if pos + k - len(ids) < len(out) else None for k in range(drafter.block_size)]
            d = prop.draft_ids[0].tolist()
            n_rounds += 1
            for t in replay:
                taken = prop if flow is None or t == 0 else take_hints(Proposal(prop.draft_ids, None, prop.confidence), flow, t)
                replay[t] += _accepted(taken.draft_ids[0].tolist(), truth)
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
    report = {"dataset": a.dataset, "num_prompts": len(texts), "max_new_tokens": a.max_new_tokens, "rounds": n_rounds,
              "hint_trust": HINT_TRUST, "consistent_hints": n,
              "hint_right": sum(s[1] for s in by_k.values()) / max(1, n),
              "draft_right_there": sum(s[2] for s in by_k.values()) / max(1, n),
              "by_position": {k: {"n": s[0], "hint_right": s[1] / s[0], "draft_right": s[2] / s[0]}
                              for k, s in sorted(by_k.items())},
              "replay_tau": {str(t): 1 + v / max(1, n_rounds) for t, v in replay.items()}}
    console = Console()
    console.print(f"{len(texts)} prompts ({a.dataset}), {n_rounds} rounds; consistent hints after a right prefix: "
                  f"{n}, hint right {report['hint_right']:.3f}, draft right {report['draft_right_there']:.3f}")
    t = Table(title="replayed τ by hint trust (0: hints off)")
    t.add_column("trust", justify="right")
    t.add_column("τ (replay)", justify="right")
    for k, v in report["replay_tau"].items():
        t.add_row(k, f"{v:.4f}")
    console.print(t)
    if a.json:
        p = Path(a.json)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(tmp, p)
        console.print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
