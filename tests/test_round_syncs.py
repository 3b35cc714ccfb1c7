"""The loop's host syncs, counted: one per round (the transcript's), plus one where a policy decides
the verified block's shape on the host. On a GPU each is a stall of the whole pipeline."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from conftest import chat_prompts
from dflow_trt.decoding.loop import generate
from dflow_trt.decoding.options import DecodeOptions, preset
from dflow_trt.drafter.defaults import build_drafter, untrained_config
from dflow_trt.drafter.runtime import TorchDrafter

DECODING = os.path.join("dflow_trt", "decoding") + os.sep
READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy")


class SyncCounter:
    """Counts tensor-to-host reads made from code under dflow_trt/decoding/ (the loop's own)."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in READS:
            real = getattr(torch.Tensor, name)

            def read(t, *a, _real=real, **k):
                if DECODING in sys._getframe(1).f_code.co_filename:
                    self.count += 1
                return _real(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, read)


@pytest.mark.parametrize("mode", ["ar", "dflash", "dflow"])
@pytest.mark.parametrize("setting", ["whole-block", "cpu"])
def test_one_host_sync_per_round(tiny_qwen3, monkeypatch, mode, setting):
    prompts = chat_prompts(tiny_qwen3, 3)
    model = build_drafter(tiny_qwen3, untrained_config(tiny_qwen3, flow=True, block_size=8), seed=0)
    options = preset(setting, mode=mode, max_new_tokens=24, stop_token_ids=(),
                     hint_trust=0.0 if setting == "whole-block" else 1.0)
    drafter = TorchDrafter(model) if mode != "ar" else None
    counter = SyncCounter(monkeypatch)
    res = generate(tiny_qwen3, drafter, prompts, options)
    assert res.rounds >= 3
    shaped = setting == "cpu" and mode != "ar"  # the policy reads the block's length on the host
    assert counter.count == 1 + res.rounds * (2 if shaped else 1), (counter.count, res.rounds)


def test_counter_sees_a_sync(tiny_qwen3, monkeypatch):
    """The counter is not blind: an extra read planted in the loop is counted."""
    import dflow_trt.decoding.loop as loop

    real, planted = loop.judge, {}
    exec(compile("def read(t):\n    return t.tolist()\n", DECODING + "planted.py", "exec"), planted)

    def judge_and_read(plan, logits, sampling, gen):
        v = real(plan, logits, sampling, gen)
        planted["read"](v.num_accepted)  # as if the loop read it
        return v

    monkeypatch.setattr(loop, "judge", judge_and_read)
    counter = SyncCounter(monkeypatch)
    res = generate(tiny_qwen3, None, chat_prompts(tiny_qwen3, 2), DecodeOptions(mode="ar", max_new_tokens=6))
    assert counter.count == 1 + 2 * res.rounds
