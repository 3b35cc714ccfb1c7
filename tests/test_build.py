"""The staged build: every artefact, a manifest, cached re-runs, no trust in unfinished stages,
and `load_backends` on the ONNX Runtime back end equal to torch."""

import json

import pytest
import torch

from conftest import PROMPTS_TEXT, chat_ids
from dflow_trt.loading import load_backends
from dflow_trt.decoding.loop import generate
from dflow_trt.decoding.options import DecodeOptions
from dflow_trt.export.build import Build, BuildSpec


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("build") / "tiny"
    spec = BuildSpec(target="tiny-qwen3", out=str(out), tp_size=2, calib_prompts=4, check_prompts=2,
                     check_max_new_tokens=4)
    logs = []
    Build(spec, log=logs.append).run()
    return spec, out, logs


def test_build_writes_everything(built):
    spec, out, logs = built
    m = json.loads((out / "manifest.json").read_text())
    assert m["target"]["tap_layers"] and m["tp_size"] == 2 and set(m["drafters"]) == {"dflash", "dflow"}
    assert m["drafters"]["dflash"]["untrained"] and m["tools"]["nvidia-modelopt"]
    assert set(m["source_hashes"]) == {"target", "drafter-dflash", "drafter-dflow"}
    for rel in m["artefacts"].values():
        assert (out / rel).exists(), rel
    for rel in ("onnx/target/target.onnx", "onnx/drafter-dflow/drafter.onnx", "fp8/hf/target/hf_quant_config.json",
                "fp8/hf/drafter-dflash-dflash/config.json", "trtllm/checkpoints/target-tp2/rank1.safetensors",
                "trtllm/checkpoints/drafter-dflow-tp2/rank1.safetensors", "trtllm/llm_api.yaml",
                "trtllm/build_engines.sh", "reports/fp8_check.json"):
        assert (out / rel).exists(), rel
    opts = json.loads((out / "trtllm/llm_api.json").read_text())
    assert opts["speculative_config"]["target_layer_ids"] == m["target"]["tap_layers"]
    assert opts["speculative_config"]["max_draft_len"] == m["drafters"]["dflash"]["block_size"] - 1
    if m["engines"] != "built":
        assert "GPU host" in m["engines"] and any("engines: SKIPPED" in line for line in logs)


def test_build_writes_the_dflow_plugin_folder_and_its_llm_api_options(built):
    """The DFlow drafter in z-lab's layout with its flow branch beside it (the TensorRT-LLM plug-in's
    folder, the branch equal to the built drafter's), and `llm_api_dflow.json` naming it and the
    plug-in: served as dflow where `llm_api.json` serves dflash."""
    from dflow_trt.backends.tensorrt_llm import llm_api_options, served_modes
    from dflow_trt.backends.trtllm_dflow import PLUGIN_MODULE
    from dflow_trt.backends.trtllm_dflow.relay_io import FLOW_FILE, flow_state_dict, load_flow_branch
    from dflow_trt.drafter.defaults import load_target_and_drafter

    _, out, _ = built
    m = json.loads((out / "manifest.json").read_text())
    folder = out / "fp8/hf/drafter-dflow-dflash"
    assert json.loads((folder / "config.json").read_text())["dflash_config"]["target_layer_ids"] == m["target"]["tap_layers"]
    _, drafter = load_target_and_drafter("tiny-qwen3", m["drafters"]["dflow"]["path"], "dflow", warn=lambda msg: None)
    want, got = flow_state_dict(drafter), load_flow_branch(folder / FLOW_FILE).state_dict()
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)
    opts = llm_api_options(out, dflow=True)
    assert served_modes(opts) == ("dflow",) and opts["dflow_plugin"] == PLUGIN_MODULE
    assert opts["speculative_config"]["speculative_model"] == str(folder.resolve())
    assert served_modes(llm_api_options(out)) == ("dflash",)
    assert "flow branch" in m["zlab_dflash_layout"]["dflow"]


def test_rebuild_is_cached_and_unfinished_stages_rerun(built):
    spec, out, _ = built
    (out / ".stages" / "trtllm-configs.json").unlink()  # as if interrupted before its marker
    stale = out / "trtllm" / ".llm_api.json.dflow-tmp-abc123"
    stale.write_text("half")  # the temporary a killed write of that stage left behind
    users = [out / ".my-notes", out / "onnx" / ".target-abc123", out / "sub" / ".node-cache"]
    for d in users:  # hidden folders with a '-' that the build did not write: never deleted
        d.mkdir(parents=True)
        (d / "keep.txt").write_text("mine")
    logs = []
    Build(spec, log=logs.append).run()
    cached = [line for line in logs if line.endswith(": cached")]
    rebuilt = [line for line in logs if line.endswith("building ...")]
    assert len(cached) >= 10 and rebuilt == ["[12] trtllm-configs: building ..."], rebuilt
    assert not stale.exists()
    assert all((d / "keep.txt").read_text() == "mine" for d in users)


def test_load_backends_onnxruntime_equals_torch(built):
    spec, out, _ = built
    m = json.loads((out / "manifest.json").read_text())
    drafter = m["drafters"]["dflow"]["path"]
    for mode in ("ar", "dflow"):
        t_torch, d_torch = load_backends("tiny-qwen3", drafter, mode, "torch")
        t_ort, d_ort = load_backends("tiny-qwen3", drafter, mode, "onnxruntime", str(out),
                                     log=lambda msg: None)
        prompts = [chat_ids(t_torch, t) for t in PROMPTS_TEXT[:2]]
        a = generate(t_torch, d_torch, prompts, DecodeOptions(block_size=4 if mode != "ar" else None, mode=mode, max_new_tokens=16, stop_token_ids=()))
        b = generate(t_ort, d_ort, prompts, DecodeOptions(block_size=4 if mode != "ar" else None, mode=mode, max_new_tokens=16, stop_token_ids=()))
        assert a.token_ids == b.token_ids
