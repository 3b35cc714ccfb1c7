"""The PyTorch drafter's shortcuts under a verify threshold change no draft the loop can verify."""

import pytest
import torch

from conftest import PROMPTS_TEXT, chat_ids
from dflow_trt.decoding.flow import carry_flow
from dflow_trt.decoding.policy import verify_lengths
from dflow_trt.decoding.sampling import SamplingParams
from dflow_trt.drafter.defaults import load_target_and_drafter
from dflow_trt.drafter.runtime import TorchDrafter, draft_spans


@pytest.mark.parametrize("S", [2, 3, 5, 8, 9, 16, 17, 40])
def test_draft_spans_cover_the_block_in_order(S):
    spans = draft_spans(S, 0.05)
    assert spans[0][0] == 1 and spans[-1][1] == S
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(hi - lo >= min(4, S - 1) for lo, hi in spans)  # attention differs in the last bit under 4 queries
    assert draft_spans(S, 0.0) == [(1, S)]


def _drafts(mode, threshold, batch=2):
    """One drafting round after a prefill (and a carried flow for dflow) on tiny-qwen3."""
    target, model = load_target_and_drafter("tiny-qwen3", None, mode, warn=lambda m: None)
    torch.manual_seed(0)
    for p in model.parameters():  # a drafter sure enough of itself that some rounds go past one span
        p.data.normal_(0, 0.3)
    ids = [chat_ids(target, t) for t in PROMPTS_TEXT[:batch]]
    n = min(map(len, ids))
    ids = torch.tensor([p[:n] for p in ids])
    cache, out = target.prefill(ids, torch.full((batch,), n))
    d = TorchDrafter(model)
    flow = None
    if mode == "dflow":  # as if the last round verified 16 positions and accepted 2 (row 0) / 5 (row 1)
        block = torch.randint(0, target.info.vocab_size, (batch, 16))
        taps = torch.randn(batch, 16, out.taps.shape[-1])
        flow = carry_flow(block, taps, block.roll(1, 1), torch.tensor([2, 5][:batch]))
    st = d.new_state(batch, block_size=16)
    return d.draft(st, out.taps, torch.full((batch,), n), ids[:, -1], torch.full((batch,), n), flow,
                   SamplingParams(), threshold)


@pytest.mark.parametrize("mode", ["dflash", "dflow"])
def test_threshold_drafts_equal_the_whole_blocks_where_verified(mode):
    full = _drafts(mode, 0.0)
    assert full.draft_ids.shape == (2, 15)
    for threshold in (0.9, 0.05, 1e-6, 1e-30):
        short = _drafts(mode, threshold)
        K = short.draft_ids.shape[1]
        assert K in [hi - 1 for _, hi in draft_spans(16, threshold)]
        assert torch.equal(short.draft_ids, full.draft_ids[:, :K]) and torch.equal(short.confidence, full.confidence[:, :K])
        n = verify_lengths(full.confidence, threshold)
        assert torch.equal(verify_lengths(short.confidence, threshold), n)  # the loop verifies the same drafts
        assert int(n.max()) <= K
        if K < 15:  # stopped early: no row would have verified the next span
            assert (full.confidence.float().cumprod(-1)[:, K - 1] < threshold).all()
    assert _drafts(mode, 1e-30).draft_ids.shape[1] == 15  # nothing falls that low: every span drafted


def test_flow_rows_skip_only_slots_without_flow():
    target, model = load_target_and_drafter("tiny-qwen3", None, "dflow", warn=lambda m: None)
    torch.manual_seed(1)
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    block = torch.randint(0, target.info.vocab_size, (3, 16))
    taps = torch.randn(3, 16, model.config.feature_size)
    flow = carry_flow(block, taps, block.roll(1, 1), torch.tensor([12, 9, 15]))  # valid slots: 3, 6, 0
    ids = torch.randint(0, target.info.vocab_size, (3, 16))
    with torch.inference_mode():
        assert torch.equal(model.block_inputs(ids, flow, 6), model.block_inputs(ids, flow))
        assert not torch.equal(model.block_inputs(ids, flow, 2), model.block_inputs(ids, flow))  # row 1 has 6
        none = carry_flow(block, taps, block.roll(1, 1), torch.tensor([15, 15, 15]))  # all accepted: no flow
        assert torch.equal(model.block_inputs(ids, none, 0), model.block_inputs(ids, none))
