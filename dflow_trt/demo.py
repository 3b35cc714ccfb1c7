"""The README's main job: every mode on the embedded target, checked lossless, tau and tokens/s."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .decoding.loop import generate
from .drafter.defaults import load_target_and_drafter
from .drafter.runtime import TorchDrafter

DEMO_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "A shop sells pencils at 3 for 2 dollars. How much do 12 pencils cost? Explain step by step.",
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three tips for writing clear emails.",
]


# Verify a draft when its estimated acceptance chance beats its marginal cost in `ar` steps:
# 0.053-0.056 on the 2-core CI CPU (scripts/bench_round.py); on a GPU a draft costs ~nothing (use 0).
CPU_VERIFY_THRESHOLD = 0.05


def run_demo(target_name: str = "smollm2-135m", max_new_tokens: int = 48, num_prompts: int = 3,
             verify_threshold: float | None = None) -> int:
    """One table per setting: `verify_threshold`, or by default the whole block and then the CPU's
    threshold (the demo runs on the CPU), so the algorithm as designed and the setting that pays
    on this hardware are both shown."""
    for i, t in enumerate((0.0, CPU_VERIFY_THRESHOLD) if verify_threshold is None else (verify_threshold,)):
        _demo_table(target_name, max_new_tokens, num_prompts, t, show_sample=i == 0)
    return 0


def _demo_table(target_name: str, max_new_tokens: int, num_prompts: int, verify_threshold: float,
                show_sample: bool) -> None:
    console = Console()
    prompts_text = DEMO_PROMPTS[:num_prompts]
    verify = f", verify threshold {verify_threshold:g}" if verify_threshold else ""
    table = Table(title=f"{target_name}: greedy, {len(prompts_text)} prompts x {max_new_tokens} new tokens{verify}")
    for col in ("mode", "drafter", "block", "tau", "tokens/s", "speedup", "matches ar"):
        table.add_column(col, justify="right")
    ar_tokens, ar_tps = None, None
    for mode in ("ar", "dflash", "dflow"):
        target, model = load_target_and_drafter(target_name, None, mode, warn=lambda m: console.print(f"[yellow]{m}"))
        drafter = TorchDrafter(model) if model is not None else None
        prompts = [target.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                        tokenize=True, return_dict=True)["input_ids"]
                   for p in prompts_text]
        results = [generate(target, drafter, [p], mode, max_new_tokens, verify_threshold=verify_threshold)
                   for p in prompts]
        tokens = [r.token_ids[0] for r in results]
        n_tok = sum(len(t) for t in tokens)
        tps = n_tok / sum(r.total_s for r in results)
        accept = [a for r in results for a in r.acceptance_lengths[0]]
        tau = sum(accept) / len(accept)
        if mode == "ar":
            ar_tokens, ar_tps = tokens, tps
        if mode == "ar" and show_sample:
            console.print(f"[dim]ar sample: {target.tokenizer.decode(tokens[0], skip_special_tokens=True)[:200]!r}")
        name = "-" if model is None else model.config.extra.get("name", "untrained")
        table.add_row(mode, name, str(drafter.block_size if drafter else 1), f"{tau:.2f}", f"{tps:.1f}",
                      f"{tps / ar_tps:.2f}x", "yes" if tokens == ar_tokens else "NO")
    console.print(table)
