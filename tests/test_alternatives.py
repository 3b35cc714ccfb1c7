"""First-draft alternatives: the target verifies the drafter's runner-ups for draft 1 as a token tree
beside the chain. Lossless against plain greedy decoding; the tree pass itself matches chain passes."""

import pytest
import torch

from conftest import PROMPTS_TEXT, OracleDrafter, assert_greedy_equivalent, chat_ids
from dflow_trt.decoding.acceptance import accept_alternative
from dflow_trt.decoding.interfaces import Proposal
from dflow_trt.decoding.loop import generate
from dflow_trt.decoding.policy import alternative_counts
from dflow_trt.decoding.options import DecodeOptions
from dflow_trt.decoding.sampling import SamplingParams
from dflow_trt.drafter.defaults import untrained_config
from dflow_trt.drafter.io import build_drafter
from dflow_trt.drafter.runtime import TorchDrafter
from dflow_trt.errors import UserError
from dflow_trt.targets.hf_target import tree_ancestors


def _prompts(target, n):
    return [chat_ids(target, t) for t in PROMPTS_TEXT[:n]]


class RunnerUpOracle(OracleDrafter):
    """The target's own continuation, with draft 1 made wrong in seeded rounds and the right token
    hidden among the runner-ups at a seeded rank (or left out), so every acceptance path is taken:
    the chain, an alternative, none."""

    def __init__(self, sequences, block_size, vocab, seed=0, per_row_conf=False):
        super().__init__(sequences, block_size)
        self.g, self.vocab, self.per_row_conf = torch.Generator().manual_seed(seed), vocab, per_row_conf
        self.hidden = []  # per round: rows whose right draft 1 was offered among the runner-ups [B] bool

    def draft(self, *args):
        ids = super().draft(*args).draft_ids  # [B, K]
        B, K = ids.shape
        right = ids[:, 0].clone()
        wrong = torch.rand(B, generator=self.g) < 0.6
        ids[:, 0] = torch.where(wrong, (right + 1) % self.vocab, right)
        alts = (right[:, None] + 2 + torch.arange(4)[None, :]) % self.vocab  # [B, 4] all wrong
        rank = torch.randint(0, 5, (B,), generator=self.g)  # 4: the right token is not offered
        hide = wrong & (rank < 4)
        alts[hide, rank[hide]] = right[hide]
        self.hidden.append(hide)
        conf = torch.full((B, K), 0.9)
        alt_conf = torch.tensor([0.6, 0.4, 0.1, 0.02]).repeat(B, 1)
        if self.per_row_conf:  # rows propose different numbers of runner-ups under a threshold, some none
            alt_conf = alt_conf * torch.rand(B, 1, generator=self.g) * 2
        return Proposal(draft_ids=ids, draft_probs=None, confidence=conf, alt_ids=alts, alt_conf=alt_conf)


@pytest.mark.parametrize("S,threshold", [(4, 0.0), (8, 0.5), (16, 0.05)])
def test_alternatives_are_lossless_batched_and_single(tiny_qwen3, S, threshold):
    prompts, max_new = _prompts(tiny_qwen3, 5), 32
    # rows done early keep drafting while the batch finishes: the reference runs well past max_new
    ar_long = [generate(tiny_qwen3, None, [p], DecodeOptions(mode="ar", max_new_tokens=4 * max_new, stop_token_ids=())).token_ids[0] for p in prompts]
    ar = [a[:max_new] for a in ar_long]
    seqs = [p + a for p, a in zip(prompts, ar_long)]
    for mode in ("dflash", "dflow"):
        d = RunnerUpOracle(seqs, S, tiny_qwen3.info.vocab_size)
        res = generate(tiny_qwen3, d, prompts, DecodeOptions(mode=mode, max_new_tokens=max_new, stop_token_ids=(), verify_threshold=threshold, alternatives=4))
        assert res.token_ids == ar, (mode, S, threshold)
        assert res.alternatives_taken > 0
        n_rounds = sum(map(len, res.acceptance_lengths))
        if threshold == 0:  # every round sends the whole chain and all four runner-ups
            assert res.verified_drafts == n_rounds * (S - 1 + 4)
            # a row offered the right token as a runner-up takes it, and its next round carries no flow
            # (the chain's states there read the rejected draft 1, not the alternative)
            # (counted for rows still decoding: row b decodes in round r + 1 while it has r + 1 lengths)
            assert res.alternatives_taken == sum(bool(h[b]) for r, h in enumerate(d.hidden)
                                                 for b, lens in enumerate(res.acceptance_lengths) if len(lens) > r)
            if mode == "dflow":
                took = [b for r, h in enumerate(d.hidden[:res.rounds - 1]) for b in h.nonzero()[:, 0].tolist()
                        if not d.flows[r + 1].valid[b].any()]
                assert len(took) == sum(int(h.sum()) for h in d.hidden[:res.rounds - 1]) > 0
                # while a row whose draft 1 was rejected with no runner-up right carries the rest of its chain
                missed = [(r, b) for r, h in enumerate(d.hidden[:res.rounds - 1]) for b in range(len(h))
                          if not h[b] and d.flows[r + 1].valid[b].any()]
                assert missed
        single = [generate(tiny_qwen3, RunnerUpOracle([s], S, tiny_qwen3.info.vocab_size, seed=i), [p], DecodeOptions(mode=mode, max_new_tokens=max_new, stop_token_ids=(), verify_threshold=threshold, alternatives=4)).token_ids[0]
                  for i, (s, p) in enumerate(zip(seqs, prompts))]
        assert single == ar
        # the same drafts without alternatives: same tokens, fewer per round
        chain = generate(tiny_qwen3, RunnerUpOracle(seqs, S, tiny_qwen3.info.vocab_size), prompts, DecodeOptions(mode=mode, max_new_tokens=max_new, stop_token_ids=(), verify_threshold=threshold))
        assert chain.token_ids == ar and chain.alternatives_taken == 0
        assert chain.tau < res.tau
        mixed = generate(tiny_qwen3, RunnerUpOracle(seqs, S, tiny_qwen3.info.vocab_size, seed=7, per_row_conf=True), prompts, DecodeOptions(mode=mode, max_new_tokens=max_new, stop_token_ids=(), verify_threshold=max(threshold, 0.05), alternatives=4))
        assert mixed.token_ids == ar and mixed.alternatives_taken > 0


def test_real_drafter_with_alternatives_is_lossless(tiny_qwen3):
    """A real drafter's own runner-ups (`propose`), not an oracle's: the seeded drafter whose drafts
    vary with the context (tests/doubles.py), all seven runner-ups sent at threshold 0."""
    from doubles import varied_drafter

    prompts, max_new = _prompts(tiny_qwen3, 4), 24
    ar = [generate(tiny_qwen3, None, [p], DecodeOptions(mode="ar", max_new_tokens=max_new, stop_token_ids=())).token_ids[0] for p in prompts]
    for flow, mode in ((False, "dflash"), (True, "dflow")):
        d = TorchDrafter(varied_drafter(tiny_qwen3, flow=flow, block_size=8))
        for threshold in (0.0, 0.01):
            res = generate(tiny_qwen3, d, prompts, DecodeOptions(mode=mode, max_new_tokens=max_new, stop_token_ids=(), verify_threshold=threshold, alternatives=7))
            for p, got, want in zip(prompts, res.token_ids, ar):
                assert_greedy_equivalent(tiny_qwen3, p, got, want, max_new_tokens=max_new)
            if threshold == 0:
                assert res.verified_drafts == sum(map(len, res.acceptance_lengths)) * (7 + 7), "runner-ups not sent"


def test_greedy_proposal_alternatives_are_the_runner_ups():
    """`propose` (greedy, alternatives=A): draft 1 is the argmax, `alt_ids` the next A tokens best
    first (in target ids) and `alt_conf` their probabilities; draft 1 is never among them."""
    from dflow_trt.decoding.sampling import propose

    g = torch.Generator().manual_seed(0)
    V, Vd, A = 50, 20, 3
    draft_vocab = torch.randperm(V, generator=g)[:Vd]
    logits = torch.randn(6, 4, Vd, generator=g) * 2
    prop = propose(logits, draft_vocab, V, SamplingParams(), None, alternatives=A)
    probs = logits.softmax(-1)
    top = probs[:, 0].topk(A + 1, -1)
    assert torch.equal(prop.draft_ids, draft_vocab[logits.argmax(-1)])
    assert torch.equal(prop.alt_ids, draft_vocab[top.indices[:, 1:]])
    torch.testing.assert_close(prop.alt_conf, top.values[:, 1:])
    assert not (prop.alt_ids == prop.draft_ids[:, :1]).any()


@pytest.mark.slow
def test_shipped_drafters_with_alternatives_are_lossless(smollm2):
    from dflow_trt.drafter.defaults import load_target_and_drafter

    prompts, max_new = _prompts(smollm2, 4), 32
    ar = generate(smollm2, None, prompts, DecodeOptions(mode="ar", max_new_tokens=max_new, stop_token_ids=())).token_ids
    for mode in ("dflash", "dflow"):
        target, model = load_target_and_drafter("smollm2-135m", None, mode, target=smollm2)
        for S in (4, 16):
            res = generate(target, TorchDrafter(model), prompts, DecodeOptions(block_size=S, mode=mode, max_new_tokens=max_new, stop_token_ids=(), verify_threshold=0.05, alternatives=7))
            assert res.token_ids == ar, (mode, S)
            assert res.alternatives_taken > 0  # the shipped drafters' runner-ups do get accepted


def test_tree_verify_matches_chain_verifies(tiny_qwen3):
    """One tree pass [anchor, d1, d2, a1, a2] gives the chain rows' logits of a chain pass, and each
    alternative's logits of a pass over [anchor, alternative]; committing an alternative's branch
    leaves the cache a chain pass over that branch would."""
    t = tiny_qwen3
    prompts = _prompts(t, 2)
    ids = torch.zeros(2, max(map(len, prompts)), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, ids.shape[1] - len(p):] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts])
    block = torch.tensor([[5, 6, 7, 8, 9], [15, 16, 17, 18, 19]])
    parents = torch.tensor([-1, 0, 1, 0, 0])

    cache, _ = t.prefill(ids, lens)
    tree = t.verify(cache, block, parents)
    for cols, keep in (([0, 1, 2], 3), ([0, 3], 2), ([0, 4], 2)):
        ref_cache, _ = t.prefill(ids, lens)
        ref = t.verify(ref_cache, block[:, cols])
        torch.testing.assert_close(tree.logits[:, cols], ref.logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(tree.logits[:, cols].argmax(-1), ref.logits.argmax(-1))
    # keep [anchor, a1] in row 0 and [anchor, d1, d2] in row 1, then decode one more token
    path = torch.tensor([[0, 3, 2, 3, 4], [0, 1, 2, 3, 4]])
    t.commit(cache, torch.tensor([2, 3]), path)
    nxt = t.verify(cache, torch.tensor([[1], [1]]))
    for b, kept in ((0, [5, 8]), (1, [15, 16, 17])):
        ref_cache, _ = t.prefill(ids[b:b + 1], lens[b:b + 1])
        t.verify(ref_cache, torch.tensor([kept]))
        t.commit(ref_cache, torch.tensor([len(kept)]))
        ref = t.verify(ref_cache, torch.tensor([[1]]))
        torch.testing.assert_close(nxt.logits[b], ref.logits[0], rtol=1e-4, atol=1e-4)


def test_tree_needs_sdpa_attention_and_a_refused_tree_leaves_the_cache_usable(tiny_qwen3):
    from dflow_trt.targets import load_target

    eager = load_target("tiny-qwen3", num_taps=3)
    eager.model.set_attn_implementation("eager")  # adds a mask to the scores: a bool tree mask would not mask
    assert tiny_qwen3.supports_tree and not eager.supports_tree
    p = _prompts(tiny_qwen3, 1)
    d = TorchDrafter(build_drafter(eager, untrained_config(eager, flow=False, block_size=4)))
    with pytest.raises(UserError, match="chains only"):
        generate(eager, d, p, DecodeOptions(mode="dflash", max_new_tokens=4, alternatives=2))

    ids, lens = torch.tensor(p), torch.tensor([len(p[0])])
    cache, _ = tiny_qwen3.prefill(ids, lens)
    with pytest.raises(ValueError, match="parents"):
        tiny_qwen3.verify(cache, torch.tensor([[5, 6, 7]]), torch.tensor([-1, 2, 0]))
    with pytest.raises(ValueError, match="parents"):
        tiny_qwen3.verify(cache, torch.tensor([[5, 6, 7]]), torch.tensor([-1, 0]))
    got = tiny_qwen3.verify(cache, torch.tensor([[5, 6, 7]]))
    ref_cache, _ = tiny_qwen3.prefill(ids, lens)
    torch.testing.assert_close(got.logits, tiny_qwen3.verify(ref_cache, torch.tensor([[5, 6, 7]])).logits)


def test_accept_alternative_and_counts():
    alts = torch.tensor([[4, 5, 6], [4, 5, 6], [4, 5, 6], [7, 8, 9]])
    target_at_anchor = torch.tensor([5, 6, 5, 3])
    chain_acc = torch.tensor([0, 0, 1, 0])
    took = accept_alternative(alts, target_at_anchor, chain_acc, torch.tensor([3, 2, 3, 3]))
    # row 1's hit sits past its 2 proposed; row 2's chain already accepted draft 1; row 3 has no hit
    assert took.tolist() == [1, -1, -1, -1]
    conf = torch.tensor([[0.3, 0.06, 0.01], [0.04, 0.03, 0.02]])
    assert alternative_counts(conf, 3, 0.05).tolist() == [2, 0]
    assert alternative_counts(conf, 2, 0.0).tolist() == [2, 2]
    assert tree_ancestors([-1, 0, 1, 0]).tolist() == [
        [True, False, False, False], [True, True, False, False], [True, True, True, False], [True, False, False, True]]
    with pytest.raises(ValueError, match="parents"):
        tree_ancestors([-1, 2, 0])


def test_alternatives_bad_input(tiny_qwen3):
    p = _prompts(tiny_qwen3, 1)
    d = TorchDrafter(build_drafter(tiny_qwen3, untrained_config(tiny_qwen3, flow=False, block_size=4)))
    with pytest.raises(UserError, match="greedy"):
        generate(tiny_qwen3, d, p, DecodeOptions(mode="dflash", max_new_tokens=4, sampling=SamplingParams(temperature=1.0), alternatives=2))
    with pytest.raises(UserError, match="alternatives must be in"):
        generate(tiny_qwen3, d, p, DecodeOptions(mode="dflash", max_new_tokens=4, alternatives=99))

    class ChainOnly:  # a back end without tree verification (as ONNX Runtime's)
        info, tokenizer, supports_tree = tiny_qwen3.info, None, False

    with pytest.raises(UserError, match="chains only"):
        generate(ChainOnly(), d, p, DecodeOptions(mode="dflash", max_new_tokens=4, alternatives=2))
