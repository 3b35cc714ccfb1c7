import pytest
import torch

from dflow_trt.decoding.flow import carry_flow, right_align, take_hints
from dflow_trt.decoding.interfaces import FlowState, Proposal


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


def _flow(seen, guess, n_valid):
    """FlowState over one block of 6 slots: slot j read token seen[j], the target guessed guess[j]."""
    B, S = len(seen), len(seen[0])
    valid = torch.arange(S)[None, :] < torch.tensor(n_valid)[:, None]
    return FlowState(taps=torch.zeros(B, S, 2), token_ids=torch.tensor(seen) * valid,
                     hint_ids=torch.tensor(guess) * valid, valid=valid)


def test_hint_replaces_a_draft_only_where_the_verifier_read_the_same_token():
    # slot j read seen[j]; its guess guess[j] is for slot j+1 (draft j+1 = index j)
    flow = _flow([[7, 11, 12, 13, 14, 15]], [[50, 51, 52, 53, 54, 55]], [5])
    drafts = torch.tensor([[11, 20, 21, 22, 23]])  # draft 1 == seen[1]: draft 2 may take guess[1]
    prop = take_hints(Proposal(drafts, None, torch.full((1, 5), 0.2)), flow, trust=0.5)
    assert prop.draft_ids.tolist() == [[11, 51, 21, 22, 23]]  # draft 3 kept: seen[2]=12 != new draft 2 (51)
    assert torch.allclose(prop.confidence[0], torch.tensor([0.2, 0.5, 0.2, 0.2, 0.2]))
    assert drafts.tolist() == [[11, 20, 21, 22, 23]]  # the input proposal is not modified


def test_taken_hints_chain_and_a_sure_drafter_keeps_its_draft():
    flow = _flow([[7, 11, 51, 52, 9, 9]], [[50, 51, 52, 53, 54, 55]], [6])
    drafts = torch.tensor([[11, 20, 21, 22, 23]])
    conf = torch.tensor([[0.9, 0.2, 0.3, 0.6, 0.1]])
    prop = take_hints(Proposal(drafts, None, conf), flow, trust=0.5)
    # 2 takes 51 (seen[1] == 11); then seen[2] == 51 so 3 takes 52; 4 is sure (0.6 >= 0.5) and keeps 22;
    # seen[4] = 9 != 22, so 5 keeps its draft; draft 1 never takes a hint (slot 0 held the rejected draft)
    assert prop.draft_ids.tolist() == [[11, 51, 52, 22, 23]]
    assert torch.allclose(prop.confidence[0], torch.tensor([0.9, 0.5, 0.5, 0.6, 0.1]))


def test_hints_respect_validity_rows_and_sampling_distributions():
    V = 60
    flow = _flow([[7, 11, 12, 0, 0, 0], [7, 30, 0, 0, 0, 0]], [[50, 51, 52, 0, 0, 0], [40, 41, 0, 0, 0, 0]], [3, 1])
    drafts = torch.tensor([[11, 12, 13, 14, 15], [30, 31, 32, 33, 34]])
    probs = torch.softmax(torch.randn(2, 5, V), -1)
    prop = take_hints(Proposal(drafts, probs, torch.full((2, 5), 0.1)), flow, trust=0.5)
    # row 0: 2 takes 51; seen[2]=12 != 51 so 3 keeps 13; row 1: slot 1 carries no flow, nothing changes
    assert prop.draft_ids.tolist() == [[11, 51, 13, 14, 15], [30, 31, 32, 33, 34]]
    assert torch.equal(prop.draft_probs[0, 1], torch.nn.functional.one_hot(torch.tensor(51), V).float())
    untouched = torch.ones(2, 5, dtype=torch.bool)
    untouched[0, 1] = False
    assert torch.equal(prop.draft_probs[untouched], probs[untouched])
    # without confidences every consistent guess is taken; trust 0 takes none
    assert take_hints(Proposal(drafts, None, None), flow).draft_ids[0, 1] == 51
    assert torch.equal(take_hints(Proposal(drafts, None, torch.full((2, 5), 0.1)), flow, trust=0.0).draft_ids, drafts)


def test_draft_1_never_takes_a_hint():
    """Slot 0 held the rejected draft, not the anchor: draft 1 keeps its draft even where slot 0 read
    a token equal to some draft (here every draft, the last one included) and the drafter is unsure.
    Drafts 2.. still take theirs (the flow is consistent there), so the case is not vacuous."""
    flow = _flow([[7, 7, 7, 7, 7, 7]], [[50, 51, 52, 53, 54, 55]], [6])
    drafts = torch.tensor([[7, 7, 7, 7, 7]])
    prop = take_hints(Proposal(drafts, None, torch.full((1, 5), 0.1)), flow, trust=0.5)
    assert prop.draft_ids[0, 0] == 7 and prop.confidence[0, 0] == pytest.approx(0.1)
    assert prop.draft_ids[0, 1] == 51  # draft 1 (7) matches slot 1's read token: draft 2 takes its guess
