"""The DFlow paper's relay (`DrafterConfig.relay == "paper"`, `drafter/relay.py: relay_paper`) beside
ours: its arithmetic (the drafter's own context projection, shifted one slot onto the mask slots, an
MLP scale/shift of the mask embedding), a lossless decode with the relay really taken, training that
computes what decoding computes over its three unrolled rounds with no gradient across a round or
into the target, the config through save/load, exports that refuse it, and `train --relay paper`."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_greedy_equivalent, chat_ids, chat_prompts, run_cli
from doubles import PartlyRight, rounds
from test_training_matches_inference import (  # noqa: F401
    _anchors,
    _batch,
    _close,
    _decode,
    _same_flow,
    _train_pass,
    seqs,
)

from dflow_trt.decoding.interfaces import FlowState
from dflow_trt.decoding.loop import generate
from dflow_trt.decoding.options import DecodeOptions
from dflow_trt.drafter.defaults import untrained_config
from dflow_trt.drafter.io import build_drafter, load_drafter, read_config, save_drafter
from dflow_trt.drafter.model import DFlowDrafter
from dflow_trt.drafter.runtime import TorchDrafter
from dflow_trt.errors import UserError
from dflow_trt.targets import SHIPPED_DRAFTERS
from dflow_trt.training.trainer import Objective, TrainConfig

S = 5  # test_training_matches_inference's block size (its helpers decode with it)


def paper_config(target, block_size=S, **kw):
    return dataclasses.replace(untrained_config(target, flow=True, block_size=block_size, **kw), relay="paper")


def unit_drafter(target, block_size=S, seed=3, draft_vocab_size=None, num_layers=2) -> DFlowDrafter:
    """A paper-relay drafter with O(1) weights (the default init gives nearly the same logits
    everywhere, and its relay MLP starts silent), so a wrong slot, shift or round shows."""
    cfg = dataclasses.replace(paper_config(target, block_size, num_layers=num_layers),
                              draft_vocab_size=draft_vocab_size)
    m = build_drafter(target, cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            else:
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    return m.eval()


def reference_inputs(m: DFlowDrafter, ids: torch.Tensor, flow: FlowState, S: int) -> torch.Tensor:
    """The paper's relay written slot by slot from its description (what `relay_paper` must compute)."""
    x = F.embedding(ids, m.embed_weight).clone()  # [B, Q, H]
    B, Q, _ = x.shape
    out = x.clone()
    for b in range(B):
        for blk in range(Q // S):
            o = blk * S
            corr = x[b, o]  # the correction token (the block's anchor)
            first = F.embedding(flow.token_ids[b, o], m.embed_weight)  # the first rejected token
            for k in range(1, S):  # unresolved slot k takes the state the verifier read at slot k-1
                if not flow.valid[b, o + k - 1]:
                    continue
                state = m.ctx_norm(m.ctx_proj(flow.taps[b, o + k - 1]))
                scale, shift = m.relay_mlp(torch.cat([corr, first, state])).chunk(2)
                out[b, o + k] = x[b, o + k] * (1 + scale) + shift
    return out


def random_flow(m, B, Q, S, seed):
    """Flow over B rows of Q // S blocks: each block a prefix of rejected slots of its own length."""
    g = torch.Generator().manual_seed(seed)
    V, Fs = m.config.target.vocab_size, m.config.feature_size
    n = torch.randint(0, S, (B, Q // S), generator=g)  # rejected slots carried, 0..S-1
    valid = (torch.arange(S)[None, None] < n[..., None]).reshape(B, Q)
    taps = torch.randn(B, Q, Fs, generator=g) * valid[..., None]
    tok = torch.randint(0, V, (B, Q), generator=g) * valid
    return FlowState(taps=taps, token_ids=tok, hint_ids=tok.flip(1), valid=valid)


# ---------------------------------------------------------------- arithmetic


@torch.no_grad()
def test_relay_paper_modulates_exactly_the_shifted_mask_slots(tiny_qwen3):
    m = unit_drafter(tiny_qwen3, block_size=6)
    B, S, nb = 3, 6, 4
    flow = random_flow(m, B, nb * S, S, seed=1)
    ids = torch.full((B, nb * S), m.config.mask_token_id)
    ids[:, ::S] = torch.randint(0, m.config.target.vocab_size, (B, nb), generator=torch.Generator().manual_seed(2))
    calls = []
    hook = m.relay_mlp.register_forward_hook(lambda mod, i, o: calls.append(o.shape))
    got = m.block_inputs(ids, flow, block=S)  # blocks side by side, as training lays them out
    hook.remove()
    assert calls, "the scale/shift MLP never ran"
    want = reference_inputs(m, ids, flow, S)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    x = F.embedding(ids, m.embed_weight)
    moved = (got != x).any(-1)  # [B, Q] slots whose input changed
    shifted = torch.cat([torch.zeros_like(flow.valid[:, :1]), flow.valid[:, :-1]], 1)  # valid[k-1] at slot k
    shifted[:, ::S] = False  # a block's anchor never moves (nor does the next block's, from the last slot)
    assert torch.equal(moved, shifted) and moved.any() and (~moved & (ids == m.config.mask_token_id)).any()
    # no flow: exactly the embeddings, the DFlash input (no learned "no flow" vector in this design)
    assert torch.equal(m.block_inputs(ids, None, block=S), x)
    # one block per row with decoding's flow prefix (`rows`): the same as without it
    one = FlowState(taps=flow.taps[:, :S], token_ids=flow.token_ids[:, :S], hint_ids=flow.hint_ids[:, :S],
                    valid=flow.valid[:, :S])
    torch.testing.assert_close(m.block_inputs(ids[:, :S], one, one.prefix()), got[:, :S], rtol=1e-6, atol=1e-6)
    # a fresh paper drafter starts silent (its MLP's last layer is zero): flow changes nothing yet
    fresh = build_drafter(tiny_qwen3, paper_config(tiny_qwen3, block_size=6))
    assert torch.equal(fresh.block_inputs(ids, flow, block=S), fresh.block_inputs(ids, None, block=S))


# ---------------------------------------------------------------- config, save/load, exports


def test_config_round_trips_and_the_default_relay_is_unchanged(tiny_qwen3, tmp_path):
    m = unit_drafter(tiny_qwen3, draft_vocab_size=64)
    path = save_drafter(m, tmp_path / "paper")
    assert json.loads((path / "config.json").read_text())["relay"] == "paper"
    back = load_drafter(path, tiny_qwen3.with_taps(m.config.tap_layers))
    assert back.config == m.config and back.config.relay == "paper"
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in m.state_dict().items())
    assert {k for k in back.state_dict() if k.startswith("relay_mlp")} == {"relay_mlp.0.weight", "relay_mlp.2.weight"}
    assert not hasattr(back, "flow_proj") and [n for n, _ in back.named_parameters() if "relay" in n] == \
        ["relay_mlp.0.weight", "relay_mlp.2.weight"] == [n for n, p in back.named_parameters()
                                                         if any(p is q for q in back.flow_parameters())]
    # today's design: "relay" is not written (config.json as before) and reads back as "ours"
    ours = save_drafter(build_drafter(tiny_qwen3, untrained_config(tiny_qwen3, flow=True)), tmp_path / "ours")
    assert "relay" not in json.loads((ours / "config.json").read_text())
    assert read_config(ours).relay == "ours"
    for shipped in ("smollm2-135m-dflash", "smollm2-135m-dflow"):
        c = read_config(SHIPPED_DRAFTERS / shipped)
        assert c.relay == "ours" and "relay" not in json.loads((SHIPPED_DRAFTERS / shipped / "config.json").read_text())
    for bad in ({"relay": "theirs"}, {"relay": ["paper"]}, {"relay": "paper", "flow": False}):
        with pytest.raises(UserError, match="relay must be one of"):
            dataclasses.replace(m.config, **bad)
    # the exports refuse it in one line (only the PyTorch drafter runs the paper's relay)
    from dflow_trt.backends.trtllm_dflow.relay_io import flow_state_dict
    from dflow_trt.export.onnx_drafter import export_drafter

    for export in (lambda: export_drafter(m, tmp_path / "onnx"), lambda: flow_state_dict(m)):
        with pytest.raises(UserError, match="relay 'paper'.*PyTorch back end") as e:
            export()
        assert "\n" not in str(e.value)
    assert not (tmp_path / "onnx").exists()


# ---------------------------------------------------------------- decoding


def test_paper_relay_decode_is_lossless_and_takes_the_relay(tiny_qwen3, monkeypatch):
    """A drafter that really drafts (O(1) weights: drafts vary with the context; `PartlyRight` makes
    the first k of them right: every acceptance length), batched rows, the paper relay in every
    round after a rejection: exactly `ar`'s tokens, and the relay changed the mask slots' inputs."""
    prompts, max_new = chat_prompts(tiny_qwen3, 4), 32
    ar_long = [generate(tiny_qwen3, None, [p], DecodeOptions(mode="ar", max_new_tokens=max_new + 16,
                                                             stop_token_ids=())).token_ids[0] for p in prompts]
    ar, seqs_ = [a[:max_new] for a in ar_long], [p + a for p, a in zip(prompts, ar_long)]
    for block in (4, 8):
        m = unit_drafter(tiny_qwen3, block_size=block, num_layers=1)
        seen = {"calls": 0, "moved": 0, "flows": 0}
        real = DFlowDrafter.block_inputs

        def spy(self, ids, flow=None, rows=None, block=None, real=real, seen=seen):
            out = real(self, ids, flow, rows, block)
            if flow is not None and flow.valid.any():
                seen["flows"] += 1
                moved = (out != F.embedding(ids, self.embed_weight)).any(-1)  # [B, S]
                shifted = torch.cat([torch.zeros_like(flow.valid[:, :1]), flow.valid[:, :-1]], 1)
                assert torch.equal(moved, shifted), (moved, flow.valid)  # exactly the relayed mask slots
                seen["moved"] += int(moved.sum())
            return out

        calls = []
        hook = m.relay_mlp.register_forward_hook(lambda mod, i, o, calls=calls: calls.append(o.shape))
        monkeypatch.setattr(DFlowDrafter, "block_inputs", spy)
        for trust in (0.0, 0.5):  # verifier hints off and at their default
            res = generate(tiny_qwen3, PartlyRight(TorchDrafter(m), seqs_, seed=block), prompts,
                           DecodeOptions(mode="dflow", block_size=block, max_new_tokens=max_new, stop_token_ids=(),
                                         hint_trust=trust))
            for p, g, w in zip(prompts, res.token_ids, ar):
                assert_greedy_equivalent(tiny_qwen3, p, g, w, max_new_tokens=max_new)
            kinds = rounds(res.acceptance_lengths, block)
            assert kinds["rejected"] > 0 and kinds["partial"] > 0, dict(kinds)
        monkeypatch.undo()
        hook.remove()
        assert calls and seen["flows"] > 0 and seen["moved"] > 0, (block, seen)


# ---------------------------------------------------------------- training = inference, gradients


def _paper_objective(target, m, nb, rounds_=0):
    cfg = TrainConfig(target="tiny-qwen3", objective="dflow", relay="paper", flow_rounds=rounds_, block_size=S,
                      anchors_per_seq=nb, gamma=3.0, draft_vocab_size=128, precision="fp32")  # as the loop
    return Objective(m, target, cfg)


def test_training_rounds_are_the_decoding_loops(tiny_qwen3, seqs):  # noqa: F811
    """The paper objective's masked round and both reject-conditioned rounds compute, block by
    block, what the decoding loop's drafter computes in its first three rounds: the same anchors
    (L, then after each first mismatch), flows, logits and accepted counts."""
    m = unit_drafter(tiny_qwen3, draft_vocab_size=128)
    vocab = sorted({t for s, _ in seqs for t in s})
    rest = [t for t in torch.randperm(tiny_qwen3.info.vocab_size, generator=torch.Generator().manual_seed(0)).tolist()
            if t not in set(vocab)]
    m.draft_vocab.copy_(torch.tensor(sorted(vocab + rest[:128 - len(vocab)])))
    anchors = _anchors(seqs, [(0, 2), (1, 3)])  # room for three rounds inside each response
    tr = _train_pass(_paper_objective(tiny_qwen3, m, 2), _batch(seqs), anchors)
    assert len(tr["logits"]) == 3 and len(tr["flow"]) == 2
    valid_flows = 0
    for n, (seq, _) in enumerate(seqs):
        for i, L in enumerate(anchors[n].tolist()):
            loop = _decode(tiny_qwen3, m, seq, L, "dflow", rounds=3)
            assert loop[0]["flow"] is None and loop[0]["pos"] == L
            for r in range(3):
                assert int(tr["anchors"][r][n, i]) == loop[r]["pos"], (n, i, r)
                _close(tr["logits"][r][n, i], loop[r]["logits"])
                if r:
                    _same_flow(tr["flow"][r - 1], n * 2 + i, loop[r]["flow"])
                    valid_flows += int(loop[r]["flow"].valid.any())
                    assert int(tr["accepted"][r - 1][n, i]) == loop[r - 1]["accepted"]
    assert valid_flows >= 4, "too few rounds carried flow for the comparison to bite"


def test_no_gradient_reaches_the_target_or_crosses_a_round(tiny_qwen3, seqs):  # noqa: F811
    m = unit_drafter(tiny_qwen3, draft_vocab_size=128)
    m.train()
    obj = _paper_objective(tiny_qwen3, m, 3)
    tr = _train_pass(obj, _batch(seqs), _anchors(seqs, [(0, 2, 5), (1, 3, 6)]), grad=True)
    assert len(obj.flow_stats) == 2  # the paper's default: two reject-conditioned rounds
    for f in tr["flow"]:  # the relayed states come from the frozen target, outside any graph
        assert not f.taps.requires_grad
    first, second, third = tr["first"], *obj.flow_stats
    assert tr["loss"].item() == pytest.approx((first.loss + second.loss + third.loss).item(), rel=1e-6)
    # each round's loss reaches the relay MLP (rounds 2 and 3) but not an earlier round's outputs: the
    # round's inputs are argmax ids and target states, and its logits get no gradient from a later loss
    mlp = list(m.relay_mlp.parameters())
    g_first = torch.autograd.grad(first.loss, mlp, retain_graph=True, allow_unused=True)
    assert all(g is None or not g.any() for g in g_first)  # round 1 has no flow
    for st in (second, third):
        g = torch.autograd.grad(st.loss, mlp, retain_graph=True)
        assert all(x.abs().sum() > 0 for x in g)
    logits = _round_logits(obj, _batch(seqs), _anchors(seqs, [(0, 2, 5), (1, 3, 6)]))
    for later in (1, 2):
        for earlier in range(later):
            assert torch.autograd.grad(logits["loss"][later], logits["logits"][earlier], retain_graph=True,
                                       allow_unused=True)[0] is None, (earlier, later)
    # and nothing reaches the target: its weights would take a gradient (requires_grad is on) but get none
    tr["loss"].backward()
    target_params = list(tiny_qwen3.model.parameters())
    assert any(p.requires_grad for p in target_params) and all(p.grad is None for p in target_params)
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)


def _round_logits(obj, batch, anchors) -> dict:
    """One forward with every round's logits kept in the graph (the spy of `_train_pass` detaches
    them), with each round's loss."""
    import sys

    mod = sys.modules[Objective.__module__]
    rec = {"logits": [], "loss": []}
    blocks, loss = mod.drafter_blocks, mod.block_loss

    def spy_blocks(*a):
        out = blocks(*a)
        rec["logits"].append(out)
        return out

    def spy_loss(*a):
        st = loss(*a)
        rec["loss"].append(st.loss)
        return st

    with pytest.MonkeyPatch.context() as p:
        p.setattr(mod, "sample_anchors", lambda b, n, s, g: anchors.clone())
        p.setattr(mod, "drafter_blocks", spy_blocks)
        p.setattr(mod, "block_loss", spy_loss)
        obj(batch, torch.Generator().manual_seed(0))
    assert len(rec["logits"]) == len(rec["loss"]) == 3
    return rec


# ---------------------------------------------------------------- the trainer


def test_train_relay_paper_learns_and_decodes_losslessly(tiny_qwen3, tmp_path):
    from test_training import TRAIN

    from dflow_trt.training.data import generate_dataset

    data = tmp_path / "data"
    generate_dataset(tiny_qwen3, data, num_prompts=24, max_new_tokens=24, batch_size=8, shard_size=24, heldout_every=8)
    out = tmp_path / "run"
    r = run_cli("train", *TRAIN, "--data-dir", str(data), "--out-dir", str(out), "--objective", "dflow",
                "--relay", "paper", "--steps", "30", "--lr", "3e-3", "--eval-every", "30", "--ckpt-every", "30")
    assert r.returncode == 0, r.stderr[-3000:]
    log = [json.loads(x) for x in (out / "drafter" / "train_log.jsonl").read_text().splitlines()]
    first, last = sum(x["loss"] for x in log[:5]) / 5, sum(x["loss"] for x in log[-5:]) / 5
    assert last < first, (first, last)
    assert all("train_tau_flow" in x and "train_tau_flow2" in x for x in log)  # three rounds each step
    assert {"eval_tau_noflow", "eval_tau_flow", "eval_tau_flow2"} <= log[-1].keys()
    assert json.loads((out / "drafter" / "config.json").read_text())["relay"] == "paper"
    assert json.loads((out / "drafter" / "training_config.json").read_text())["relay"] == "paper"
    target = tiny_qwen3.with_taps(read_config(out / "drafter").tap_layers)
    drafter = load_drafter(out / "drafter", target)
    assert drafter.relay_mlp[-1].weight.abs().sum() > 0  # the relay trained away from its silent start
    prompts = [chat_ids(target, "What is 12 plus 30?"), chat_ids(target, "Write a haiku about rain.")]
    ar = generate(target, None, prompts, DecodeOptions(mode="ar", max_new_tokens=24, stop_token_ids=())).token_ids
    res = generate(target, TorchDrafter(drafter), prompts,
                   DecodeOptions(block_size=4, mode="dflow", max_new_tokens=24, stop_token_ids=()))
    assert res.token_ids == ar
    # bad combinations are refused before any work, one line each
    for args, needle in ((["--objective", "dflash", "--relay", "paper"], "only --objective dflow"),
                         (["--relay", "theirs"], "unknown relay")):
        r = run_cli("train", *TRAIN, "--data-dir", str(data), "--out-dir", str(tmp_path / "bad"), *args)
        assert r.returncode == 2 and needle in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
