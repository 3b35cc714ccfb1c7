"""The static back end (backends/static.py) against the eager Hugging Face target it borrows weights
from: the same forward within fp32 rounding, and the same decodes token for token."""

import pytest
import torch
from conftest import assert_greedy_equivalent, chat_prompts
from doubles import rounds, varied_drafter

from dflow_trt.backends.static import BLOCK_HEADROOM, DECODE_ROWS, StaticTarget
from dflow_trt.decoding.loop import generate
from dflow_trt.decoding.options import DecodeOptions
from dflow_trt.decoding.sampling import SamplingParams
from dflow_trt.drafter.runtime import TorchDrafter
from dflow_trt.errors import UserError
from dflow_trt.kernels import available as kernels_available

FAMILIES = ("tiny_qwen3", "tiny_llama")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny targets' tensors are too small to share out: on a busy machine two threads wait on each
    other at every op (a tiny-model decode measured 50x slower beside one other job)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _close(a, b, what):
    """fp32 rounding: a verify's sums differ from the eager path's in the last bits only."""
    scale = max(1.0, float(b.abs().max()))
    err = float((a - b).abs().max())
    assert err <= 1e-5 * scale * 10, f"{what}: max |diff| {err:.3g} at scale {scale:.3g}"


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_equals_hf(family, request):
    """Ragged batched prefill (all positions), chain verifies with mixed commits, a tree verify
    whose kept branch moves into place, and a chain after it: logits and taps as the eager target's."""
    hf = request.getfixturevalue(family)
    st = StaticTarget(hf, max_len=128, prefill_logits="all")
    assert st.info.fingerprint == hf.info.fingerprint and st.info.tap_layers == hf.info.tap_layers
    g = torch.Generator().manual_seed(0)
    lens, T = torch.tensor([7, 12, 1]), 12
    valid = torch.arange(T)[None] >= (T - lens)[:, None]  # [B, T]
    ids = torch.randint(0, 250, (3, T), generator=g) * valid
    with torch.inference_mode():
        ch, oh = hf.prefill(ids, lens)
        cs, os_ = st.prefill(ids, lens)
        _close(os_.logits[valid], oh.logits[valid], "prefill logits")
        _close(os_.taps[valid], oh.taps[valid], "prefill taps")
        for S, kept in ((4, [1, 4, 2]), (16, [16, 3, 1]), (2, [2, 2, 1]), (4, [3, 1, 4])):
            blk = torch.randint(0, 250, (3, S), generator=g)
            a, b = hf.verify(ch, blk), st.verify(cs, blk)
            _close(b.logits, a.logits, f"verify {S} logits")
            _close(b.taps, a.taps, f"verify {S} taps")
            hf.commit(ch, torch.tensor(kept))
            st.commit(cs, torch.tensor(kept))
        assert cs.fill.tolist() == ch.next_pos.tolist()
        parents = torch.tensor([-1, 0, 0, 1, 2])
        blk = torch.randint(0, 250, (3, 5), generator=g)
        a, b = hf.verify(ch, blk, parents), st.verify(cs, blk, parents)
        _close(b.logits, a.logits, "tree logits")
        path = torch.tensor([[0, 2, 4, 1, 3], [0, 1, 3, 2, 4], [0, 1, 2, 3, 4]])
        kept = torch.tensor([3, 3, 1])
        hf.commit(ch, kept, path)
        st.commit(cs, kept, path)
        blk = torch.randint(0, 250, (3, 8), generator=g)
        a, b = hf.verify(ch, blk), st.verify(cs, blk)
        _close(b.logits, a.logits, "verify after a tree commit")
    # and the loop's default: only the last prefill position's logits
    with torch.inference_mode():
        out = StaticTarget(hf, max_len=128).prefill(ids, lens)[1]
    assert out.logits.shape == (3, 1, hf.info.vocab_size) and out.taps.shape[:2] == (3, T)
    _close(out.logits[:, 0], oh.logits[:, -1], "last-position prefill logits")


class _MatmulsOn(torch.overrides.TorchFunctionMode):
    """Records which of `weights` (by identity) were the right operand of a matmul."""

    def __init__(self, weights):
        super().__init__()
        self.ids, self.used = {id(w) for w in weights}, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("matmul", "__matmul__") and id(args[1]) in self.ids:
            self.used.add(id(args[1]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_weights_for_small_calls(family, request):
    """On a CPU, calls of at most DECODE_ROWS rows (ar steps, small batches) run on the transposed
    copy of the weights (fused q|k|v and gate|up, the head), made once per model; wider calls on the
    borrowed weights. Both within fp32 rounding of the eager target."""
    hf = request.getfixturevalue(family)
    st = StaticTarget(hf, max_len=64)
    dw = st.decode
    assert dw is not None and StaticTarget(hf, max_len=32).decode is dw, "one copy per model"
    assert StaticTarget(hf, max_len=32, decode_weights=False).decode is None
    with torch.no_grad():  # weights written in place: the next static target copies them again
        w = hf.model.model.layers[0].mlp.down_proj.weight
        w.add_(0.0)
    fresh = StaticTarget(hf, max_len=32).decode
    assert fresh is not dw and torch.equal(fresh.down[0], w.t())
    st = StaticTarget(hf, max_len=64)
    dw = st.decode
    assert dw is fresh
    every = [*dw.qkv, *dw.o, *dw.gate_up, *dw.down, dw.head]
    ids = torch.tensor([[5, 17, 42, 9, 3, 77]])
    lens = torch.tensor([6])
    with torch.inference_mode():
        ch, _ = hf.prefill(ids, lens)
        cs, _ = st.prefill(ids, lens)
        for S, kept in ((1, 1), (8, 3), (1, 1), (9, 2), (1, 1)):
            blk = torch.randint(0, 250, (1, S), generator=torch.Generator().manual_seed(S + kept))
            with _MatmulsOn(every) as spy:
                b = st.verify(cs, blk)
            a = hf.verify(ch, blk)
            _close(b.logits, a.logits, f"verify {S} logits")
            _close(b.taps, a.taps, f"verify {S} taps")
            want = {id(w) for w in every} if S <= DECODE_ROWS else set()
            assert spy.used == want, f"verify {S}: {len(spy.used)} of {len(every)} decode weights used"
            hf.commit(ch, torch.tensor([kept]))
            st.commit(cs, torch.tensor([kept]))


class PartialOracle:
    """The target's own continuation (`sequences[b]`: prompt + reference) with every draft at an
    absolute position p (p % 5 == 3) wrong: rounds accept some drafts and reject the rest, and full
    blocks happen between the wrong ones. A row off the reference (a finished row the loop keeps
    verifying: its cache is held at the pool's end) gets zeros."""

    uses_flow = True

    def __init__(self, sequences, block_size, alternatives=False):
        self.sequences, self.block_size, self.alternatives = sequences, block_size, alternatives

    def new_state(self, batch_size, generator=None, block_size=None):
        return None

    def draft(self, state, context_taps, context_lens, anchor_ids, anchor_pos, flow, sampler, verify_threshold=0.0):
        from dflow_trt.decoding.interfaces import Proposal

        K, rows, alts = self.block_size - 1, [], []
        for b, p in enumerate(anchor_pos.tolist()):
            seq = self.sequences[b]
            right = seq[p + 1: p + 1 + K] if p < len(seq) and seq[p] == int(anchor_ids[b]) else []
            nxt = [(t + 1) % 250 if (p + 1 + j) % 5 == 3 else t for j, t in enumerate(right)]
            rows.append(nxt + [0] * (K - len(nxt)))
            alts.append([(right or [0])[0], 1])  # with `alternatives`: the right first draft is the runner-up
        prop = Proposal(draft_ids=torch.tensor(rows, dtype=torch.long), draft_probs=None)
        if self.alternatives:
            prop.alt_ids, prop.alt_conf = torch.tensor(alts), torch.full((len(alts), 2), 0.5)
        return prop


def _ar(target, prompts, max_new, stop=()):
    """The eager target's ar decode (batched: equal to row by row, test_lossless)."""
    return generate(target, None, prompts, DecodeOptions(mode="ar", max_new_tokens=max_new, stop_token_ids=stop)
                    ).token_ids


def _check(hf, prompts, want, got, max_new, stop=()):
    for p, w, g in zip(prompts, want, got):
        assert_greedy_equivalent(hf, p, g, w, stop, max_new)


# (target, mode, block, drafter): every mode and block on tiny-qwen3, the drafting modes spot-checked on tiny-llama
CASES = [("tiny_qwen3", m, S, "partial") for m in ("dflash", "dflow") for S in (2, 4, 16)] + [
    ("tiny_qwen3", "dflow", 4, "varied"), ("tiny_qwen3", "dflash", 16, "varied"),
    ("tiny_llama", "dflash", 4, "partial"), ("tiny_llama", "dflow", 16, "partial"), ("tiny_llama", "dflow", 2, "varied")]


@pytest.fixture(scope="module")
def references(tiny_qwen3, tiny_llama):
    """family -> (prompts of different lengths, the eager target's ar decode 16 tokens past MAX_NEW)."""
    out = {}
    for name, hf in (("tiny_qwen3", tiny_qwen3), ("tiny_llama", tiny_llama)):
        prompts = [p[: 20 + 9 * i] for i, p in enumerate(chat_prompts(hf, 3))]
        out[name] = prompts, _ar(hf, prompts, MAX_NEW + 16)
    return out


MAX_NEW = 24


@pytest.mark.parametrize("family", FAMILIES)
def test_ar_equals_eager_ar(family, request, references):
    hf = request.getfixturevalue(family)
    prompts, ar_long = references[family]
    res = generate(StaticTarget(hf, max_len=128), None, prompts,
                   DecodeOptions(mode="ar", max_new_tokens=MAX_NEW, stop_token_ids=()))
    _check(hf, prompts, [a[:MAX_NEW] for a in ar_long], res.token_ids, MAX_NEW)


@pytest.mark.parametrize("family,mode,S,kind", CASES)
def test_speculative_equals_ar(family, mode, S, kind, request, references):
    """dflash/dflow on the static target, batched rows of different lengths, with drafters that
    accept (partial and full blocks) and one that rejects nearly everything: the eager target's ar."""
    hf = request.getfixturevalue(family)
    prompts, ar_long = references[family]
    d = (PartialOracle([p + a for p, a in zip(prompts, ar_long)], S) if kind == "partial"
         else TorchDrafter(varied_drafter(hf, flow=mode == "dflow")))
    res = generate(StaticTarget(hf, max_len=128), d, prompts,
                   DecodeOptions(mode=mode, block_size=S, max_new_tokens=MAX_NEW, stop_token_ids=()))
    _check(hf, prompts, [a[:MAX_NEW] for a in ar_long], res.token_ids, MAX_NEW)
    seen = rounds(res.acceptance_lengths, S)  # the paths were taken
    if kind == "partial":
        # a wrong draft every 5 positions: full blocks up to S = 5, partial accepts from S = 3
        assert (S > 5 or seen["full"] > 0) and (S == 2 or seen["partial"] > 0), seen
    else:
        assert seen["rejected"] > 0, seen


def test_tree_verify_and_stop_mid_batch(tiny_qwen3):
    """First-draft alternatives (a token tree, its kept branch moved into place) and a stop token one
    row meets early while the others decode on: the eager target's ar, row by row."""
    hf, st = tiny_qwen3, StaticTarget(tiny_qwen3, max_len=256)
    prompts, max_new = chat_prompts(hf, 3), 24
    ar_long = _ar(hf, prompts, max_new + 16)
    stop = ar_long[1][5]  # row 1 stops at its 6th token at the latest
    want = _ar(hf, prompts, max_new, stop=(stop,))
    assert len(want[1]) <= 6 and max(map(len, want)) > 12, "the stop must end one row well before another"
    d = PartialOracle([p + a for p, a in zip(prompts, ar_long)], 8, alternatives=True)
    for alternatives in (0, 2):
        res = generate(st, d, prompts, DecodeOptions(mode="dflow", block_size=8, max_new_tokens=max_new,
                                                     stop_token_ids=(stop,), alternatives=alternatives))
        _check(hf, prompts, want, res.token_ids, max_new, (stop,))
        assert "stop" in res.finish_reasons
    assert res.alternatives_taken > 0, "no round kept a tree branch: the tree commit went untested"


def test_decode_to_the_pool_end(tiny_llama):
    """A decode that fills the pool exactly (prompt + max new = max_len, block 16, finished rows held
    at the end) runs and equals ar; one more token is refused before anything runs."""
    hf = tiny_llama
    prompts = [p[:30 + 10 * i] for i, p in enumerate(chat_prompts(hf, 2))]
    max_new = 40
    st = StaticTarget(hf, max_len=max(map(len, prompts)) + max_new)
    ar_long = _ar(hf, prompts, max_new + 16)
    want = [a[:max_new] for a in ar_long]
    d = PartialOracle([p + a for p, a in zip(prompts, ar_long)], 16)
    res = generate(st, d, prompts, DecodeOptions(mode="dflow", max_new_tokens=max_new, stop_token_ids=()))
    _check(hf, prompts, want, res.token_ids, max_new)
    with pytest.raises(UserError, match="context of"):
        generate(st, d, prompts, DecodeOptions(mode="dflow", max_new_tokens=max_new + 1, stop_token_ids=()))
    with pytest.raises(UserError, match="static KV pool"):
        st.prefill(torch.zeros(1, st.max_len + 1, dtype=torch.long), torch.tensor([st.max_len + 1]))
    with pytest.raises(UserError, match="headroom"):
        cache, _ = st.prefill(torch.ones(1, 4, dtype=torch.long), torch.tensor([4]))
        st.verify(cache, torch.ones(1, BLOCK_HEADROOM + 1, dtype=torch.long))


def test_cuda_graphs_equal_eager_static(tiny_qwen3):
    """Replayed graphs (one per block size, trees through the same graph) give the eager static
    forward's decodes: greedy with alternatives (trees) and the ar path. DFLOW_TRT_TEST_DEVICE=cuda only."""
    if tiny_qwen3.device.type != "cuda":
        pytest.skip("CUDA graphs need the targets on a GPU (DFLOW_TRT_TEST_DEVICE=cuda)")
    hf = tiny_qwen3
    prompts = chat_prompts(hf, 3)
    ar_long = _ar(hf, prompts, 40)
    d = PartialOracle([p + a for p, a in zip(prompts, ar_long)], 8, alternatives=True)
    for mode, drafter, alts in (("ar", None, 0), ("dflow", d, 2)):
        o = DecodeOptions(mode=mode, block_size=8 if drafter else None, max_new_tokens=24, stop_token_ids=(),
                          alternatives=alts)
        a = generate(StaticTarget(hf, max_len=128), drafter, prompts, o)
        b = generate(StaticTarget(hf, max_len=128, cuda_graphs=True), drafter, prompts, o)
        assert a.token_ids == b.token_ids, mode


def test_sampled_decode_equals_hf_same_seed(tiny_qwen3):
    """Sampling draws from the same distributions with the same generator: the same tokens."""
    hf, st = tiny_qwen3, StaticTarget(tiny_qwen3, max_len=256)
    prompts = chat_prompts(hf, 2)
    d = TorchDrafter(varied_drafter(hf, flow=True))
    for mode, drafter in (("ar", None), ("dflow", d)):
        o = DecodeOptions(mode=mode, block_size=4 if drafter else None, max_new_tokens=16, stop_token_ids=(),
                          sampling=SamplingParams(temperature=1.0, seed=7))
        a, b = generate(hf, drafter, prompts, o), generate(st, drafter, prompts, o)
        assert a.token_ids == b.token_ids, mode
        assert a.acceptance_lengths == b.acceptance_lengths


def test_refusals(tiny_qwen3):
    if tiny_qwen3.device.type != "cuda":
        with pytest.raises(UserError, match="CUDA graphs need a CUDA target"):
            StaticTarget(tiny_qwen3, cuda_graphs=True)
    with pytest.raises(UserError, match="exceeds the target's context"):
        StaticTarget(tiny_qwen3, max_len=10**6)


def test_loader_gives_static_targets():
    from dflow_trt.loading import BACKENDS, load_modes

    assert "static" in BACKENDS
    from dflow_trt.kernels import PackedLinear

    models = load_modes("tiny-qwen3", "static", modes=("ar", "dflow"), log=lambda m: None)
    assert all(isinstance(m.target, StaticTarget) for m in models.values())
    # the loaded target's linears are oneDNN-packed; the decode copy is made over them, once for every mode
    st = models["ar"].target
    assert isinstance(st.model.model.layers[0].mlp.down_proj, PackedLinear) or not kernels_available()
    assert st.decode is not None and models["dflow"].target.decode is st.decode
    assert isinstance(models["dflow"].drafter, TorchDrafter)
    assert models["dflow"].drafter.config.tap_layers == models["dflow"].target.info.tap_layers
    # a drafter builds against a static target as against the eager one (shared embeddings and head)
    from dflow_trt.drafter.defaults import untrained_config
    from dflow_trt.drafter.io import build_drafter

    st = models["dflow"].target
    d = build_drafter(st, untrained_config(st, flow=True, block_size=4))
    assert d.embed_weight.data_ptr() == st.model.get_input_embeddings().weight.data_ptr()


def test_bench_static_smoke(tmp_path, capsys):
    """`dflow-trt bench static` end to end on the few-MB random target (the GPU script's path, on a
    CPU): a report whose back ends decode the same tokens; graphs on a CPU refused in one line."""
    import json

    from test_cli_bad_input import refused

    from dflow_trt.cli import main

    n = torch.get_num_threads()
    out = tmp_path / "static.json"
    try:
        rc = main(["bench", "static", "--size", "smoke", "--context", "32", "--repeats", "1", "--new-tokens", "4",
                   "--threads", "1", "--json-out", str(out)])
    finally:
        torch.set_num_threads(n)
    assert rc == 0, capsys.readouterr()
    r = json.loads(out.read_text())
    assert [row["backend"] for row in r["rows"]] == ["eager", "static"] and "machine" in r
    assert all(g["same_tokens_as_eager"] for g in r["generate"]) and len(r["generate"]) == 4
    refused(capsys, ["bench", "static", "--size", "smoke", "--cuda-graphs", "--json-out", tmp_path / "g.json"],
            "--cuda-graphs needs --device cuda")


def test_generate_cli_backend_static_equals_torch(capsys):
    """`dflow-trt generate --backend static` gives `--backend torch`'s tokens."""
    import json

    from dflow_trt.cli import main

    got = {}
    for backend in ("torch", "static"):
        assert main(["generate", "--target", "tiny-qwen3", "--mode", "dflow", "--prompt", "hello world",
                     "--max-new-tokens", "12", "--block-size", "4", "--json", "--backend", backend]) == 0
        got[backend] = json.loads(capsys.readouterr().out)
    assert got["static"]["backend"] == "static"
    assert got["static"]["token_ids"] == got["torch"]["token_ids"] and len(got["torch"]["token_ids"]) == 12


@pytest.mark.slow
def test_smollm2_static_equals_ar_held_out(smollm2):
    """SmolLM2-135M on held-out HumanEval and MT-Bench prompts, batched rows of different lengths:
    `ar` (its steps on the decode weights), `dflash` and `dflow` (the shipped drafters, block 16 and
    the CPU setting) on the static target give the eager target's greedy tokens."""
    from conftest import chat_ids

    from dflow_trt.drafter.defaults import load_target_and_drafter
    from dflow_trt.evalsets import humaneval_prompts, mtbench_prompts

    prompts = [chat_ids(smollm2, t) for t in (humaneval_prompts()[3], mtbench_prompts()[5], humaneval_prompts()[40])]
    n = 32
    want = [_ar(smollm2, [p], n)[0] for p in prompts]
    st = StaticTarget(smollm2, max_len=max(map(len, prompts)) + n)
    assert st.decode is not None  # over the loaded target's oneDNN-packed linears too
    res = generate(st, None, prompts, DecodeOptions(mode="ar", max_new_tokens=n, stop_token_ids=()))
    _check(smollm2, prompts, want, res.token_ids, n)
    for mode in ("dflash", "dflow"):
        _, model = load_target_and_drafter("smollm2-135m", None, mode, target=smollm2)
        for extra in ({}, {"verify_threshold": 0.05, "alternatives": 7}):
            res = generate(st, TorchDrafter(model), prompts,
                           DecodeOptions(mode=mode, block_size=16, max_new_tokens=n, stop_token_ids=(), **extra))
            _check(smollm2, prompts, want, res.token_ids, n)
            assert res.tau > 1.0, (mode, extra)  # the drafters really drafted


def test_pad_block_makes_bf16_drafting_equal_ar_bit_for_bit(tiny_qwen3):
    """In bf16 a 1-row `ar` step and a 16-row verify round differently, so greedy drafting can leave
    `ar` at a near tie. With `pad_block` every verify runs as the same padded block: a position's
    logits are the same bits alone or inside a block, and dflow (blocks accepted in part, in full,
    and trees) equals `ar` exactly, batched rows of different lengths. Padding in fp32 changes
    nothing beyond rounding. (Measured here with this oracle, 8 rows × 64 tokens, blocks 4 and 16:
    unpadded, dflow left `ar` in 3-4 of 8 rows on the eager target and 2 on the static one; padded, in
    none. Not asserted: which rows round differently depends on the CPU's kernels.)"""
    import copy

    from dflow_trt.targets.hf_target import HFTarget

    hf = HFTarget(copy.deepcopy(tiny_qwen3.model).to(torch.bfloat16), "tiny-qwen3-bf16", tiny_qwen3.info.tap_layers,
                  tokenizer=tiny_qwen3.tokenizer)
    st = StaticTarget(hf, max_len=200, pad_block=8)
    widths, inner = [], st._verify

    def spy(ks, vs, ids, *rest):
        widths.append(ids.shape[1])
        return inner(ks, vs, ids, *rest)

    st._verify = spy
    prompts = chat_prompts(hf, 8)
    with torch.inference_mode():  # one position, alone (an ar step) and as slot 0 of a block of 8
        ids, lens = torch.tensor([prompts[0]]), torch.tensor([len(prompts[0])])
        blk = torch.tensor([[7, 11, 13, 17, 19, 23, 29, 31]])
        alone = st.verify(st.prefill(ids, lens)[0], blk[:, :1])
        inside = st.verify(st.prefill(ids, lens)[0], blk)
        assert torch.equal(alone.logits[:, 0], inside.logits[:, 0]) and torch.equal(alone.taps[:, 0], inside.taps[:, 0])
        assert alone.logits.shape[1] == 1 and inside.logits.shape[1] == 8
    n = 48
    ar = generate(st, None, prompts, DecodeOptions(mode="ar", max_new_tokens=n + 8, stop_token_ids=())).token_ids
    assert set(widths) == {8}, widths  # every ar step ran as a block of 8
    d = PartialOracle([p + a for p, a in zip(prompts, ar)], 8, alternatives=True)
    for alternatives in (0, 2):
        res = generate(st, d, prompts, DecodeOptions(mode="dflow", block_size=8, max_new_tokens=n, stop_token_ids=(),
                                                     alternatives=alternatives))
        assert res.token_ids == [a[:n] for a in ar], alternatives  # exact: no tie allowance
        seen = rounds(res.acceptance_lengths, 8)
        assert seen["partial"] > 0, seen  # a wrong draft every 5 positions
    assert res.alternatives_taken > 0
    # fp32: padded and unpadded verifies agree within rounding, and the decode equals eager ar
    st32 = StaticTarget(tiny_qwen3, max_len=160, pad_block=16)
    with torch.inference_mode():
        a = st32.verify(st32.prefill(ids, lens)[0], blk[:, :3])
        b = StaticTarget(tiny_qwen3, max_len=160).verify(st32.prefill(ids, lens)[0], blk[:, :3])
    _close(a.logits, b.logits, "padded verify logits")
    want = _ar(tiny_qwen3, prompts, n)
    _check(tiny_qwen3, prompts, want, generate(st32, None, prompts, DecodeOptions(
        mode="ar", max_new_tokens=n, stop_token_ids=())).token_ids, n)
    with pytest.raises(UserError, match="pad_block"):
        StaticTarget(tiny_qwen3, pad_block=BLOCK_HEADROOM + 1)


def test_gpu_script_runs_on_the_cpu(tmp_path):
    """`scripts/gpu_static.sh`, the lent GPU's one call, end to end on the CPU with the smoke size:
    a report per context with the padded static target, its bandwidth floor, and every back end's
    drafting mode equal to its own ar."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "SIZE": "smoke", "DEVICE": "cpu", "CONTEXTS": "24 40", "REPEATS": "1", "NEW_TOKENS": "4",
           "THREADS": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(root / "scripts" / "gpu_static.sh")], check=False, cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for ctx in (24, 40):
        rep = json.loads((tmp_path / f"bench_static_smoke_ctx{ctx}.json").read_text())
        assert rep["context"] == ctx and [x["backend"] for x in rep["rows"]] == ["eager", "static", "static+pad"]
        assert rep["bandwidth_floor_ms"] > 0 and rep["step_weight_bytes"] > 0
        assert all(g["equals_own_ar"] and g["same_tokens_as_eager"] for g in rep["generate"])
    assert "pytest exit" not in r.stdout  # the CUDA test tier runs on a GPU only


def test_bench_decode_and_demo_on_the_static_backend(tmp_path, capsys, monkeypatch):
    """`bench decode --backend static` and `demo --backend static`: every mode through the static
    target (its verify ran), equal to ar, the back end named in the report and the table."""
    import json

    from dflow_trt.cli import main

    calls = []
    verify = StaticTarget.verify
    monkeypatch.setattr(StaticTarget, "verify", lambda self, *a, **k: (calls.append(1), verify(self, *a, **k))[1])
    prompts, out = tmp_path / "p.jsonl", tmp_path / "bench.json"
    prompts.write_text('{"prompt": "abc"}\n{"prompt": "hello there"}\n')
    assert main(["bench", "decode", "--target", "tiny-qwen3", "--dataset", str(prompts), "--num-prompts", "2",
                 "--max-new-tokens", "8", "--block-size", "4", "--backend", "static", "--json-out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["backend"] == "static" and all(m["matches_ar"] for m in rep["modes"].values()) and calls
    calls.clear()
    capsys.readouterr()
    assert main(["demo", "--target", "tiny-qwen3", "--num-prompts", "1", "--max-new-tokens", "8",
                 "--verify-threshold", "0", "--backend", "static"]) == 0
    text = capsys.readouterr().out
    assert "--backend static" in text and text.count(" yes ") == 3 and " NO " not in text and calls
