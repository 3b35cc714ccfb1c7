"""Speculative sampling has the target's distribution: a two-sample chi-square test on a tiny
(16-token) target, over the first three generated tokens, for dflash and dflow."""

import pytest
import torch
from scipy.stats import chi2_contingency

from dflow_trt.decoding.loop import generate
from dflow_trt.decoding.sampling import SamplingParams
from dflow_trt.drafter.defaults import untrained_config
from dflow_trt.drafter.io import build_drafter
from dflow_trt.drafter.runtime import TorchDrafter
from dflow_trt.targets.hf_target import HFTarget
from dflow_trt.targets.tiny import build_tiny

V, N, K = 16, 3000, 3  # vocabulary, samples per arm, tokens compared


@pytest.fixture(scope="module")
def small_target():
    model, _ = build_tiny("qwen3", seed=3, vocab_size=V)
    with torch.no_grad():  # sharpen the random head so the distribution is far from uniform
        model.lm_head.weight.mul_(1.5)
    return HFTarget(model, name="tiny-qwen3-v16", tap_layers=(1, 3), tokenizer=None, eos_token_ids=())


def _samples(target, drafter, mode, params, block):
    res = generate(target, TorchDrafter(drafter, block) if drafter else None, [[1, 2, 3]] * N, mode, K, params,
                   stop_token_ids=())
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


def test_the_test_can_fail(small_target):
    """The same statistic rejects a different distribution (temperature 1.6 vs 1.0)."""
    a, _ = _samples(small_target, None, "ar", SamplingParams(1.0, 0.95, 12, seed=1), 1)
    b, _ = _samples(small_target, None, "ar", SamplingParams(1.6, 0.95, 12, seed=2), 1)
    _, p, _, _ = chi2_contingency(list(zip(*_table(a, b))))
    assert p < 1e-3
