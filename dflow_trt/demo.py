"""The README's main job: every mode on the embedded target, checked lossless, tau and tokens/s."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .benchmarks.decode import MODES, run_modes
from .decoding.flow import HINT_TRUST
from .drafter.defaults import load_target_and_drafter
from .prompting import encode_prompts

DEMO_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "A shop sells pencils at 3 for 2 dollars. How much do 12 pencils cost? Explain step by step.",
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three tips for writing clear emails.",
]


# Verify a draft when its estimated acceptance chance beats its marginal cost in `ar` steps:
# 0.053-0.056 on the 2-core CI CPU (`dflow-trt bench round`); on a GPU a draft costs ~nothing (use 0).
CPU_VERIFY_THRESHOLD = 0.05
# ... and verify the drafter's runner-ups for draft 1 that clear the same bar, beside the chain
# (`generate(alternatives=)`): a runner-up with probability p is the target's token about p of the time.
CPU_ALTERNATIVES = 7


def run_demo(target_name: str = "smollm2-135m", max_new_tokens: int = 48, num_prompts: int = 3,
             verify_threshold: float | None = None, hint_trust: float = HINT_TRUST,
             alternatives: int | None = None) -> int:
    """One table per setting: `verify_threshold` (and `alternatives`), or by default the whole block
    and then the CPU's setting (the demo runs on the CPU: its threshold and first-draft
    alternatives), so the algorithm as designed and the setting that pays on this hardware are
    both shown."""
    cpu_alternatives = CPU_ALTERNATIVES if alternatives is None else alternatives
    if verify_threshold is None:
        settings = [(0.0, alternatives or 0), (CPU_VERIFY_THRESHOLD, cpu_alternatives)]
    else:
        settings = [(verify_threshold, alternatives or 0)]
    for i, (t, alts) in enumerate(settings):
        _demo_table(target_name, max_new_tokens, num_prompts, t, hint_trust, alts, show_sample=i == 0)
    return 0


def _demo_table(target_name: str, max_new_tokens: int, num_prompts: int, verify_threshold: float,
                hint_trust: float, alternatives: int, show_sample: bool) -> None:
    console = Console()
    prompts_text = DEMO_PROMPTS[:num_prompts]
    verify = f", verify threshold {verify_threshold:g}" if verify_threshold else ""
    verify += f", {alternatives} first-draft alternatives" if alternatives else ""
    table = Table(title=f"{target_name}: greedy, {len(prompts_text)} prompts x {max_new_tokens} new tokens{verify}")
    for col in ("mode", "drafter", "block", "tau", "tokens/s", "speedup", "matches ar"):
        table.add_column(col, justify="right")
    target, _ = load_target_and_drafter(target_name, None, "ar")
    prompts = encode_prompts(target, prompts_text, True, max_new_tokens)
    runs = run_modes(target_name, {}, list(MODES), prompts, max_new_tokens, None, target=target,
                     warn=lambda m: console.print(f"[yellow]{m}"), verify_threshold=verify_threshold,
                     hint_trust=hint_trust, alternatives=alternatives)
    ar = runs["ar"]
    if show_sample:
        console.print(f"[dim]ar sample: {target.tokenizer.decode(ar.tokens[0], skip_special_tokens=True)[:200]!r}")
    for mode, r in runs.items():
        table.add_row(mode, r.drafter, str(r.block_size), f"{r.tau:.2f}", f"{r.tokens_per_s:.1f}",
                      f"{r.tokens_per_s / ar.tokens_per_s:.2f}x", "yes" if r.tokens == ar.tokens else "NO")
    console.print(table)
