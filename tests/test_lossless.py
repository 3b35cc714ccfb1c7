"""Every decoding path equals plain greedy decoding of the target, token for token (up to rounding
ties: `assert_greedy_equivalent`), with the drafters' paths asserted taken: rejected, partial and
full rounds, verifier hints."""

import pytest
import torch

from conftest import HintSpy, OracleDrafter, assert_greedy_equivalent, chat_prompts
from doubles import PartlyRight, rounds, varied_drafter
from dflow_trt.decoding.loop import generate
from dflow_trt.decoding.policy import verify_lengths
from dflow_trt.decoding.options import DecodeOptions
from dflow_trt.drafter.defaults import untrained_config
from dflow_trt.drafter.io import build_drafter
from dflow_trt.drafter.runtime import TorchDrafter

BLOCKS = (2, 4, 8, 16)


def _same(target, prompts, got, want, max_new=None, what=()):
    """Each row of `got` is the greedy decode `want` of its prompt, or parts from it at a rounding tie only."""
    assert len(got) == len(want), what
    for p, g, w in zip(prompts, got, want):
        assert_greedy_equivalent(target, p, g, w, max_new_tokens=max_new)


def _assert_paths(res, S, what, partial=True):
    """The decode took rejected rounds, and (`partial`, S > 2) partial ones: 1 < a < S."""
    kinds = rounds(res.acceptance_lengths, S)
    assert kinds["rejected"] > 0, (what, dict(kinds))
    if partial and S > 2:
        assert kinds["partial"] > 0, (what, dict(kinds))
    return kinds


def _check_target(target, max_new, blocks=BLOCKS):
    prompts = chat_prompts(target)
    # the reference runs a block past max_new so the oracle can propose full blocks to the end
    ar_long = [generate(target, None, [p], DecodeOptions(mode="ar", max_new_tokens=max_new + 16, stop_token_ids=())).token_ids[0] for p in prompts]
    ar = [a[:max_new] for a in ar_long]
    # the ar path itself equals transformers' own greedy generate
    ref = target.model.generate(torch.tensor([prompts[0]], device=target.device), max_new_tokens=max_new, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    assert_greedy_equivalent(target, prompts[0], ref[0, len(prompts[0]):].tolist(), ar[0], max_new_tokens=max_new)
    seqs = [p + a for p, a in zip(prompts, ar_long)]
    for flow in (False, True):
        # a seeded drafter whose drafts vary with the context (not the constant untrained one)
        varied = varied_drafter(target, flow=flow, block_size=16, num_layers=1)
        for S in blocks:
            modes = ("dflash", "dflow") if flow else ("dflash",)
            for mode in modes:
                # real drafts (nearly all wrong) after a seeded number of right ones per row and round,
                # all rows in one batch: every acceptance length, rejections at every position, full
                # blocks (the bonus token)
                res = generate(target, PartlyRight(TorchDrafter(varied), seqs, seed=S), prompts, DecodeOptions(block_size=S, mode=mode, max_new_tokens=max_new, stop_token_ids=()))
                _same(target, prompts, res.token_ids, ar, max_new, ("partly right", mode, S))
                kinds = _assert_paths(res, S, ("partly right", mode, S))
                assert kinds["full"] > 0 or S > 8, dict(kinds)  # 1 round in S is full: few rounds at S = 16
                # best case: drafts are the target's own continuation; full blocks accepted
                oracle = OracleDrafter(seqs, S)
                res = generate(target, oracle, prompts, DecodeOptions(mode=mode, max_new_tokens=max_new, stop_token_ids=()))
                _same(target, prompts, res.token_ids, ar, max_new, ("oracle", mode, S))
                assert res.tau == S
                if mode == "dflow":
                    assert len(oracle.flows) == res.rounds and oracle.flows[0] is None  # round 1 has no flow yet
                    assert all(f is None or not f.valid.any() for f in oracle.flows), "full acceptance carries no flow"


def test_tiny_qwen3_lossless(tiny_qwen3):
    _check_target(tiny_qwen3, max_new=40)


def test_tiny_llama_lossless(tiny_llama):
    _check_target(tiny_llama, max_new=40, blocks=(2, 8))


def _sent_hints(spy_calls, res, threshold):
    """The hints among the drafts each row sent to the target, from the spy's record of every
    `take_hints` call (round r >= 2 calls it once; row b is still decoding in round r while it has
    r acceptance lengths): what `GenerationResult.hints_taken` must count."""
    n = 0
    for i, (replaced, conf) in enumerate(spy_calls):
        sent = verify_lengths(conf, threshold) if threshold > 0 and conf is not None else \
            torch.full((replaced.shape[0],), replaced.shape[1])
        for b, lens in enumerate(res.acceptance_lengths):
            if len(lens) >= i + 2:
                n += int(replaced[b, :int(sent[b])].sum())
    return n


@pytest.mark.parametrize("S", (8, 16))
def test_verifier_hints_are_lossless(tiny_qwen3, monkeypatch, S):
    """DFlow with every consistent hint taken (trust 1), batched rows: still the target's tokens.

    The constant untrained drafter is the stress case here: it drafts its mask token everywhere, so
    every flow slot that read a rejected mask qualifies and trust 1 takes the verifier's guess there
    (the hinted drafts are then accepted: partial rounds). Under the threshold, seeded random
    confidences (`_Unsure`; a taken hint reports 1) shorten rows' blocks: some hinted drafts go unsent."""
    spy = HintSpy(monkeypatch)
    prompts, max_new = chat_prompts(tiny_qwen3, 6), 40
    ar = [generate(tiny_qwen3, None, [p], DecodeOptions(mode="ar", max_new_tokens=max_new, stop_token_ids=())).token_ids[0] for p in prompts]
    d = TorchDrafter(build_drafter(tiny_qwen3, untrained_config(tiny_qwen3, flow=True, block_size=S)))
    for threshold in (0.0, 0.3):
        spy.calls.clear()
        res = generate(tiny_qwen3, _Unsure(d) if threshold else d, prompts, DecodeOptions(mode="dflow", max_new_tokens=max_new, stop_token_ids=(), verify_threshold=threshold, hint_trust=1.0))
        _same(tiny_qwen3, prompts, res.token_ids, ar, max_new, (S, threshold))
        _assert_paths(res, S, ("hints", S, threshold))
        assert len(spy.calls) == res.rounds - 1  # every round after the first takes hints
        # only the drafts sent to the target count (a shortened verify leaves some unsent)
        assert res.hints_taken == _sent_hints(spy.calls, res, threshold) > 0, (S, threshold)
        if threshold:  # and some hinted drafts went unsent, so counting them all would be caught
            assert res.hints_taken < _sent_hints(spy.calls, res, 0.0), "no hinted draft went unsent"
    # one row, the whole block: every replaced draft is verified while its row decodes, so the
    # result counts all that take_hints replaced (shortened or batched runs count fewer: unsent drafts)
    before, counted = spy.taken, 0
    for p in prompts:
        counted += generate(tiny_qwen3, d, [p], DecodeOptions(mode="dflow", max_new_tokens=max_new, stop_token_ids=(), hint_trust=1.0)).hints_taken
    assert counted == spy.taken - before > 0


def test_single_row_equals_batched(tiny_qwen3):
    """Rows of one batch accept different lengths in the same round; each equals its own single-row decode."""
    prompts = chat_prompts(tiny_qwen3, 4)
    ar_long = [generate(tiny_qwen3, None, [p], DecodeOptions(mode="ar", max_new_tokens=28, stop_token_ids=())).token_ids[0] for p in prompts]
    seqs = [p + a for p, a in zip(prompts, ar_long)]
    real = TorchDrafter(varied_drafter(tiny_qwen3, flow=True, block_size=4))
    batched = generate(tiny_qwen3, PartlyRight(real, seqs), prompts, DecodeOptions(mode="dflow", max_new_tokens=20, stop_token_ids=()))
    single = [generate(tiny_qwen3, PartlyRight(real, [s], seed=b), [p], DecodeOptions(mode="dflow", max_new_tokens=20, stop_token_ids=())).token_ids[0]
              for b, (s, p) in enumerate(zip(seqs, prompts))]
    _same(tiny_qwen3, prompts, batched.token_ids, single, 20)
    _assert_paths(batched, 4, "batched")
    # some round committed different lengths in different rows (the batch is not in lockstep)
    assert any(len({row[r] for row in batched.acceptance_lengths if r < len(row)}) > 1 for r in range(batched.rounds))


def test_stop_tokens_and_max_new_tokens(tiny_qwen3):
    p = chat_prompts(tiny_qwen3, 1)
    ar = generate(tiny_qwen3, None, p, DecodeOptions(mode="ar", max_new_tokens=30, stop_token_ids=())).token_ids[0]
    stop = ar[7]
    first = ar.index(stop)
    d = TorchDrafter(varied_drafter(tiny_qwen3, flow=True, block_size=8))
    for mode, dr in (("ar", None), ("dflow", d), ("dflow", OracleDrafter([p[0] + ar], 8))):
        res = generate(tiny_qwen3, dr, p, DecodeOptions(mode=mode, max_new_tokens=30, stop_token_ids=(stop,)))
        assert res.token_ids[0] == ar[: first + 1] and res.finish_reasons == ["stop"]
        res = generate(tiny_qwen3, dr, p, DecodeOptions(mode=mode, max_new_tokens=5, stop_token_ids=()))
        assert res.token_ids[0] == ar[:5] and res.finish_reasons == ["length"]
        if isinstance(dr, OracleDrafter):  # the cut falls inside the first round's full block
            assert res.rounds == 1 and res.acceptance_lengths == [[8]]


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
    seqs = [p + a for p, a in zip(prompts, ar_long)]
    real = TorchDrafter(varied_drafter(tiny_qwen3, flow=True, block_size=S))
    for inner in (PartlyRight(real, seqs), OracleDrafter(seqs, S)):
        for mode in ("dflash", "dflow"):
            d = _Unsure(inner)
            res = generate(tiny_qwen3, d, prompts, DecodeOptions(mode=mode, max_new_tokens=max_new, stop_token_ids=(), verify_threshold=0.5))
            _same(tiny_qwen3, prompts, res.token_ids, ar, max_new, (type(inner).__name__, mode, S))
            n_rounds = sum(len(a) for a in res.acceptance_lengths)
            assert n_rounds <= res.verified_drafts < n_rounds * (S - 1)  # shortened, never empty
            if isinstance(inner, OracleDrafter):  # every sent draft is right: a = sent + 1 each round
                assert res.verified_drafts == sum(a - 1 for row in res.acceptance_lengths for a in row)
                assert 1 < res.tau < S
            else:
                _assert_paths(res, S, ("shortened", mode, S), partial=S > 4)
            if mode == "dflow":
                assert d.flow_sizes and all(n == S for n in d.flow_sizes)  # flow always covers a whole next block
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
