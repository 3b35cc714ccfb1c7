"""The staged, hash-cached build: target + drafters -> `build/<name>/` with every deployable artefact.

    build/<name>/
      drafters/<mode>-untrained/          seeded untrained drafters, when no trained one exists
      onnx/target/, onnx/drafter-<label>/ ONNX graphs (+ external data, meta json)
      fp8/hf/target/                      ModelOpt HF FP8 checkpoint of the target (+ tokenizer)
      fp8/hf/drafter-<label>/             FP8 drafter, our layout; `-dflash` suffix: z-lab's DFlash layout
                                          (a DFlow drafter's with its flow branch, for the TensorRT-LLM plug-in)
      trtllm/checkpoints/*-tp<N>/         TensorRT-LLM checkpoints, rank0..rank<N-1>
      trtllm/llm_api.{yaml,json}          LLM-API options (PyTorch back end, FP8 target, DFlash drafting)
      trtllm/llm_api_dflow.json           the same with the DFlow drafter through the plug-in
      trtllm/build_engines.sh             the engine build, for GPU hosts
      trtllm/engines/                     engines (only where tensorrt_llm and a GPU exist)
      reports/fp8_check.json              the FP8 accuracy report
      manifest.json                       what was built from what (written last)
      .stages/<stage>.json                completion markers: {input hash, outputs}

Every stage writes into a temporary path and renames it into place, then writes its marker. A
stage is skipped only when its marker exists, records the same input hash (sources, settings,
code, tool versions) and all its outputs exist; anything else is rebuilt. So an interrupted build
never leaves an artefact a later stage would trust.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..atomic import claim_dir, write_text
from ..drafter.defaults import DEFAULT_NUM_TAPS, shipped_drafter_path, untrained_config
from ..drafter.io import build_drafter, load_drafter, read_config, save_drafter
from ..errors import UserError
from ..targets import TARGET_NAMES, load_target
from . import manifest as mf

STAGES_DIR = ".stages"
CODE_FILES = ("export/onnx_target.py", "export/onnx_drafter.py", "export/fp8.py", "export/trtllm.py",
              "export/hf_drafter.py", "export/fp8_check.py", "drafter/model.py", "targets/hf_target.py",
              "training/prompts.py")  # calibration prompts come from the training prompt set


@dataclass
class BuildSpec:
    target: str = "smollm2-135m"
    drafters: tuple[str, ...] = ()  # drafter folders; empty: the target's shipped ones (else seeded untrained)
    name: str | None = None
    tp_size: int = 1
    out: str | None = None  # default build/<name>
    calib_prompts: int = 32
    check_prompts: int = 16
    check_max_new_tokens: int = 32
    fp8_check: bool = True
    onnx_only: bool = False  # just the ONNX graphs (what `--backend onnxruntime` needs)

    def __post_init__(self):
        for name in ("tp_size", "calib_prompts", "check_prompts", "check_max_new_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")

    @property
    def build_dir(self) -> Path:
        return Path(self.out) if self.out else Path("build") / (self.name or self.target.replace("/", "_"))


def _code_hash() -> str:
    root = Path(__file__).resolve().parent.parent
    return mf.hash_files([root / f for f in CODE_FILES])[:16]


class Build:
    def __init__(self, spec: BuildSpec, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)):
        """Touches no file: `run` validates every input first, and takes over `--out` only if it is
        new, empty or an earlier build (a folder of other files is refused, never cleaned)."""
        self.spec, self.log = spec, log
        self.dir = spec.build_dir
        self.tools = mf.tool_versions()
        self.code = _code_hash()
        self.artefacts: dict[str, str] = {}
        self.step = 0

    # ---- stage machinery

    def _marker(self, stage: str) -> Path:
        return self.dir / STAGES_DIR / f"{stage}.json"

    def stage(self, stage: str, inputs: dict, outputs: list[Path], fn: Callable[[], None]) -> bool:
        """Run fn unless a completed marker with the same input hash exists; returns True if cached."""
        self.step += 1
        key = hashlib.sha256(json.dumps({"stage": stage, "inputs": inputs, "code": self.code,
                                         "tools": self.tools}, sort_keys=True).encode()).hexdigest()
        marker = self._marker(stage)
        rel = [str(p.relative_to(self.dir)) for p in outputs]
        if marker.is_file():
            m = json.loads(marker.read_text())
            if m.get("hash") == key and all((self.dir / r).exists() for r in rel):
                self.log(f"[{self.step}] {stage}: cached")
                self._record(stage, rel)
                return True
            marker.unlink()
        self.log(f"[{self.step}] {stage}: building ...")
        t0 = time.perf_counter()
        fn()
        missing = [r for r in rel if not (self.dir / r).exists()]
        assert not missing, f"stage {stage} did not produce {missing}"
        marker.parent.mkdir(parents=True, exist_ok=True)
        write_text(marker, json.dumps({"hash": key, "outputs": rel, "inputs": inputs}, indent=2) + "\n")
        self.log(f"[{self.step}] {stage}: done in {time.perf_counter() - t0:.1f}s")
        self._record(stage, rel)
        return False

    def _record(self, stage: str, rel: list[str]) -> None:
        for i, r in enumerate(rel):
            self.artefacts[stage if len(rel) == 1 else f"{stage}[{i}]"] = r

    # ---- inputs

    def resolve_drafters(self) -> dict[str, Path]:
        """label -> drafter folder. Labels are the mode (dflash/dflow), or the folder name on a clash."""
        s = self.spec
        out: dict[str, Path] = {}
        if s.drafters:
            for p in map(Path, s.drafters):
                label = "dflow" if read_config(p).flow else "dflash"
                out[p.name if label in out else label] = p
            return out
        for mode in ("dflash", "dflow"):
            p = shipped_drafter_path(s.target, mode)
            if p is None:
                p = self.dir / "drafters" / f"{mode}-untrained"
                self.untrained.append(mode)
            out[mode] = p
        return out

    def run(self) -> dict:
        s = self.spec
        claim_dir(self.dir, "dflow_trt build", own=(STAGES_DIR, mf.MANIFEST))
        self.untrained: list[str] = []
        paths = self.resolve_drafters()
        for p in paths.values():
            if p.parent != self.dir / "drafters" and not (p / "config.json").is_file():
                raise UserError(f"no drafter at {p} (no config.json); pass a folder written by `dflow-trt train`")
        if s.target not in TARGET_NAMES and not (Path(s.target) / "config.json").is_file():
            raise UserError(f"unknown target {s.target!r}; use one of {', '.join(TARGET_NAMES)} or a checkpoint folder")
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.untrained:
            self.log(f"warning: no trained {'/'.join(self.untrained)} drafter for {s.target}; using seeded untrained "
                     "drafters (tau ~ 1); train with `dflow-trt train` and pass --drafter")
            base = load_target(s.target, num_taps=DEFAULT_NUM_TAPS)
            for mode in self.untrained:
                p = paths[mode]
                self.stage(f"drafter-{mode}-untrained", {"target": base.info.fingerprint, "mode": mode}, [p],
                           lambda p=p, mode=mode: save_drafter(build_drafter(
                               base, untrained_config(base, flow=(mode == "dflow"))), p))
        configs = {k: read_config(p) for k, p in paths.items()}
        for c in configs.values():
            c.check_exportable("dflow-trt build")
        taps = {c.tap_layers for c in configs.values()}
        if len(taps) != 1:
            raise UserError(f"the drafters read different target layers {sorted(taps)}; build them separately "
                            "(one --drafter and a distinct --name each)")
        tap_layers = taps.pop()
        target = load_target(s.target, tap_layers=tap_layers)
        drafters = {k: load_drafter(p, target) for k, p in paths.items()}
        src = {"target": mf.hash_state_dict(target.model)[:16],
               **{f"drafter-{k}": mf.hash_files([p])[:16] for k, p in paths.items()}}
        self.log(f"build {self.dir}: target {s.target} taps {list(tap_layers)}, drafters "
                 + ", ".join(f"{k}={p}" for k, p in paths.items()))
        from . import onnx_drafter, onnx_target

        base_in = {"target": src["target"], "taps": list(tap_layers)}
        d_onnx = self.dir / "onnx"
        self.stage("onnx-target", base_in, [d_onnx / "target"],
                   lambda: onnx_target.export_target(target, d_onnx / "target"))
        for k, m in drafters.items():
            self.stage(f"onnx-drafter-{k}", {**base_in, "drafter": src[f"drafter-{k}"]}, [d_onnx / f"drafter-{k}"],
                       lambda k=k, m=m: onnx_drafter.export_drafter(m, d_onnx / f"drafter-{k}"))
        result = {"onnx_target": d_onnx / "target", "onnx_drafters": {k: d_onnx / f"drafter-{k}" for k in drafters},
                  "target": target, "drafters": drafters, "paths": paths}
        if s.onnx_only:
            if not (self.dir / mf.MANIFEST).is_file():  # a full build's manifest (a superset) is kept
                self._write_manifest(target, drafters, paths, src, configs)
            return result
        self._fp8_stages(target, drafters, src, base_in)
        self._write_manifest(target, drafters, paths, src, configs)
        return result

    # ---- FP8, TensorRT-LLM, checks

    def _fp8_stages(self, target, drafters, src, base_in) -> None:
        from . import fp8, fp8_check, hf_drafter, trtllm

        s = self.spec
        calib_in = {**base_in, "calib_prompts": s.calib_prompts}

        @functools.cache
        def q_target():
            self.log("  quantizing the target (FP8, ModelOpt, calibration on training prompts)")
            return fp8.quantize_target(target, fp8.calibration_prompts(target, s.calib_prompts))

        @functools.cache
        def q_drafter(k):
            self.log(f"  quantizing drafter {k}")
            return fp8.quantize_drafter(drafters[k], q_target(), fp8.calibration_prompts(target, s.calib_prompts)[:16])

        hf = self.dir / "fp8" / "hf"
        self.stage("fp8-hf-target", calib_in, [hf / "target"], lambda: fp8.export_target_hf_fp8(q_target(), hf / "target"))
        # z-lab's layout holds flow-off drafters (value None); a reduced vocabulary only earns a note
        self.zlab = {k: hf_drafter.zlab_unsupported(m.config) for k, m in drafters.items()}
        self.zlab_notes = {k: hf_drafter.zlab_vocab_note(m.config) for k, m in drafters.items() if self.zlab[k] is None}
        for k, note in self.zlab_notes.items():
            if note:
                self.log(f"  note: drafter-{k} in z-lab's DFlash layout: {note}")
        for k, m in drafters.items():
            # z-lab's layout for a flow-off drafter; for a DFlow drafter the same folder with its flow
            # branch beside it (`dflash+flow`), what TensorRT-LLM's DFlash mode loads with the plug-in
            layout = "dflash" if self.zlab[k] is None else "dflash+flow"
            outs = [hf / f"drafter-{k}", hf / f"drafter-{k}-dflash"]

            def write(k=k, layout=layout):
                hf_drafter.export_drafter_hf(q_drafter(k), hf / f"drafter-{k}", "dflow")
                hf_drafter.export_drafter_hf(q_drafter(k), hf / f"drafter-{k}-dflash", layout)
            self.stage(f"fp8-hf-drafter-{k}", {**calib_in, "drafter": src[f"drafter-{k}"], "layout": layout}, outs,
                       write)

        tp = s.tp_size
        ck = self.dir / "trtllm" / "checkpoints"
        self.stage("trtllm-ckpt-target", {**calib_in, "tp": tp}, [ck / f"target-tp{tp}"],
                   lambda: trtllm.export_target_checkpoint(q_target(), ck / f"target-tp{tp}", tp))
        for k in drafters:
            self.stage(f"trtllm-ckpt-drafter-{k}", {**calib_in, "drafter": src[f"drafter-{k}"], "tp": tp},
                       [ck / f"drafter-{k}-tp{tp}"],
                       lambda k=k: trtllm.export_drafter_checkpoint(q_drafter(k), ck / f"drafter-{k}-tp{tp}", tp))

        flow_off = [k for k in drafters if self.zlab[k] is None]
        flow_on = [k for k in drafters if self.zlab[k] is not None]
        dflash_dir = str((hf / f"drafter-{flow_off[0]}-dflash").resolve()) if flow_off else None
        dflow_dir = str((hf / f"drafter-{flow_on[0]}-dflash").resolve()) if flow_on else None
        block = drafters[flow_off[0]].config.block_size if flow_off else next(iter(drafters.values())).config.block_size
        trt = self.dir / "trtllm"
        engine_dir = trt / "engines" / f"target-tp{tp}"
        commands = trtllm.engine_build_commands((ck / f"target-tp{tp}").resolve(), engine_dir.resolve(), block, tp)

        def write_configs():
            mask = drafters[flow_off[0]].config.mask_token_id if flow_off else None
            opts = trtllm.llm_api_config(str((hf / "target").resolve()), dflash_dir, block,
                                         list(target.info.tap_layers), tp, mask)
            files = [("llm_api.json", json.dumps(opts, indent=2) + "\n"), ("llm_api.yaml", trtllm.to_yaml(opts) + "\n"),
                     ("build_engines.sh", "#!/usr/bin/env bash\n# TensorRT-LLM engine build (GPU host)\nset -euo pipefail\n"
                      + "\n".join(" ".join(c) for c in commands) + "\n")]
            if dflow_dir:  # DFlow through the plug-in: our loader reads `dflow_plugin` (not an LLM argument)
                c = drafters[flow_on[0]].config
                dopts = trtllm.llm_api_config(str((hf / "target").resolve()), dflow_dir, c.block_size,
                                              list(target.info.tap_layers), tp, c.mask_token_id, dflow=True)
                files.append(("llm_api_dflow.json", json.dumps(dopts, indent=2) + "\n"))
            for name, text in files:
                write_text(trt / name, text)
        self.stage("trtllm-configs", {**base_in, "tp": tp, "dflash": dflash_dir, "dflow": dflow_dir, "block": block},
                   [trt / "llm_api.json", trt / "llm_api.yaml", trt / "build_engines.sh"]
                   + ([trt / "llm_api_dflow.json"] if dflow_dir else []), write_configs)

        if s.fp8_check:
            report_path = self.dir / "reports" / "fp8_check.json"

            def check():
                pairs = {("dflow" if m.config.flow else "dflash"): (m, q_drafter(k)) for k, m in drafters.items()}
                prompts = fp8_check.heldout_prompts(target, s.check_prompts)
                rep = fp8_check.run_check(target, q_target(), pairs, prompts, s.check_max_new_tokens,
                                          drafter_sources={k: ("untrained (seeded)" if k in self.untrained else "trained")
                                                           for k in drafters}, log=self.log)
                self.log(rep.table())
                fp8_check.write_report(rep, report_path)
            self.stage("fp8-check", {**calib_in, "prompts": s.check_prompts, "max_new": s.check_max_new_tokens,
                                     **{k: v for k, v in src.items() if k.startswith("drafter")}}, [report_path], check)
            rep = json.loads(report_path.read_text())
            self.log(f"  fp8 check: {'PASS' if rep['passed'] else 'FAIL'} ({report_path})")

        self.step += 1
        try:
            trtllm.build_engines(commands)
            self.artefacts["engines"] = str(engine_dir.relative_to(self.dir))
            self.engines = "built"
        except trtllm.EngineBuildUnavailable as e:
            self.log(f"[{self.step}] engines: SKIPPED — {e}")
            self.engines = str(e)

    def _write_manifest(self, target, drafters, paths, src, configs) -> None:
        man = {"name": self.spec.name or self.spec.target, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "target": {"name": target.info.name, "fingerprint": target.info.fingerprint,
                          "tap_layers": list(target.info.tap_layers), "num_layers": target.info.num_layers,
                          "hidden_size": target.info.hidden_size, "vocab_size": target.info.vocab_size},
               "drafters": {k: {"path": str(paths[k]), "flow": c.flow, "block_size": c.block_size,
                                "mask_token_id": c.mask_token_id, "tap_layers": list(c.tap_layers),
                                "untrained": k in self.untrained} for k, c in configs.items()},
               "source_hashes": src, "code_hash": self.code, "tp_size": self.spec.tp_size,
               "dtypes": {"onnx": "float32", "fp8_hf": "float8_e4m3fn weights+activations (per-tensor), rest float32",
                          "trtllm_target": "float8_e4m3fn weights+activations, rest float16",
                          "trtllm_drafter": "float8_e4m3fn weights+activations, rest float32"},
               "zlab_dflash_layout": {k: ("written with its flow branch (dflow_flow.safetensors), the TensorRT-LLM "
                                          "DFlow plug-in's folder" if why else
                                          "written" + (f" ({n})" if (n := self.zlab_notes.get(k)) else ""))
                                      for k, why in getattr(self, "zlab", {}).items()},
               "tools": self.tools, "artefacts": self.artefacts, "engines": getattr(self, "engines", None)}
        mf.write_manifest(self.dir, man)
        self.log(f"manifest: {self.dir / mf.MANIFEST}")
