"""The `target` model's KV sessions (TargetService) on their own: equal outputs, errors, eviction."""

import numpy as np
import pytest
import torch

from dflow_trt.errors import UserError
from dflow_trt.serving.bls import TargetService


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
    with pytest.raises(UserError, match="1 target sessions are open"):
        svc.session("prefill", "b", _prefill_inputs([[1, 2]]))
    with pytest.raises(UserError, match="unknown target op"):
        svc.session("rewind", "a", {})
    with pytest.raises(UserError, match="outside the vocabulary"):
        svc.session("verify", "a", {"input_ids": np.array([[10**6]])})
    svc.idle_s = 0.0  # a caller that vanished: its session goes at the next call
    svc.session("release", "zzz", {})
    assert svc.active_sessions == 0
