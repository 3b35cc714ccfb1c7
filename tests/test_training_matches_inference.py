"""Training computes what inference computes (issue 26, point 3).

The trainer's own tests check that the loss falls and τ ≥ 1, which a training pass with its labels
shifted by one position passes too. These pin the training pass to the decoding loop, on the
tiny-qwen3 target whose greedy continuations are the data (so the teacher-forced context, labels and
acceptance are exactly what decoding sees), with a seeded drafter whose weights are large enough
that its logits vary with context, position and flow:
- the block-sparse training pass's logits = the TorchDrafter's as `generate` calls it (DFlash; DFlow
  without flow in its first round, with flow in its second);
- the DFlow objective's simulated verify = a real target verify + `carry_flow`;
- labels sit at anchor + k, and a planted shift by one is caught;
- a 2-process DDP step = a 1-process step on the concatenated batch, and summed gradients are caught.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import chat_ids
from dflow_trt.decoding.loop import generate
from dflow_trt.decoding.options import DecodeOptions
from dflow_trt.drafter import runtime
from dflow_trt.drafter.defaults import untrained_config
from dflow_trt.drafter.io import build_drafter
from dflow_trt.drafter.runtime import TorchDrafter
from dflow_trt.targets import load_target
from dflow_trt.training import objective
from dflow_trt.training.objective import IGNORE, Batch
from dflow_trt.training.trainer import Objective, TrainConfig

S = 5  # block size: anchor + 4 drafts
GAMMA = 3.0
VD = 128  # draft vocabulary: every token of the data plus a seeded fill, not the identity map
PROMPTS = [("What is 17 times 23?", 20), ("Explain why the sky is blue.", 16)]  # (prompt, response length)
TAPS = 3
LR = 1e-3  # the DDP step's AdamW learning rate


@pytest.fixture(scope="module")
def seqs(tiny_qwen3) -> list[tuple[list[int], int]]:
    """(prompt + the target's greedy response, prompt length) per row; the rows differ in length."""
    if tiny_qwen3.device.type != "cpu":  # the objective's index tensors follow the default device, which train() sets
        pytest.skip("compares the CPU training pass with CPU decoding")
    out = []
    for text, n in PROMPTS:
        p = chat_ids(tiny_qwen3, text)
        out.append((p + generate(tiny_qwen3, None, [p], DecodeOptions(mode="ar", max_new_tokens=n, stop_token_ids=())).token_ids[0], len(p)))
    return out


def _batch(seqs) -> Batch:
    """Right-padded batch of the rows, as the trainer's `collate` makes it."""
    T = max(len(s) for s, _ in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)  # [N, T]
    for i, (s, _) in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    return Batch(ids=ids, lens=torch.tensor([len(s) for s, _ in seqs]), prompt_lens=torch.tensor([p for _, p in seqs]))


def _drafter(target, flow: bool, seqs, seed: int = 3):
    """A 2-layer drafter (so the early/last layer split of decoding runs) with O(1) weights: the
    default init (std 0.02, zero flow vectors) gives nearly the same logits everywhere, which
    would hide a wrong context, position or flow."""
    cfg = dataclasses.replace(untrained_config(target, flow=flow, block_size=S, num_layers=2), draft_vocab_size=VD)
    m = build_drafter(target, cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:  # linears: unit gain
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            else:  # norm gains, flow vectors, hint gate: off their neutral start
                p.add_(0.5 * torch.randn(p.shape, generator=g))
        data = sorted({t for s, _ in seqs for t in s})
        assert len(data) <= VD
        rest = torch.randperm(target.info.vocab_size, generator=g).tolist()
        vocab = list(dict.fromkeys(data + rest))[:VD]
        m.draft_vocab.copy_(torch.tensor(sorted(vocab)))
    return m


def _objective(target, drafter, kind: str, nb: int) -> Objective:
    cfg = TrainConfig(target="tiny-qwen3", objective=kind, block_size=S, anchors_per_seq=nb, gamma=GAMMA,
                      draft_vocab_size=VD, lr=LR, precision="fp32")  # the loop runs fp32
    return Objective(drafter, target, cfg)


def _trainer_module():
    """The module whose names `Objective.forward` looks up (patched there, wherever it lives)."""
    return sys.modules[Objective.__module__]


def _train_pass(model, batch: Batch, anchors: torch.Tensor, grad: bool = False) -> dict:
    """One `Objective.forward` at fixed anchors [N, nb]; records every drafter pass's anchors and
    logits, the labels each loss got, and the simulated verify's flow and accepted counts."""
    mod, rec = _trainer_module(), {"anchors": [], "logits": [], "labels": [], "flow": [], "accepted": []}
    blocks, loss, verify = mod.drafter_blocks, mod.block_loss, mod.verifier_flow

    def spy_blocks(m, taps, b, a, flow):
        out = blocks(m, taps, b, a, flow)  # [N, nb, S-1, Vd]
        rec["anchors"].append(a.clone())
        rec["logits"].append(out.detach().clone())
        return out

    def spy_loss(m, logits, labels, gamma, to_draft):
        rec["labels"].append(labels.clone())
        return loss(m, logits, labels, gamma, to_draft)

    def spy_verify(*args):
        flow, acc = verify(*args)
        rec["flow"].append(flow)
        rec["accepted"].append(acc.clone())
        return flow, acc

    with pytest.MonkeyPatch.context() as p, torch.set_grad_enabled(grad):
        p.setattr(mod, "sample_anchors", lambda b, n, s, g: anchors.clone())
        p.setattr(mod, "drafter_blocks", spy_blocks)
        p.setattr(mod, "block_loss", spy_loss)
        p.setattr(mod, "verifier_flow", spy_verify)
        rec["loss"], rec["first"], rec["second"] = model(batch, torch.Generator().manual_seed(0))
    return rec


def _decode(target, drafter, seq: list[int], L: int, mode: str, rounds: int, planted=None) -> list[dict]:
    """The real loop on prompt seq[:L] (its first token is the anchor seq[L]) for `rounds` rounds.

    Per round: the anchor and its position, the flow the drafter got (a real verify + `carry_flow`),
    the logits the drafter handed to `propose`, and the accepted count. `planted` {round: drafts
    [S-1]} replaces the drafter's drafts in that round (what the target verifies). Hints are off:
    they replace drafts by a rule training does not model.
    """
    td, rec = TorchDrafter(drafter), []

    class Spy:
        block_size, uses_flow = td.block_size, td.uses_flow

        def new_state(self, batch_size, generator=None, block_size=None):
            return td.new_state(batch_size, generator, block_size)

        def draft(self, state, ctx, ctx_lens, anchor, anchor_pos, flow, sampler, verify_threshold=0.0):
            rec.append({"anchor": int(anchor[0]), "pos": int(anchor_pos[0]), "flow": flow})
            prop = td.draft(state, ctx, ctx_lens, anchor, anchor_pos, flow, sampler, verify_threshold)
            if planted and len(rec) in planted:
                prop = dataclasses.replace(prop, draft_ids=planted[len(rec)][None].to(prop.draft_ids))
            return prop

    propose = runtime.propose

    def spy_propose(logits, *args, **kw):
        rec[-1]["logits"] = logits[0].clone()  # [S-1, Vd]
        return propose(logits, *args, **kw)

    with pytest.MonkeyPatch.context() as p:
        p.setattr(runtime, "propose", spy_propose)
        res = generate(target, Spy(), [seq[:L]], DecodeOptions(mode=mode, max_new_tokens=rounds * S + 1, stop_token_ids=(), hint_trust=0.0), on_round=lambda ev: ev.round >= rounds)
    assert rec[0]["anchor"] == seq[L], "the data is not the target's greedy output here"
    for r, a in zip(rec, res.acceptance_lengths[0]):
        r["accepted"] = a - 1
    return rec


def _close(a: torch.Tensor, b: torch.Tensor, argmax: bool = True) -> None:
    """Equal up to fp32 rounding (relative to b's scale); logits also pick the same tokens."""
    torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-4 * float(b.abs().max()))
    if argmax:
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def _same_flow(train, j: int, loop) -> None:
    """Row j of the training flow [N*nb, S] equals the loop's flow [1, S]."""
    assert torch.equal(train.valid[j], loop.valid[0]), (train.valid[j], loop.valid[0])
    assert torch.equal(train.token_ids[j], loop.token_ids[0])
    assert torch.equal(train.hint_ids[j], loop.hint_ids[0])
    _close(train.taps[j], loop.taps[0], argmax=False)


def _anchors(seqs, offsets) -> torch.Tensor:
    """Anchors [N, nb] at prompt end + offsets (inside the response, room for two rounds)."""
    return torch.tensor([[p + o for o in offs] for (_, p), offs in zip(seqs, offsets)])


@pytest.mark.parametrize("kind", ["dflash", "dflow"])
def test_training_block_logits_are_the_decoding_drafters(tiny_qwen3, seqs, kind):
    """Every block of one training pass (2 rows of other lengths, 3 overlapping blocks each) has the
    logits the decoding loop's drafter computes for that context and anchor: DFlash; DFlow in its
    first round (no flow) and its second (flow from the simulated verify, at L + a + 1). The
    teacher-forced accepted counts (τ) are the loop's, and so is DFlow's flow."""
    m = _drafter(tiny_qwen3, kind == "dflow", seqs)
    anchors = _anchors(seqs, [(0, 3, 6), (1, 2, 6)])  # [2, 3]
    tr = _train_pass(_objective(tiny_qwen3, m, kind, 3), _batch(seqs), anchors)
    assert len(tr["logits"]) == (2 if kind == "dflow" else 1)
    for n, (seq, _) in enumerate(seqs):
        for i, L in enumerate(anchors[n].tolist()):
            loop = _decode(tiny_qwen3, m, seq, L, kind, rounds=len(tr["logits"]))
            assert loop[0]["pos"] == L and loop[0]["flow"] is None
            _close(tr["logits"][0][n, i], loop[0]["logits"])
            assert int(tr["first"].accepted[n * 3 + i]) == loop[0]["accepted"]
            if kind == "dflow":
                a = int(tr["accepted"][0][n, i])
                assert a == loop[0]["accepted"] and int(tr["anchors"][1][n, i]) == loop[1]["pos"] == L + a + 1
                _same_flow(tr["flow"][0], n * 3 + i, loop[1]["flow"])
                _close(tr["logits"][1][n, i], loop[1]["logits"])
                assert int(tr["second"].accepted[n * 3 + i]) == loop[1]["accepted"]
    # the weights make the comparison bite: logits differ across blocks and positions
    lg = tr["logits"][0]
    assert (lg[0, 0] - lg[0, 1]).abs().max() > 0.1 and (lg[0, 0, 0] - lg[0, 0, 1]).abs().max() > 0.1


def test_simulated_verify_is_a_real_verify_and_carry_flow(tiny_qwen3, seqs):
    """DFlow's batched self-conditioning pass for planted drafts whose first error sits at each
    slot (a = 0..S-1; S-1: all accepted, nothing carried), five blocks per row in one pass, gives
    the same accepted count, flow (ids, valid slots, hints, verifier states) and next-round logits
    as the loop's real target verify + `carry_flow` of those drafts."""
    m = _drafter(tiny_qwen3, True, seqs)
    batch = _batch(seqs)
    anchors = _anchors(seqs, [(0, 2, 4, 6, 8), (1, 2, 3, 4, 5)])  # [2, S]: block i's first error at slot i
    drafts = torch.stack([torch.stack([batch.ids[n, L + 1:L + S] for L in row.tolist()])
                          for n, row in enumerate(anchors)])  # [2, S, S-1]: the data, then one error each
    for i in range(S - 1):
        drafts[:, i, i] = (drafts[:, i, i] + 1) % tiny_qwen3.info.vocab_size
    taps, kv = objective.target_states(tiny_qwen3, batch, keep_cache=True)
    labels = objective._labels(batch, anchors, S)
    with torch.no_grad():
        flow, acc = objective.verifier_flow(tiny_qwen3, kv, batch, anchors, drafts, labels)
        logits = objective.drafter_blocks(m, taps, batch, anchors + acc + 1, flow)  # [2, S, S-1, Vd]
    assert torch.equal(acc, torch.arange(S).expand(2, S))
    for n, (seq, _) in enumerate(seqs):
        for i, L in enumerate(anchors[n].tolist()):
            loop = _decode(tiny_qwen3, m, seq, L, "dflow", rounds=2, planted={1: drafts[n, i]})
            assert loop[0]["accepted"] == i and loop[1]["pos"] == L + i + 1
            _same_flow(flow, n * S + i, loop[1]["flow"])
            assert int(flow.valid[n * S + i].sum()) == S - 1 - i  # the rejected slots, none when all accepted
            _close(logits[n, i], loop[1]["logits"])


def _expected_loss(logits: torch.Tensor, batch: Batch, anchors: torch.Tensor, vocab: torch.Tensor) -> float:
    """The DFlash loss written from the sequence itself: block position k (weight exp(-(k-1)/γ))
    against the token at anchor + k, positions past the row's end skipped. logits [N, nb, S-1, Vd]."""
    num = den = 0.0
    for n in range(anchors.shape[0]):
        for i, L in enumerate(anchors[n].tolist()):
            for k in range(1, S):
                if L + k >= int(batch.lens[n]):
                    continue
                d = int((vocab == batch.ids[n, L + k]).nonzero()[0, 0])
                w = math.exp(-(k - 1) / GAMMA)
                row = logits[n, i, k - 1].double()
                num += w * float(torch.logsumexp(row, 0) - row[d])
                den += w
    return num / den


def _check_labels(target, seqs, m) -> float:
    """The labels each DFlow loss gets are the sequence's tokens at anchor + k (IGNORE past the
    end), both rounds, and the first loss is the cross-entropy against exactly those tokens.
    Returns the first prediction's loss."""
    batch = _batch(seqs)
    anchors = _anchors(seqs, [(0, 5, 17), (2, 7, 13)])  # the last blocks of each row run past its end
    tr = _train_pass(_objective(target, m, "dflow", 3), batch, anchors)
    lens = batch.lens[:, None, None]
    for a, lab in zip(tr["anchors"], tr["labels"]):  # round 1 at the anchors, round 2 at L + a + 1
        pos = a[..., None] + torch.arange(1, S)  # [N, nb, S-1]
        want = batch.ids.gather(1, pos.clamp(max=batch.ids.shape[1] - 1).flatten(1)).view_as(pos)
        assert torch.equal(lab, want.masked_fill(pos >= lens, IGNORE))
    assert (tr["labels"][0] == IGNORE).any() and (tr["labels"][0] != IGNORE).sum() >= 16
    assert torch.equal(objective._labels(batch, anchors, S), tr["labels"][0])
    loss = float(tr["first"].loss)
    assert loss == pytest.approx(_expected_loss(tr["logits"][0], batch, anchors, m.draft_vocab), rel=1e-5)
    return loss


def test_labels_are_the_tokens_at_anchor_plus_k_and_a_shift_is_caught(tiny_qwen3, seqs):
    """Labels line up with the sequence; a `_labels` shifted by one position (the bug that every
    other training test misses) fails `_check_labels` and moves the loss measurably."""
    m = _drafter(tiny_qwen3, True, seqs)
    loss = _check_labels(tiny_qwen3, seqs, m)
    real = objective._labels

    def shifted(batch, anchors, block_size):  # the token after the right one
        return real(batch, anchors + 1, block_size)

    with pytest.MonkeyPatch.context() as p:
        for mod in {objective, _trainer_module()}:
            p.setattr(mod, "_labels", shifted)
        with pytest.raises(AssertionError):
            _check_labels(tiny_qwen3, seqs, m)
        shifted_loss = float(_train_pass(_objective(tiny_qwen3, m, "dflow", 3), _batch(seqs),
                                         _anchors(seqs, [(0, 5, 17), (2, 7, 13)]))["first"].loss)
    assert abs(shifted_loss - loss) > 0.05 * loss, (loss, shifted_loss)


def test_block_loss_counts_only_the_accepted_prefix_and_skips_ignored_labels():
    """`block_loss` on hand-made logits: the reported accepted count of a block is its prefix of
    right predictions (a hit after a miss does not count: the training τ the logs report), a block
    whose first label is past the end is left out, and ignored labels add nothing to the loss."""
    from types import SimpleNamespace

    V, S1 = 7, 4
    draft_vocab = torch.tensor([3, 0, 6, 1, 5, 2, 4])  # draft id -> target id, not the identity
    to_draft = torch.empty(V, dtype=torch.long)
    to_draft[draft_vocab] = torch.arange(V)
    model = SimpleNamespace(draft_vocab=draft_vocab)
    labels = torch.tensor([[[1, 2, 3, 4], [5, 6, IGNORE, IGNORE], [IGNORE] * 4, [2, 2, 2, 2]]])  # [1, 4, S-1]
    hits = torch.tensor([[[1, 0, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [0, 1, 1, 1]]]).bool()
    pred = torch.where(hits, labels.clamp(min=0), (labels.clamp(min=0) + 1) % V)  # the token each argmax names
    logits = torch.nn.functional.one_hot(to_draft[pred], V).float() * 4.0  # [1, 4, S-1, V]
    st = objective.block_loss(model, logits, labels, GAMMA, to_draft)
    assert st.accepted.tolist() == [1, 2, 0]  # block 3 (no label) left out; block 4 misses first
    w = [math.exp(-k / GAMMA) for k in range(S1)]
    hit_ce = float(torch.logsumexp(torch.tensor([4.0] + [0.0] * (V - 1)), 0) - 4.0)
    miss_ce = hit_ce + 4.0
    num = sum(w[k] * (hit_ce if hits[0, i, k] else miss_ce) for i in range(4) for k in range(S1)
              if labels[0, i, k] != IGNORE)
    den = sum(w[k] for i in range(4) for k in range(S1) if labels[0, i, k] != IGNORE)
    assert float(st.loss) == pytest.approx(num / den, rel=1e-5)


# ---- DDP: 2 processes (gloo) vs 1 process on the concatenated batch ----

DDP_OFFSETS = [(0, 3, 6), (1, 4, 6)]  # both rows' blocks and next-round blocks end inside the row:
# every rank's loss weighs the same number of labels, so the mean of the ranks' losses is the
# 1-process loss of the concatenated batch


def _step(model, drafter, batch: Batch, anchors: torch.Tensor) -> dict:
    """One training step as `train()` takes it (AdamW with the trainer's betas, clipping) at fixed
    anchors; -> loss, the gradients as reduced before clipping, the weights after the step."""
    cfg = getattr(model, "module", model).cfg
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    rec = _train_pass(model, batch, anchors, grad=True)
    opt.zero_grad(set_to_none=True)
    rec["loss"].backward()  # under DDP: the reduced gradient lands in .grad
    grads = {n: p.grad.detach().clone() for n, p in drafter.named_parameters()}
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    return {"loss": float(rec["loss"].detach()), "grads": grads,
            "weights": {n: p.detach().clone() for n, p in drafter.named_parameters()}}


def _allreduce_sum(state, bucket):
    """The planted bug: gradients summed over processes instead of averaged."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def _ddp_worker(rank: int, world: int, port: int, out: str, seqs) -> None:
    """Rank r trains row r of the batch, once with DDP's averaging and once with summed gradients."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        target = load_target("tiny-qwen3", num_taps=TAPS)
        mine = [seqs[rank]]
        res = {}
        for how in ("mean", "sum"):
            m = _drafter(target, True, seqs)
            ddp = torch.nn.parallel.DistributedDataParallel(_objective(target, m, "dflow", 3), broadcast_buffers=False)
            if how == "sum":
                ddp.register_comm_hook(None, _allreduce_sum)
            res[how] = _step(ddp, m, _batch(mine), _anchors(mine, [DDP_OFFSETS[rank]]))
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _check_same_step(one: dict, ranks: list[dict], lr: float) -> None:
    """Two ranks' step = the 1-process step: the mean of their losses, their reduced gradients
    and their weights after the step, each within fp32 rounding.

    AdamW's first step moves each weight by about lr * g / (|g| + eps): where |g| is within a few
    decades of eps (1e-8), fp32 rounding noise in g (~1e-7 of the largest gradient: a gradient
    of 1e-7 came out 7e-8 or 1.1e-7 depending on summation order) moves the weight by a visible
    fraction of lr. So weights whose gradient exceeds 1e-5 of the largest are held to lr/20 (a
    different step moves most weights by ~lr), and all weights to 1e-6 almost everywhere."""
    assert sum(r["loss"] for r in ranks) / len(ranks) == pytest.approx(one["loss"], rel=1e-5)
    for r in ranks:
        for k, g in one["grads"].items():
            torch.testing.assert_close(r["grads"][k], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()), msg=k)
        for k, w in one["weights"].items():
            g = one["grads"][k].abs()
            big = g > 1e-5 * float(g.max())  # where rounding cannot move g / (|g| + eps) visibly
            torch.testing.assert_close(r["weights"][k][big], w[big], rtol=0, atol=lr / 20, msg=k)
            assert ((r["weights"][k] - w).abs() > 1e-6).float().mean() < 1e-3, k


def test_two_process_ddp_step_is_one_step_on_the_whole_batch(tiny_qwen3, seqs, tmp_path):
    """DDP (gloo, 2 processes, one row each, the same fixed anchors) takes the step one process
    takes on both rows; a comm hook that sums instead of averaging fails the same check. AdamW's
    first step and gradient clipping are scale-free, so summed gradients leave the weights after
    one step as they are: the reduced gradients themselves are compared."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seq_lists = [(list(s), p) for s, p in seqs]
    mp.spawn(_ddp_worker, args=(2, port, str(tmp_path), seq_lists), nprocs=2, join=True)
    got = {how: [torch.load(tmp_path / f"rank{r}.pt", weights_only=True)[how] for r in range(2)]
           for how in ("mean", "sum")}

    m = _drafter(tiny_qwen3, True, seqs)
    start = {k: w.detach().clone() for k, w in m.named_parameters()}
    one = _step(_objective(tiny_qwen3, m, "dflow", 3), m, _batch(seqs), _anchors(seqs, DDP_OFFSETS))
    assert all(g.abs().max() > 0 for g in one["grads"].values())  # every parameter learns in this step
    moved = torch.cat([(one["weights"][k] - w).abs().flatten() for k, w in start.items()])
    assert (moved > LR / 2).float().mean() > 0.9  # the step moves most weights by ~lr: lr/20 is a tight bound
    _check_same_step(one, got["mean"], LR)
    for k in one["weights"]:  # the replicas stay in sync
        assert torch.equal(got["mean"][0]["weights"][k], got["mean"][1]["weights"][k])
    with pytest.raises(AssertionError):
        _check_same_step(one, got["sum"], LR)
