import torch

from dflow_trt.decoding.flow import carry_flow, right_align


def _block(B, S, F=3):
    ids = torch.arange(B * S).view(B, S) + 100
    taps = torch.arange(B * S * F, dtype=torch.float32).view(B, S, F) + 1
    return ids, taps


def test_carries_exactly_the_rejected_positions_aligned_with_next_block():
    S = 6
    ids, taps = _block(4, S)
    num_acc = torch.tensor([0, 2, 4, 5])  # a accepted drafts of S-1 = 5
    flow = carry_flow(ids, taps, ids + 1000, num_acc)
    for b, a in enumerate(num_acc.tolist()):
        # block slot i sits at L+i; rejected slots a+1..S-1; next block starts at L+a+1
        n_carried = S - 1 - a
        assert flow.valid[b].tolist() == [True] * n_carried + [False] * (S - n_carried)
        for j in range(n_carried):
            assert torch.equal(flow.taps[b, j], taps[b, a + 1 + j])
            assert flow.token_ids[b, j] == ids[b, a + 1 + j]
            assert flow.hint_ids[b, j] == ids[b, a + 1 + j] + 1000
        assert (flow.taps[b, n_carried:] == 0).all() and (flow.token_ids[b, n_carried:] == 0).all()


def test_nothing_carried_after_full_acceptance():
    ids, taps = _block(2, 4)
    flow = carry_flow(ids, taps, ids, torch.tensor([3, 3]))
    assert not flow.valid.any()
    assert (flow.taps == 0).all()


def test_committed_slots_never_in_flow():
    ids, taps = _block(1, 8)
    for a in range(8):
        flow = carry_flow(ids, taps, ids, torch.tensor([a]))
        carried = set(flow.token_ids[0][flow.valid[0]].tolist())
        committed = set(ids[0, : a + 1].tolist())
        assert not carried & committed


def test_right_align_moves_left_padding_to_the_end():
    x = torch.tensor([[0, 0, 1, 2], [3, 4, 5, 6], [0, 0, 0, 7]])
    out = right_align(x, torch.tensor([2, 4, 1]))
    assert out[0, :2].tolist() == [1, 2] and out[1].tolist() == [3, 4, 5, 6] and out[2, 0] == 7
