"""Speculative sampling against the target's *exact* distribution, over whole generated sequences.

A tiny target (16-token vocabulary) gives every conditional exactly: one teacher-forced forward
over each generated sequence yields p_t(. | prefix) at every position. Two one-sample statistics:
- the randomised probability integral transform: u_t = P(tokens ranked above x_t) + U * p_t(x_t),
  tokens ranked by the target's probability; exact sampling makes the u_t i.i.d. uniform
  (Rosenblatt), a chi-square over 20 bins tests it;
- the log-probability score: sum_t (log p_t(x_t) + H(p_t)), standardised by its exact variance, is
  N(0, 1) under exact sampling; flattening or sharpening moves it.
Both see every generated token after the prompt (10 per row), so hints (round 2 on), shortened
rounds under a verify threshold and full-block bonuses all fall inside the compared window. A
token the processed distribution gives probability 0 (outside top-k / top-p) fails outright.

Power (stated and tested below): at N = 1200 rows x 10 tokens, the test rejects plain sampling at
temperature 1.1 checked against 1.0, and each planted speculative-sampling bug.
"""

import dataclasses

import pytest
import torch
from scipy.stats import chisquare, norm

from conftest import SMALL_VOCAB as V, CloseDrafter
from dflow_trt.decoding import acceptance, policy
from dflow_trt.decoding.acceptance import rejection_sample
from dflow_trt.decoding.loop import generate
from dflow_trt.decoding.options import DecodeOptions
from dflow_trt.decoding.sampling import SamplingParams, processed_probs

N, K = 1200, 10  # rows, generated tokens compared per row
N_HINTS = 2400  # rows where hints are judged on their own slots (~1 in 20 tokens)
PROMPT = [1, 2, 3]
ALPHA = 5e-4  # per statistic; two statistics: a correct sampler fails a case with probability <= 1e-3


@pytest.fixture(scope="module")
def target(small_target):
    return small_target


@torch.no_grad()
def exact_pvalues(target, rows: list[list[int]], params: SamplingParams, seed: int = 0,
                  where: torch.Tensor | None = None) -> tuple[float, float]:
    """(PIT chi-square p, log-probability score p) of `rows` under the target's processed distribution.
    `where` [N, K] bool: judge only those positions (chosen from what came before them)."""
    ids = torch.tensor([PROMPT + r[:K] for r in rows], device=target.device)  # [N, P+K]
    assert ids.shape == (len(rows), len(PROMPT) + K), "every row must generate K tokens"
    logits = target.model(input_ids=ids).logits[:, len(PROMPT) - 1:-1].float()  # [N, K, V]: p_t(. | prefix)
    probs = processed_probs(logits, params).double().cpu()  # [N, K, V]
    x = ids[:, len(PROMPT):].cpu()  # [N, K]
    px = probs.gather(-1, x[..., None])[..., 0]  # [N, K]
    assert (px > 0).all(), f"{int((px == 0).sum())} tokens the distribution rules out (top-k / top-p)"
    if where is not None:
        probs, x, px = probs[where], x[where], px[where]  # [M, V], [M], [M]
    # rank tokens by probability (ties by id): the mass ranked strictly above x_t
    ids_v = torch.arange(V)
    above = (probs > px[..., None]) | ((probs == px[..., None]) & (ids_v < x[..., None]))
    u = (probs * above).sum(-1) + torch.rand(px.shape, generator=torch.Generator().manual_seed(seed),
                                             dtype=torch.float64) * px
    counts = torch.histc(u.float(), bins=20 if u.numel() > 2000 else 10, min=0.0, max=1.0)
    p_pit = chisquare(counts.numpy()).pvalue
    logp = probs.clamp_min(1e-300).log()
    mean = (probs * logp).sum(-1)  # E[log p] = -H
    var = (probs * logp ** 2).sum(-1) - mean ** 2
    z = float((px.log() - mean).sum() / var.sum().sqrt())
    return float(p_pit), float(2 * norm.sf(abs(z)))


def _check(target, rows, params):
    p_pit, p_score = exact_pvalues(target, rows, params)
    assert p_pit > ALPHA and p_score > ALPHA, f"not the target's distribution: PIT p={p_pit:.2e}, score p={p_score:.2e}"


def _reject(target, rows, params):
    p_pit, p_score = exact_pvalues(target, rows, params)
    assert min(p_pit, p_score) < ALPHA, f"the test missed a biased sampler: PIT p={p_pit:.2e}, score p={p_score:.2e}"


class _Written(CloseDrafter):
    """CloseDrafter that is told which drafts the loop sent (hints may replace some), since it
    rebuilds each row's committed tokens from its own last drafts."""

    def attach(self, monkeypatch, spy: dict):
        real = policy.take_hints

        def hints(prop, flow, trust):
            out = real(prop, flow, trust)
            took = out.draft_ids != prop.draft_ids  # [B, K]: draft k+1 replaced
            spy["taken"] += int(took.sum())
            for b, p in enumerate(self.state["pos"].tolist()):
                spy["at"][(b, p)] = [k + 1 for k in took[b].nonzero()[:, 0].tolist()]
            self.state["drafts"] = out.draft_ids.tolist()
            return out

        monkeypatch.setattr(policy, "take_hints", hints)
        return self


def _decode(target, mode, params, block=4, threshold=0.0, trust=0.5, drafter_t=1.3, monkeypatch=None):
    spy = {"taken": 0, "at": {}}
    drafter = None
    if mode != "ar":
        drafter = _Written(target.model, block, uses_flow=mode == "dflow", prompt=PROMPT, temperature=drafter_t)
        if mode == "dflow":
            drafter.attach(monkeypatch, spy)
    n = N_HINTS if trust == 1.0 else N
    res = generate(target, drafter, [PROMPT] * n, DecodeOptions(mode=mode, max_new_tokens=K, sampling=params, stop_token_ids=(), verify_threshold=threshold, hint_trust=trust))
    return res, spy


def hint_positions(res, spy) -> torch.Tensor:
    """[N, K] bool: generated positions whose token came from a round in which a verifier hint
    stood at that block slot and the drafts before it were accepted. The choice depends only on
    what came before the position, so the tokens there must still follow the target exactly."""
    where = torch.zeros(len(res.token_ids), K, dtype=torch.bool)
    for b, lens in enumerate(res.acceptance_lengths):
        pos = len(PROMPT)  # anchor of the row's first round, as an index into prompt + generated
        for a in lens:
            for k in spy["at"].get((b, pos), []):
                if k <= a and pos + k - len(PROMPT) < K:
                    where[b, pos + k - len(PROMPT)] = True
            pos += a
    return where


CASES = {  # name: (mode, sampling, block, verify threshold, hint trust, drafter's temperature on the target's logits)
    "ar T0.7": ("ar", SamplingParams(0.7, seed=1), 1, 0.0, 0.5, None),
    "dflash T0.7": ("dflash", SamplingParams(0.7, seed=2), 4, 0.0, 0.5, 1.3),
    "dflash T1.3 top-k 6": ("dflash", SamplingParams(1.3, top_k=6, seed=3), 4, 0.0, 0.5, 1.3),
    "dflow T0.8 top-p 0.8": ("dflow", SamplingParams(0.8, top_p=0.8, seed=4), 4, 0.0, 0.5, 1.3),
    # hints: a flat target (T 2) so the verifier's guess is often wrong, block 8 for many flow slots
    "dflow hints T2": ("dflow", SamplingParams(2.0, seed=5), 8, 0.0, 1.0, 4.0),
    "dflow threshold T1.2": ("dflow", SamplingParams(1.2, top_k=10, seed=6), 5, 0.3, 0.5, 1.3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_sampling_is_the_target_distribution(target, monkeypatch, name):
    mode, params, block, threshold, trust, drafter_t = CASES[name]
    res, spy = _decode(target, mode, params, block, threshold, trust, drafter_t, monkeypatch)
    _check(target, res.token_ids, params)
    if mode != "ar":
        flat = [a for row in res.acceptance_lengths for a in row]
        assert 1 in flat and max(flat) >= 3, "rejections and multi-token commits must both occur"
        assert block in flat or threshold, "some round must accept the whole block (bonus path)"
    if trust == 1.0:
        where = hint_positions(res, spy)
        assert where.sum() > 300, "too few verifier hints inside the compared window"
        p_pit, p_score = exact_pvalues(target, res.token_ids, params, where=where)
        assert p_pit > ALPHA and p_score > ALPHA, f"tokens at hinted slots: PIT p={p_pit:.2e}, score p={p_score:.2e}"
    if threshold:
        assert res.verified_drafts < sum(map(len, res.acceptance_lengths)) * (block - 1), "no round was shortened"


def test_power_temperature(target):
    """A biased sampler of small effect: plain sampling at temperature 1.1 judged against 1.0."""
    res = generate(target, None, [PROMPT] * N, DecodeOptions(mode="ar", max_new_tokens=K, sampling=SamplingParams(1.1, seed=9), stop_token_ids=()))
    _reject(target, res.token_ids, SamplingParams(1.0))


def _bug_resample_from_target(draft_ids, draft_probs, target_probs, generator=None, num_drafts=None):
    n, _ = rejection_sample(draft_ids, draft_probs, target_probs, generator, num_drafts)
    at = target_probs[torch.arange(len(n)), n]  # the target itself, not norm(max(p - q, 0))
    return n, torch.multinomial(at, 1, generator=generator)[:, 0]


def _bug_bonus_from_residual(draft_ids, draft_probs, target_probs, generator=None, num_drafts=None):
    """Under a verify threshold a row that accepts all it proposed must draw from the target at
    the next slot; this one draws from the residual against the unproposed draft there."""
    n, nxt = rejection_sample(draft_ids, draft_probs, target_probs, generator, num_drafts)
    if num_drafts is None:
        return n, nxt
    rows = torch.arange(len(n))
    short = (n < draft_ids.shape[1]) & (n == num_drafts)  # accepted all it proposed, in a shortened block
    res = (target_probs[rows, n] - draft_probs[rows, n.clamp(max=draft_ids.shape[1] - 1)]).clamp(min=0) + 1e-12
    wrong = torch.multinomial(res / res.sum(-1, keepdim=True), 1, generator=generator)[:, 0]
    return n, torch.where(short, wrong, nxt)


def _bug_hint_keeps_drafter_probs(real):
    def hints(prop, flow, trust):
        return dataclasses.replace(real(prop, flow, trust), draft_probs=prop.draft_probs)
    return hints


@pytest.mark.parametrize("bug", ["resample from target", "bonus from residual", "hint keeps q"])
def test_power_planted_bugs(target, monkeypatch, bug):
    """Each plausible bug, planted alone into the real loop, is rejected by the same statistics."""
    if bug == "resample from target":
        monkeypatch.setattr(acceptance, "rejection_sample", _bug_resample_from_target)
        name = "dflash T0.7"
    elif bug == "bonus from residual":
        monkeypatch.setattr(acceptance, "rejection_sample", _bug_bonus_from_residual)
        name = "dflow threshold T1.2"
    else:
        monkeypatch.setattr(policy, "take_hints", _bug_hint_keeps_drafter_probs(policy.take_hints))
        name = "dflow hints T2"
    mode, params, block, threshold, trust, drafter_t = CASES[name]
    res, spy = _decode(target, mode, params, block, threshold, trust, drafter_t, monkeypatch)
    if bug == "hint keeps q":  # judged where hints stood, as the correct case is
        p_pit, p_score = exact_pvalues(target, res.token_ids, params, where=hint_positions(res, spy))
        assert min(p_pit, p_score) < ALPHA, (p_pit, p_score)
    else:
        _reject(target, res.token_ids, params)


def test_acceptance_rate_is_sum_min_p_q(target, monkeypatch):
    """A draft judged at block position k (drafts 1..k-1 accepted) is accepted with probability
    sum_x min(p(x), q(x)), p and q conditioned on the same committed prefix: the measured count
    over every judged draft of every round against that exact value (z-test)."""
    params = SamplingParams(1.0, seed=21)
    drafter = _Written(target.model, 4, uses_flow=False, prompt=PROMPT)
    seen = {}  # (row, anchor position) -> q of every draft [S-1, V]
    real = drafter.draft

    def draft(state, ctx, lens, anchor_ids, anchor_pos, *rest, **kw):
        prop = real(state, ctx, lens, anchor_ids, anchor_pos, *rest, **kw)
        for b, p in enumerate(anchor_pos.tolist()):
            seen[(b, p)] = prop.draft_probs[b].double().cpu()
        return prop

    drafter.draft = draft
    res = generate(target, drafter, [PROMPT] * N, DecodeOptions(mode="dflash", max_new_tokens=K, sampling=params, stop_token_ids=()))
    ids = torch.tensor([PROMPT + r for r in res.token_ids], device=target.device)
    with torch.no_grad():
        probs = processed_probs(target.model(input_ids=ids).logits.float(), params).double().cpu()  # [N, T, V]
    expected, var, accepted, judged = 0.0, 0.0, 0, [0] * 3
    for b, lens in enumerate(res.acceptance_lengths):
        pos = len(PROMPT)  # the first anchor (the prefill's token) sits right after the prompt
        for a in lens:  # a = accepted + 1: drafts 1..a-1 accepted, draft a (if any) rejected
            q = seen[(b, pos)]
            for k in range(1, min(a, q.shape[0]) + 1):  # draft k was judged; p of the token at pos + k
                if pos + k - 1 < ids.shape[1]:
                    m = float(torch.minimum(probs[b, pos + k - 1], q[k - 1]).sum())
                    expected, var, accepted = expected + m, var + m * (1 - m), accepted + (a > k)
                    judged[k - 1] += 1
            pos += a
    z = (accepted - expected) / var ** 0.5
    assert min(judged) > 200 and abs(z) < 4, (judged, accepted, expected, z)


def test_sampling_over_onnxruntime_is_the_target_distribution(target, tmp_path_factory, monkeypatch):
    """The same check with the exported target graph verifying (ONNX Runtime back end)."""
    from dflow_trt.backends.onnxruntime import OrtTarget
    from dflow_trt.export.onnx_target import export_target

    ort = OrtTarget(export_target(target, tmp_path_factory.mktemp("onnx") / "target"))
    params = SamplingParams(0.8, top_k=12, seed=31)
    drafter = _Written(target.model, 4, uses_flow=True, prompt=PROMPT)
    spy = {"taken": 0, "at": {}}
    drafter.attach(monkeypatch, spy)
    res = generate(ort, drafter, [PROMPT] * N, DecodeOptions(mode="dflow", max_new_tokens=K, sampling=params, stop_token_ids=()))
    flat = [a for row in res.acceptance_lengths for a in row]
    assert 1 in flat and 4 in flat, "rejections and full blocks must both occur"
    _check(target, res.token_ids, params)
