"""The in-place KV cache: the same keys, values and logits as transformers' DynamicCache, without
copying the cache on every step."""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from dflow_trt.targets.kv_cache import GrowingLayer, new_kv_cache


def _kv(B, S, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 2, S, 4, generator=g), torch.randn(B, 2, S, 4, generator=g)


def test_growing_layer_matches_dynamic_layer_through_updates_crops_and_batch_ops():
    ref, new = DynamicLayer(), GrowingLayer()
    steps = [("update", 5), ("update", 3), ("crop", -2), ("update", 70), ("crop", -1), ("update", 1),
             ("select", None), ("update", 4), ("crop", -3), ("update", 2)]
    for i, (op, n) in enumerate(steps):
        for layer in (ref, new):
            if op == "update":
                k, v = _kv(ref.keys.shape[0] if ref.is_initialized and ref.keys.dim() == 4 else 3, n, i)
                out = layer.update(k, v)
            elif op == "crop":
                layer.crop(n)
            else:
                layer.batch_select_indices(torch.tensor([2, 0]))
        if op == "update":
            assert torch.equal(out[0], new.keys) and torch.equal(out[1], new.values)
        assert torch.equal(ref.keys, new.keys) and torch.equal(ref.values, new.values), (i, op)
        assert new.get_seq_length() == ref.get_seq_length()


def test_appends_write_in_place_until_the_buffer_is_full():
    layer = GrowingLayer()
    layer.update(*_kv(1, 10, 0))
    start = layer.keys.data_ptr()
    for i in range(20):
        layer.update(*_kv(1, 2, i + 1))
        if i % 3 == 0:
            layer.crop(-1)
    assert layer.keys.data_ptr() == start  # 10 + 20 * 2 - 7 slots fit the first 10 + 64: never copied
    layer.update(*_kv(1, 40, 99))  # past the capacity: one copy into a larger buffer, with room to spare
    assert layer.keys.data_ptr() != start and layer._k.shape[2] > layer.get_seq_length() == 83


def test_an_update_of_another_batch_is_refused():
    layer = GrowingLayer()
    layer.update(*_kv(2, 5, 0))
    with pytest.raises(ValueError, match="batch methods"):
        layer.update(*_kv(1, 1, 1))


def test_target_forward_is_bitwise_the_same_with_either_cache(tiny_qwen3):
    model = tiny_qwen3.model
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    caches = [DynamicCache(config=model.config), new_kv_cache(model.config)]
    assert all(type(layer) is GrowingLayer for layer in caches[1].layers)
    outs = [[], []]
    with torch.inference_mode():
        for c, o in zip(caches, outs):
            o.append(model(input_ids=ids[:, :8], past_key_values=c, use_cache=True).logits)
            o.append(model(input_ids=ids[:, 8:11], past_key_values=c, use_cache=True).logits)
            c.crop(-2)  # a rejection: keep the first of the three
            o.append(model(input_ids=ids[:, 9:12], past_key_values=c, use_cache=True).logits)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
