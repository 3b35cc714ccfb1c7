"""Issue 30: every bad CLI input is answered with exit 2 and one `error: ...` line, before any work,
and leaves no file behind; Ctrl-C ends any command with `error: interrupted` and exit 130."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflow_trt.cli import main
from dflow_trt.drafter.defaults import untrained_config
from dflow_trt.drafter.io import build_drafter, save_drafter
from dflow_trt.targets.tiny import build_tiny

T = ["--target", "tiny-qwen3"]
GEN = ["generate", *T, "--prompt", "hello", "--max-new-tokens", "4"]
AR = [*GEN, "--mode", "ar"]


def refused(capsys, argv, *needles) -> str:
    """Run `dflow-trt argv` in this process: exit 2, exactly one stderr line, `error: ...` naming needles."""
    try:
        rc = main([str(x) for x in argv])
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def files(path) -> set:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


@pytest.fixture(scope="module")
def bad(tmp_path_factory, tiny_qwen3):
    """Broken target checkpoints and drafter folders, by name."""
    root = tmp_path_factory.mktemp("bad")
    ck = root / "ckpt"
    model, tokenizer = build_tiny("qwen3")  # its own copy: save_pretrained rewrites the config of what it saves
    model.save_pretrained(ck)
    tokenizer.save_pretrained(ck)

    def target(name, edit):
        shutil.copytree(ck, root / name)
        edit(root / name)

    target("no-tokenizer", lambda d: (d / "tokenizer.json").unlink())
    target("no-weights", lambda d: (d / "model.safetensors").unlink())
    target("short-weights", lambda d: (d / "model.safetensors").write_bytes((ck / "model.safetensors").read_bytes()[:4096]))
    target("bad-config", lambda d: (d / "config.json").write_text("{not json"))
    target("fewer-weights", lambda d: save_file(
        {k: v for k, v in load_file(ck / "model.safetensors").items() if "layers.5." not in k},
        d / "model.safetensors", metadata={"format": "pt"}))

    for flow in (True, False):
        model = build_drafter(tiny_qwen3, untrained_config(tiny_qwen3, flow=flow, block_size=4), seed=0)
        save_drafter(model, root / ("dflow" if flow else "dflash"))
    good = json.loads((root / "dflow" / "config.json").read_text())

    def drafter(name, edit):
        shutil.copytree(root / "dflow", root / name)
        edit(root / name)

    def config(**kw):
        return lambda d: (d / "config.json").write_text(json.dumps({**good, **kw}))

    drafter("d-heads", config(num_heads=8, num_kv_heads=4))
    drafter("d-layers", config(num_layers=2))
    drafter("d-huge", config(intermediate_size=10**12))
    drafter("d-text", config(num_layers="two"))
    drafter("d-zero", config(num_heads=0))
    drafter("d-eps", config(rms_norm_eps=float("nan")))
    drafter("d-noflow", config(flow=False))
    drafter("d-vocab", config(target={**good["target"], "vocab_size": 999}))
    drafter("d-list", lambda d: (d / "config.json").write_text("[1, 2]"))
    drafter("d-corrupt", lambda d: (d / "config.json").write_text('{"target": '))
    drafter("d-binary", lambda d: (d / "config.json").write_bytes(b"\xff\xfe\x00"))
    drafter("d-short", lambda d: (d / "model.safetensors").write_bytes(b"\x08\x00"))
    drafter("d-no-weights", lambda d: (d / "model.safetensors").unlink())
    drafter("d-nan", lambda d: save_file({k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
                                          for k, v in load_file(d / "model.safetensors").items()},
                                         d / "model.safetensors"))

    def jsonl(name, data: bytes):
        (root / name).write_bytes(data)

    jsonl("int.jsonl", b'{"prompt": 5}\n')
    jsonl("empty-prompt.jsonl", b'{"prompt": ""}\n')
    jsonl("latin1.jsonl", b'{"prompt": "caf\xe9"}\n')
    jsonl("surrogate.jsonl", b'{"prompt": "caf\\udce9"}\n')
    jsonl("not-json.jsonl", b'{"prompt": "a"}\n{"prompt": \n')
    jsonl("list.jsonl", b'["prompt"]\n')
    jsonl("no-key.jsonl", b'{"text": "a"}\n')
    jsonl("blank.jsonl", b"\n\n")
    jsonl("ok.jsonl", b'{"prompt": "hello"}\n{"prompt": "abc"}\n')
    jsonl("long.jsonl", b'{"prompt": "hi"}\n' + json.dumps({"prompt": "a" * 5000}).encode() + b"\n")
    return root


# ---- numbers: finite and in range, refused by argparse before anything loads

@pytest.mark.parametrize("argv,needle", [
    ([*GEN, "--temperature", "nan"], "--temperature"),
    ([*GEN, "--temperature", "inf"], "--temperature"),
    ([*GEN, "--temperature", "-1"], "--temperature"),
    ([*GEN, "--temperature", "1e-45"], "temperature"),  # SamplingParams: 0 or at least 1e-3
    ([*GEN, "--temperature", "1e9"], "--temperature"),
    ([*GEN, "--temperature", "warm"], "--temperature"),
    ([*GEN, "--top-p", "0"], "--top-p"),
    ([*GEN, "--top-p", "nan"], "--top-p"),
    ([*GEN, "--top-p", "1.5"], "--top-p"),
    ([*GEN, "--top-k", "-1"], "--top-k"),
    ([*GEN, "--seed", str(2**70)], "--seed"),
    ([*GEN, "--seed", "-1"], "--seed"),
    ([*GEN, "--seed", "2**70"], "--seed"),
    ([*GEN, "--max-new-tokens", "0"], "--max-new-tokens"),
    ([*GEN, "--max-new-tokens", "-5"], "--max-new-tokens"),
    ([*GEN, "--max-new-tokens", "1.5"], "--max-new-tokens"),
    ([*GEN, "--block-size", "1"], "--block-size"),
    ([*GEN, "--verify-threshold", "1"], "--verify-threshold"),
    ([*GEN, "--verify-threshold", "nan"], "--verify-threshold"),
    ([*GEN, "--alternatives", "99"], "--alternatives"),
    ([*GEN, "--hint-trust", "-0.5"], "--hint-trust"),
    ([*GEN, "--no-such-flag"], "--no-such-flag"),
    (["generate", *T], "--prompt"),
    (["demo", *T, "--num-prompts", "0"], "--num-prompts"),
    (["demo", *T, "--num-prompts", "99"], "--num-prompts"),
    (["demo", *T, "--max-new-tokens", "nan"], "--max-new-tokens"),
    (["bench", "decode", *T, "--num-prompts", "0"], "--num-prompts"),
    (["bench", "decode", *T, "--first-prompt", "-1"], "--first-prompt"),
    (["bench", "decode", *T, "--max-new-tokens", "0"], "--max-new-tokens"),
    (["client", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["client", "--prompt", "hi", "--temperature", "nan"], "--temperature"),
    (["make-data", *T, "--num-prompts", "0"], "--num-prompts"),
    (["make-data", *T, "--batch-size", "0"], "--batch-size"),
    (["make-data", *T, "--seed", "-3"], "--seed"),
    (["make-data", *T, "--shard-size", "0"], "--shard-size"),
    (["make-data", *T, "--max-minutes", "-1"], "--max-minutes"),
    (["make-data", *T, "--device", "gpu"], "--device"),
    (["bench", "decode", *T, "--device", "tpu"], "--device"),
    (["cache-states", *T, "--max-len", "0"], "--max-len"),
    (["cache-states", *T, "--num-taps", "0"], "--num-taps"),
    (["cache-flows", *T, "--data-dir", "/tmp"], "--drafter"),
    (["cache-flows", *T, "--drafter", "/nonexistent/d", "--anchors-per-seq", "0"], "--anchors-per-seq"),
    (["cache-flows", *T, "--drafter", "/nonexistent/d", "--max-len", "0"], "--max-len"),
    (["cache-flows", *T, "--drafter", "/nonexistent/d", "--precision", "fp16"], "--precision"),
    (["train", *T, "--train-part", "body"], "--train-part"),
    (["fp8-check", *T, "--calib-prompts", "-3"], "--calib-prompts"),
    (["fp8-check", *T, "--check-prompts", "0"], "--check-prompts"),
    (["build", *T, "--tp-size", "0"], "--tp-size"),
    (["build", *T, "--check-max-new-tokens", "nan"], "--check-max-new-tokens"),
    (["bench", "serving", "--unbatched-baseline", "--json-out", "/tmp/dflow_trt_bad_input_load.json"], "add --start"),
    (["bench", "training-tau", "--compute", "--throughput", "/nonexistent/tp.json",
      "--compute-out", "/tmp/dflow_trt_never_tau.png"], "bench training"),
])
def test_numbers_out_of_range(capsys, argv, needle):
    refused(capsys, argv, needle)


@pytest.mark.parametrize("flags,needle", [
    (["--lr", "nan"], "--lr"), (["--lr", "0"], "--lr"), (["--lr", "inf"], "--lr"), (["--lr", "5"], "--lr"),
    (["--steps", "-1"], "--steps"), (["--steps", "0"], "--steps"), (["--gamma", "0"], "--gamma"),
    (["--gamma", "-1"], "--gamma"), (["--eval-every", "0"], "--eval-every"), (["--eval-seqs", "0"], "--eval-seqs"),
    (["--seqs-per-step", "0"], "--seqs-per-step"), (["--anchors-per-seq", "0"], "--anchors-per-seq"),
    (["--block-size", "1"], "--block-size"), (["--warmup-frac", "2"], "--warmup-frac"),
    (["--grad-clip", "0"], "--grad-clip"), (["--ckpt-every", "0"], "--ckpt-every"), (["--seed", "-1"], "--seed"),
    (["--num-layers", "0"], "--num-layers"), (["--draft-vocab-size", "0"], "--draft-vocab-size"),
    (["--threads", "-2"], "--threads"), (["--max-len", "1.5"], "--max-len"), (["--weight-decay", "nan"], "--weight-decay"),
    (["--max-minutes", "-1"], "--max-minutes"), (["--max-shard-mb", "nan"], "--max-shard-mb"),
    (["--device", "gpu"], "--device"),
])
def test_train_flags_checked_before_any_work(capsys, monkeypatch, tmp_path, flags, needle):
    import dflow_trt.training.trainer as trainer

    monkeypatch.setattr(trainer, "train", lambda cfg: pytest.fail("trained despite a bad flag"))
    refused(capsys, ["train", *T, "--out-dir", tmp_path / "run", *flags], needle)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("config,needle", [
    ({"steps": 0}, "--steps"), ({"lr": "fast"}, "--lr"), ({"gamma": 0}, "--gamma"), ({"eval_every": 0}, "--eval-every"),
    ({"steps": 1.5}, "--steps"), ({"target": 7}, "--target"), ({"bogus": 1}, "bogus"), ([1, 2], "JSON object"),
    ("{not json", "cannot read"),
])
def test_train_config_file_checked_too(capsys, monkeypatch, tmp_path, config, needle):
    import dflow_trt.training.trainer as trainer

    monkeypatch.setattr(trainer, "train", lambda cfg: pytest.fail("trained despite a bad config"))
    path = tmp_path / "cfg.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    refused(capsys, ["train", "--config", path, "--out-dir", tmp_path / "run"], needle)
    assert not (tmp_path / "run").exists()


# ---- prompts: text, UTF-8, within the target's context

@pytest.mark.parametrize("argv,needles", [
    ([*AR, "--prompt", os.fsdecode(b"caf\xe9")], ["UTF-8", "--prompt"]),  # undecodable argv bytes
    (["generate", *T, "--mode", "ar", "--prompt", ""], ["empty prompt"]),
    ([*AR, "--max-new-tokens", "100000"], ["--max-new-tokens 100000", "4096-token context"]),
    (["generate", *T, "--mode", "ar", "--prompt", "a" * 5000], ["5000 tokens", "context"]),
])
def test_prompt_refused(capsys, argv, needles):
    refused(capsys, argv, *needles)


def test_demo_refuses_past_the_context(capsys):
    refused(capsys, ["demo", *T, "--num-prompts", "1", "--max-new-tokens", "5000"], "context")


def test_non_utf8_argv_in_a_real_process():
    r = subprocess.run([sys.executable, "-m", "dflow_trt.cli", "generate", "--target", "tiny-qwen3", "--prompt",
                        b"caf\xe9"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "UTF-8" in r.stderr, r.stderr


# ---- broken target and drafter folders

@pytest.mark.parametrize("name,needles", [
    ("no-tokenizer", ["tokenizer in", "tokenizer.json"]),
    ("no-weights", ["model in"]),
    ("short-weights", ["model in"]),
    ("bad-config", ["model in", "config.json"]),
    ("fewer-weights", ["lack", "layers.5"]),
])
def test_broken_target_folder(capsys, bad, name, needles):
    refused(capsys, ["generate", "--target", bad / name, "--mode", "ar", "--prompt", "hi"], str(bad / name), *needles)


@pytest.mark.parametrize("name,needles", [
    ("d-heads", ["disagrees with model.safetensors"]),
    ("d-layers", ["disagrees with model.safetensors"]),
    ("d-huge", ["disagrees with model.safetensors"]),  # refused before 10**12 floats are asked for
    ("d-noflow", ["disagrees with model.safetensors"]),
    ("d-text", ["num_layers"]),
    ("d-zero", ["num_heads"]),
    ("d-eps", ["rms_norm_eps"]),
    ("d-vocab", ["edited"]),
    ("d-list", ["not a usable"]),
    ("d-corrupt", ["not a usable"]),
    ("d-binary", ["not a usable"]),
    ("d-short", ["cannot read drafter weights"]),
    ("d-no-weights", ["cannot read drafter weights"]),
    ("d-nan", ["NaN"]),
    ("dflash", ["without flow"]),  # a flow-less drafter in dflow mode
])
def test_broken_drafter_folder(capsys, bad, name, needles):
    refused(capsys, [*GEN, "--drafter", bad / name, "--block-size", "4"], *needles)


# ---- benchmark prompt files

@pytest.mark.parametrize("name,needles", [
    ("int.jsonl", ["int.jsonl:1", "must be text"]),
    ("empty-prompt.jsonl", ["empty prompt", "empty-prompt.jsonl:1"]),
    ("latin1.jsonl", ["UTF-8"]),
    ("surrogate.jsonl", ["UTF-8", "surrogate.jsonl:1"]),
    ("not-json.jsonl", ["not-json.jsonl:2"]),
    ("list.jsonl", ["list.jsonl:1"]),
    ("no-key.jsonl", ["no-key.jsonl:1", '"prompt"']),
    ("blank.jsonl", ["holds no prompts"]),
    ("long.jsonl", ["prompt 2 of", "context"]),  # checked before prompt 1 is decoded
])
def test_bad_benchmark_file(capsys, monkeypatch, bad, name, needles):
    import dflow_trt.benchmarks.decode as bench

    monkeypatch.setattr(bench, "generate", lambda *a, **k: pytest.fail("decoded before refusing"))
    refused(capsys, ["bench", "decode", *T, "--dataset", bad / name, "--max-new-tokens", "4"], *needles)


def test_bench_refuses_a_flowless_dflow_drafter_before_decoding(capsys, monkeypatch, bad):
    import dflow_trt.benchmarks.decode as bench

    monkeypatch.setattr(bench, "generate", lambda *a, **k: pytest.fail("decoded before refusing"))
    refused(capsys, ["bench", "decode", *T, "--dataset", bad / "ok.jsonl", "--dflow-drafter", bad / "dflash",
                     "--max-new-tokens", "4", "--block-size", "4"], "without flow conditioning")


# ---- outputs: checked writable before the work, nothing left behind

def _unwritable(tmp_path, kind):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-folder").mkdir()
    return {"under-a-file": tmp_path / "a-file" / "sub" / "out.json",
            "proc": "/proc/dflow-trt-test/out.json",
            "folder-for-file": tmp_path / "a-folder",
            "file-for-folder": tmp_path / "a-file"}[kind]


FILE_OUTS = ["under-a-file", "proc", "folder-for-file"]
DIR_OUTS = ["under-a-file", "proc", "file-for-folder"]


@pytest.mark.parametrize("kind", FILE_OUTS)
@pytest.mark.parametrize("flag", ["--json-out", "--plot-out"])
def test_bench_outputs_checked_before_the_run(capsys, monkeypatch, tmp_path, bad, flag, kind):
    import dflow_trt.benchmarks.decode as bench

    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("benched before checking its outputs"))
    path = _unwritable(tmp_path, kind)
    before = files(tmp_path)
    extra = ["--json-out", tmp_path / "ok.json"] if flag == "--plot-out" else []
    refused(capsys, ["bench", "decode", *T, "--dataset", bad / "ok.jsonl", *extra, flag, path], flag)
    assert files(tmp_path) == before


@pytest.mark.parametrize("kind", DIR_OUTS)
@pytest.mark.parametrize("argv,flag", [
    (["train", *T], "--out-dir"),
    (["make-data", *T, "--num-prompts", "1"], "--data-dir"),
    (["cache-states", *T], "--data-dir"),
    (["cache-flows", *T, "--drafter", "/nonexistent/d"], "--data-dir"),
    (["build", *T, "--no-fp8-check"], "--out"),
])
def test_output_folders_checked_before_the_work(capsys, tmp_path, argv, flag, kind):
    path = _unwritable(tmp_path, kind)
    before = files(tmp_path)
    refused(capsys, [*argv, flag, path], flag)
    assert files(tmp_path) == before


@pytest.mark.parametrize("kind", FILE_OUTS)
def test_fp8_report_checked_before_the_build(capsys, tmp_path, kind):
    path = _unwritable(tmp_path, kind)
    before = files(tmp_path)
    refused(capsys, ["fp8-check", *T, "--out", tmp_path / "build", "--json-out", path], "--json-out")
    assert files(tmp_path) == before


# ---- Ctrl-C

def test_ctrl_c_is_one_line_and_130(tmp_path, bad):
    """SIGINT mid-bench (its progress bar is up): `error: interrupted`, exit 130, no report written."""
    prompts = tmp_path / "many.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"prompt number {i}"}) + "\n" for i in range(200)))
    out = tmp_path / "report.json"
    p = subprocess.Popen([sys.executable, "-m", "dflow_trt.cli", "bench", "decode", *T, "--dataset", str(prompts),
                          "--num-prompts", "200", "--max-new-tokens", "200", "--modes", "ar",
                          "--json-out", str(out)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    seen = b""
    while b"%|" not in seen:  # tqdm's bar: decoding has started
        chunk = os.read(p.stderr.fileno(), 4096)
        assert chunk, seen.decode(errors="replace")
        seen += chunk
    p.send_signal(signal.SIGINT)
    err = (seen + p.stderr.read()).decode(errors="replace")
    assert p.wait(timeout=120) == 130, err
    assert "Traceback" not in err and err.count("error:") == 1, err
    assert err.strip().splitlines()[-1].split("\r")[-1].strip() == "error: interrupted", err
    assert not out.exists() and not list(tmp_path.glob("report*"))
