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


def test_rejection_sampling_reads_each_slot_of_the_target():
    """Two drafts against a target whose distribution differs at every block slot: the accepted
    counts follow the per-slot acceptance rates, the token after a rejection at slot k is drawn from
    norm(max(p_k - q_k, 0)) of that slot, and after both drafts the bonus from the last slot's p_2.
    (With the same target at every slot, as above, a slot mix-up or a bonus read one slot early is
    invisible.)"""
    V, N = 6, 60000
    g = torch.Generator().manual_seed(11)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)  # target at block slots 0, 1, 2
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)  # the drafter's at drafts 1, 2
    d = torch.stack([torch.multinomial(q[k].expand(N, V), 1, generator=g)[:, 0] for k in range(2)], 1)  # [N, 2]
    a, nxt = rejection_sample(d, q.expand(N, 2, V).contiguous(), p.expand(N, 3, V).contiguous(), g)
    m = torch.minimum(p[:2], q).sum(-1).double()  # acceptance probability of each draft, given the ones before
    want = torch.stack([1 - m[0], m[0] * (1 - m[1]), m[0] * m[1]])
    counts = torch.bincount(a, minlength=3).double()
    assert chisquare(counts.numpy(), (want * N).numpy()).pvalue > 1e-3, (counts / N, want)
    for k in range(3):
        dist = (p[k] - q[k]).clamp(min=0) if k < 2 else p[2]  # recovered at slot k, or the bonus
        dist = (dist / dist.sum()).double()
        c = torch.bincount(nxt[a == k], minlength=V).double()
        keep = dist > 0
        assert (c[~keep] == 0).all(), f"slot {k}: a token outside its residual's support"
        assert chisquare(c[keep].numpy(), (dist[keep] / dist[keep].sum() * c.sum()).numpy()).pvalue > 1e-3, k
