import torch
from scipy.stats import chisquare

from dflow_trt.decoding.acceptance import greedy_accept, rejection_sample


def test_greedy_accept_longest_prefix_and_next_token():
    V = 10
    target_ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1]])
    logits = torch.nn.functional.one_hot(target_ids, V).float()
    drafts = torch.tensor([[1, 2, 3], [5, 0, 7], [9, 1, 1]])
    a, nxt = greedy_accept(drafts, logits)
    assert a.tolist() == [3, 1, 0]
    assert nxt.tolist() == [4, 6, 1]  # bonus after full acceptance, else the target's token at the miss
    # rows proposing fewer drafts stop there and take the target's token at the next slot
    a, nxt = greedy_accept(drafts, logits, torch.tensor([2, 3, 1]))
    assert a.tolist() == [2, 1, 0] and nxt.tolist() == [3, 6, 1]


def test_rejection_sampling_of_fewer_drafts_draws_the_bonus_from_the_target():
    V, N = 5, 20000
    target = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(2)) * 1.5, -1)
    draft = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(3)) * 1.5, -1)
    g = torch.Generator().manual_seed(4)
    d = torch.multinomial(draft.expand(N, V), 2, replacement=True, generator=g)  # [N, 2]
    a, nxt = rejection_sample(d, draft.expand(N, 2, V).contiguous(), target.expand(N, 3, V).contiguous(), g,
                              num_drafts=torch.ones(N, dtype=torch.long))
    assert a.max() == 1  # the second draft is never proposed
    # the token after the first accepted draft follows the target (bonus), not the residual
    counts = torch.bincount(nxt[a == 1], minlength=V).numpy()
    expected = target.double().numpy() * counts.sum()
    assert chisquare(counts, expected * counts.sum() / expected.sum()).pvalue > 1e-3


def test_rejection_sampling_output_follows_target_distribution():
    torch.manual_seed(0)
    V, N = 6, 40000
    target = torch.softmax(torch.randn(V) * 1.5, -1)
    draft = torch.softmax(torch.randn(V) * 1.5, -1)
    g = torch.Generator().manual_seed(1)
    d = torch.multinomial(draft.expand(N, V), 1, generator=g)  # [N, 1]
    tp = target.expand(N, 2, V).contiguous()
    a, nxt = rejection_sample(d, draft.expand(N, 1, V).contiguous(), tp, g)
    first = torch.where(a == 1, d[:, 0], nxt)  # the token committed at the first position
    counts = torch.bincount(first, minlength=V).numpy()
    assert chisquare(counts, target.numpy() * N).pvalue > 1e-3
    # acceptance rate is sum(min(p, q)), the known optimum
    assert abs(a.float().mean() - torch.minimum(target, draft).sum()) < 0.01
