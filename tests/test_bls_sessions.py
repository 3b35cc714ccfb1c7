"""The `target` model's KV sessions (TargetService) on their own: equal outputs, errors, eviction."""

import numpy as np
import pytest
import torch

from dflow_trt.errors import UserError
from dflow_trt.serving.bls import TargetService
from dflow_trt.serving.requests import Busy
from dflow_trt.serving.sessions import ServiceLimits


def _prefill_inputs(rows):
    T = max(map(len, rows))
    ids = np.zeros((len(rows), T), np.int64)
    for b, r in enumerate(rows):
        ids[b, T - len(r):] = r
    return {"input_ids": ids, "prompt_lens": np.array([len(r) for r in rows]), "num_last": np.array([T], np.int32)}


def test_session_verify_equals_full_recompute(tiny_qwen3):
    svc = TargetService(tiny_qwen3)
    rows = [[5, 6, 7, 8, 9], [11, 12, 13]]
    out = svc.session("prefill", "a", _prefill_inputs(rows))
    assert out["logits"].shape[:2] == (2, 5) and svc.active_sessions == 1
    block = np.array([[40, 41, 42], [50, 51, 52]], np.int64)
    v = svc.session("verify", "a", {"input_ids": block})
    full_l, full_t = svc.forward(**{k: v_ for k, v_ in _prefill_inputs([r + b for r, b in zip(rows, block.tolist())]).items()
                                    if k != "num_last"}, num_last=3)
    torch.testing.assert_close(torch.from_numpy(v["logits"]), torch.from_numpy(full_l), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.from_numpy(v["hidden_states"]), torch.from_numpy(full_t), atol=1e-4, rtol=1e-4)
    # keep 2 of row 0's block, 1 of row 1's; the next verify continues from there
    svc.session("commit", "a", {"num_kept": np.array([2, 1])})
    nxt = np.array([[60, 61], [70, 71]], np.int64)
    v2 = svc.session("verify", "a", {"input_ids": nxt})
    kept = [rows[0] + [40, 41], rows[1] + [50]]
    ref_l, _ = svc.forward(**{k: x for k, x in _prefill_inputs([r + n for r, n in zip(kept, nxt.tolist())]).items()
                              if k != "num_last"}, num_last=2)
    torch.testing.assert_close(torch.from_numpy(v2["logits"]), torch.from_numpy(ref_l), atol=1e-4, rtol=1e-4)
    svc.session("release", "a", {})
    assert svc.active_sessions == 0


def test_session_errors_and_eviction(tiny_qwen3):
    svc = TargetService(tiny_qwen3, max_sessions=1, idle_s=3600)
    with pytest.raises(UserError, match="no target session 'x'"):
        svc.session("verify", "x", {"input_ids": np.array([[1]])})
    svc.session("prefill", "a", _prefill_inputs([[1, 2]]))
    with pytest.raises(UserError, match="already exists"):
        svc.session("prefill", "a", _prefill_inputs([[1, 2]]))
    with pytest.raises(Busy, match="all 1 target sessions are busy"):
        svc.session("prefill", "b", _prefill_inputs([[1, 2]]))
    with pytest.raises(UserError, match="unknown target op"):
        svc.session("rewind", "a", {})
    with pytest.raises(UserError, match="outside the vocabulary"):
        svc.session("verify", "a", {"input_ids": np.array([[10**6]])})
    svc.idle_s = 0.0  # a caller that vanished: its session goes at the next call
    svc.session("release", "zzz", {})
    assert svc.active_sessions == 0


def test_refused_verify_and_commit_leave_the_session_usable(tiny_qwen3):
    """Every malformed verify or commit is refused before the cache changes; the same session then
    verifies exactly as a fresh one (the logits of a full recompute)."""
    svc = TargetService(tiny_qwen3)
    svc.session("prefill", "a", _prefill_inputs([[5, 6, 7]]))
    with pytest.raises(UserError, match="nothing to commit"):
        svc.session("commit", "a", {"num_kept": np.array([1])})
    for bad in (np.array([[1, 2]] * 2), np.zeros((1, 0), np.int64), np.zeros((1, 65), np.int64), np.array([1, 2])):
        with pytest.raises(UserError, match="verify needs input_ids"):
            svc.session("verify", "a", {"input_ids": bad})
    block = np.array([[40, 41, 42]], np.int64)
    svc.session("verify", "a", {"input_ids": block})
    with pytest.raises(UserError, match="awaiting commit"):
        svc.session("verify", "a", {"input_ids": block})
    for kept in ([0], [4], [1, 1], [], [-3]):
        with pytest.raises(UserError, match="num_kept needs 1 values in 1..3"):
            svc.session("commit", "a", {"num_kept": np.array(kept, np.int64)})
    with pytest.raises(UserError, match="path needs"):
        svc.session("commit", "a", {"num_kept": np.array([2]), "path": np.array([[0, 1, 7]])})
    svc.session("commit", "a", {"num_kept": np.array([2])})
    nxt = np.array([[60, 61]], np.int64)
    got = svc.session("verify", "a", {"input_ids": nxt})
    ref, _ = svc.forward(np.array([[5, 6, 7, 40, 41, 60, 61]]), np.array([7]), 2)
    torch.testing.assert_close(torch.from_numpy(got["logits"]), torch.from_numpy(ref), atol=1e-4, rtol=1e-4)


def test_session_key_budget_and_response_bounds(tiny_qwen3):
    svc = TargetService(tiny_qwen3, max_sessions=2, session_key="k3y", limits=ServiceLimits(max_response_bytes=2**20))
    op = {"op": np.array([b"prefill"], dtype=object), "session_id": np.array([b"s"], dtype=object),
          **_prefill_inputs([[1, 2]])}
    for key in (None, b"wrong"):
        x = dict(op) if key is None else {**op, "session_key": np.array([key], dtype=object)}
        with pytest.raises(UserError, match="internal to the dflow_bls model"):
            svc.session_request(x)
    assert svc.active_sessions == 0
    good = {**op, "session_key": np.array([b"k3y"], dtype=object)}
    svc.session_request(good)
    svc.session_request({**good, "session_id": np.array([b"t"], dtype=object)})
    with pytest.raises(Busy, match="all 2 target sessions are busy"):
        svc.session_request({**good, "session_id": np.array([b"u"], dtype=object)})
    # 1000 positions of a 260-token vocabulary: ~1 MiB of logits, over this service's 1 MiB
    with pytest.raises(UserError, match=r"this prefill would return 1\.\d MiB, more than the limit of 1 MiB"):
        svc.forward(np.ones((1, 1000), np.int64), np.array([1000]), 1000)
    logits, taps = svc.forward(np.ones((1, 1000), np.int64), np.array([1000]), 1000, num_logits=1)
    assert logits.shape == (1, 1, 260) and taps.shape[1] == 1000
    with pytest.raises(UserError, match="1..8 rows"):
        svc.forward(np.ones((9, 2), np.int64), np.full(9, 2), 1)
    with pytest.raises(UserError, match="the target's context"):
        svc.forward(np.ones((1, 4097), np.int64), np.array([4097]), 1, num_logits=1)
