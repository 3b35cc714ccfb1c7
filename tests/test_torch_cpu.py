"""oneDNN-packed linear layers for CPU decoding: same numbers, same parameters, still lossless."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import chat_prompts
from dflow_trt import kernels as torch_cpu
from dflow_trt.decoding.loop import generate
from dflow_trt.decoding.options import DecodeOptions
from dflow_trt.drafter.defaults import load_target_and_drafter
from dflow_trt.drafter.runtime import TorchDrafter

pytestmark = pytest.mark.skipif(not torch_cpu.available(), reason="this PyTorch build has no oneDNN")


def _packed_copy(lin: nn.Linear) -> nn.Linear:
    p = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
    p.load_state_dict(lin.state_dict())
    assert torch_cpu.pack_linears(p) == 1 and type(p) is torch_cpu.PackedLinear
    return p


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_and_rows_are_independent(bias):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=bias)
    p = _packed_copy(lin)
    x = torch.randn(2, 7, 64)
    with torch.inference_mode():
        assert p._packed is None
        out = p(x)
        assert p._packed is not None  # this call went through the packed weight
        torch.testing.assert_close(out, lin(x), rtol=1e-5, atol=1e-5)
        # a row's result does not depend on how many rows share the call (verify vs ar)
        torch.testing.assert_close(p(x[:1, :1]), out[:1, :1], rtol=0, atol=1e-6)


def test_packed_linear_trains_and_repacks_after_updates():
    torch.manual_seed(0)
    lin = nn.Linear(32, 16)
    p = _packed_copy(lin)
    x = torch.randn(5, 32)
    with torch.inference_mode():
        p(x)  # packs
    p(x).square().sum().backward()  # autograd takes the plain path
    lin(x).square().sum().backward()
    torch.testing.assert_close(p.weight.grad, lin.weight.grad)
    with torch.no_grad():
        for m in (p, lin):
            m.weight.add_(0.5)  # an optimizer step, in place
    with torch.inference_mode():
        torch.testing.assert_close(p(x), lin(x), rtol=1e-5, atol=1e-5)  # not the stale packed weight
    p.weight = lin.weight = nn.Parameter(torch.randn(16, 32))  # another tensor altogether
    with torch.inference_mode():
        torch.testing.assert_close(p(x), lin(x), rtol=1e-5, atol=1e-5)
        copied = copy.deepcopy(p)  # the opaque packed weight is not copied, and is remade on use
        assert copied._packed is None
        torch.testing.assert_close(copied(x), lin(x), rtol=1e-5, atol=1e-5)


def test_pack_linears_keeps_parameters_ties_and_outputs(tiny_qwen3):
    from dflow_trt.targets import load_target

    t = load_target("tiny-qwen3", num_taps=3)  # a fresh copy: the session fixture stays plain
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    n_linear = sum(type(m) is nn.Linear for m in t.model.modules())
    ids = torch.randint(0, t.info.vocab_size, (2, 9))
    lens = torch.tensor([9, 6])
    _, plain = t.prefill(ids, lens)
    assert torch_cpu.pack_linears(t.model) == n_linear > 0
    assert torch_cpu.pack_linears(t.model) == 0  # idempotent
    after = t.model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    if t.model.config.tie_word_embeddings:
        assert t.model.get_output_embeddings().weight is t.model.get_input_embeddings().weight
    _, packed = t.prefill(ids, lens)
    torch.testing.assert_close(packed.logits, plain.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed.taps, plain.taps, rtol=1e-4, atol=1e-4)
    assert torch_cpu.unpack_linears(t.model) == n_linear
    assert not any(type(m) is torch_cpu.PackedLinear for m in t.model.modules())


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama"])
def test_grouped_attention_matches_sdpa(name, monkeypatch):
    """Padded rows and multi-token verifies (where a mask is present) give transformers' SDPA numbers."""
    from dflow_trt.targets import load_target

    sdpa, grouped_calls = F.scaled_dot_product_attention, []

    def spy(*args, **kw):
        grouped_calls.append(bool(kw.get("enable_gqa")))
        return sdpa(*args, **kw)

    monkeypatch.setattr(torch_cpu.F, "scaled_dot_product_attention", spy)
    t = load_target(name, num_taps=2)
    assert t.model.config.num_key_value_heads < t.model.config.num_attention_heads  # grouped K/V to pass on
    ids = torch.randint(0, t.info.vocab_size, (2, 11))
    block = torch.randint(0, t.info.vocab_size, (2, 5))
    lens = torch.tensor([11, 7])

    def run():
        cache, pre = t.prefill(ids, lens)
        ver = t.verify(cache, block)
        t.commit(cache, torch.tensor([2, 5]))
        again = t.verify(cache, block[:, :3])  # after a row kept fewer: holes in that row's mask
        return pre, ver, again

    plain = run()
    assert not any(grouped_calls)
    assert torch_cpu.grouped_attention(t.model)
    assert t.model.config._attn_implementation == torch_cpu.GROUPED_SDPA
    grouped = run()
    assert sum(grouped_calls) == 3 * t.info.num_layers  # every masked call took the grouped path
    for a, b in zip(plain, grouped):
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.taps, a.taps, rtol=1e-5, atol=1e-5)


def test_draft_head_cache_follows_the_vocabulary(tiny_qwen3, monkeypatch):
    from dflow_trt.drafter.defaults import untrained_config
    from dflow_trt.drafter.io import build_drafter

    cfg = untrained_config(tiny_qwen3, flow=True, block_size=4)
    cfg = type(cfg)(**{**cfg.__dict__, "draft_vocab_size": 64})
    d = build_drafter(tiny_qwen3, cfg, seed=0)
    h = torch.randn(1, 3, cfg.hidden_size)
    with torch.inference_mode():
        first = d.draft_logits(h)
    torch.testing.assert_close(first, F.linear(h, d.draft_head()), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        d.draft_vocab.copy_(torch.arange(64) + 100)  # what the trainer does when it picks the vocabulary
    with torch.inference_mode():
        second = d.draft_logits(h)
    torch.testing.assert_close(second, F.linear(h, d.lm_head_weight[100:164]), rtol=1e-5, atol=1e-5)
    d.draft_logits(h.requires_grad_()).sum().backward()  # training after inference: no inference tensors
    assert h.grad is not None
    torch_cpu.pack_linears(d)
    multiplies, inner = [], torch_cpu._packed_linear
    monkeypatch.setattr(torch_cpu, "_packed_linear", lambda x, p, *a: multiplies.append(p) or inner(x, p, *a))
    with torch.inference_mode():
        torch.testing.assert_close(d.draft_logits(h), second, rtol=1e-5, atol=1e-5)
    assert multiplies and multiplies[-1] is d._head_packed is not None  # a packed drafter multiplies a packed head
    copied = copy.deepcopy(d)  # after decoding: the head cache is dropped, not copied
    assert not hasattr(copied, "_head_packed")
    with torch.inference_mode():
        torch.testing.assert_close(copied.draft_logits(h), second, rtol=1e-5, atol=1e-5)


def test_packed_decoding_is_lossless(tiny_qwen3):
    """Every mode on a packed target with a packed drafter, batched, equals greedy decoding row by row."""
    target, _ = load_target_and_drafter("tiny-qwen3", None, "ar", warn=lambda m: None)
    assert any(type(m) is torch_cpu.PackedLinear for m in target.model.modules())
    from doubles import PartlyRight, rounds

    prompts = chat_prompts(target, 4)
    ar_long = [generate(target, None, [p], DecodeOptions(mode="ar", max_new_tokens=32, stop_token_ids=())).token_ids[0] for p in prompts]
    ar = [a[:24] for a in ar_long]
    seqs = [p + a for p, a in zip(prompts, ar_long)]
    for mode in ("dflash", "dflow"):
        t, model = load_target_and_drafter("tiny-qwen3", None, mode, warn=lambda m: None, target=target)
        assert any(type(m) is torch_cpu.PackedLinear for m in model.modules())
        for S in (3, 8):
            res = generate(t, TorchDrafter(model), prompts, DecodeOptions(block_size=S, mode=mode, max_new_tokens=24, stop_token_ids=()))
            assert res.token_ids == ar, (mode, S)
            # the packed drafter's drafts with a seeded number of right ones in front: multi-token
            # commits and rejections at every position through the packed target's verify and cache
            res = generate(t, PartlyRight(TorchDrafter(model), seqs, seed=S), prompts, DecodeOptions(block_size=S, mode=mode, max_new_tokens=24, stop_token_ids=()))
            assert res.token_ids == ar, ("partly right", mode, S)
            kinds = rounds(res.acceptance_lengths, S)
            assert kinds["rejected"] and kinds["partial"] and kinds["full"], (mode, S, dict(kinds))


@pytest.mark.slow
def test_packed_smollm2_shipped_drafters_lossless():
    """The default decoding set-up (packed target and drafters, real acceptances) equals greedy."""
    target, _ = load_target_and_drafter("smollm2-135m", None, "ar")
    prompts = chat_prompts(target, 3)
    ar = [generate(target, None, [p], DecodeOptions(mode="ar", max_new_tokens=32, stop_token_ids=())).token_ids[0] for p in prompts]
    for mode in ("dflash", "dflow"):
        t, model = load_target_and_drafter("smollm2-135m", None, mode, target=target)
        for S, threshold in ((16, 0.0), (6, 0.0), (16, 0.05)):
            res = generate(t, TorchDrafter(model), prompts, DecodeOptions(block_size=S, mode=mode, max_new_tokens=32, stop_token_ids=(), verify_threshold=threshold))
            assert res.token_ids == ar, (mode, S, threshold)
            assert res.tau > 1.0
