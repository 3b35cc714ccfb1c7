"""Drafter configuration: the architecture, and the target it was built for."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..decoding.interfaces import TargetInfo
from ..errors import UserError


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_fields(obj, counts: tuple[str, ...], texts: tuple[str, ...] = (), positive: tuple[str, ...] = ()) -> None:
    """Refuse an edited config.json before it sizes a model: `counts` whole numbers >= 1, `texts`
    strings, `positive` finite numbers > 0."""
    for name in counts + texts + positive:
        v = getattr(obj, name)
        if name in counts:
            ok, want = _is_int(v) and v >= 1, "a whole number >= 1"
        elif name in texts:
            ok, want = isinstance(v, str), "a string"
        else:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
            want = "a finite number > 0"
        if not ok:
            raise UserError(f"drafter config field {name} must be {want}, got {v!r}")


# How a DFlow drafter takes last round's verifier states (docs/history/2026-12-07-paper-relay.md):
RELAYS = {
    # ours (the default, the shipped drafters): a flow branch of its own (`flow_proj` + RMSNorm, the
    # rejected token's embedding, present/absent vectors, the verifier's argmax one slot later) added
    # to every block slot's input (`relay.relay`)
    "ours": "own flow projection, rejected-token and hint embeddings added to each slot",
    # paper (the DFlow paper, arXiv 2609.06498): the states go through the drafter's own context
    # projection (`ctx_proj` + `ctx_norm`), shifted one slot onto the next block's unresolved slots,
    # and an MLP over (correction-token embedding, first rejected token's embedding, relayed state)
    # gives a per-channel scale and shift of the mask-token embedding there (`relay.relay_paper`)
    "paper": "context projection, shifted one slot, MLP scale/shift of the mask embedding",
}


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
    relay: str = "ours"  # how flow reaches the drafter (flow only): RELAYS
    draft_vocab_size: int | None = None  # reduced draft vocabulary (None: the target's)
    extra: dict = field(default_factory=dict)  # free-form provenance (training run, etc.)

    def __post_init__(self):
        _check_fields(self.target, ("vocab_size", "hidden_size", "num_layers"), ("name", "fingerprint"))
        _check_fields(self, ("num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "block_size"),
                      positive=("rms_norm_eps", "rope_theta"))
        if not isinstance(self.flow, bool) or not isinstance(self.extra, dict):
            raise UserError(f"drafter config field flow must be true or false and extra an object, got "
                            f"{self.flow!r} and {type(self.extra).__name__}")
        if not isinstance(self.relay, str) or self.relay not in RELAYS or (self.relay != "ours" and not self.flow):
            raise UserError(f"drafter config field relay must be one of {sorted(RELAYS)} ('paper' needs flow "
                            f"true), got {self.relay!r} with flow {self.flow!r}")
        if any(not _is_int(t) or t < 0 for t in self.tap_layers) or not _is_int(self.mask_token_id) or (
                self.draft_vocab_size is not None and not _is_int(self.draft_vocab_size)):
            raise UserError("drafter config fields tap_layers, mask_token_id and draft_vocab_size must be "
                            "whole numbers (tap layers >= 0)")
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"drafter config: num_heads {self.num_heads} is not a multiple of num_kv_heads "
                            f"{self.num_kv_heads}")
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
        if d["relay"] == "ours":  # today's drafters' config.json (and every hash of it) stay as they were
            del d["relay"]
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

    def check_exportable(self, what: str) -> None:
        """Refuse `what` (an export) for the paper's relay, which only the PyTorch drafter runs."""
        if self.relay != "ours":
            raise UserError(f"{what} supports the shipped relay only; this drafter uses relay {self.relay!r} (the "
                            f"DFlow paper's), which runs on the PyTorch back end only (--backend torch or static)")

    def check_target(self, info: TargetInfo) -> None:
        """Refuse a target other than the one this drafter was built for, naming the fix."""
        t = self.target
        sizes, target_sizes = (t.vocab_size, t.hidden_size, t.num_layers), (info.vocab_size, info.hidden_size,
                                                                           info.num_layers)
        if t.fingerprint == info.fingerprint and sizes != target_sizes:
            raise UserError(f"drafter config gives target {t.name!r} vocabulary, hidden size and layers {sizes} "
                            f"but it has {target_sizes}: the config.json was edited; restore the drafter's own")
        if t.fingerprint != info.fingerprint:
            raise UserError(
                f"drafter was built for target {t.name!r} (fingerprint {t.fingerprint}) but the target is "
                f"{info.name!r} (fingerprint {info.fingerprint}); use --target {t.name} or train a drafter "
                f"for {info.name} with `dflow-trt train --target {info.name}`")
