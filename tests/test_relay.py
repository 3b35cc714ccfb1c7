"""The relay as one pure function (`drafter/relay.py`): it is what `DFlowDrafter.block_inputs`
computed inline before (bit for bit), and what the TensorRT-LLM plug-in computes from the tensors
DFlash's worker holds after a real verify."""

import functools

import pytest
import torch
import torch.nn.functional as F

from dflow_trt.backends.trtllm_dflow.relay_io import (
    engine_flow,
    load_flow_branch,
    save_flow_branch,
)
from dflow_trt.decoding.flow import carry_flow
from dflow_trt.decoding.interfaces import FlowState
from dflow_trt.drafter.config import DrafterConfig
from dflow_trt.drafter.io import build_drafter
from dflow_trt.drafter.relay import relay


@pytest.fixture(scope="module")
def drafter(tiny_qwen3):
    cfg = DrafterConfig.for_target(tiny_qwen3.info, mask_token_id=3, block_size=6, num_layers=1, num_heads=4,
                                   num_kv_heads=2, head_dim=16, intermediate_size=64)
    d = build_drafter(tiny_qwen3, cfg, seed=0).eval()
    with torch.no_grad():  # the defaults (zeros, a unit gate) would hide a dropped or swapped term
        for p in (d.flow_present, d.no_flow, d.hint_gate, d.flow_norm.weight):
            p.normal_()
    return d


def inline_block_inputs(d, block_ids, flow, rows=None):
    """The arithmetic `block_inputs` held inline before the relay moved out (the reference)."""
    x = F.embedding(block_ids, d.embed_weight)
    m = flow.valid[..., None].to(x.dtype)
    n = x.shape[1] if rows is None else rows
    state = d.flow_norm(d.flow_proj(flow.taps[:, :n].to(d.flow_proj.weight.dtype))) + d.flow_tok_proj(
        F.embedding(flow.token_ids[:, :n], d.embed_weight))
    if n < x.shape[1]:
        state = torch.cat([state, state.new_zeros(state.shape[0], x.shape[1] - n, state.shape[2])], 1)
    hint = F.embedding(flow.hint_ids, d.embed_weight) * m
    hint = torch.cat([torch.zeros_like(hint[:, :1]), hint[:, :-1]], 1)
    return x + m * (state + d.flow_present) + (1 - m) * d.no_flow + d.hint_gate * hint


def random_flow(d, B, Q, prefix, seed):
    g = torch.Generator().manual_seed(seed)
    V, Fs = d.config.target.vocab_size, d.config.feature_size
    valid = torch.arange(Q)[None, :] < torch.tensor(prefix)[:, None]  # [B, Q] per-row prefixes
    valid[0, 0] = False  # and a hole: validity need not be a prefix for the arithmetic
    taps = torch.randn(B, Q, Fs, generator=g) * valid[..., None]
    tok = torch.randint(0, V, (B, Q), generator=g) * valid
    hint = torch.randint(0, V, (B, Q), generator=g) * valid
    return FlowState(taps=taps, token_ids=tok, hint_ids=hint, valid=valid)


@torch.no_grad()
@pytest.mark.parametrize("rows", [None, 4])
def test_relay_is_the_former_inline_arithmetic_bit_for_bit(drafter, rows):
    B, Q = 3, 6
    flow = random_flow(drafter, B, Q, prefix=[4, 0, 2], seed=1)
    ids = torch.randint(0, drafter.config.target.vocab_size, (B, Q), generator=torch.Generator().manual_seed(2))
    ref = inline_block_inputs(drafter, ids, flow, rows)
    got = drafter.block_inputs(ids, flow, rows)
    direct = relay(F.embedding(ids, drafter.embed_weight), flow.taps, flow.token_ids, flow.hint_ids, flow.valid,
                   drafter.flow_params(), rows)
    assert torch.equal(got, ref) and torch.equal(direct, ref)
    # the flow actually moved the rows it covers, and row 1 (no flow) got exactly `no_flow`, no hint
    x = F.embedding(ids, drafter.embed_weight)
    assert not torch.allclose(got[0, 1], x[0, 1] + drafter.no_flow)
    assert torch.allclose(got[1], x[1] + drafter.no_flow)


def greedy_accepted(drafts, target_ids):
    """Drafts accepted per row under greedy verification: [B, S-1] drafts vs [B, S] argmax -> [B]."""
    return torch.cumprod((drafts == target_ids[:, :-1]).long(), 1).sum(1)


@torch.no_grad()
def test_engine_path_equals_carry_flow_and_block_inputs_after_a_real_verify(drafter, tiny_qwen3, tmp_path):
    t, S = tiny_qwen3, drafter.config.block_size
    prompt = torch.tensor([[5, 17, 42, 8, 99, 23]] * 2)
    lens = torch.tensor([6, 6])

    def verify(drafts):
        cache, pre = t.prefill(prompt, lens)
        anchor = pre.logits[:, -1].argmax(-1)  # [B]
        block = torch.cat([anchor[:, None], drafts], 1)  # [B, S]
        return block, t.verify(cache, block)

    rand = torch.randint(100, 200, (2, S - 1), generator=torch.Generator().manual_seed(3))
    block, out = verify(rand)
    first = out.logits[:, 0].argmax(-1)
    drafts = rand.clone()
    drafts[0, 0] = first[0]  # row 0 accepts at least one draft, row 1 (most likely) none
    block, out = verify(drafts)
    target = out.logits.argmax(-1)  # [B, S]
    a = greedy_accepted(drafts, target)
    assert a[0] >= 1 and a[1] < a[0]

    # our loop: carry_flow over the verified block, then block_inputs of the next block
    flow = carry_flow(block, out.taps, target, a)
    next_ids = torch.full((2, S), drafter.config.mask_token_id)
    next_ids[:, 0] = target.gather(1, a[:, None]).squeeze(1)  # the bonus token anchors the next block
    ours = drafter.block_inputs(next_ids, flow)

    # the plug-in: DFlash's flat, request-major tensors, its count (drafts + 1), the shipped flow file
    eflow = engine_flow(block.reshape(-1), out.taps.reshape(2 * S, -1), target, a + 1, S, S)
    branch = load_flow_branch(save_flow_branch(drafter, tmp_path))
    embed = functools.partial(F.embedding, weight=drafter.embed_weight)
    theirs = relay(embed(next_ids), eflow.taps, eflow.token_ids, eflow.hint_ids, eflow.valid, branch.params(embed))
    assert eflow.valid.any() and not eflow.valid.all()
    assert torch.equal(eflow.valid, flow.valid) and torch.equal(eflow.token_ids, flow.token_ids)
    assert torch.equal(theirs, ours)

    # a request whose last step was its prefill verified placeholders: no flow, exactly as flow=None
    none = engine_flow(block.reshape(-1), out.taps.reshape(2 * S, -1), target, a + 1, S, S,
                       eligible=torch.tensor([True, False]))
    masked = relay(embed(next_ids), none.taps, none.token_ids, none.hint_ids, none.valid, branch.params(embed))
    assert torch.equal(masked[0], ours[0])
    assert torch.equal(masked[1], drafter.block_inputs(next_ids, None)[1])
