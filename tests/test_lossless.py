"""Every decoding path equals plain greedy decoding of the target, token for token."""

import pytest
import torch

from conftest import PROMPTS_TEXT, OracleDrafter, chat_ids
from dflow_trt.decoding.loop import generate
from dflow_trt.drafter.defaults import untrained_config
from dflow_trt.drafter.io import build_drafter
from dflow_trt.drafter.runtime import TorchDrafter

BLOCKS = (2, 4, 8, 16)


def _prompts(target, n=8):
    return [chat_ids(target, t) for t in PROMPTS_TEXT[:n]]


def _check_target(target, max_new, blocks=BLOCKS):
    prompts = _prompts(target)
    # the reference runs a block past max_new so the oracle can propose full blocks to the end
    ar_long = [generate(target, None, [p], "ar", max_new + 16, stop_token_ids=()).token_ids[0] for p in prompts]
    ar = [a[:max_new] for a in ar_long]
    # the ar path itself equals transformers' own greedy generate
    ref = target.model.generate(torch.tensor([prompts[0]]), max_new_tokens=max_new, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    assert ref[0, len(prompts[0]):].tolist() == ar[0]
    seqs = [p + a for p, a in zip(prompts, ar_long)]
    for flow in (False, True):
        untrained = build_drafter(target, untrained_config(target, flow=flow, block_size=16, num_layers=1))
        for S in blocks:
            modes = ("dflash", "dflow") if flow else ("dflash",)
            for mode in modes:
                # worst case: seeded untrained drafter, nearly every draft rejected; all rows in one batch
                res = generate(target, TorchDrafter(untrained, S), prompts, mode, max_new, stop_token_ids=())
                assert res.token_ids == ar, (mode, S, flow)
                # best case: drafts are the target's own continuation; full blocks accepted
                oracle = OracleDrafter(seqs, S)
                res = generate(target, oracle, prompts, mode, max_new, stop_token_ids=())
                assert res.token_ids == ar, ("oracle", mode, S)
                assert res.tau == S
                if mode == "dflow":
                    assert all(f is None or not f.valid.any() for f in oracle.flows), "full acceptance carries no flow"


def test_tiny_qwen3_lossless(tiny_qwen3):
    _check_target(tiny_qwen3, max_new=40)


def test_tiny_llama_lossless(tiny_llama):
    _check_target(tiny_llama, max_new=40, blocks=(2, 8))


def test_single_row_equals_batched(tiny_qwen3):
    prompts = _prompts(tiny_qwen3, 4)
    d = TorchDrafter(build_drafter(tiny_qwen3, untrained_config(tiny_qwen3, flow=True, block_size=4)))
    batched = generate(tiny_qwen3, d, prompts, "dflow", 20, stop_token_ids=())
    single = [generate(tiny_qwen3, d, [p], "dflow", 20, stop_token_ids=()).token_ids[0] for p in prompts]
    assert batched.token_ids == single


def test_stop_tokens_and_max_new_tokens(tiny_qwen3):
    p = _prompts(tiny_qwen3, 1)
    ar = generate(tiny_qwen3, None, p, "ar", 30, stop_token_ids=()).token_ids[0]
    stop = ar[7]
    first = ar.index(stop)
    d = TorchDrafter(build_drafter(tiny_qwen3, untrained_config(tiny_qwen3, flow=True, block_size=8)))
    for mode, dr in (("ar", None), ("dflow", d), ("dflow", OracleDrafter([p[0] + ar], 8))):
        res = generate(tiny_qwen3, dr, p, mode, 30, stop_token_ids=(stop,))
        assert res.token_ids[0] == ar[: first + 1] and res.finish_reasons == ["stop"]
        res = generate(tiny_qwen3, dr, p, mode, 5, stop_token_ids=())
        assert res.token_ids[0] == ar[:5] and res.finish_reasons == ["length"]


@pytest.mark.slow
def test_smollm2_lossless(smollm2):
    _check_target(smollm2, max_new=24)
