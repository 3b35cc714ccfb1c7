"""Speculative sampling has the target's distribution: a two-sample chi-square test on a tiny
(16-token) target, over the first three generated tokens, for dflash and dflow — with the real
(untrained) drafter, which is mostly rejected, and with a close drafter, mostly accepted."""

import pytest
import torch
from scipy.stats import chi2_contingency

from conftest import CloseDrafter, HintSpy
from dflow_trt.decoding.interfaces import Proposal
from dflow_trt.decoding.loop import generate
from dflow_trt.decoding.options import DecodeOptions
from dflow_trt.decoding.sampling import SamplingParams
from dflow_trt.drafter.defaults import untrained_config
from dflow_trt.drafter.io import build_drafter
from dflow_trt.drafter.runtime import TorchDrafter

N, K = 3000, 3  # samples per arm, tokens compared


PROMPT = [1, 2, 3]


def _samples(target, drafter, mode, params, block, verify_threshold=0.0, hint_trust=0.5):
    if drafter is not None and not isinstance(drafter, CloseDrafter):
        drafter = TorchDrafter(drafter)
    options = DecodeOptions(mode=mode, block_size=block if mode != "ar" else None, max_new_tokens=K, sampling=params,
                            stop_token_ids=(), verify_threshold=verify_threshold, hint_trust=hint_trust)
    res = generate(target, drafter, [PROMPT] * N, options)
    return [tuple(r[:K]) for r in res.token_ids], res


def _table(a, b):
    keys = sorted(set(a) | set(b))
    ca, cb = {k: 0 for k in keys}, {k: 0 for k in keys}
    for x in a:
        ca[x] += 1
    for x in b:
        cb[x] += 1
    # pool rare outcomes so every expected count is large enough for chi-square
    rare = [k for k in keys if ca[k] + cb[k] < 10]
    rows = [[ca[k] for k in keys if k not in rare] + [sum(ca[k] for k in rare)],
            [cb[k] for k in keys if k not in rare] + [sum(cb[k] for k in rare)]]
    return [r for r in zip(*rows) if sum(r) > 0]


@pytest.mark.parametrize("mode,block", [("dflash", 4), ("dflow", 4), ("dflow", 2)])
def test_speculative_sampling_matches_ar(small_target, mode, block):
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=12, seed=7)
    drafter = build_drafter(small_target, untrained_config(small_target, flow=(mode == "dflow"), block_size=block),
                            seed=0)
    ar, _ = _samples(small_target, None, "ar", SamplingParams(1.0, 0.95, 12, seed=11), 1)
    spec, res = _samples(small_target, drafter, mode, params, block)
    assert res.tau > 1.0  # some drafts were accepted, so rejection sampling was exercised
    _, p, _, _ = chi2_contingency(list(zip(*_table(ar, spec))))
    assert p > 1e-3, f"{mode}: distribution differs from ar (p={p:.2e})"


@pytest.mark.parametrize("mode,block,threshold,trust", [("dflash", 4, 0.0, 0.5), ("dflow", 3, 0.0, 0.5),
                                                         ("dflow", 4, 0.05, 0.5), ("dflow", 4, 0.0, 1.0)])
def test_speculative_sampling_with_a_close_drafter_matches_ar(small_target, monkeypatch, mode, block, threshold, trust):
    """threshold > 0: rounds verify only a prefix of the drafts (the drafter's confidences decide).
    DFlow takes verifier hints (point-mass drafts); at trust 1 it takes every consistent one."""
    import dflow_trt.decoding.policy as policy

    spy = HintSpy(monkeypatch)
    drafter = CloseDrafter(small_target.model, block, uses_flow=(mode == "dflow"), prompt=PROMPT)
    counted = policy.take_hints

    def hints_written_back(prop, flow, trust):  # the double rebuilds its context from what was proposed
        out = counted(prop, flow, trust)
        drafter.state["drafts"] = out.draft_ids.tolist()
        return out

    monkeypatch.setattr(policy, "take_hints", hints_written_back)
    ar, _ = _samples(small_target, None, "ar", SamplingParams(1.0, 0.95, 12, seed=13), 1)
    spec, res = _samples(small_target, drafter, mode, SamplingParams(1.0, 0.95, 12, seed=17), block, threshold, trust)
    assert res.tau > 1.5, res.tau  # most drafts accepted: the accept path carries the distribution
    if mode == "dflow":
        assert spy.taken > 0, "no verifier hint was taken: the point-mass path went untested"
    if threshold:  # some rounds were shortened
        assert res.verified_drafts < sum(len(a) for a in res.acceptance_lengths) * (block - 1)
    _, p, _, _ = chi2_contingency(list(zip(*_table(ar, spec))))
    assert p > 1e-3, f"{mode}: distribution differs from ar (p={p:.2e})"


def test_the_test_catches_a_wrong_accept_rule(small_target):
    """A drafter that misreports its distribution breaks the acceptance ratio p/q; the statistic sees it."""

    class Misreporting(CloseDrafter):
        def draft(self, *args):
            prop = super().draft(*args)
            return Proposal(prop.draft_ids, torch.softmax(torch.log(prop.draft_probs) * 2.6, -1))

    ar, _ = _samples(small_target, None, "ar", SamplingParams(1.0, 0.95, 12, seed=13), 1)
    spec, _ = _samples(small_target, Misreporting(small_target.model, 4, False, prompt=PROMPT), "dflash",
                       SamplingParams(1.0, 0.95, 12, seed=17), 4)
    _, p, _, _ = chi2_contingency(list(zip(*_table(ar, spec))))
    assert p < 1e-3


def test_the_test_can_fail(small_target):
    """The same statistic rejects a different distribution (temperature 1.6 vs 1.0)."""
    a, _ = _samples(small_target, None, "ar", SamplingParams(1.0, 0.95, 12, seed=1), 1)
    b, _ = _samples(small_target, None, "ar", SamplingParams(1.6, 0.95, 12, seed=2), 1)
    _, p, _, _ = chi2_contingency(list(zip(*_table(a, b))))
    assert p < 1e-3


def test_the_test_catches_a_verify_length_chosen_from_the_sampled_drafts(small_target):
    """Deciding how many drafts to verify from the sampled tokens' own probabilities skews the
    proposal distribution (measured p ~ 1e-8); the loop must be given a per-position confidence."""

    class SampleConfident(CloseDrafter):
        def draft(self, *args):
            prop = super().draft(*args)
            conf = prop.draft_probs.gather(-1, prop.draft_ids[..., None])[..., 0]
            return Proposal(prop.draft_ids, prop.draft_probs, confidence=conf)

    ar, _ = _samples(small_target, None, "ar", SamplingParams(1.0, 0.95, 12, seed=13), 1)
    spec, _ = _samples(small_target, SampleConfident(small_target.model, 4, True, prompt=PROMPT), "dflow",
                       SamplingParams(1.0, 0.95, 12, seed=17), 4, verify_threshold=0.05)
    _, p, _, _ = chi2_contingency(list(zip(*_table(ar, spec))))
    assert p < 1e-3
