"""What one generation is asked to do: a validated options object, and its named presets.

The CLI, the benchmark, the demo and the served model all build a `DecodeOptions` and the loop
takes nothing else, so a setting is checked once, in one place, with one wording. Checks that
need the models (context length, flow, trees) are `check_against`, run by the loop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import UserError
from .flow import HINT_TRUST
from .interfaces import MAX_ALTERNATIVES, Drafter, Target
from .sampling import SamplingParams

MODES = ("ar", "dflash", "dflow")


@dataclass(frozen=True)
class DecodeOptions:
    mode: str = "dflow"  # ar | dflash | dflow
    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    block_size: int | None = None  # anchor + drafts; None: the drafter's own (a drafter is block-length agnostic)
    verify_threshold: float = 0.0  # > 0: verify only drafts likely to be accepted (0: the whole block)
    hint_trust: float = HINT_TRUST  # dflow: take a verifier hint over a draft less sure than this (0: off)
    alternatives: int = 0  # greedy: runner-up tokens for draft 1 verified beside the chain (a token tree)
    verify_budget: int = 0  # > 0: most tokens one verify pass carries over all rows (0: no cap); see policy.py
    stop_token_ids: tuple[int, ...] | None = None  # None: the target's end-of-sequence tokens

    def __post_init__(self):
        if self.mode not in MODES:
            raise UserError(f"unknown mode {self.mode!r}; use one of {', '.join(MODES)}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1 (an integer), got {self.max_new_tokens!r}")
        if self.block_size is not None and (not _is_int(self.block_size) or self.block_size < 2):
            raise UserError(f"block_size must be at least 2 (anchor + one draft), got {self.block_size!r}")
        if not _is_num(self.verify_threshold) or not 0.0 <= self.verify_threshold < 1.0:
            raise UserError(f"verify_threshold must be in [0, 1), got {self.verify_threshold!r}")
        if not _is_num(self.hint_trust) or not 0.0 <= self.hint_trust <= 1.0:
            raise UserError(f"hint_trust must be in [0, 1], got {self.hint_trust!r}")
        if not _is_int(self.alternatives) or not 0 <= self.alternatives <= MAX_ALTERNATIVES:
            raise UserError(f"alternatives must be in [0, {MAX_ALTERNATIVES}] (an integer), got {self.alternatives!r}")
        if not _is_int(self.verify_budget) or self.verify_budget < 0:
            raise UserError(f"verify_budget must be >= 0 (an integer; 0: no cap), got {self.verify_budget!r}")
        if self.alternatives and not self.sampling.greedy:
            raise UserError("first-draft alternatives are verified for greedy decoding only (temperature 0); "
                            "set alternatives to 0 or decode greedily")

    @property
    def speculative(self) -> bool:
        return self.mode != "ar"

    def check_against(self, target: Target, drafter: Drafter | None, prompts: list[list[int]]) -> None:
        """Refuse, before any model runs, what these models cannot do for these prompts."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise UserError("empty prompt: give at least one token")
        ctx, longest = target.info.max_context, max(map(len, prompts))
        if ctx and longest + self.max_new_tokens > ctx:
            raise UserError(f"prompt ({longest} tokens) + max new tokens ({self.max_new_tokens}) exceed the "
                            f"target's context of {ctx} tokens; shorten the prompt or ask for fewer new tokens")
        if not self.speculative:
            return
        if drafter is None:
            raise UserError(f"mode {self.mode!r} needs a drafter")
        if self.mode == "dflow" and not drafter.uses_flow:
            raise UserError("this drafter was built without flow conditioning; use mode dflash or a DFlow drafter")
        if self.alternatives and not target.supports_tree:
            raise UserError("this target back end verifies chains only, not the token tree that alternatives "
                            "need; set alternatives to 0 or use the PyTorch target")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# The two settings the results table reports. "whole-block" verifies every draft (the paper's
# setting; the DFlash path is then the policy-free loop). "cpu" is what pays on a 2-core CPU, where a
# verify pass costs in proportion to its length: verify only drafts with an estimated acceptance
# chance >= 0.05, and up to 7 runner-ups for draft 1 beside the chain (greedy only).
PRESETS = {
    "whole-block": DecodeOptions(),
    "cpu": DecodeOptions(verify_threshold=0.05, alternatives=MAX_ALTERNATIVES),
}


def preset(name: str, **overrides) -> DecodeOptions:
    """A named preset with some fields replaced. Under sampling the cpu preset drops its
    alternatives (they are greedy-only) rather than refusing the request."""
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; use one of {', '.join(PRESETS)}")
    base = PRESETS[name]
    sampling = overrides.get("sampling", base.sampling)
    if "alternatives" not in overrides and not sampling.greedy:
        overrides["alternatives"] = 0
    return dataclasses.replace(base, **overrides)
