"""The unchanged decoding loop on the ONNX Runtime back ends equals the torch back end, token for token."""

import numpy as np
import pytest
import torch

from conftest import PROMPTS_TEXT, OracleDrafter, chat_ids
from onnx_cache import exported_drafter, exported_target
from dflow_trt.backends.onnxruntime import OrtDrafter, OrtTarget
from dflow_trt.decoding.interfaces import Proposal
from dflow_trt.decoding.loop import generate
from dflow_trt.decoding.options import DecodeOptions
from dflow_trt.drafter.runtime import TorchDrafter
from dflow_trt.errors import UserError


class NoisyOracle(OracleDrafter):
    """The target's own continuation with seeded corruptions: rows accept different lengths."""

    def __init__(self, sequences, block_size, vocab, seed=0):
        super().__init__(sequences, block_size)
        self.g, self.vocab = torch.Generator().manual_seed(seed), vocab

    def draft(self, *args):
        ids = super().draft(*args).draft_ids
        bad = torch.rand(ids.shape, generator=self.g) < 0.25
        return Proposal(draft_ids=torch.where(bad, (ids + 1) % self.vocab, ids), draft_probs=None)


def _prompts(target, n):
    return [chat_ids(target, t) for t in PROMPTS_TEXT[:n]]


def _check_lossless(target, ort_target, drafters, prompts, max_new, blocks):
    ar = generate(target, None, prompts, DecodeOptions(mode="ar", max_new_tokens=max_new, stop_token_ids=()))
    assert generate(ort_target, None, prompts, DecodeOptions(mode="ar", max_new_tokens=max_new, stop_token_ids=())).token_ids == ar.token_ids
    for flow, (model, folder) in drafters.items():
        for S in blocks:
            for mode in ("dflash", "dflow") if flow else ("dflash",):
                ref = generate(target, TorchDrafter(model), prompts, DecodeOptions(block_size=S, mode=mode, max_new_tokens=max_new, stop_token_ids=()))
                got = generate(ort_target, OrtDrafter(folder), prompts, DecodeOptions(block_size=S, mode=mode, max_new_tokens=max_new, stop_token_ids=()))
                assert ref.token_ids == ar.token_ids, (mode, S)
                assert got.token_ids == ref.token_ids, (mode, S)
                assert got.acceptance_lengths == ref.acceptance_lengths, (mode, S)
    return ar


def test_ort_lossless_tiny_qwen3(tiny_qwen3):
    ort_target = OrtTarget(exported_target(tiny_qwen3))
    drafters = {flow: exported_drafter(tiny_qwen3, flow, num_layers=2 if flow else 1) for flow in (False, True)}
    prompts = _prompts(tiny_qwen3, 4)
    ar = _check_lossless(tiny_qwen3, ort_target, drafters, prompts, 32, blocks=(2, 8, 16))
    for p in prompts[:2]:  # one row at a time too (exact crops, no holes)
        one = generate(ort_target, OrtDrafter(drafters[True][1]), [p], DecodeOptions(block_size=4, mode="dflow", max_new_tokens=32, stop_token_ids=()))
        assert one.token_ids[0] == ar.token_ids[prompts.index(p)]
    # mixed acceptance across rows: the validity-mask cache with holes, on both targets
    seqs = [p + generate(tiny_qwen3, None, [p], DecodeOptions(mode="ar", max_new_tokens=48, stop_token_ids=())).token_ids[0] for p in prompts]
    for mode in ("dflash", "dflow"):
        a = generate(tiny_qwen3, NoisyOracle(seqs, 8, tiny_qwen3.info.vocab_size), prompts, DecodeOptions(mode=mode, max_new_tokens=32, stop_token_ids=()))
        b = generate(ort_target, NoisyOracle(seqs, 8, tiny_qwen3.info.vocab_size), prompts, DecodeOptions(mode=mode, max_new_tokens=32, stop_token_ids=()))
        assert a.token_ids == b.token_ids == ar.token_ids
        assert a.acceptance_lengths == b.acceptance_lengths and a.tau > 2
        # rows of one round commit different lengths: the caches' rows really do get holes
        assert any(len({row[r] for row in a.acceptance_lengths if r < len(row)}) > 1 for r in range(a.rounds))


def test_ort_drafter_refuses_other_target(tiny_qwen3, tiny_llama):
    _, folder = exported_drafter(tiny_qwen3, False)
    with pytest.raises(UserError, match="built for target"):
        OrtDrafter(folder).check_target(tiny_llama.info)
    with pytest.raises(UserError, match="tap"):
        OrtDrafter(folder).check_target(tiny_qwen3.with_taps((1,)).info)
    with pytest.raises(UserError, match="no ONNX graph|missing"):
        OrtTarget(folder)


@pytest.mark.slow
def test_ort_lossless_smollm2(smollm2):
    ort_target = OrtTarget(exported_target(smollm2))
    drafters = {flow: exported_drafter(smollm2, flow) for flow in (False, True)}
    _check_lossless(smollm2, ort_target, drafters, _prompts(smollm2, 3), 24, blocks=(4, 16))


def test_serving_engine_on_onnxruntime_build(tiny_qwen3, tmp_path):
    """The decoding model's engine with backend=onnxruntime and a build_dir (what config.pbtxt sets)."""
    from dflow_trt.export.build import Build, BuildSpec
    from dflow_trt.prompting import encode_prompt
    from dflow_trt.serving.engine import DecodingEngine, ServeConfig

    Build(BuildSpec(target="tiny-qwen3", out=str(tmp_path / "b"), onnx_only=True), log=lambda m: None).run()
    engine = DecodingEngine(ServeConfig(target="tiny-qwen3", backend="onnxruntime", build_dir=str(tmp_path / "b")),
                            log=lambda m: None)
    assert set(engine.modes) == {"ar", "dflash", "dflow"}
    prompt = "def add(a, b):"
    ar = generate(tiny_qwen3, None, [encode_prompt(tiny_qwen3.tokenizer, prompt, False)], DecodeOptions(mode="ar", max_new_tokens=16)).token_ids[0]
    for mode in ("ar", "dflash", "dflow"):
        chunks = []
        req = engine.parse({"text_input": np.array([prompt.encode()], dtype=object),
                            "max_tokens": np.array([16], np.int32), "mode": np.array([mode.encode()], dtype=object),
                            "block_size": np.array([4], np.int32)})
        stats = engine.run(req, chunks.append)
        assert [t for c in chunks for t in c.token_ids] == ar, mode
        assert chunks[-1].final and stats["backend"] == "onnxruntime"
    with pytest.raises(UserError, match="built for target 'tiny-qwen3'"):
        DecodingEngine(ServeConfig(target="tiny-llama", backend="onnxruntime", build_dir=str(tmp_path / "b")),
                       log=lambda m: None)


def test_ort_drafters_that_really_draft_tiny_qwen3(tiny_qwen3, good_drafters, varied_drafters, tmp_path):
    """Real drafter folders (tests/doubles.py) exported to ONNX: greedy dflash and dflow on ONNX
    Runtime equal `ar` and the torch back end (tokens and acceptance lengths) for 4 prompts at once
    and blocks 4 and 8. The good drafters commit several tokens per round (τ >= 1.5; partial, full
    and rejected rounds; hints taken in dflow); the varied one drafts many distinct tokens, almost
    all rejected, a few accepted."""
    from doubles import GOOD_TEXTS, DraftSpy, prompt_ids, rounds
    from dflow_trt.drafter.io import load_drafter
    from dflow_trt.export.onnx_drafter import export_drafter

    ort_target = OrtTarget(exported_target(tiny_qwen3))
    prompts = [prompt_ids(tiny_qwen3, t, True) for t in GOOD_TEXTS[:4]]
    ar = generate(tiny_qwen3, None, prompts, DecodeOptions(mode="ar", max_new_tokens=48)).token_ids
    models = {("good", m): load_drafter(f, tiny_qwen3) for m, f in good_drafters.items()}
    models.update({("varied", m): v[0] for m, v in varied_drafters.items()})
    for (kind, mode), model in models.items():
        folder = export_drafter(model, tmp_path / f"{kind}-{mode}")
        seen, taus, hints, drafts, accepted, verified = rounds([], 8), [], 0, set(), 0, 0
        for S in (4, 8):
            spy = DraftSpy(TorchDrafter(model))
            ref = generate(tiny_qwen3, spy, prompts, DecodeOptions(block_size=S, mode=mode, max_new_tokens=48))
            got = generate(ort_target, OrtDrafter(folder), prompts, DecodeOptions(block_size=S, mode=mode, max_new_tokens=48))
            assert ref.token_ids == ar and got.token_ids == ar, (kind, mode, S)
            assert got.acceptance_lengths == ref.acceptance_lengths, (kind, mode, S)
            assert got.hints_taken == ref.hints_taken
            counts = rounds(got.acceptance_lengths, S)
            seen += counts
            taus.append(got.tau)
            hints += got.hints_taken
            drafts |= set(spy.drafts)
            accepted += sum(a - 1 for row in got.acceptance_lengths for a in row)
            verified += got.verified_drafts
            if kind == "good":
                assert counts["partial"] and counts["full"] and counts["rejected"], (mode, S, counts)
        print(f"\n{kind} {mode}: tau {taus} rounds {dict(seen)} hints {hints}")
        if kind == "good":
            assert min(taus) >= 1.5, (mode, taus)
            assert hints > 0 or mode == "dflash"
        else:
            print(f"  {len(drafts)} distinct draft tokens, {accepted} of {verified} verified drafts accepted")
            assert len(drafts) >= 20, len(drafts)  # not a constant drafter (the untrained one: 1)
            assert 0 < accepted < 0.1 * verified, (accepted, verified)
