"""The README's main job: every mode on the embedded target, checked lossless, tau and tokens/s."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .benchmarks.decode import run_modes
from .decoding.flow import HINT_TRUST
from .decoding.options import MODES, DecodeOptions, preset
from .drafter.defaults import load_target_and_drafter
from .prompting import encode_prompts

DEMO_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "A shop sells pencils at 3 for 2 dollars. How much do 12 pencils cost? Explain step by step.",
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three tips for writing clear emails.",
]


def run_demo(target_name: str = "smollm2-135m", max_new_tokens: int = 48, num_prompts: int = 3,
             verify_threshold: float | None = None, hint_trust: float = HINT_TRUST,
             alternatives: int | None = None, backend: str = "torch") -> int:
    """One table per setting: `verify_threshold` (and `alternatives`), or by default the whole block
    and then the CPU's setting (the demo runs on the CPU: its threshold and first-draft
    alternatives), so the algorithm as designed and the setting that pays on this hardware are
    both shown."""
    common = dict(max_new_tokens=max_new_tokens, hint_trust=hint_trust)
    if verify_threshold is None:
        cpu = {} if alternatives is None else {"alternatives": alternatives}
        settings = [preset("whole-block", alternatives=alternatives or 0, **common), preset("cpu", **cpu, **common)]
    else:
        settings = [DecodeOptions(verify_threshold=verify_threshold, alternatives=alternatives or 0, **common)]
    for i, options in enumerate(settings):
        _demo_table(target_name, num_prompts, options, show_sample=i == 0, backend=backend)
    return 0


def _demo_table(target_name: str, num_prompts: int, options: DecodeOptions, show_sample: bool,
                backend: str = "torch") -> None:
    console = Console()
    max_new_tokens, verify_threshold, alternatives = options.max_new_tokens, options.verify_threshold, options.alternatives
    prompts_text = DEMO_PROMPTS[:num_prompts]
    verify = f", verify threshold {verify_threshold:g}" if verify_threshold else ""
    verify += f", {alternatives} first-draft alternatives" if alternatives else ""
    verify += f", --backend {backend}" if backend != "torch" else ""
    table = Table(title=f"{target_name}: greedy, {len(prompts_text)} prompts x {max_new_tokens} new tokens{verify}")
    for col in ("mode", "drafter", "block", "tau", "tokens/s", "speedup", "matches ar"):
        table.add_column(col, justify="right")
    target, _ = load_target_and_drafter(target_name, None, "ar")
    prompts = encode_prompts(target, prompts_text, True, max_new_tokens)
    runs = run_modes(target_name, {}, list(MODES), prompts, options, target=target,
                     warn=lambda m: console.print(f"[yellow]{m}"), backend=backend)
    ar = runs["ar"]
    if show_sample:
        console.print(f"[dim]ar sample: {target.tokenizer.decode(ar.tokens[0], skip_special_tokens=True)[:200]!r}")
    for mode, r in runs.items():
        table.add_row(mode, r.drafter, str(r.block_size), f"{r.tau:.2f}", f"{r.tokens_per_s:.1f}",
                      f"{r.tokens_per_s / ar.tokens_per_s:.2f}x", "yes" if r.tokens == ar.tokens else "NO")
    console.print(table)
