"""Drafter configuration: the architecture, and the target it was built for."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..decoding.interfaces import TargetInfo
from ..errors import UserError


@dataclass(frozen=True)
class TargetRef:
    """The target a drafter belongs to; loading it against another target is refused."""

    name: str
    fingerprint: str
    vocab_size: int
    hidden_size: int
    num_layers: int


@dataclass(frozen=True)
class DrafterConfig:
    target: TargetRef
    tap_layers: tuple[int, ...]  # target decoder layers whose outputs form the context features
    mask_token_id: int
    block_size: int = 16  # anchor + block_size - 1 drafts
    num_layers: int = 1
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 1536
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    flow: bool = True  # DFlow: condition on last round's verifier states at rejected positions
    draft_vocab_size: int | None = None  # reduced draft vocabulary (None: the target's)
    extra: dict = field(default_factory=dict)  # free-form provenance (training run, etc.)

    def __post_init__(self):
        if self.block_size < 2:
            raise UserError(f"block size must be at least 2 (anchor + one draft), got {self.block_size}")
        if not self.tap_layers:
            raise UserError("a drafter needs at least one target tap layer")
        if not 0 <= self.mask_token_id < self.target.vocab_size:
            raise UserError(f"mask token id {self.mask_token_id} is outside the target vocabulary")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.target.vocab_size:
            raise UserError(f"draft vocabulary size {self.draft_vocab_size} must be in 1..{self.target.vocab_size}")

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def feature_size(self) -> int:
        return len(self.tap_layers) * self.target.hidden_size

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tap_layers"] = list(self.tap_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        d = dict(d)
        d["target"] = TargetRef(**d["target"])
        d["tap_layers"] = tuple(d["tap_layers"])
        return cls(**d)

    @classmethod
    def for_target(cls, info: TargetInfo, mask_token_id: int, **kw) -> "DrafterConfig":
        ref = TargetRef(info.name, info.fingerprint, info.vocab_size, info.hidden_size, info.num_layers)
        kw.setdefault("tap_layers", info.tap_layers)
        return cls(target=ref, mask_token_id=mask_token_id, **kw)

    def check_target(self, info: TargetInfo) -> None:
        """Refuse a target other than the one this drafter was built for, naming the fix."""
        t = self.target
        if t.fingerprint != info.fingerprint:
            raise UserError(
                f"drafter was built for target {t.name!r} (fingerprint {t.fingerprint}) but the target is "
                f"{info.name!r} (fingerprint {info.fingerprint}); use --target {t.name} or train a drafter "
                f"for {info.name} with `dflow-trt train --target {info.name}`")
