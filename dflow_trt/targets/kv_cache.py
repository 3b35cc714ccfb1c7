"""The target's KV cache: transformers' `DynamicCache` whose layers grow a buffer in place.

`DynamicLayer.update` concatenates every layer's whole cache with the new keys and values on
every forward, so each decoding step copies the entire cache once per layer, and a crop (every
speculative round with a rejection) leaves a strided view that the next concatenation copies more
slowly still. `GrowingLayer` writes the new slots into a buffer with spare capacity (grown by
half plus a few slots, so appends stay amortised O(new slots) and memory within 1.5x + 64 slots of
the filled part) and hands out views of its filled part; a crop only shortens the view. The keys
and values, hence every attention result, are the same.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Spare slots past the filled ones whenever the buffer is (re)made: a prompt's prefill fills its
# buffer, and the verify passes after it should not all reallocate.
HEADROOM = 64


class GrowingLayer(DynamicLayer):
    """`DynamicLayer` with an in-place, geometrically grown buffer [B, Hkv, capacity, D].

    The batch, heads, head size and dtype change only through the inherited batch methods
    (which copy); an `update` with other shapes is refused, where `torch.cat` would fail too.

    `keys`/`values` stay what `DynamicLayer` promises (the cached states [B, Hkv, T, D]), now as
    views of the buffer. Methods inherited from `DynamicLayer` that rebind them (crop, batch
    selection, reordering) keep working: the next `update` adopts whatever they left.
    """

    _k: torch.Tensor | None = None  # buffers; slots [0, _n) are filled
    _v: torch.Tensor | None = None
    _n: int = 0
    _handed_out: torch.Tensor | None = None  # the last `keys` view made here

    def _adopt(self) -> None:
        """Re-read `keys`/`values` after an inherited method rebound them."""
        k = self.keys
        if k is None or k.numel() == 0:
            self._k = self._v = None
            self._n = 0
        elif (self._k is not None and k.dim() == 4 and k.data_ptr() == self._k.data_ptr()
              and k.stride() == self._k.stride() and k.shape[:2] == self._k.shape[:2]):
            self._n = k.shape[2]  # a shorter view of the same buffer: a crop
        else:
            self._k, self._v, self._n = k, self.values, k.shape[2]  # a new tensor: full, grows on the next update

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.keys is not self._handed_out:
            self._adopt()
        B, H, S, D = key_states.shape
        n = self._n
        if n and (self._k.shape[:2] != (B, H) or self._k.shape[3] != D or self._k.dtype != key_states.dtype):
            raise ValueError(f"cache holds {tuple(self._k.shape)} {self._k.dtype} states, got {tuple(key_states.shape)} "
                             f"{key_states.dtype}: change the batch with the cache's batch methods first")
        if self._k is None or n + S > self._k.shape[2] or self._k.shape[:2] != (B, H):
            cap = max(n + S + HEADROOM, int(1.5 * (0 if self._k is None else self._k.shape[2])))
            k, v = key_states.new_empty(B, H, cap, D), value_states.new_empty(B, H, cap, D)
            if n:
                k[:, :, :n], v[:, :, :n] = self._k[:, :, :n], self._v[:, :, :n]
            self._k, self._v = k, v
        self._k[:, :, n:n + S] = key_states
        self._v[:, :, n:n + S] = value_states
        self._n = n + S
        self.keys, self.values = self._k[:, :, :self._n], self._v[:, :, :self._n]  # [B, Hkv, T, D]
        self._handed_out = self.keys
        return self.keys, self.values


def new_kv_cache(config) -> DynamicCache:
    """An empty cache for a model with `config`: growing layers where transformers would make
    plain dynamic ones (full attention), its own layer types (sliding windows, ...) elsewhere."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def reorder_last_slots(cache: DynamicCache, path: torch.Tensor) -> None:
    """Rewrite each row's last S cached slots in the order path [B, S] gives (block-relative slot
    indices), in place: the branch a tree verify kept comes first, so the usual crop drops the rest."""
    B, S = path.shape
    with torch.inference_mode():  # the cached states are inference tensors (the target's forward made them)
        for layer in cache.layers:
            for t in (layer.keys, layer.values):  # [B, Hkv, T, D]
                last = t[:, :, t.shape[2] - S:]
                last.copy_(last.gather(2, path[:, None, :, None].expand(B, t.shape[1], S, t.shape[3])))


def join_kv(a: DynamicCache, b: DynamicCache, Pa: int, Pb: int) -> DynamicCache:
    """Stack b's rows under a's, each layer's slots padded at the end to the longer one's (the
    padding slots are masked by the caller's validity mask). Full-attention layers only."""
    P = max(Pa, Pb)
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, P - t.shape[2]))  # noqa: E731  [B, Hkv, P, D]
    with torch.inference_mode():
        for la, lb in zip(a.layers, b.layers):
            la.keys, la.values = torch.cat([pad(la.keys), pad(lb.keys)]), torch.cat([pad(la.values), pad(lb.values)])
    return a


def keep_kv(cache: DynamicCache, rows: torch.Tensor, slots: torch.Tensor) -> DynamicCache:
    """Only rows [R], each with its slots slots [R, P'] (slot indices, in order): the caller's
    way to drop rows and squeeze out the slots no kept row uses."""
    with torch.inference_mode():
        for layer in cache.layers:
            k, v = layer.keys[rows], layer.values[rows]  # [R, Hkv, P, D]
            idx = slots[:, None, :, None].expand(k.shape[0], k.shape[1], slots.shape[1], k.shape[3])
            layer.keys, layer.values = k.gather(2, idx), v.gather(2, idx)
    return cache
