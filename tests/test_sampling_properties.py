"""Properties rejection sampling relies on, checked on the pure functions with random inputs:
- the distribution a proposal reports (`draft_probs`) is the one its drafts were sampled from;
- its confidence, and every decision to replace or cut a draft, never depends on the sampled draft
  itself (else the proposal distribution the acceptance rule corrects for would be skewed)."""

import dataclasses

import pytest
import torch
from scipy.stats import chisquare

from dflow_trt.decoding.flow import take_hints
from dflow_trt.decoding.interfaces import FlowState, Proposal
from dflow_trt.decoding.sampling import SamplingParams, propose

V, VD, K, ROWS = 40, 12, 3, 40000


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.6, top_k=5), SamplingParams(1.7, top_p=0.7)])
def test_proposal_reports_the_distribution_it_sampled(params):
    g = torch.Generator().manual_seed(0)
    draft_vocab = torch.randperm(V, generator=g)[:VD]  # draft id -> target id, not sorted
    logits = (torch.randn(1, K, VD, generator=g) * 2).expand(ROWS, K, VD)  # one distribution per position
    prop = propose(logits, draft_vocab, V, params, torch.Generator().manual_seed(1))
    q = prop.draft_probs  # [ROWS, K, V]
    assert torch.allclose(q.sum(-1), torch.ones(ROWS, K))
    outside = torch.ones(V, dtype=torch.bool)
    outside[draft_vocab] = False
    assert (q[..., outside] == 0).all(), "mass outside the draft vocabulary"
    assert torch.equal(prop.confidence, q.amax(-1)), "confidence is the top probability"
    assert (prop.confidence == prop.confidence[0]).all(), "confidence varies with the sampled draft"
    for k in range(K):
        counts = torch.bincount(prop.draft_ids[:, k], minlength=V).double()
        assert (counts[q[0, k] == 0] == 0).all(), "a draft the reported distribution rules out"
        keep = q[0, k] > 0
        if int(keep.sum()) == 1:  # top-p kept one token: every draft must be it
            continue
        expected = q[0, k, keep].double()
        p = chisquare(counts[keep].numpy(), (expected / expected.sum() * ROWS).numpy()).pvalue
        assert p > 1e-4, f"position {k}: drafts do not follow draft_probs (p={p:.1e})"


def _random_hint_case(seed: int, B: int = 4000, S: int = 6):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S - 1), generator=g)
    probs = torch.softmax(torch.randn(B, S - 1, V, generator=g) * 2, -1)
    conf = probs.amax(-1)
    seen = torch.randint(0, V, (B, S), generator=g)
    agree = torch.rand(B, S, generator=g) < 0.6  # the flow saw the draft before slot j (hint qualifies)
    seen[:, 1:] = torch.where(agree[:, 1:], ids, seen[:, 1:])
    valid = torch.rand(B, S, generator=g) < 0.8
    valid = valid.long().cumprod(1).bool()  # flow slots form a prefix
    flow = FlowState(taps=torch.zeros(B, S, 1), token_ids=seen, hint_ids=torch.randint(0, V, (B, S), generator=g),
                     valid=valid)
    return Proposal(draft_ids=ids, draft_probs=probs, confidence=conf), flow


def _assert_decisions_ignore_the_draft(hints_fn, seed: int = 0, trust: float = 0.6) -> int:
    """Replacing draft i by another token must not change whether draft i is replaced (only what
    comes after it may change). Returns how many replacements were checked."""
    prop, flow = _random_hint_case(seed)
    guess = flow.hint_ids
    checked, out = 0, hints_fn(prop, flow, trust)
    for i in range(1, prop.draft_ids.shape[1]):
        other = (prop.draft_ids[:, i] + 1 + torch.randint(0, V - 2, (len(guess),))) % V
        other = torch.where(other == guess[:, i], (other + 1) % V, other)  # neither the draft nor the guess
        other = torch.where(other == prop.draft_ids[:, i], (other + 1) % V, other)
        ids = prop.draft_ids.clone()
        ids[:, i] = other
        alt = dataclasses.replace(prop, draft_ids=ids)
        out_alt = hints_fn(alt, flow, trust)
        rows = prop.draft_ids[:, i] != guess[:, i]  # where a replacement is visible in the output
        taken = out.draft_ids[:, i] == guess[:, i]
        taken_alt = out_alt.draft_ids[:, i] == guess[:, i]
        assert torch.equal(taken[rows], taken_alt[rows]), f"the decision at draft {i + 1} depends on that draft"
        # a taken hint is a point mass at the guess; an untaken draft keeps the drafter's distribution
        onehot = torch.nn.functional.one_hot(guess[:, i], V).float()
        t = taken & rows
        assert torch.equal(out.draft_probs[t, i], onehot[t])
        assert torch.equal(out.draft_probs[~taken, i], prop.draft_probs[~taken, i])
        checked += int(t.sum())
    return checked


def test_hint_decisions_never_depend_on_the_draft_they_replace():
    assert _assert_decisions_ignore_the_draft(take_hints) > 1000  # many replacements were judged


def test_the_property_catches_a_decision_on_the_sampled_draft():
    """Planted: a hint replaces a draft only when the drafter gave that very draft a low probability."""

    def biased(prop, flow, trust):
        p_draft = prop.draft_probs.gather(-1, prop.draft_ids[..., None])[..., 0]  # [B, K]
        return take_hints(dataclasses.replace(prop, confidence=p_draft), flow, trust)

    with pytest.raises(AssertionError, match="depends on that draft"):
        _assert_decisions_ignore_the_draft(biased)


def _reference_probs(logits: torch.Tensor, t: float, top_k: int, top_p: float) -> torch.Tensor:
    """The processed distribution written from its definition, one row at a time in float64:
    softmax(logits / t); keep the top_k most probable tokens; of those (renormalised), keep the most
    probable ones until their mass first reaches top_p; renormalise."""
    out = []
    for row in logits.double():
        p = torch.softmax(row / t, -1)
        order = p.argsort(descending=True).tolist()
        kept = order[:top_k] if top_k else order
        mass, keep, total = 0.0, [], float(p[kept].sum())
        for i in kept:
            keep.append(i)
            mass += float(p[i]) / total
            if mass >= top_p:
                break
        q = torch.zeros_like(p)
        q[keep] = p[keep]
        out.append(q / q.sum())
    return torch.stack(out)


@pytest.mark.parametrize("t,top_k,top_p", [(0.5, 0, 1.0), (1.7, 0, 1.0), (0.8, 5, 1.0), (1.0, 1, 1.0),
                                           (0.7, 0, 0.6), (1.3, 7, 0.9), (2.0, 0, 0.3)])
def test_processed_probs_is_the_defined_distribution(t, top_k, top_p):
    """`processed_probs` against a reference written from the definition. Every exact-distribution
    test compares sampled tokens with `processed_probs` itself, so a wrong temperature, top-k or
    top-p in it is invisible there: this is the check that sees it."""
    from dflow_trt.decoding.sampling import processed_probs

    logits = torch.randn(64, 30, generator=torch.Generator().manual_seed(5)) * 3  # no ties (continuous)
    got = processed_probs(logits, SamplingParams(t, top_p=top_p, top_k=top_k)).double()
    want = _reference_probs(logits, t, top_k, top_p)
    assert torch.equal(got > 0, want > 0), "a different support (a token too many or too few kept)"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_top_p_keeps_the_token_that_reaches_it():
    """Probabilities 0.5, 0.3, 0.2: top-p 0.75 keeps the first two (0.5 < 0.75 <= 0.8); 0.5 keeps one
    (the first token reaches it alone); 0.81 keeps all three."""
    from dflow_trt.decoding.sampling import processed_probs

    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    for top_p, n in ((0.75, 2), (0.5, 1), (0.81, 3), (1.0, 3)):
        got = processed_probs(logits, SamplingParams(1.0, top_p=top_p))[0]
        assert int((got > 0).sum()) == n, (top_p, got)
        torch.testing.assert_close(got[:n], torch.tensor([0.5, 0.3, 0.2])[:n] / [0.5, 0.8, 1.0, 1.0][n - 1])
