"""FP8 PTQ (ModelOpt fake quant): checkpoints load back, TensorRT-LLM names and TP shards are right."""

import json

import pytest
import torch
from safetensors.torch import load_file

from onnx_cache import untrained_drafter
from dflow_trt.export import fp8, hf_drafter, trtllm
from dflow_trt.export.fp8_check import Thresholds, heldout_prompts, run_check


@pytest.fixture(scope="module")
def quantized(tiny_qwen3):
    calib = fp8.calibration_prompts(tiny_qwen3, 8)
    qt = fp8.quantize_target(tiny_qwen3, calib)
    drafters = {flow: untrained_drafter(tiny_qwen3, flow, num_layers=2) for flow in (False, True)}
    qd = {flow: fp8.quantize_drafter(d, qt, calib[:4], max_new_tokens=8) for flow, d in drafters.items()}
    return qt, drafters, qd


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_fp8_close(got, want):
    """Equal up to ties: ModelOpt's fake quant (x * 448/amax) and its export (x / (amax/448)) may round
    a value sitting on a tie to neighbouring e4m3 codes; allow one code step, on at most 0.5% of values."""
    diff = (got - want).abs()
    step = want.abs() * 2 ** -3 + want.abs().max() * 2 ** -18  # one e4m3 mantissa step (+ subnormal floor)
    code_changed = diff > 1e-5 * want.abs() + 1e-9  # beyond float rounding of q * scale
    assert (diff <= step).all() and code_changed.float().mean() <= 0.005


def _fake_quant_weights(model):
    return {name: m.weight_quantizer(m.weight.detach()).float() for name, m in fp8.quantized_linears(model)}


def test_calibration_prompts_exclude_eval_sets(tiny_qwen3):
    from dflow_trt.evalsets import humaneval_prompts

    texts = [tiny_qwen3.tokenizer.decode(p) for p in fp8.calibration_prompts(tiny_qwen3, 16)]
    assert not any(h[:60] in t for h in humaneval_prompts() for t in texts)


def test_target_hf_fp8_loads_back(quantized, tmp_path):
    qt, _, _ = quantized
    out = fp8.export_target_hf_fp8(qt, tmp_path / "hf")
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "FP8"
    sd = load_file(out / "model.safetensors")
    assert sd["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    back = fp8.load_target_hf_fp8(out)
    ref = _fake_quant_weights(qt.model)
    assert len(ref) == 7 * qt.info.num_layers
    for name, w in ref.items():
        assert_fp8_close(back.get_submodule(name).weight, w)
    assert torch.equal(back.model.embed_tokens.weight, qt.model.model.embed_tokens.weight)


@pytest.mark.parametrize("flow", [False, True])
def test_drafter_hf_fp8_loads_back(quantized, tiny_qwen3, tmp_path, flow):
    _, drafters, qd = quantized
    out = hf_drafter.export_drafter_hf(qd[flow], tmp_path / "d", "dflow")
    cfg = json.loads((out / "config.json").read_text())
    rec = cfg["dflow_config"]
    assert rec["tap_layers"] == list(tiny_qwen3.info.tap_layers) and rec["block_size"] == 8
    assert rec["mask_token_id"] == 257 and rec["target"]["fingerprint"] == tiny_qwen3.info.fingerprint
    back = hf_drafter.load_drafter_hf_fp8(out, tiny_qwen3.input_embeddings, tiny_qwen3.lm_head)
    for name, w in _fake_quant_weights(qd[flow]).items():
        assert_fp8_close(back.get_submodule(name).weight, w)
    if flow:
        torch.testing.assert_close(back.no_flow, drafters[flow].no_flow)


def test_dflash_layout(quantized, tiny_qwen3, tmp_path):
    _, drafters, qd = quantized
    out = hf_drafter.export_drafter_hf(qd[False], tmp_path / "z", "dflash")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 8
    assert cfg["dflash_config"]["target_layer_ids"] == list(tiny_qwen3.info.tap_layers)
    assert cfg["dflash_config"]["mask_token_id"] == 257
    names = set(load_file(out / "model.safetensors"))
    for n in ("fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_proj.weight",
              "layers.1.self_attn.k_norm.weight", "layers.0.mlp.down_proj.weight", "layers.0.mlp.down_proj.weight_scale",
              "layers.0.post_attention_layernorm.weight"):
        assert n in names, n
    assert not any("embed" in n or "lm_head" in n for n in names)
    with pytest.raises(Exception, match="flow"):
        hf_drafter.export_drafter_hf(qd[True], tmp_path / "z2", "dflash")
    c = qd[False].config
    assert hf_drafter.zlab_unsupported(c) is None
    assert hf_drafter.zlab_vocab_note(c) is None
    reduced = type(c)(**{**c.__dict__, "draft_vocab_size": 64})  # the target's LM head has 260 rows
    assert hf_drafter.zlab_unsupported(reduced) is None and "(260)" in hf_drafter.zlab_vocab_note(reduced)


def test_target_trtllm_checkpoint_names_and_shards(quantized, tmp_path):
    qt, _, _ = quantized
    c1, (full,) = trtllm.read_checkpoint(trtllm.export_target_checkpoint(qt, tmp_path / "tp1", 1))
    assert all(k in c1 for k in trtllm.CONFIG_KEYS)
    assert c1["architecture"] == "Qwen3ForCausalLM" and c1["quantization"]["quant_algo"] == "FP8"
    assert set(full) == trtllm.expected_target_names(c1)
    assert full["transformer.layers.0.attention.qkv.weight"].dtype == torch.float8_e4m3fn
    c2, ranks = trtllm.read_checkpoint(trtllm.export_target_checkpoint(qt, tmp_path / "tp2", 2))
    assert c2["mapping"] == {"world_size": 2, "tp_size": 2, "pp_size": 1} and len(ranks) == 2
    merged = trtllm.merge_target_shards(c2, ranks)
    assert set(merged) == set(full)
    for k in full:
        assert torch.equal(_bits(merged[k]), _bits(full[k])), k


@pytest.mark.parametrize("tp", [1, 2])
def test_drafter_trtllm_checkpoint_shards(quantized, tiny_qwen3, tmp_path, tp):
    _, _, qd = quantized
    c, ranks = trtllm.read_checkpoint(trtllm.export_drafter_checkpoint(qd[True], tmp_path / f"d{tp}", tp))
    assert len(ranks) == tp and c["dflow"]["tap_layers"] == list(tiny_qwen3.info.tap_layers)
    assert c["dflow"]["target"]["fingerprint"] == tiny_qwen3.info.fingerprint and c["dflow"]["block_size"] == 8
    assert ranks[0]["layers.0.self_attn.q_proj.weight"].shape[0] * tp == 4 * 16
    full = fp8.drafter_fp8_state_dict(qd[True])
    merged = trtllm.merge_drafter_shards(ranks)
    assert set(merged) == set(full)
    for k in full:
        assert torch.equal(_bits(merged[k]), _bits(full[k])), k


def test_tp_size_must_divide_heads(quantized, tmp_path):
    from dflow_trt.errors import UserError

    qt, _, qd = quantized
    with pytest.raises(UserError, match="does not divide"):
        trtllm.export_drafter_checkpoint(qd[True], tmp_path / "x", 4)
    with pytest.raises(UserError, match="does not divide"):
        trtllm.export_target_checkpoint(qt, tmp_path / "y", 3)


def test_llm_api_config_and_engine_guard(tmp_path):
    opts = trtllm.llm_api_config("/b/fp8/hf/target", "/b/fp8/hf/drafter-dflash-dflash", 16, [1, 3, 5], tp_size=2,
                                 mask_token_id=257)
    assert opts["backend"] == "pytorch" and opts["tensor_parallel_size"] == 2
    spec = opts["speculative_config"]
    assert spec["decoding_type"] == "DFlash" and spec["max_draft_len"] == 15
    assert spec["target_layer_ids"] == [1, 3, 5] and spec["speculative_model"].endswith("-dflash")
    assert spec["mask_token_id"] == 257 and set(spec) <= set(trtllm.DFLASH_SPEC_FIELDS)
    assert "speculative_config" not in trtllm.llm_api_config("/b/t", None, 16, [1, 3, 5])
    assert "speculative_config:\n  decoding_type: \"DFlash\"" in trtllm.to_yaml(opts)
    cmds = trtllm.engine_build_commands(tmp_path / "ck", tmp_path / "eng", 16, 2)
    flat = cmds[0]
    assert flat[flat.index("--max_draft_len") + 1] == "15" and "draft_tokens_external" in flat
    ok, _ = trtllm.engine_build_available()
    if not ok:
        with pytest.raises(trtllm.EngineBuildUnavailable, match="trtllm-build --checkpoint_dir"):
            trtllm.build_engines(cmds)


def test_fp8_check_report(quantized, tiny_qwen3, tmp_path):
    qt, drafters, qd = quantized
    prompts = heldout_prompts(tiny_qwen3, 4)
    rep = run_check(tiny_qwen3, qt, {"dflash": (drafters[False], qd[False])}, prompts, 8, log=lambda m: None)
    assert 0 <= rep.top1_agreement <= 1 and rep.kl_mean >= 0 and set(rep.tau["dflash"]) == {
        "full", "fp8_target_fp8_drafter", "fp8_target_full_drafter"}
    loose = run_check(tiny_qwen3, qt, {}, prompts, 8, Thresholds(0.0, 10.0, 0.0, 0.0), log=lambda m: None)
    assert loose.passed
    strict = run_check(tiny_qwen3, qt, {}, prompts, 8, Thresholds(1.01, 0.0, 1.01, 2.0), log=lambda m: None)
    assert not strict.passed and "FAIL" in strict.table()
    assert json.loads(strict.to_json())["passed"] is False
