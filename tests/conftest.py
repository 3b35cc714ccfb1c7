import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# Where the shared target fixtures live: cpu here and in CI; `DFLOW_TRT_TEST_DEVICE=cuda` on a GPU host.
TEST_DEVICE = os.environ.get("DFLOW_TRT_TEST_DEVICE", "cpu")

PROMPTS_TEXT = [
    "Write a Python function that checks whether a number is prime.",
    "What is 17 times 23? Show your work.",
    "Explain why the sky is blue.",
    "def fibonacci(n):",
    "Give me three tips for a job interview.",
    "Translate 'good morning' into French and Spanish.",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
]


def run_cli(*args, timeout=600):
    """The real `dflow-trt` command in a subprocess (captured text output)."""
    return subprocess.run([sys.executable, "-m", "dflow_trt.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


class OracleDrafter:
    """Test double for the best case: proposes the target's own greedy continuation.

    `sequences[b]` is prompt + reference output of row b; the draft after the anchor at
    position p is sequences[b][p+1 : p+S] (padded with 0 past the end).
    """

    uses_flow = True

    def __init__(self, sequences, block_size):
        self.sequences, self.block_size = sequences, block_size
        self.flows = []  # every FlowState it was given, for bookkeeping checks

    def new_state(self, batch_size, generator=None, block_size=None):
        assert block_size in (None, self.block_size), "a fixed-block test double"
        return None

    def draft(self, state, context_taps, context_lens, anchor_ids, anchor_pos, flow, sampler, verify_threshold=0.0):
        from dflow_trt.decoding.interfaces import Proposal

        self.flows.append(flow)
        rows = []
        for b, p in enumerate(anchor_pos.tolist()):
            seq = self.sequences[b]
            assert seq[p] == int(anchor_ids[b]), "anchor must be the reference token at its position"
            nxt = seq[p + 1: p + self.block_size]
            rows.append(nxt + [0] * (self.block_size - 1 - len(nxt)))
        return Proposal(draft_ids=torch.tensor(rows, dtype=torch.long), draft_probs=None)


@pytest.fixture(scope="session")
def tiny_qwen3():
    from dflow_trt.targets import load_target

    return load_target("tiny-qwen3", num_taps=3, device=TEST_DEVICE)


@pytest.fixture(scope="session")
def tiny_llama():
    from dflow_trt.targets import load_target

    return load_target("tiny-llama", num_taps=2, device=TEST_DEVICE)


@pytest.fixture(scope="session")
def smollm2():
    from dflow_trt.targets import load_target

    return load_target("smollm2-135m", num_taps=3, device=TEST_DEVICE)


def chat_ids(target, text):
    return target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]


SMALL_VOCAB = 16  # the sampling checks' target: every conditional can be enumerated


@pytest.fixture(scope="session")
def small_target():
    """A tiny Qwen3 target over 16 tokens, its head sharpened so the distribution is far from uniform."""
    from dflow_trt.targets.hf_target import HFTarget
    from dflow_trt.targets.tiny import build_tiny

    model, _ = build_tiny("qwen3", seed=3, vocab_size=SMALL_VOCAB)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    return HFTarget(model.to(TEST_DEVICE), name="tiny-qwen3-v16", tap_layers=(1, 3), tokenizer=None,
                    eos_token_ids=())


def chat_prompts(target, n=8):
    """The first n test prompts, chat-templated for `target`."""
    return [chat_ids(target, t) for t in PROMPTS_TEXT[:n]]


class CloseDrafter:
    """Test double whose drafts follow the target at another temperature (classic draft/target
    speculative sampling), so most are accepted and the accept, reject and bonus paths all run.
    It rebuilds each row's committed tokens from its own last drafts and the new anchor."""

    def __init__(self, model, block_size, uses_flow, prompt, temperature=1.3):
        self.model, self.block_size, self.uses_flow, self.t = model, block_size, uses_flow, temperature
        self.prompt = list(prompt)

    def new_state(self, batch_size, generator=None, block_size=None):
        assert block_size in (None, self.block_size), "a fixed-block test double"
        return {"seqs": [list(self.prompt) for _ in range(batch_size)], "drafts": None, "pos": None, "gen": generator}

    @torch.no_grad()
    def _next_probs(self, seqs):
        dev = self.model.device
        L = torch.tensor([len(x) for x in seqs], device=dev)
        ids = torch.zeros(len(seqs), int(L.max()), dtype=torch.long, device=dev)
        for b, x in enumerate(seqs):
            ids[b, :len(x)] = torch.tensor(x)
        mask = torch.arange(ids.shape[1], device=dev)[None] < L[:, None]
        logits = self.model(input_ids=ids, attention_mask=mask.long()).logits  # right padding: causal rows unaffected
        return torch.softmax(logits[torch.arange(len(seqs), device=dev), L - 1].float() / self.t, -1)  # [B, V]

    def draft(self, state, context_taps, context_lens, anchor_ids, anchor_pos, flow, sampler, verify_threshold=0.0):
        seqs = state["seqs"]
        for b in range(len(seqs)):
            if state["drafts"] is not None:
                seqs[b] += state["drafts"][b][:int(anchor_pos[b] - state["pos"][b]) - 1]
            seqs[b].append(int(anchor_ids[b]))
            assert len(seqs[b]) - 1 == int(anchor_pos[b])
        work, ids, probs = [list(x) for x in seqs], [], []
        for _ in range(self.block_size - 1):
            q = self._next_probs(work)
            t = torch.multinomial(q, 1, generator=state["gen"])[:, 0]
            ids.append(t)
            probs.append(q)
            for b, x in enumerate(work):
                x.append(int(t[b]))
        draft_ids = torch.stack(ids, 1)  # [B, S-1]
        state["drafts"], state["pos"] = draft_ids.tolist(), anchor_pos.clone()
        self.state = state  # DFlow's hints may replace drafts; the test writes them back here
        q = torch.stack(probs, 1)  # [B, S-1, V]
        # top probability per position: it may depend on earlier drafts, never on the draft itself
        from dflow_trt.decoding.interfaces import Proposal

        return Proposal(draft_ids=draft_ids, draft_probs=q, confidence=q.amax(-1))


class HintSpy:
    """Counts the drafts the loop's real `take_hints` replaced (it still does the work)."""

    def __init__(self, monkeypatch):
        import dflow_trt.decoding.policy as policy

        self.taken, real = 0, policy.take_hints
        self.calls = []  # per call: (replaced [B, K] bool, the hinted proposal's confidence [B, K] or None)

        def spy(prop, flow, trust):
            out = real(prop, flow, trust)
            self.taken += int((out.draft_ids != prop.draft_ids).sum())
            self.calls.append((out.draft_ids != prop.draft_ids, out.confidence))
            return out

        monkeypatch.setattr(policy, "take_hints", spy)


# ------------------------------------------------------------------ tie-aware greedy comparison

# Greedy equality rests on margins: on the CPU a verify pass's fp32 logits differ from one-token
# steps' (and from a full forward's) by up to ~1.5e-5, so where the target's top two logits are
# closer than that, two exact decoders may pick different tokens. The bound a divergence must stay
# within to count as such a rounding tie: GREEDY_TIE_RTOL times the top logit's magnitude (at least 1).
GREEDY_TIE_RTOL = 1e-4


@torch.inference_mode()
def teacher_forced_logits(target, ids):
    """The target's logits [len(ids), V] (fp32, CPU) from one cache-free forward over `ids`."""
    x = torch.tensor([list(ids)], dtype=torch.long, device=target.device)
    return target.model(input_ids=x).logits[0].float().cpu()


def assert_greedy_equivalent(target, prompt, got, want, stop_token_ids=(), max_new_tokens=None,
                             rtol=GREEDY_TIE_RTOL):
    """`got` equals the greedy decode `want` of `prompt`, or parts from it only at a rounding tie.

    Where they first differ, a teacher-forced forward of the common prefix must rank both tokens
    within the tie bound of its top logit (so its top two logits are that close); after it, `got`
    must go on as the target's own greedy continuation (each token within the bound of its
    position's top logit), stop only on its last token and, given `max_new_tokens`, end by a stop
    token or at that length. Returns the position of the tie taken, or None when equal."""
    got, want, stop = list(got), list(want), set(stop_token_ids)
    if got == want:
        return None
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if i == min(len(got), len(want)):
        raise AssertionError(f"greedy outputs differ in length ({len(got)} vs {len(want)} tokens) without a differing "
                             f"token: one stopped or was cut where the other went on (first {i} tokens equal)")
    logits = teacher_forced_logits(target, list(prompt) + want[:i])[-1]
    (l1, l2), top = logits.topk(2).values.tolist(), int(logits.argmax())
    tol = rtol * max(1.0, abs(l1))
    a, b = float(logits[got[i]]), float(logits[want[i]])
    if l1 - l2 > tol or l1 - min(a, b) > tol:
        raise AssertionError(
            f"greedy outputs differ at position {i}: got token {got[i]} (logit {a:.7g}), want {want[i]} (logit "
            f"{b:.7g}); the target's top-2 logits there are {l1:.7g} (token {top}) and {l2:.7g}, gap {l1 - l2:.3g} > "
            f"tie bound {tol:.3g}, or a token off the top: a genuine mismatch, not a rounding tie")
    tail = teacher_forced_logits(target, list(prompt) + got)
    off = len(prompt) - 1  # tail[off + j] predicts got[j]
    for j in range(i + 1, len(got)):
        lj = tail[off + j]
        gap = float(lj.max() - lj[got[j]])
        if gap > rtol * max(1.0, float(lj.max().abs())):
            raise AssertionError(f"after the tie at position {i}, token {j} ({got[j]}) is not the target's greedy "
                                 f"choice ({int(lj.argmax())}): its logit is {gap:.3g} below the top")
    early = [j for j, t in enumerate(got[:-1]) if t in stop]
    if early:
        raise AssertionError(f"after the tie at position {i}, output went on past stop token {got[early[0]]} at {early[0]}")
    if max_new_tokens is not None and got[-1] not in stop and len(got) != max_new_tokens:
        raise AssertionError(f"after the tie at position {i}, output ended after {len(got)} tokens with no stop token "
                             f"(max new tokens {max_new_tokens})")
    return i


# ---- drafters that really draft (tests/doubles.py): real DFlowDrafter folders, made once per session


@pytest.fixture(scope="session")
def varied_drafters(tiny_qwen3, tmp_path_factory):
    """{mode: (model, folder)}: seeded untrained drafters scaled so their drafts vary with context."""
    from doubles import varied_drafter
    from dflow_trt.drafter.io import save_drafter

    root = tmp_path_factory.mktemp("varied_drafters")
    out = {}
    for mode in ("dflash", "dflow"):
        model = varied_drafter(tiny_qwen3, flow=mode == "dflow")
        out[mode] = (model, save_drafter(model, root / mode))
    return out


@pytest.fixture(scope="session")
def good_drafters(tiny_qwen3, tmp_path_factory):
    """{mode: folder}: drafters trained by `dflow_trt.training` on tiny-qwen3's greedy continuations of
    the test prompts (DFlash, then DFlow started from it)."""
    from doubles import GOOD_DFLASH_STEPS, GOOD_DFLOW_STEPS, train_good, write_dataset

    root = tmp_path_factory.mktemp("good_drafters")
    data = write_dataset(tiny_qwen3, root / "data")
    dflash = train_good(data, root / "dflash", "dflash", GOOD_DFLASH_STEPS)
    dflow = train_good(data, root / "dflow", "dflow", GOOD_DFLASH_STEPS + GOOD_DFLOW_STEPS, init_from=str(dflash))
    return {"dflash": dflash, "dflow": dflow}
