"""The exported graphs compute what the PyTorch modules compute, on random and real inputs."""

import numpy as np
import pytest
import torch

from conftest import PROMPTS_TEXT, chat_ids
from onnx_cache import exported_drafter, exported_target
from dflow_trt.backends.onnxruntime import OrtDrafter, OrtTarget
from dflow_trt.decoding.interfaces import FlowState
from dflow_trt.decoding.loop import pad_left
from dflow_trt.decoding.sampling import SamplingParams
from dflow_trt.drafter.runtime import TorchDrafter
from dflow_trt.export import onnx_drafter, onnx_target


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


def _session(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_target_graph_random_inputs(tiny_qwen3):
    sess = _session(exported_target(tiny_qwen3) / onnx_target.GRAPH)
    graph = onnx_target.TargetGraph(tiny_qwen3.model, tiny_qwen3.info.tap_layers)
    names, _ = onnx_target.io_names(tiny_qwen3.info.num_layers)
    for B, S, P in [(1, 1, 1), (3, 5, 2), (2, 16, 40)]:  # batch, block and past all dynamic
        inputs = onnx_target.example_inputs(tiny_qwen3.model, B, S, P)
        with torch.no_grad():
            ref = [r.numpy() for r in graph(*inputs)]
        got = sess.run(None, {n: x.numpy() for n, x in zip(names, inputs)})
        assert got[0].shape == (B, S, tiny_qwen3.info.vocab_size) and got[2].shape[2] == P + S
        np.testing.assert_allclose(got[0], ref[0], atol=1e-4, rtol=1e-4)  # logits: tight
        assert rel_err(got[1], ref[1]) < 1e-5  # taps: relative
        for g, r in zip(got[2:], ref[2:]):
            assert rel_err(g, r) < 1e-5


def _compare(a, b, rows_valid):
    """TargetOutputs a (torch) and b (ORT) over the positions rows_valid [B, S] marks."""
    m = rows_valid
    np.testing.assert_allclose(b.logits[m].numpy(), a.logits[m].numpy(), atol=2e-4, rtol=1e-4)
    assert rel_err(b.taps[m], a.taps[m]) < 1e-5


def test_target_real_prompts_prefill_verify_commit(tiny_qwen3):
    """Left-padded real prompts, then blocks committed to different lengths per row (holes in the cache)."""
    ort_t = OrtTarget(exported_target(tiny_qwen3))
    assert ort_t.info == tiny_qwen3.info
    ids, lens = pad_left([chat_ids(tiny_qwen3, t) for t in PROMPTS_TEXT[:3]], pad_id=0)
    ca, a = tiny_qwen3.prefill(ids, lens)
    cb, b = ort_t.prefill(ids, lens)
    _compare(a, b, ca.valid)
    g = torch.Generator().manual_seed(0)
    for S, kept in [(4, [1, 4, 2]), (8, [8, 1, 3]), (1, [1, 1, 1])]:
        block = torch.randint(0, tiny_qwen3.info.vocab_size, (3, S), generator=g)
        a, b = tiny_qwen3.verify(ca, block), ort_t.verify(cb, block)
        _compare(a, b, torch.ones(3, S, dtype=torch.bool))
        tiny_qwen3.commit(ca, torch.tensor(kept)), ort_t.commit(cb, torch.tensor(kept))
        assert torch.equal(ca.valid, cb.valid) and torch.equal(ca.next_pos, cb.next_pos)
        assert cb.kv[0].shape[2] == ca.valid.shape[1]


@pytest.mark.parametrize("flow", [False, True])
def test_drafter_graph_random_inputs(tiny_qwen3, flow):
    model, folder = exported_drafter(tiny_qwen3, flow, num_layers=2 if flow else 1)
    sess = _session(folder / onnx_drafter.GRAPH)
    graph = onnx_drafter.DrafterGraph(model)
    names, _ = onnx_drafter.io_names(model.config.num_layers, flow)
    for B, N, C, S in [(1, 1, 1, 2), (3, 5, 2, 4), (2, 30, 9, 16)]:
        inputs = onnx_drafter.example_inputs(model, B, N, C, S)
        with torch.no_grad():
            ref = [r.numpy() for r in graph(*inputs)]
        got = sess.run(None, {n: x.numpy() for n, x in zip(names, inputs)})
        assert got[0].shape == (B, S - 1, tiny_qwen3.info.vocab_size)
        np.testing.assert_allclose(got[0], ref[0], atol=1e-4, rtol=1e-4)
        for g, r in zip(got[1:], ref[1:]):
            assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("flow", [False, True])
def test_drafter_rounds_match_torch_drafter(tiny_qwen3, flow):
    """Several rounds of ragged context appends, with and without flow: same drafts, close logits."""
    model, folder = exported_drafter(tiny_qwen3, flow, num_layers=2 if flow else 1)
    td, od = TorchDrafter(model), OrtDrafter(folder)
    od.check_target(tiny_qwen3.info)
    B, F, V = 3, model.config.feature_size, tiny_qwen3.info.vocab_size
    g = torch.Generator().manual_seed(1)
    sa, sb = td.new_state(B, block_size=6), od.new_state(B, block_size=6)
    lens = torch.zeros(B, dtype=torch.long)
    for r, new in enumerate([[5, 9, 1], [1, 6, 3], [6, 1, 2], [2, 2, 6]]):
        n = torch.tensor(new)
        taps = torch.randn(B, int(n.max()), F, generator=g) * 3
        anchor = torch.randint(0, V, (B,), generator=g)
        flow_state = None
        if flow and r > 0:
            valid = torch.arange(6)[None] < torch.tensor([[3], [0], [5]])
            flow_state = FlowState(taps=torch.randn(B, 6, F, generator=g) * valid[..., None],
                                   token_ids=torch.randint(0, V, (B, 6), generator=g) * valid,
                                   hint_ids=torch.randint(0, V, (B, 6), generator=g) * valid, valid=valid)
        lens = lens + n
        pa = td.draft(sa, taps, n, anchor, lens, flow_state, SamplingParams())
        pb = od.draft(sb, taps, n, anchor, lens, flow_state, SamplingParams())
        assert torch.equal(pa.draft_ids, pb.draft_ids), r
        pa = td.draft(sa, taps[:, :0], torch.zeros(B, dtype=torch.long), anchor, lens, flow_state,
                      SamplingParams(temperature=1.0))
        pb = od.draft(sb, taps[:, :0], torch.zeros(B, dtype=torch.long), anchor, lens, flow_state,
                      SamplingParams(temperature=1.0))
        np.testing.assert_allclose(pb.draft_probs.numpy(), pa.draft_probs.numpy(), atol=1e-5)
    assert torch.equal(sa.lens, sb.lens)
    for ka, kb in zip(sa.k, sb.k):
        C = int(lens.max())
        assert rel_err(kb[:, :, :C], ka[:, :, :C].numpy()) < 1e-5
