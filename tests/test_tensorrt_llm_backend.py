"""backend=tensorrt_llm up to its boundary: options from the build, load errors, the round mapping.

TensorRT-LLM cannot be installed on these machines (no wheel for this platform, no GPU), so the
LLM object itself is the one stand-in here: it replays what `generate_async(..., streaming=True)`
yields (cumulative token ids per iteration). Everything on our side of that call is real.
"""

import importlib.util
import json
from dataclasses import dataclass, field

import pytest

from dflow_trt.backends.tensorrt_llm import generate_llmapi, llm_api_options, load_llm, served_modes
from dflow_trt.decoding.sampling import SamplingParams
from dflow_trt.errors import UserError
from dflow_trt.export import manifest as mf
from dflow_trt.export.trtllm import llm_api_config
from dflow_trt.serving.engine import DecodingEngine, ServeConfig

HAVE_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None


def _build(tmp_path, spec=True, target="tiny-qwen3"):
    (tmp_path / "fp8" / "hf" / "target").mkdir(parents=True)
    (tmp_path / "fp8" / "hf" / "drafter-dflash-dflash").mkdir(parents=True)
    (tmp_path / "trtllm").mkdir()
    opts = llm_api_config(str(tmp_path / "fp8" / "hf" / "target"),
                          str(tmp_path / "fp8" / "hf" / "drafter-dflash-dflash") if spec else None, 8, [1, 3], 1, 257)
    (tmp_path / "trtllm" / "llm_api.json").write_text(json.dumps(opts))
    mf.write_manifest(tmp_path, {"target": {"name": target, "vocab_size": 260}})
    return tmp_path


def test_options_come_from_the_build(tmp_path):
    with pytest.raises(UserError, match="llm_api.json is missing; write it with `python scripts/build_engines.py"):
        llm_api_options(tmp_path)
    opts = llm_api_options(_build(tmp_path))
    assert served_modes(opts) == ("dflash",) and opts["speculative_config"]["max_draft_len"] == 7
    (tmp_path / "fp8" / "hf" / "drafter-dflash-dflash").rmdir()
    with pytest.raises(UserError, match="names drafter .* which does not exist"):
        llm_api_options(tmp_path)


def test_trtllm_dflow_parameter_picks_the_plugin_options(tmp_path):
    """Served model parameter `trtllm_dflow 1` reads the build's llm_api_dflow.json (refused in one
    line where the build has none, or with another back end)."""
    b = _build(tmp_path)
    with pytest.raises(UserError, match="llm_api_dflow.json is missing; .* with a DFlow drafter"):
        DecodingEngine(ServeConfig(target="tiny-qwen3", backend="tensorrt_llm", build_dir=str(b), trtllm_dflow=1),
                       log=lambda m: None)
    for params in ({"trtllm_dflow": "1"}, {"trtllm_dflow": "2", "backend": "tensorrt_llm"}):
        with pytest.raises(UserError, match="parameter trtllm_dflow=.* is 0 or 1, and 1 only with backend=tensorrt_llm"):
            ServeConfig.from_parameters(params)
    assert ServeConfig.from_parameters({"trtllm_dflow": "1", "backend": "tensorrt_llm"}).trtllm_dflow == 1


def test_build_without_zlab_drafter_serves_ar_only(tmp_path):
    assert served_modes(llm_api_options(_build(tmp_path, spec=False))) == ("ar",)


@pytest.mark.skipif(HAVE_TRTLLM, reason="TensorRT-LLM is installed: the guard does not apply")
def test_load_fails_clearly_without_tensorrt_llm(tmp_path):
    b = _build(tmp_path)
    with pytest.raises(UserError, match="needs a GPU host with TensorRT-LLM"):
        load_llm(llm_api_options(b))
    # the serving model fails its load the same way (not at the first request)
    with pytest.raises(UserError, match="needs a GPU host with TensorRT-LLM"):
        DecodingEngine(ServeConfig(target="tiny-qwen3", backend="tensorrt_llm", build_dir=str(b)), log=lambda m: None)
    with pytest.raises(UserError, match="built for target 'tiny-qwen3'"):
        DecodingEngine(ServeConfig(target="tiny-llama", backend="tensorrt_llm", build_dir=str(b)), log=lambda m: None)
    with pytest.raises(UserError, match="needs parameter build_dir"):
        DecodingEngine(ServeConfig(target="tiny-qwen3", backend="tensorrt_llm"), log=lambda m: None)


@dataclass
class _Out:
    token_ids: list
    finish_reason: str | None = None


@dataclass
class _Step:
    outputs: list


@dataclass
class _Request:
    steps: list
    aborted: bool = False

    def __iter__(self):
        for ids, reason in self.steps:
            if self.aborted:
                return
            yield _Step([_Out(ids, reason)])

    def abort(self):
        self.aborted = True


@dataclass
class _ReplayLLM:
    """Replays a TensorRT-LLM streaming request: cumulative ids after each iteration."""

    steps: list
    calls: list = field(default_factory=list)

    def generate_async(self, prompt_ids, params, streaming):
        assert streaming
        self.calls.append((prompt_ids, params))
        self.req = _Request(self.steps)
        return self.req


def test_streamed_iterations_become_rounds():
    llm = _ReplayLLM([([5], None), ([5, 6, 7, 8], None), ([5, 6, 7, 8], None), ([5, 6, 7, 8, 9, 2], "stop")])
    rounds = []
    res = generate_llmapi(llm, [1, 2, 3], 16, SamplingParams(), on_round=lambda ev: rounds.append(ev.new_tokens[0]),
                          make_params=lambda n, s: {"max_tokens": n, "temperature": s.temperature})
    assert llm.calls == [([1, 2, 3], {"max_tokens": 16, "temperature": 0.0})]
    assert res.token_ids == [[5, 6, 7, 8, 9, 2]] and rounds == [[5], [6, 7, 8], [9, 2]]
    # the prefill's token is not a verify round; each later iteration commits its acceptance length
    assert res.acceptance_lengths == [[3, 2]] and res.tau == 2.5 and res.finish_reasons == ["stop"]


def test_stopping_aborts_the_tensorrt_llm_request():
    llm = _ReplayLLM([([5], None), ([5, 6], None), ([5, 6, 7], None)])
    res = generate_llmapi(llm, [1], 16, SamplingParams(), on_round=lambda ev: ev.round == 1,
                          make_params=lambda n, s: None)
    assert llm.req.aborted and res.token_ids == [[5, 6]] and res.finish_reasons == ["stopped"]
