"""Drafters that really draft, for the ONNX Runtime, Triton and sampling tests (issue 26, point 2).

The seeded untrained drafter the other tests use is a constant drafter: on tiny-qwen3 it proposes
its mask token every time (τ exactly 1), so those tests only ever see a rejected point mass. The
drafters here are real `DFlowDrafter` folders written by `save_drafter`, so they go through ONNX
export and the Triton repository like shipped ones, with controlled behaviour:

- "varied": the seeded untrained drafter with its linear weights scaled up (`VARIED_SCALE`), so the
  context and the block tokens, not the mask token's embedding, decide its proposals: many distinct
  draft tokens, a low but non-zero acceptance rate (a random guess is right ~1/260 of the time).
- "good": drafters trained briefly (`dflow_trt.training.train`, both objectives) on tiny-qwen3's
  own greedy continuations of the test prompts (`GOOD_TEXTS`) and of a few more: a test double that
  knows the answers, so multi-token commits, full blocks and (DFlow) flow/hints really happen.

Everything is seeded; the trainer is deterministic on a CPU, so the same weights come back each run.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import torch

from dflow_trt.decoding.loop import generate

from dflow_trt.decoding.options import DecodeOptions
from dflow_trt.drafter.defaults import untrained_config
from dflow_trt.drafter.io import build_drafter
from dflow_trt.prompting import encode_prompt
from dflow_trt.targets.hf_target import tokenizer_fingerprint

TARGET = "tiny-qwen3"
NUM_TAPS = 3  # what `load_target_and_drafter` gives a drafterless mode; the trainer's default too
VARIED_SCALE = 20.0
# The prompts the good drafters were trained on (chat-templated) and the tests decode: the test
# prompts whose greedy continuation on tiny-qwen3 runs 64 tokens without an end of turn.
GOOD_TEXTS = [
    "Write a Python function that checks whether a number is prime.",
    "def fibonacci(n):",
    "Give me three tips for a job interview.",
    "hello world",
]
DATA_NEW_TOKENS = 64
GOOD_DFLASH_STEPS, GOOD_DFLOW_STEPS = 150, 30  # the DFlow run starts from the DFlash drafter


# ---------------------------------------------------------------- construction


def varied_drafter(target, flow: bool, block_size: int = 8, scale: float = VARIED_SCALE, seed: int = 0,
                   **config):
    """The seeded untrained drafter with every weight matrix scaled by `scale` (`config`: more
    `untrained_config` arguments, e.g. num_layers)."""
    model = build_drafter(target, untrained_config(target, flow=flow, block_size=block_size, **config), seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(scale)
    return model.eval()


def prompt_ids(target, text: str, chat: bool) -> list[int]:
    return encode_prompt(target.tokenizer, text, chat)


def write_dataset(target, out: Path, texts=GOOD_TEXTS, max_new_tokens: int = DATA_NEW_TOKENS) -> Path:
    """A training data set (the format `dflow_trt.training.data` reads) of the target's greedy
    continuations of the chat-templated `texts`; no sequence is held out."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = [prompt_ids(target, t, True) for t in texts]
    res = generate(target, None, prompts, DecodeOptions(mode="ar", max_new_tokens=max_new_tokens))
    rows = [json.dumps({"id": i + 1, "source": "doubles", "prompt_ids": p, "response_ids": r})
            for i, (p, r) in enumerate(zip(prompts, res.token_ids))]
    (out / "shard-0000.jsonl").write_text("\n".join(rows) + "\n")
    manifest = {"format": 1, "target": target.info.name, "target_fingerprint": target.info.fingerprint,
                "tokenizer_fingerprint": tokenizer_fingerprint(target.tokenizer), "max_new_tokens": max_new_tokens,
                "decoding": "greedy", "num_prompts": len(prompts), "seed": 0, "shard_size": len(prompts),
                "heldout_every": 10**9, "first_prompt": 1, "shards": ["shard-0000.jsonl"], "sources": ["doubles"]}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


def train_good(data_dir: Path, out_dir: Path, objective: str, steps: int, init_from: str = "",
               block_size: int = 8, lr: float = 1e-2, threads: int = 2) -> Path:
    """A drafter trained with the project's trainer on `data_dir` (every sequence, most positions,
    each step: it memorises them); returns its saved folder. `init_from` a DFlash drafter starts a
    DFlow run from it (`steps` count on from its last step)."""
    from dflow_trt.training.trainer import TrainConfig, train

    cfg = TrainConfig(target=TARGET, data_dir=str(data_dir), out_dir=str(out_dir), objective=objective, steps=steps,
                      seqs_per_step=len(GOOD_TEXTS), anchors_per_seq=48, block_size=block_size, gamma=4.0,
                      num_layers=1, num_taps=NUM_TAPS, draft_vocab_size=None, max_len=400, lr=lr, warmup_frac=0.05,
                      weight_decay=0.0, eval_every=10**6, eval_seqs=1, ckpt_every=10**6, seed=0, threads=threads,
                      states="off", init_from=init_from)
    n = torch.get_num_threads()
    try:
        return train(cfg)
    finally:
        torch.set_num_threads(n)


class PartlyRight:
    """A real drafter (its context cache, its flow conditioning) whose first k drafts of each row
    are replaced by the reference continuation `sequences[b]` (prompt + target output), k seeded per
    row and round in [0, S-1]: acceptances of every length, rejections at every position, full
    blocks. Past the reference it drafts alone."""

    def __init__(self, real, sequences, seed=0):
        self.real, self.sequences = real, sequences
        self.block_size, self.uses_flow = real.block_size, real.uses_flow
        self.gen = torch.Generator().manual_seed(seed)

    def new_state(self, batch_size, generator=None, block_size=None):
        return self.real.new_state(batch_size, generator, block_size)

    def draft(self, state, context_taps, context_lens, anchor_ids, anchor_pos, flow, sampler, verify_threshold=0.0):
        import dataclasses

        prop = self.real.draft(state, context_taps, context_lens, anchor_ids, anchor_pos, flow, sampler,
                               verify_threshold)
        ids = prop.draft_ids.clone()
        S = ids.shape[1] + 1  # this request's block
        k = torch.randint(0, S, (ids.shape[0],), generator=self.gen).tolist()
        for b, p in enumerate(anchor_pos.tolist()):
            seq = self.sequences[b]
            if p + S <= len(seq):  # within the reference: the anchor is its token there
                assert seq[p] == int(anchor_ids[b]), "anchor must be the reference token at its position"
                ids[b, :k[b]] = torch.tensor(seq[p + 1: p + 1 + k[b]], dtype=ids.dtype)
        return dataclasses.replace(prop, draft_ids=ids)


# ---------------------------------------------------------------- observation


class DraftSpy:
    """A Drafter that forwards to another and keeps every proposal's draft ids (rows, flattened)."""

    def __init__(self, inner):
        self.inner, self.drafts = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def new_state(self, *a, **k):
        return self.inner.new_state(*a, **k)

    def draft(self, *a, **k):
        prop = self.inner.draft(*a, **k)
        self.drafts.extend(prop.draft_ids.reshape(-1).tolist())
        return prop


def rounds(acceptance_lengths, block_size: int) -> collections.Counter:
    """Rounds by kind: "rejected" (a == 1: every draft rejected), "partial" (1 < a < S), "full" (a == S)."""
    flat = [a for row in acceptance_lengths for a in (row if isinstance(row, list) else [row])]
    assert all(1 <= a <= block_size for a in flat), (flat, block_size)
    return collections.Counter("rejected" if a == 1 else "full" if a == block_size else "partial" for a in flat)


# ---------------------------------------------------------------- BLS, locally


def local_bls(drafters: dict[str, str], mode: str):
    """(RemoteTarget, RemoteDrafter) of the BLS layout over in-process `target` and `drafter`
    services loaded as the server loads them: the same code path as `dflow_bls`, without Triton."""
    from dflow_trt.serving.bls import RemoteDrafter, RemoteTarget
    from dflow_trt.serving.services import load_drafter_service, load_target_service

    quiet = lambda m: None  # noqa: E731
    tsvc = load_target_service({"target": TARGET, "drafter": drafters["dflow"]}, None, log=quiet)
    dsvc = load_drafter_service({"target": TARGET, "dflash_drafter": drafters["dflash"],
                                 "dflow_drafter": drafters["dflow"]}, None, log=quiet)

    def remote(model, inputs, names):
        if "info_only" in inputs:
            out = {"info": np.array([(tsvc if model == "target" else dsvc).info_json()], dtype=object)}
        elif model == "target":
            out = tsvc.session_request(inputs) if "op" in inputs else tsvc.forward_request(inputs)
        else:  # as DrafterModel.compute: one-value inputs as scalars
            x = dict(inputs)
            for k in ("mode", "block_size", "temperature", "top_p", "top_k", "seed"):
                if k in x:
                    x[k] = np.asarray(x[k]).reshape(-1)[0]
            if isinstance(x["mode"], (bytes, np.bytes_)):
                x["mode"] = x["mode"].decode()
            out = dsvc.draft(x)
        return {n: out[n] for n in names}

    info = RemoteDrafter.available(remote)[mode]
    return RemoteTarget(remote), RemoteDrafter(remote, mode, info)


# ---------------------------------------------------------------- statistics


@torch.no_grad()
def exact_prefix_probs(target, ids: list[int], params, k: int) -> dict[tuple, float]:
    """The exact distribution of the first k sampled tokens (a sequence ending at an end-of-turn
    token is shorter), enumerated through the target's processed distributions (`params` must cut
    the support, e.g. top-k)."""
    from dflow_trt.decoding.sampling import processed_probs

    eos = set(target.info.eos_token_ids)
    dist, frontier = {}, {(): 1.0}
    for step in range(k):
        seqs = list(frontier)
        x = torch.tensor([ids + list(s) for s in seqs])
        probs = processed_probs(target.model(input_ids=x).logits[:, -1], params)
        nxt = {}
        for s, pr in zip(seqs, probs):
            for t in pr.nonzero().flatten().tolist():
                seq, w = s + (t,), frontier[s] * float(pr[t])
                (dist if t in eos or step == k - 1 else nxt)[seq] = w
        frontier = nxt
    return dist


def chi_square_gof(counts: dict, p: dict, q: dict, alpha: float, min_expected: float = 5.0):
    """Goodness of fit of observed `counts` to the distribution `p` (outcomes with fewer than
    `min_expected` expected counts pooled into one bin) -> (statistic, df, p-value, power against
    the alternative `q` at level `alpha`, from the non-central chi-square)."""
    from scipy.stats import chi2, ncx2

    n = sum(counts.values())
    assert set(counts) <= set(p), f"outcomes outside the support: {set(counts) - set(p)}"
    big = [c for c in p if n * p[c] >= min_expected]
    small = [c for c in p if c not in big]
    bins = [[c] for c in big] + ([small] if small else [])
    obs = np.array([sum(counts.get(c, 0) for c in b) for b in bins], float)
    pe = np.array([sum(p[c] for c in b) for b in bins])
    qe = np.array([sum(q.get(c, 0.0) for c in b) for b in bins])
    stat, df = float(((obs - n * pe) ** 2 / (n * pe)).sum()), len(bins) - 1
    lam = n * float(((qe - pe) ** 2 / pe).sum())
    return stat, df, float(chi2.sf(stat, df)), float(ncx2.sf(chi2.isf(alpha, df), df, lam))
