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

    def new_state(self, batch_size, generator=None):
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


class HintSpy:
    """Counts the drafts the loop's real `take_hints` replaced (it still does the work)."""

    def __init__(self, monkeypatch):
        import dflow_trt.decoding.loop as loop

        self.taken, real = 0, loop.take_hints

        def spy(prop, flow, trust):
            out = real(prop, flow, trust)
            self.taken += int((out.draft_ids != prop.draft_ids).sum())
            return out

        monkeypatch.setattr(loop, "take_hints", spy)
