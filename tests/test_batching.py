"""Continuous batching (issue 29): rows join a running batch after their own prefill and leave at
round boundaries, and each still decodes exactly what it decodes alone. First the loop's
`DecodeBatch.join`/`keep` on both batching back ends, then the transport-free scheduler with a
concurrent mix (modes, block sizes, lengths, stop tokens, greedy and sampled, a cancellation)."""

import dataclasses
import threading

import pytest
import torch
from scipy.stats import chi2_contingency

from conftest import assert_greedy_equivalent, chat_prompts
from dflow_trt.backends.static import StaticTarget
from dflow_trt.decoding.loop import DecodeBatch, can_batch, generate
from dflow_trt.decoding.options import DecodeOptions
from dflow_trt.decoding.sampling import SamplingParams
from dflow_trt.drafter.defaults import load_target_and_drafter, untrained_config
from dflow_trt.drafter.io import build_drafter
from dflow_trt.drafter.runtime import TorchDrafter
from dflow_trt.serving.requests import Busy
from dflow_trt.serving.scheduler import Done, Scheduler

N_NEW = 40


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def good(good_drafters):
    """{mode: (target, TorchDrafter)} with the trained test drafters (multi-token commits, flow)."""
    out = {}
    for mode in ("dflash", "dflow"):
        target, model = load_target_and_drafter("tiny-qwen3", str(good_drafters[mode]), mode, warn=lambda m: None)
        out[mode] = (target, TorchDrafter(model))
    return out


def _alone(target, prompt, n, mode="ar", drafter=None, **kw):
    return generate(target, drafter, [prompt], DecodeOptions(mode=mode, max_new_tokens=n, **kw)).token_ids[0]


@pytest.mark.parametrize("backend", ["torch", "static"])
@pytest.mark.parametrize("mode", ["dflash", "dflow"])
def test_rows_joining_and_leaving_decode_as_alone(good, backend, mode):
    hf, drafter = good[mode]
    target = hf if backend == "torch" else StaticTarget(hf, max_len=256)
    assert can_batch(target, drafter)
    prompts = chat_prompts(hf, 4)
    o = DecodeOptions(mode=mode, max_new_tokens=N_NEW, block_size=8)
    want = [_alone(hf, p, N_NEW) for p in prompts]
    batch = DecodeBatch(target, drafter, prompts[:2], o)
    for _ in range(2):
        batch.round()
    flow_before = batch.flow
    batch.join(DecodeBatch(target, drafter, prompts[2:3], o))  # rows now at different lengths
    assert len(batch) == 3 and len(set(batch.anchor_pos.tolist())) == 3
    if mode == "dflow":
        assert flow_before is not None and bool(flow_before.valid.any())  # flow was carried across the join
        assert not batch.flow.valid[2].any()  # the newcomer carries none
    for _ in range(2):
        batch.round()
    left = batch.log.rows[1]
    if backend == "torch":
        holes = (~batch.cache.valid).sum().item()
        assert holes > 0  # rows that accepted different amounts left holes in the padded cache
    batch.keep([0, 2])  # row 1 leaves (cancelled) mid-decode
    if backend == "torch":  # ... which leaving squeezes out: each row's slots are a prefix, the width its longest
        v = batch.cache.valid
        assert torch.equal(v, torch.arange(v.shape[1])[None] < v.sum(1)[:, None]) and v.shape[1] == v.sum(1).max()
        assert batch.cache.kv.layers[0].keys.shape[2] == v.shape[1]
    batch.join(DecodeBatch(target, drafter, prompts[3:4], o))
    rows = [batch.log.rows[i] for i in range(3)]
    while not all(batch.log.done):
        batch.round()
        stay = [i for i, r in enumerate(batch.log.rows) if not r.done]
        if len(stay) < len(batch):
            batch.keep(stay)  # finished rows leave at once, as the scheduler does
    got = {0: rows[0].tokens, 2: rows[1].tokens, 3: rows[2].tokens}
    for i, toks in got.items():
        assert_greedy_equivalent(hf, prompts[i], toks, want[i], stop_token_ids=hf.info.eos_token_ids,
                                 max_new_tokens=N_NEW)
    assert want[1][:len(left.tokens)] == left.tokens and 1 < len(left.tokens) < N_NEW
    # the drafters really drafted in the batch: multi-token rounds
    assert max(a for r in rows for a in r.accept_lens) > 2
    assert len(batch) == 0 or all(r.done for r in batch.log.rows)


def _consume(job):
    """A request's view of its job: the tokens of every event, then the Done."""
    toks = []
    while True:
        ev = job.events.get(timeout=300)
        if isinstance(ev, Done):
            return toks, ev
        toks.extend(ev)


def test_scheduler_mix_gets_what_each_gets_alone(good):
    hf, dflow = good["dflow"]
    _, dflash = good["dflash"]
    prompts = chat_prompts(hf, 4)
    eos = hf.info.eos_token_ids
    ar_want = {i: _alone(hf, p, 48) for i, p in enumerate(prompts)}
    stop_tok = ar_want[1][10]  # a token the greedy decode of prompt 1 reaches: that request stops there
    mix = [  # (prompt, models, options)
        (0, dflow, DecodeOptions(mode="dflow", max_new_tokens=48, block_size=8)),
        (1, dflow, DecodeOptions(mode="dflow", max_new_tokens=48, block_size=8, stop_token_ids=(stop_tok,))),
        (2, dflow, DecodeOptions(mode="dflow", max_new_tokens=20, block_size=8)),
        (3, dflash, DecodeOptions(mode="dflash", max_new_tokens=32, block_size=8)),
        (0, dflash, DecodeOptions(mode="dflash", max_new_tokens=48, block_size=4)),
        (1, None, DecodeOptions(mode="ar", max_new_tokens=24)),
        (2, dflow, DecodeOptions(mode="dflow", max_new_tokens=48, block_size=8)),  # cancelled mid-stream
        (3, dflow, DecodeOptions(mode="dflow", max_new_tokens=48, block_size=8,
                                 sampling=SamplingParams(temperature=0.8))),
    ]
    sched = Scheduler(max_batch=8, max_queue=8, log=lambda m: None)
    peak = []
    real_round = sched._round

    def spy(key):  # records how many rows shared each batch's rounds
        peak.append(len(sched._batches[key][1]))
        real_round(key)

    sched._round = spy
    jobs = [sched.submit(hf, d, prompts[i], o) for i, d, o in mix]
    out = [None] * len(jobs)

    def read(k):
        toks = []
        while True:
            ev = jobs[k].events.get(timeout=300)
            if isinstance(ev, Done):
                out[k] = (toks, ev)
                return
            toks.extend(ev)
            if k == 6 and len(toks) >= 9:
                jobs[k].cancel.set()

    threads = [threading.Thread(target=read, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    sched.close()
    assert max(peak) >= 4, peak  # requests really shared a batch
    for k, (i, d, o) in enumerate(mix):
        toks, done = out[k]
        assert done.error is None, done.error
        assert done.result.token_ids[0][:len(toks)] == toks
        want = ar_want[i][:o.max_new_tokens]
        if k == 1:
            want = want[:want.index(stop_tok) + 1]
            assert toks == want and done.result.finish_reasons == ["stop"]
        elif k == 6:
            assert 9 <= len(toks) < 48 and toks == want[:len(toks)]
        elif k == 7:
            assert len(toks) == 48 or toks[-1] in eos  # sampled: its own length, checked for distribution below
        else:
            assert_greedy_equivalent(hf, prompts[i], toks, want, stop_token_ids=eos, max_new_tokens=o.max_new_tokens)
    assert max(a for k in (0, 3, 4) for a in out[k][1].result.acceptance_lengths[0]) > 2
    assert sched.state() == {"waiting": 0, "rows": 0, "batches": 0}


@pytest.mark.parametrize("budget", [0, 96])
def test_sampled_rows_sharing_a_batch_keep_the_target_distribution(small_target, budget, monkeypatch):
    """Sampled requests decoded as rows of shared batches (joining at different rounds) have the
    target's distribution: chi-square against plain sampling, first three tokens. With a verify
    budget the rows verify 96 // rows slots each (2 to 4): truncated blocks, truncated draft
    probabilities."""
    drafter = TorchDrafter(build_drafter(small_target, untrained_config(small_target, flow=True, block_size=4), seed=0))
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=12)
    n, K, prompt = 600, 3, [1, 2, 3]
    ar = generate(small_target, None, [prompt] * 2000,
                  DecodeOptions(mode="ar", max_new_tokens=K, sampling=SamplingParams(1.0, 0.95, 12, seed=5),
                                stop_token_ids=())).token_ids
    sched = Scheduler(max_batch=64, max_queue=n, log=lambda m: None)
    o = DecodeOptions(mode="dflow", block_size=4, sampling=params, stop_token_ids=(), verify_budget=budget)
    widths = _record_verify_widths(monkeypatch, small_target)
    jobs = [sched.submit(small_target, drafter, prompt, dataclasses.replace(o, max_new_tokens=3 + k % 5))
            for k in range(n)]
    got = [_consume(j) for j in jobs]
    sched.close()
    B_w = {(b, w) for b, w in widths if b > 1}
    if budget:  # the budget was applied: every row within its share, and shares that changed with the rows
        assert all(w <= max(2, budget // b) for b, w in B_w) and {2, 4} <= {w for _, w in B_w}, sorted(B_w)
    else:
        assert {w for _, w in B_w} == {4}
    taus = [a for _, d in got for a in d.result.acceptance_lengths[0]]
    assert max(taus) > 1  # drafts were accepted: rejection sampling ran on shared rows
    spec = [tuple(t[:K]) for t, _ in got]
    keys = sorted(set(map(tuple, (r[:K] for r in ar))) | set(spec))
    ca = [sum(tuple(r[:K]) == k for r in ar) for k in keys]
    cb = [sum(s == k for s in spec) for k in keys]
    keep = [(a, b) for a, b in zip(ca, cb) if a + b >= 10]
    rest = (sum(ca) - sum(a for a, _ in keep), sum(cb) - sum(b for _, b in keep))
    table = list(zip(*(keep + ([rest] if sum(rest) else []))))
    _, p, _, _ = chi2_contingency(table)
    assert p > 1e-3, p


def _record_verify_widths(monkeypatch, target) -> list[tuple[int, int]]:
    """Spy on `target.verify` for the test: (rows, slots) per call."""
    seen, real = [], target.verify

    def verify(cache, tokens, parents=None):
        seen.append(tuple(tokens.shape))
        return real(cache, tokens, parents)

    monkeypatch.setattr(target, "verify", verify)
    return seen


@pytest.mark.parametrize("mode", ["dflash", "dflow"])
@pytest.mark.parametrize("setting", ["whole-block", "cpu"])
def test_verify_budget_shares_the_pass_among_rows_and_keeps_the_output(good, mode, setting, monkeypatch):
    """A verify budget of 12 tokens: four rows verify 3 slots each (the cpu setting: 2 of the chain
    and one first-draft alternative), and once one row is left it verifies its whole block. Every
    row still decodes the target's greedy tokens."""
    hf, drafter = good[mode]
    prompts = chat_prompts(hf, 4)
    extra = {"verify_threshold": 0.05, "alternatives": 7} if setting == "cpu" else {}
    o = DecodeOptions(mode=mode, max_new_tokens=N_NEW, block_size=8, verify_budget=12, **extra)
    want = [_alone(hf, p, N_NEW) for p in prompts]
    widths = _record_verify_widths(monkeypatch, hf)
    batch = DecodeBatch(hf, drafter, prompts, o)
    for _ in range(3):
        batch.round()
    assert widths and all(w <= 3 for _, w in widths), widths
    rows = list(batch.log.rows)
    batch.keep([0])
    widths.clear()
    while not all(batch.log.done):
        batch.round()
    assert max(w for _, w in widths) > 3  # alone, the row has the whole budget again
    monkeypatch.undo()  # the greedy references below run on the target as it is
    for b in range(4):  # rows 1-3 left after three rounds: a prefix of their greedy decode
        got = rows[b].tokens
        if b == 0:
            assert_greedy_equivalent(hf, prompts[0], got, want[0], stop_token_ids=hf.info.eos_token_ids,
                                     max_new_tokens=N_NEW)
        else:
            assert got == want[b][:len(got)] and len(got) > 3
    assert max(a for r in rows for a in r.accept_lens) > 1  # drafts were accepted within the budget


def test_plan_within_a_budget_keeps_a_valid_prefix():
    from dflow_trt.decoding.policy import Plan

    chain, probs = torch.arange(12).view(2, 6), torch.rand(2, 5, 9)
    alts = torch.tensor([[20, 21, 22], [23, 24, 25]])
    p = Plan(chain, probs, torch.tensor([5, 2]), alts, torch.tensor([3, 1]), torch.zeros(2, 5, dtype=torch.bool))
    assert p.within(9) is p  # room for all: unchanged
    q = p.within(6)  # 3 alternatives kept, the chain cut to 3
    assert torch.equal(q.chain, chain[:, :3]) and torch.equal(q.draft_probs, probs[:, :2])
    assert q.proposed().tolist() == [2, 2] and q.proposed_alts().tolist() == [3, 1] and q.hinted.shape == (2, 2)
    r = p.within(3)  # the chain keeps anchor + one draft, one alternative
    assert r.chain.shape == (2, 2) and r.alts.tolist() == [[20], [23]] and r.proposed_alts().tolist() == [1, 1]
    assert r.parents.tolist() == [-1, 0, 0]
    s = p.within(1)  # below anchor + one draft: still anchor + one draft, no alternatives
    assert s.chain.shape == (2, 2) and s.alts is None and s.num_alts is None


def test_full_queue_answers_busy_and_close_ends_everyone(good):
    hf, dflow = good["dflow"]
    p = chat_prompts(hf, 1)[0]
    sched = Scheduler(max_batch=1, max_queue=1, log=lambda m: None)
    o = DecodeOptions(mode="dflow", max_new_tokens=200, block_size=8, stop_token_ids=())
    first = sched.submit(hf, dflow, p, o)
    first.events.get(timeout=300)  # running: its row holds the one batch slot
    second = sched.submit(hf, dflow, p, o)  # waits in the queue
    with pytest.raises(Busy, match="busy: 1 requests are waiting.*max_queue"):
        sched.submit(hf, dflow, p, o)
    sched.close()
    for job in (first, second):
        _, done = _consume(job)
        assert isinstance(done.error, Busy) and "shutting down" in str(done.error)
    assert sched.state() == {"waiting": 0, "rows": 0, "batches": 0}
    with pytest.raises(Busy, match="shutting down"):
        sched.submit(hf, dflow, p, o)


def test_a_bad_request_is_refused_before_it_joins(good):
    hf, dflow = good["dflow"]
    sched = Scheduler(max_batch=2, max_queue=2, log=lambda m: None)
    with pytest.raises(Exception, match="empty prompt"):
        sched.submit(hf, dflow, [], DecodeOptions(mode="dflow"))
    sched.close()
