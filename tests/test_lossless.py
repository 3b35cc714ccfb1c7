"""Every decoding path equals plain greedy decoding of the target, token for token."""

import pytest
import torch

from conftest import HintSpy, OracleDrafter, chat_prompts
from dflow_trt.decoding.loop import generate
from dflow_trt.decoding.options import DecodeOptions
from dflow_trt.drafter.defaults import untrained_config
from dflow_trt.drafter.io import build_drafter
from dflow_trt.drafter.runtime import TorchDrafter

BLOCKS = (2, 4, 8, 16)


def _check_target(target, max_new, blocks=BLOCKS):
    prompts = chat_prompts(target)
    # the reference runs a block past max_new so the oracle can propose full blocks to the end
    ar_long = [generate(target, None, [p], DecodeOptions(mode="ar", max_new_tokens=max_new + 16, stop_token_ids=())).token_ids[0] for p in prompts]
    ar = [a[:max_new] for a in ar_long]
    # the ar path itself equals transformers' own greedy generate
    ref = target.model.generate(torch.tensor([prompts[0]], device=target.device), max_new_tokens=max_new, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    assert ref[0, len(prompts[0]):].tolist() == ar[0]
    seqs = [p + a for p, a in zip(prompts, ar_long)]
    for flow in (False, True):
        untrained = build_drafter(target, untrained_config(target, flow=flow, block_size=16, num_layers=1))
        for S in blocks:
            modes = ("dflash", "dflow") if flow else ("dflash",)
            for mode in modes:
                # worst case: seeded untrained drafter, nearly every draft rejected; all rows in one batch
                res = generate(target, TorchDrafter(untrained), prompts, DecodeOptions(block_size=S, mode=mode, max_new_tokens=max_new, stop_token_ids=()))
                assert res.token_ids == ar, (mode, S, flow)
                # best case: drafts are the target's own continuation; full blocks accepted
                oracle = OracleDrafter(seqs, S)
                res = generate(target, oracle, prompts, DecodeOptions(mode=mode, max_new_tokens=max_new, stop_token_ids=()))
                assert res.token_ids == ar, ("oracle", mode, S)
                assert res.tau == S
                if mode == "dflow":
                    assert all(f is None or not f.valid.any() for f in oracle.flows), "full acceptance carries no flow"


def test_tiny_qwen3_lossless(tiny_qwen3):
    _check_target(tiny_qwen3, max_new=40)


def test_tiny_llama_lossless(tiny_llama):
    _check_target(tiny_llama, max_new=40, blocks=(2, 8))


@pytest.mark.parametrize("S", (8, 16))
def test_verifier_hints_are_lossless(tiny_qwen3, monkeypatch, S):
    """DFlow with every consistent hint taken (trust 1), batched rows: still the target's tokens."""
    spy = HintSpy(monkeypatch)
    prompts, max_new = chat_prompts(tiny_qwen3, 6), 40
    ar = [generate(tiny_qwen3, None, [p], DecodeOptions(mode="ar", max_new_tokens=max_new, stop_token_ids=())).token_ids[0] for p in prompts]
    d = TorchDrafter(build_drafter(tiny_qwen3, untrained_config(tiny_qwen3, flow=True, block_size=S)))
    for threshold in (0.0, 0.3):
        before = spy.taken
        res = generate(tiny_qwen3, d, prompts, DecodeOptions(mode="dflow", max_new_tokens=max_new, stop_token_ids=(), verify_threshold=threshold, hint_trust=1.0))
        assert res.token_ids == ar, (S, threshold)
        assert res.hints_taken <= spy.taken - before  # only the drafts sent to the target count
    assert spy.taken > 0
    # one row, the whole block: every replaced draft is verified while its row decodes, so the
    # result counts all that take_hints replaced (shortened or batched runs count fewer: unsent drafts)
    before, counted = spy.taken, 0
    for p in prompts:
        counted += generate(tiny_qwen3, d, [p], DecodeOptions(mode="dflow", max_new_tokens=max_new, stop_token_ids=(), hint_trust=1.0)).hints_taken
    assert counted == spy.taken - before > 0


def test_single_row_equals_batched(tiny_qwen3):
    prompts = chat_prompts(tiny_qwen3, 4)
    d = TorchDrafter(build_drafter(tiny_qwen3, untrained_config(tiny_qwen3, flow=True, block_size=4)))
    batched = generate(tiny_qwen3, d, prompts, DecodeOptions(mode="dflow", max_new_tokens=20, stop_token_ids=()))
    single = [generate(tiny_qwen3, d, [p], DecodeOptions(mode="dflow", max_new_tokens=20, stop_token_ids=())).token_ids[0] for p in prompts]
    assert batched.token_ids == single


def test_stop_tokens_and_max_new_tokens(tiny_qwen3):
    p = chat_prompts(tiny_qwen3, 1)
    ar = generate(tiny_qwen3, None, p, DecodeOptions(mode="ar", max_new_tokens=30, stop_token_ids=())).token_ids[0]
    stop = ar[7]
    first = ar.index(stop)
    d = TorchDrafter(build_drafter(tiny_qwen3, untrained_config(tiny_qwen3, flow=True, block_size=8)))
    for mode, dr in (("ar", None), ("dflow", d), ("dflow", OracleDrafter([p[0] + ar], 8))):
        res = generate(tiny_qwen3, dr, p, DecodeOptions(mode=mode, max_new_tokens=30, stop_token_ids=(stop,)))
        assert res.token_ids[0] == ar[: first + 1] and res.finish_reasons == ["stop"]
        res = generate(tiny_qwen3, dr, p, DecodeOptions(mode=mode, max_new_tokens=5, stop_token_ids=()))
        assert res.token_ids[0] == ar[:5] and res.finish_reasons == ["length"]


@pytest.mark.slow
def test_smollm2_lossless(smollm2):
    _check_target(smollm2, max_new=24)


class _Unsure:
    """Wraps a drafter and reports seeded random confidences, so the verify length varies by round."""

    def __init__(self, inner, seed=0):
        self.inner, self.gen = inner, torch.Generator().manual_seed(seed)
        self.block_size, self.uses_flow = inner.block_size, inner.uses_flow
        self.flow_sizes = []

    def new_state(self, batch_size, generator=None, block_size=None):
        return self.inner.new_state(batch_size, generator, block_size)

    def draft(self, state, context_taps, context_lens, anchor_ids, anchor_pos, flow, sampler, verify_threshold=0.0):
        from dflow_trt.decoding.interfaces import Proposal

        if flow is not None:
            self.flow_sizes.append(flow.valid.shape[1])
        prop = self.inner.draft(state, context_taps, context_lens, anchor_ids, anchor_pos, flow, sampler)
        conf = 0.3 + 0.7 * torch.rand(prop.draft_ids.shape, generator=self.gen)
        return Proposal(prop.draft_ids, prop.draft_probs, confidence=conf)


@pytest.mark.parametrize("S", (4, 16))
def test_shortened_verify_is_lossless(tiny_qwen3, S):
    """Verifying only the drafts the drafter is sure of changes cost, never tokens."""
    prompts, max_new = chat_prompts(tiny_qwen3, 4), 32
    ar_long = [generate(tiny_qwen3, None, [p], DecodeOptions(mode="ar", max_new_tokens=max_new + 16, stop_token_ids=())).token_ids[0] for p in prompts]
    ar = [a[:max_new] for a in ar_long]
    untrained = build_drafter(tiny_qwen3, untrained_config(tiny_qwen3, flow=True, block_size=S))
    for inner in (TorchDrafter(untrained), OracleDrafter([p + a for p, a in zip(prompts, ar_long)], S)):
        for mode in ("dflash", "dflow"):
            d = _Unsure(inner)
            res = generate(tiny_qwen3, d, prompts, DecodeOptions(mode=mode, max_new_tokens=max_new, stop_token_ids=(), verify_threshold=0.5))
            assert res.token_ids == ar, (type(inner).__name__, mode, S)
            n_rounds = sum(len(a) for a in res.acceptance_lengths)
            assert n_rounds <= res.verified_drafts < n_rounds * (S - 1)  # shortened, never empty
            assert all(n == S for n in d.flow_sizes)  # flow always covers a whole next block
            full = generate(tiny_qwen3, inner, prompts, DecodeOptions(mode=mode, max_new_tokens=max_new, stop_token_ids=()))
            assert full.verified_drafts == sum(len(a) for a in full.acceptance_lengths) * (S - 1)


def test_verify_length_rule():
    from dflow_trt.decoding.policy import verify_lengths

    conf = torch.tensor([[0.9, 0.9, 0.5, 0.9], [0.6, 0.2, 0.9, 0.9]])  # cumprod: .9 .81 .405 .36 / .6 .12 ..
    assert verify_lengths(conf, 0.4).tolist() == [3, 1]
    assert verify_lengths(conf, 0.85).tolist() == [1, 1]
    assert verify_lengths(conf, 0.95).tolist() == [1, 1]  # at least one draft
    assert verify_lengths(conf, 0.3).tolist() == [4, 1]


@pytest.mark.slow
def test_smollm2_shipped_drafters_lossless(smollm2, monkeypatch):
    """The trained drafters (real acceptances, flow from real rejections, DFlow's verifier hints at
    their default trust), full and shortened verify."""
    from dflow_trt.drafter.defaults import load_target_and_drafter

    spy = HintSpy(monkeypatch)
    prompts = chat_prompts(smollm2, 3)
    ar = [generate(smollm2, None, [p], DecodeOptions(mode="ar", max_new_tokens=32, stop_token_ids=())).token_ids[0] for p in prompts]
    for mode in ("dflash", "dflow"):
        target, model = load_target_and_drafter("smollm2-135m", None, mode, target=smollm2)
        for S in (4, 16):
            for threshold in (0.0, 0.05):
                res = generate(target, TorchDrafter(model), prompts, DecodeOptions(block_size=S, mode=mode, max_new_tokens=32, stop_token_ids=(), verify_threshold=threshold))
                assert res.token_ids == ar, (mode, S, threshold)
                assert res.tau > 1.0  # some drafts were accepted
    assert spy.taken > 0  # the hints were exercised
