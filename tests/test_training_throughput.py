"""The trainer's fast path computes the reference path's loss and gradients (issue 27, item 1).

Reference: torch's own cross-entropy over the logits, dense attention over all of a row's blocks
at once, the context K/V recomputed by every drafter pass (the trainer before the speed-ups).
Fast: the fused chunked cross-entropy, attention in groups of blocks, one context per step. Both
objectives, on tiny-qwen3 with the O(1)-weight drafter of test_training_matches_inference (logits
that vary with context, position and flow), at fixed anchors: the same loss and every gradient
within fp32 rounding. bf16 autocast runs on any CPU and stays close to fp32. The benchmark runs
and writes its JSON.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F
from test_training_matches_inference import (  # noqa: F401
    S,
    _anchors,
    _batch,
    _drafter,
    _objective,
    seqs,
)

from dflow_trt.errors import UserError
from dflow_trt.training import objective, throughput
from dflow_trt.training.trainer import Objective, TrainConfig, compute_dtype

NB = 6  # blocks per row: the fast path's groups of 2 blocks make 3 attention groups
OFFSETS = [(0, 1, 3, 5, 8, 17), (2, 4, 6, 7, 9, 13)]  # blocks overlap; the last ones run past the row's end


def _trainer_module():
    return sys.modules[Objective.__module__]


def _loss_and_grads(obj: Objective, batch, anchors, reference: bool) -> tuple[float, dict, list]:
    """One forward + backward at fixed anchors -> (loss, gradients, each drafter pass's logits)."""
    mod, logits = _trainer_module(), []
    blocks = mod.drafter_blocks

    def spy(m, taps, b, a, flow):
        out = blocks(m, taps, b, a, flow)
        logits.append(out.detach().float())
        return out

    obj.drafter.zero_grad(set_to_none=True)
    with pytest.MonkeyPatch.context() as p:
        p.setattr(mod, "sample_anchors", lambda b, n, s, g: anchors.clone())
        p.setattr(mod, "drafter_blocks", spy)
        if reference:
            p.setattr(objective, "GROUP_ROWS", 10**9)  # one group: every block's keys in every query's row
            p.setattr(mod, "block_loss", objective.block_loss_reference)
            p.setattr(mod, "drafter_context", lambda m, taps: taps)  # each pass computes its own context
        else:
            p.setattr(objective, "GROUP_ROWS", 2 * S)  # two blocks per group
            assert objective.attention_group(anchors.shape[1], S) == 2
        loss, _, _ = obj(batch, torch.Generator().manual_seed(0))
        loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in obj.drafter.named_parameters()}, logits


@pytest.mark.parametrize("kind", ["dflash", "dflow"])
def test_fast_path_has_the_reference_loss_and_gradients(tiny_qwen3, seqs, kind):  # noqa: F811
    m = _drafter(tiny_qwen3, kind == "dflow", seqs)
    obj = _objective(tiny_qwen3, m, kind, NB)
    batch, anchors = _batch(seqs), _anchors(seqs, OFFSETS)
    ref_loss, ref_grads, ref_logits = _loss_and_grads(obj, batch, anchors, reference=True)
    loss, grads, logits = _loss_and_grads(obj, batch, anchors, reference=False)
    assert len(logits) == len(ref_logits) == (2 if kind == "dflow" else 1)
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert ref_loss > 0.5  # a real loss, not a saturated one
    for n, g in ref_grads.items():
        assert g.abs().max() > 0, n  # every parameter learns here, so each comparison bites
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()), msg=n)


def test_fused_cross_entropy_equals_torchs_and_a_wrong_weight_is_caught(monkeypatch):
    """Loss and gradient of the fused CE = F.cross_entropy's, across chunk edges and ignored rows."""
    monkeypatch.setattr(objective._WeightedCE, "CHUNK", 7)  # 3 chunks, the last one short
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(20, 50, generator=g)).requires_grad_()
    target = torch.randint(0, 50, (20,), generator=g)
    target[[3, 11]] = objective.IGNORE
    w = torch.rand(20, generator=g) * (target != objective.IGNORE)
    fused = objective._WeightedCE.apply(logits, target, w)
    (gf,) = torch.autograd.grad(2.5 * fused, logits)
    ref = (F.cross_entropy(logits, target, ignore_index=objective.IGNORE, reduction="none") * w).sum()
    (gr,) = torch.autograd.grad(2.5 * ref, logits)
    assert float(fused) == pytest.approx(float(ref), rel=1e-6)
    torch.testing.assert_close(gf, gr, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(gf, torch.autograd.grad(2.5 * (F.cross_entropy(
        logits, target, ignore_index=objective.IGNORE, reduction="none")).sum(), logits)[0], atol=1e-4)


@pytest.mark.parametrize("kind", ["dflash", "dflow"])
def test_bf16_autocast_runs_and_stays_close(tiny_qwen3, seqs, kind):  # noqa: F811
    """precision=bf16 really computes the drafter in bf16 (its logits are bf16) and its loss and
    gradients stay near fp32's (bf16 keeps ~3 significant digits)."""
    m = _drafter(tiny_qwen3, kind == "dflow", seqs)
    batch, anchors = _batch(seqs), _anchors(seqs, OFFSETS)
    out = {}
    for prec in ("fp32", "bf16"):
        cfg = TrainConfig(target="tiny-qwen3", objective=kind, block_size=S, anchors_per_seq=NB, gamma=3.0,
                          draft_vocab_size=m.config.draft_vocab_size, precision=prec)
        obj = Objective(m, tiny_qwen3, cfg)
        assert obj.compute_dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[prec]
        dtypes = []
        mod = _trainer_module()
        blocks = mod.drafter_blocks
        with pytest.MonkeyPatch.context() as p:
            p.setattr(mod, "drafter_blocks", lambda *a, d=dtypes, f=blocks: (d.append((r := f(*a)).dtype), r)[1])
            out[prec] = _loss_and_grads(obj, batch, anchors, reference=False)[:2]
        assert set(dtypes) == {obj.compute_dtype}
    (l32, g32), (l16, g16) = out["fp32"], out["bf16"]
    assert l16 == pytest.approx(l32, rel=3e-2)
    cos = lambda a, b: float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))
    # each weight's gradient points the same way (DFlow's bf16 drafts may flip a near-tied argmax,
    # moving a second-round block: a looser bound per weight, a tight one for the whole step)
    for n, g in g32.items():
        assert cos(g16[n], g) > 0.9, (n, cos(g16[n], g))
    assert cos(torch.cat([g.flatten() for g in g16.values()]), torch.cat([g.flatten() for g in g32.values()])) > 0.98


def test_auto_precision_follows_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(throughput, "cpu_flags", lambda: {"avx2", "fma"})
    assert compute_dtype("auto") == torch.float32  # AVX2 only: bf16 is emulated, fp32 is faster
    monkeypatch.setattr(throughput, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert compute_dtype("auto") == torch.bfloat16
    monkeypatch.setattr(throughput, "cpu_flags", lambda: {"amx_bf16", "amx_tile"})
    assert compute_dtype("auto") == torch.bfloat16
    assert compute_dtype("fp32") == torch.float32
    with pytest.raises(UserError, match="precision"):
        TrainConfig(precision="fp16")


def test_benchmark_measures_and_writes_json(tiny_qwen3, tmp_path, capsys):
    """`dflow-trt bench training` on tiny-qwen3: one step per objective, a table, a JSON of
    positive rates and FLOPs (the step does matmuls, the microbenchmark finds some)."""
    from dflow_trt.cli import main

    out = tmp_path / "bench.json"
    sets = ["target=\"tiny-qwen3\"", "block_size=4", "anchors_per_seq=4", "draft_vocab_size=64", "threads=1"]
    rc = main(["bench", "training", "--steps", "1", "--warmup", "0", "--threads", "1", "--data-dir",
               str(tmp_path / "data"), "--json-out", str(out), "--set", *sets])
    assert rc == 0
    rep = json.loads(out.read_text())
    res = rep["results"]
    assert [r["objective"] for r in res] == ["dflash", "dflow"] and isinstance(rep["cpu_flags_bf16"], bool)
    for r in res:
        assert r["blocks_per_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["trained_blocks_per_s"] * 3)
        assert r["flops_per_step"] > 0 and r["peak_flops"] > 0 and r["fraction"] > 0
        assert r["config"]["anchors_per_seq"] == 4 and r["threads"] == 1
    assert res[1]["trained_blocks_per_s"] == pytest.approx(2 * res[1]["blocks_per_s"])  # DFlow's second round
    assert res[1]["flops_per_step"] > res[0]["flops_per_step"]  # plus the target's self-conditioning pass
    assert "blocks/s" in capsys.readouterr().out
    assert main(["bench", "training", "--set", "oops"]) == 2
    assert "--set takes KEY=VALUE" in capsys.readouterr().err

def test_benchmark_measures_relay_only_steps(tiny_qwen3, tmp_path, capsys):
    """`--objective relay`: the relay alone on a saved DFlash drafter's frozen body, its first rounds
    cached first (their one-off cost reported per sequence); a step trains the flow round's blocks
    only, with no target pass, so it costs about what a DFlash step does."""
    from dflow_trt.cli import main
    from dflow_trt.drafter.defaults import untrained_config
    from dflow_trt.drafter.io import build_drafter, save_drafter

    cfg = untrained_config(tiny_qwen3, flow=False, block_size=4, num_layers=1)
    src = save_drafter(build_drafter(tiny_qwen3, type(cfg)(**{**cfg.__dict__, "draft_vocab_size": 64}), seed=0),
                       tmp_path / "dflash")
    out = tmp_path / "bench.json"
    sets = ["target=\"tiny-qwen3\"", "block_size=4", "anchors_per_seq=4", "draft_vocab_size=64"]
    rc = main(["bench", "training", "--objective", "dflash", "relay", "--drafter", str(src), "--steps", "2",
               "--warmup", "0", "--threads", "1", "--data-dir", str(tmp_path / "data"), "--json-out", str(out),
               "--no-peak", "--set", *sets])
    assert rc == 0
    dflash, relay = json.loads(out.read_text())["results"]
    assert relay["objective"] == "dflow relay-only" and relay["flows_s_per_seq"] > 0
    assert relay["trained_blocks_per_s"] == pytest.approx(relay["blocks_per_s"])  # the flow round only
    assert 0 < relay["flops_per_step"] < 2 * dflash["flops_per_step"]  # no target pass in the step
    assert not list((tmp_path / "data").glob("flows-*"))  # the flows went to a temporary folder
    capsys.readouterr()
    assert main(["bench", "training", "--objective", "relay", "--set", *sets]) == 2
    assert "pass --drafter" in capsys.readouterr().err
