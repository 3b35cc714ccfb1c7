"""The TensorRT-LLM DFlow plug-in where TensorRT-LLM is absent: the clear refusal, the release check
(run on fake TensorRT-LLM modules written like the pinned sources, then changed), the flow file and
the llm_api.json wiring. Its hooks into a real TensorRT-LLM run only on a GPU host."""

import copy
import enum
import importlib
import importlib.util
import json
import types

import pytest
import torch

from dflow_trt.backends.tensorrt_llm import llm_api_options, load_llm, served_modes
from dflow_trt.backends.trtllm_dflow import PLUGIN_MODULE
from dflow_trt.backends.trtllm_dflow.pins import (
    HOOKS,
    PINNED_RELEASE,
    check_release,
    signature_text,
)
from dflow_trt.backends.trtllm_dflow.relay_io import (
    FLOW_FILE,
    flow_state_dict,
    load_flow_branch,
    save_flow_branch,
)
from dflow_trt.decoding.flow import carry_flow
from dflow_trt.errors import UserError
from dflow_trt.export.trtllm import llm_api_config

needs_no_trtllm = pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None,
                                     reason="TensorRT-LLM is installed here")


@needs_no_trtllm
def test_plugin_import_without_tensorrt_llm_names_the_release_to_install():
    with pytest.raises(UserError) as e:
        importlib.import_module(PLUGIN_MODULE)
    msg = str(e.value)
    assert msg.startswith("TensorRT-LLM is not installed; install tensorrt_llm==") and PINNED_RELEASE in msg
    assert "\n" not in msg


# ---- fake TensorRT-LLM modules, written like the pinned sources (annotations included) ----

class Mapping:
    pass


def fake_tensorrt_llm(worker_prepare=None, drop=()):
    """{module name: module} for every hooked module; `worker_prepare` replaces the hooked method."""

    class SpecWorkerBase:
        def __init__(self, use_separate_draft_kv_cache: bool = False):
            pass

    class DFlashWorker(SpecWorkerBase):
        def __init__(self, spec_config: "DFlashDecodingConfig", mapping: Mapping,  # noqa: F821
                     use_separate_draft_kv_cache: bool = False):
            super().__init__(use_separate_draft_kv_cache)

        @property
        def _draft_tokens_per_req(self) -> int:
            return 4

        def prepare_1st_drafter_inputs(self, input_ids: torch.LongTensor, position_ids: torch.LongTensor,
                                       hidden_states: torch.Tensor, accepted_tokens: torch.Tensor,
                                       num_accepted_tokens: torch.Tensor, attn_metadata: object,
                                       spec_metadata: object, draft_model: torch.nn.Module,
                                       total_target_tokens: int = 0):
            return {}

    if worker_prepare is not None:
        DFlashWorker.prepare_1st_drafter_inputs = worker_prepare

    class DFlashSpecMetadata:
        def get_hidden_states(self, num_tokens: int) -> torch.Tensor | None:
            return None

    class SpeculativeDecodingMode(enum.IntEnum):
        MTP = 0
        DFLASH = 1

        def is_dflash(self):
            return self == SpeculativeDecodingMode.DFLASH

    def get_spec_worker(spec_config, model_config, mapping, use_separate_draft_kv_cache: bool = False):
        return None

    def register_draft_model(mode):
        return lambda builder: builder

    def get_registered_draft_model_builder(mode) -> object | None:
        return None

    class DFlashForCausalLM(torch.nn.Module):
        def __init__(self, draft_config, *, dflash_attention_backend: str = "VANILLA"):
            super().__init__()

    def _build_dflash_draft(model_config, draft_config, lm_head, model):
        return DFlashForCausalLM(draft_config)

    contents = {
        "tensorrt_llm._torch.speculative.dflash": {"DFlashWorker": DFlashWorker, "DFlashSpecMetadata": DFlashSpecMetadata},
        "tensorrt_llm._torch.speculative.utils": {"get_spec_worker": get_spec_worker},
        "tensorrt_llm._torch.speculative.interface": {"SpeculativeDecodingMode": SpeculativeDecodingMode},
        "tensorrt_llm._torch.models.modeling_speculative": {"get_spec_worker": get_spec_worker},
        "tensorrt_llm._torch.models.modeling_utils": {
            "register_draft_model": register_draft_model,
            "get_registered_draft_model_builder": get_registered_draft_model_builder},
        "tensorrt_llm._torch.models.modeling_dflash": {"DFlashForCausalLM": DFlashForCausalLM,
                                                           "_build_dflash_draft": _build_dflash_draft},
    }
    mods = {}
    for name, attrs in contents.items():
        m = types.ModuleType(name)
        for k, v in attrs.items():
            if (name, k) not in drop:
                setattr(m, k, v)
        mods[name] = m

    def import_module(name):
        if name not in mods:
            raise ModuleNotFoundError(name)
        return mods[name]

    return import_module


def test_release_check_passes_a_tensorrt_llm_written_like_the_pins():
    check_release(PINNED_RELEASE, fake_tensorrt_llm())  # no error: every hook found with its pinned signature


def test_release_check_covers_every_hooked_module():
    assert {h.module for h in HOOKS} == {
        "tensorrt_llm._torch.speculative.dflash", "tensorrt_llm._torch.speculative.utils",
        "tensorrt_llm._torch.speculative.interface", "tensorrt_llm._torch.models.modeling_speculative",
        "tensorrt_llm._torch.models.modeling_utils", "tensorrt_llm._torch.models.modeling_dflash"}


def one_line_refusal(version, import_module) -> str:
    with pytest.raises(UserError) as e:
        check_release(version, import_module)
    msg = str(e.value)
    assert "\n" not in msg and f"install tensorrt_llm=={PINNED_RELEASE}" in msg and "re-pin" in msg
    return msg


def test_release_check_refuses_another_version_even_with_matching_signatures():
    msg = one_line_refusal("1.3.0rc23", fake_tensorrt_llm())
    assert f"version 1.3.0rc23 is not {PINNED_RELEASE}" in msg


def test_release_check_refuses_a_changed_worker_signature_and_names_it():
    def prepare(self, input_ids, position_ids, hidden_states, accepted_tokens, num_accepted_tokens,
                attn_metadata, spec_metadata, draft_model, total_target_tokens=0, prep=None):  # a newer one
        return {}

    msg = one_line_refusal(PINNED_RELEASE, fake_tensorrt_llm(worker_prepare=prepare))
    assert "DFlashWorker.prepare_1st_drafter_inputs: expected" in msg and "prep=None" in msg
    assert "version" not in msg  # only what differs is listed


def test_release_check_refuses_missing_hooks_and_modules():
    msg = one_line_refusal(PINNED_RELEASE, fake_tensorrt_llm(drop={
        ("tensorrt_llm._torch.models.modeling_speculative", "get_spec_worker")}))
    assert "get_spec_worker: expected (spec_config, model_config, mapping" in msg and "missing (AttributeError)" in msg

    base = fake_tensorrt_llm()

    def no_dflash_module(name):
        if name.endswith("modeling_dflash"):
            raise ModuleNotFoundError(name)
        return base(name)

    msg = one_line_refusal(PINNED_RELEASE, no_dflash_module)
    assert "DFlashForCausalLM.__init__" in msg and "_build_dflash_draft" in msg and "ModuleNotFoundError" in msg


def test_signature_text_ignores_annotations_but_not_names_kinds_or_defaults():
    def a(self, x: int, *, b: str = "V") -> int: ...
    def b(self, x, *, b="V"): ...
    def c(self, x, b="V"): ...
    assert signature_text(a) == signature_text(b) == "(self, x, *, b='V')"
    assert signature_text(c) != signature_text(b)


# ---- the flow file beside a DFlash drafter ----

@pytest.fixture(scope="module")
def drafters(tiny_qwen3):
    from dflow_trt.drafter.config import DrafterConfig
    from dflow_trt.drafter.io import build_drafter

    kw = {"mask_token_id": 3, "block_size": 4, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
              "intermediate_size": 64}
    return {f: build_drafter(tiny_qwen3, DrafterConfig.for_target(tiny_qwen3.info, flow=f, **kw)) for f in (True, False)}


@pytest.fixture(scope="module")
def drafter_and_verify(drafters, tiny_qwen3, tmp_path_factory):
    """A flow drafter with a non-trivial branch, a real verify on tiny-qwen3 with partial acceptance,
    and the branch read back from its flow file."""
    d, t = copy.deepcopy(drafters[True]), tiny_qwen3  # its own copy: the branch is changed below
    with torch.no_grad():
        for p in (d.flow_present, d.no_flow, d.hint_gate, d.flow_norm.weight):
            p.normal_(generator=torch.Generator().manual_seed(5))
    S = d.config.block_size
    prompt, lens = torch.tensor([[5, 17, 42, 8, 99, 23]] * 2), torch.tensor([6, 6])
    cache, pre = t.prefill(prompt, lens)
    anchor = pre.logits[:, -1].argmax(-1)
    cache2, _ = t.prefill(prompt, lens)
    probe = t.verify(cache2, torch.cat([anchor[:, None], torch.full((2, S - 1), 7)], 1))
    drafts = torch.full((2, S - 1), 150)
    drafts[0, 0] = probe.logits[0, 0].argmax()  # row 0 accepts a draft, row 1 none
    block = torch.cat([anchor[:, None], drafts], 1)
    out = t.verify(cache, block)
    target = out.logits.argmax(-1)
    a = torch.cumprod((drafts == target[:, :-1]).long(), 1).sum(1)
    assert a[0] >= 1 and a[1] == 0
    next_ids = torch.full((2, S), d.config.mask_token_id)
    next_ids[:, 0] = target.gather(1, a[:, None]).squeeze(1)
    branch = load_flow_branch(save_flow_branch(d, tmp_path_factory.mktemp("flow")))
    return d, block, out.taps, target, a, next_ids, branch


def test_flow_file_round_trips_the_branch(drafters, tmp_path):
    d = copy.deepcopy(drafters[True])
    with torch.no_grad():
        d.no_flow.normal_()
    path = save_flow_branch(d, tmp_path)
    assert path.name == FLOW_FILE
    branch = load_flow_branch(path)
    sd = flow_state_dict(d)
    assert set(sd) == set(branch.state_dict()) and all(torch.equal(sd[k], v) for k, v in branch.state_dict().items())
    assert branch.flow_norm.eps == d.config.rms_norm_eps


def test_flow_file_refusals(drafters, tmp_path):
    with pytest.raises(UserError, match="has no flow branch"):
        flow_state_dict(drafters[False])
    with pytest.raises(UserError, match=f"{FLOW_FILE} is missing; write it"):
        load_flow_branch(tmp_path / FLOW_FILE)


# ---- llm_api.json wiring: a `dflow` build loads the plug-in, anything else stays as it was ----

def _build_dir(tmp_path, **kw):
    (tmp_path / "target").mkdir(exist_ok=True)
    (tmp_path / "drafter").mkdir(exist_ok=True)
    opts = llm_api_config(str(tmp_path / "target"), str(tmp_path / "drafter"), 8, [1, 3], **kw)
    (tmp_path / "trtllm").mkdir(exist_ok=True)
    (tmp_path / "trtllm" / "llm_api.json").write_text(json.dumps(opts))
    return tmp_path


def test_dflow_build_names_the_plugin_and_serves_dflow(tmp_path):
    opts = llm_api_options(_build_dir(tmp_path, dflow=True))
    assert opts["dflow_plugin"] == PLUGIN_MODULE and served_modes(opts) == ("dflow",)
    plain = llm_api_config(str(tmp_path / "target"), str(tmp_path / "drafter"), 8, [1, 3])
    assert "dflow_plugin" not in plain and served_modes(plain) == ("dflash",)
    assert "dflow_plugin" not in llm_api_config(str(tmp_path / "target"), None, 8, [1, 3], dflow=True)


def test_load_llm_refuses_a_foreign_plugin_module_and_a_host_without_tensorrt_llm(tmp_path):
    opts = llm_api_options(_build_dir(tmp_path, dflow=True))
    with pytest.raises(UserError, match="the only plug-in this back end loads is"):
        load_llm({**opts, "dflow_plugin": "os"})
    if importlib.util.find_spec("tensorrt_llm") is None:
        with pytest.raises(UserError, match="needs a GPU host with TensorRT-LLM"):
            load_llm(opts)


# ---- plugin.py itself, installed into a fake TensorRT-LLM written like the pinned sources ----

@pytest.fixture
def installed(monkeypatch):
    """Import plugin.py against fake `tensorrt_llm` modules (the pinned names and signatures; the
    worker's base method returns whatever block embedding the test set), and undo it afterwards."""
    import sys
    from importlib.machinery import ModuleSpec

    resolve = fake_tensorrt_llm()
    names = ["tensorrt_llm._torch.speculative.dflash", "tensorrt_llm._torch.speculative.utils",
             "tensorrt_llm._torch.speculative.interface", "tensorrt_llm._torch.models.modeling_speculative",
             "tensorrt_llm._torch.models.modeling_utils", "tensorrt_llm._torch.models.modeling_dflash"]
    mods = {n: resolve(n) for n in names}
    registry = {}
    utils = mods["tensorrt_llm._torch.models.modeling_utils"]
    utils.register_draft_model = lambda mode: (lambda b: registry.__setitem__(mode, b) or b)
    utils.get_registered_draft_model_builder = lambda mode: registry.get(mode)
    dflash_models = mods["tensorrt_llm._torch.models.modeling_dflash"]
    registry[mods["tensorrt_llm._torch.speculative.interface"].SpeculativeDecodingMode.DFLASH] = \
        dflash_models._build_dflash_draft
    worker_cls = mods["tensorrt_llm._torch.speculative.dflash"].DFlashWorker

    def prepare(self, input_ids, position_ids, hidden_states, accepted_tokens, num_accepted_tokens, attn_metadata,
                spec_metadata, draft_model, total_target_tokens=0):
        return {"noise_embedding": self.test_noise}  # DFlash's block embedding, as the test set it

    worker_cls.prepare_1st_drafter_inputs = prepare
    for pkg in ("tensorrt_llm", "tensorrt_llm._torch", "tensorrt_llm._torch.models", "tensorrt_llm._torch.speculative"):
        m = types.ModuleType(pkg)
        m.__spec__, m.__path__ = ModuleSpec(pkg, None, is_package=True), []
        mods[pkg] = m
    mods["tensorrt_llm"].__version__ = PINNED_RELEASE
    for n, m in mods.items():
        parent, _, leaf = n.rpartition(".")
        if parent:
            setattr(mods[parent], leaf, m)
        monkeypatch.setitem(sys.modules, n, m)
    monkeypatch.delitem(sys.modules, PLUGIN_MODULE, raising=False)
    plugin = importlib.import_module(PLUGIN_MODULE)
    yield plugin, mods, registry
    sys.modules.pop(PLUGIN_MODULE, None)


def test_plugin_registers_its_builder_and_wraps_the_factory(installed, drafters, tmp_path):
    plugin, mods, registry = installed
    modes = mods["tensorrt_llm._torch.speculative.interface"].SpeculativeDecodingMode
    spec_mod = mods["tensorrt_llm._torch.models.modeling_speculative"]
    assert registry[modes.DFLASH] is plugin.build_dflow_draft
    assert spec_mod.get_spec_worker is plugin.get_spec_worker
    spec = types.SimpleNamespace(spec_dec_mode=modes.DFLASH, speculative_model=str(tmp_path), attention_backend="VANILLA")
    assert isinstance(spec_mod.get_spec_worker(spec, None, None), plugin.DFlowWorker)
    assert spec_mod.get_spec_worker(types.SimpleNamespace(spec_dec_mode=modes.MTP), None, None) is None  # the original
    cfg = types.SimpleNamespace(spec_config=spec)
    plain = plugin.build_dflow_draft(cfg, None, None, None)  # no flow file: the built-in builder
    assert type(plain).__name__ == "DFlashForCausalLM"
    save_flow_branch(drafters[True], tmp_path)
    drafter = plugin.build_dflow_draft(cfg, None, None, None)
    assert isinstance(drafter, plugin.DFlowDrafterForCausalLM) and "dflow_flow" not in dict(drafter.named_modules())
    assert torch.equal(drafter.dflow_flow.no_flow, drafters[True].no_flow)


def test_plugin_loads_the_exported_dflow_folder(installed, drafters, tmp_path):
    """`export_drafter_hf(layout="dflash+flow")`, what `build` writes for a DFlow drafter: the DFlash
    part under z-lab's names with no flow tensor among them, the flow branch beside it; the plug-in's
    builder takes that folder as DFlow with the drafter's own branch. Layout refusals in one line."""
    from safetensors import safe_open

    from dflow_trt.drafter.model import DFlowDrafter
    from dflow_trt.export.hf_drafter import export_drafter_hf

    plugin, mods, _ = installed
    d = copy.deepcopy(drafters[True])
    with torch.no_grad():
        d.no_flow.normal_(generator=torch.Generator().manual_seed(3))
    out = export_drafter_hf(d, tmp_path / "dflow-dflash", "dflash+flow")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["target_layer_ids"] == list(
        d.config.tap_layers)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "fc.weight" in names and not {n for n in names if n.split(".")[0] in DFlowDrafter.FLOW_BRANCH}
    spec = types.SimpleNamespace(spec_dec_mode=mods["tensorrt_llm._torch.speculative.interface"]
                                 .SpeculativeDecodingMode.DFLASH, speculative_model=str(out), attention_backend="VANILLA")
    loaded = plugin.build_dflow_draft(types.SimpleNamespace(spec_config=spec), None, None, None)
    assert isinstance(loaded, plugin.DFlowDrafterForCausalLM)
    want = flow_state_dict(d)
    assert all(torch.equal(want[k], v) for k, v in loaded.dflow_flow.state_dict().items())
    with pytest.raises(UserError, match="no flow branch: use layout dflash"):
        export_drafter_hf(drafters[False], tmp_path / "x", "dflash+flow")
    with pytest.raises(UserError, match="layout dflash\\+flow"):
        export_drafter_hf(drafters[True], tmp_path / "y", "dflash")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@torch.no_grad()
def test_plugin_worker_adds_the_relay_from_the_second_gen_step_on(installed, drafter_and_verify):
    plugin, _, _ = installed
    d, block, taps, target, a, next_ids, branch = drafter_and_verify
    B, S = block.shape
    worker = plugin.DFlowWorker(None, None)
    worker._ctx_len, worker._batch_to_slot = torch.zeros(B + 1), torch.tensor([1, 0])  # slots need not be rows
    table = torch.nn.Embedding.from_pretrained(d.embed_weight)
    model = types.SimpleNamespace(dflow_flow=branch, draft_model_full=types.SimpleNamespace(
        model=types.SimpleNamespace(embed_tokens=table)))
    worker.test_noise = table(next_ids)
    captured = taps.reshape(B * S, -1)
    meta = types.SimpleNamespace(get_hidden_states=lambda n: captured[:n])

    def step(nc, bs):
        attn = types.SimpleNamespace(num_contexts=nc, num_seqs=bs, num_ctx_tokens=0)
        return worker.prepare_1st_drafter_inputs(
            input_ids=block.reshape(-1), position_ids=None, hidden_states=None, accepted_tokens=target,
            num_accepted_tokens=a + 1, attn_metadata=attn, spec_metadata=meta, draft_model=model,
            total_target_tokens=B * S)["noise_embedding"]

    # right after prefill the verified block held placeholder drafts: no relay, as flow=None
    assert torch.equal(step(0, B), d.block_inputs(next_ids, None))
    # the next gen step relays the rejected slots, exactly as our loop does
    flow = carry_flow(block, taps, target, a)
    assert torch.equal(step(0, B), d.block_inputs(next_ids, flow))
    # a prefill step for the request in slot 1 (batch row 0) clears its flag only
    worker._dflow_drafted[0] = worker._dflow_drafted[1] = True
    step(1, 1)
    assert worker._dflow_drafted.tolist()[:2] == [True, False]
