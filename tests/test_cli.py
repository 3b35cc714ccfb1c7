"""The real `dflow-trt` command: JSON output, and bad input ending in one line and exit 2."""

import json

import pytest

from conftest import run_cli as _cli
from dflow_trt.drafter.defaults import untrained_config
from dflow_trt.drafter.io import build_drafter, save_drafter


def _one_line_error(r, *needles):
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_generate_json_lossless_between_modes():
    outs = {}
    for mode in ("ar", "dflash", "dflow"):
        r = _cli("generate", "--target", "tiny-qwen3", "--mode", mode, "--prompt", "hello world",
                 "--max-new-tokens", "20", "--block-size", "4", "--json")
        assert r.returncode == 0, r.stderr
        outs[mode] = json.loads(r.stdout)
        for key in ("token_ids", "text", "acceptance_lengths", "tau", "tokens_per_s"):
            assert key in outs[mode]
    assert outs["dflash"]["token_ids"] == outs["ar"]["token_ids"] == outs["dflow"]["token_ids"]
    assert len(outs["ar"]["token_ids"]) <= 20
    # the first token comes from the prefill; each later round commits its acceptance length (the
    # last one possibly cut at --max-new-tokens)
    n, acc = len(outs["dflow"]["token_ids"]), outs["dflow"]["acceptance_lengths"]
    assert n - 1 <= sum(acc) <= n - 1 + 3 and all(1 <= a <= 4 for a in acc)


@pytest.mark.parametrize("args,needles", [
    (["--target", "no-such-target", "--prompt", "hi"], ["no-such-target"]),
    (["--target", "tiny-qwen3", "--drafter", "/nonexistent/drafter", "--prompt", "hi"], ["does not exist"]),
    (["--target", "tiny-qwen3", "--block-size", "1", "--prompt", "hi"], ["--block-size"]),
    (["--target", "tiny-qwen3", "--prompt", ""], ["empty prompt"]),
    (["--target", "tiny-qwen3", "--max-new-tokens", "0", "--prompt", "hi"], ["--max-new-tokens"]),
])
def test_generate_bad_input(args, needles):
    _one_line_error(_cli("generate", "--mode", "dflow", *args), *needles)


def test_drafter_for_another_target_is_refused(tmp_path, tiny_llama):
    model = build_drafter(tiny_llama, untrained_config(tiny_llama, flow=True, block_size=4), seed=0)
    path = save_drafter(model, tmp_path / "llama-drafter")
    _one_line_error(_cli("generate", "--target", "tiny-qwen3", "--drafter", str(path), "--prompt", "hi"),
                    "built for target", "--target tiny-llama")


def test_bench_reports_every_mode(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "abc"}\n{"prompt": "hello there"}\n')
    out = tmp_path / "bench.json"
    r = _cli("bench", "decode", "--target", "tiny-qwen3", "--dataset", str(prompts), "--num-prompts", "2",
             "--max-new-tokens", "12", "--block-size", "4", "--json-out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    for mode in ("ar", "dflash", "dflow"):
        s = rep["modes"][mode]
        assert s["matches_ar"] is True
        assert s["tokens_per_s"] > 0 and s["speedup_vs_ar"] > 0 and s["tau_se"] >= 0
        # τ is 1 + the per-position acceptance rates (a round of length a accepted drafts 1..a-1)
        assert s["tau"] == pytest.approx(1 + sum(s["acceptance_by_position"])) and 1 <= s["tau"] <= 4
    assert rep["modes"]["ar"]["tau"] == 1 and rep["modes"]["ar"]["tau_se"] == 0  # every ar round commits one token
    assert {"cpu", "cpu_flags", "threads", "torch", "date"} <= set(rep["machine"])  # where the timings hold
    # one τ per prompt (None for a prompt that stopped at its first token: it had no round)
    pt = rep["modes"]["ar"]["prompt_taus"]
    assert len(pt) == 2 and all(x in (1.0, None) for x in pt)
    assert [x is None for x in rep["modes"]["dflow"]["prompt_taus"]] == [x is None for x in pt]
    assert len(rep["modes"]["dflow"]["acceptance_by_position"]) == 3
    assert rep["modes"]["dflow"]["drafts_verified_per_round"] == 3 and rep["modes"]["ar"]["drafts_verified_per_round"] == 0
    for mode in ("ar", "dflash", "dflow"):  # the round's time split: the drafter's share is ar's ~0
        s = rep["modes"][mode]
        assert s["verify_ms_per_round"] > 0 and 0 <= s["draft_ms_per_round"]
        assert s["rounds"] * (s["draft_ms_per_round"] + s["verify_ms_per_round"]) <= 1e3 * s["seconds"]
    assert rep["modes"]["ar"]["draft_ms_per_round"] < rep["modes"]["dflow"]["draft_ms_per_round"]
    assert out.with_suffix(".png").stat().st_size > 0
    pd = rep["dflow_vs_dflash"]  # paired over the 2 prompts
    n = sum(x is not None for x in pt)  # prompts with a round
    assert pd["prompts"] == n and pd["dflow_ahead"] + pd["dflash_ahead"] <= n and pd["tau_diff_se"] >= 0
    assert "dflow − dflash, per prompt" in r.stdout
    # a verify threshold keeps the tokens and sends fewer drafts
    r = _cli("bench", "decode", "--target", "tiny-qwen3", "--dataset", str(prompts), "--num-prompts", "2",
             "--modes", "dflow",
             "--max-new-tokens", "12", "--block-size", "4", "--verify-threshold", "0.5", "--json-out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["verify_threshold"] == 0.5 and rep["modes"]["dflow"]["matches_ar"] is True
    assert 1 <= rep["modes"]["dflow"]["drafts_verified_per_round"] < 3


def test_bench_first_prompt_slices_each_set(tmp_path):
    """--first-prompt F --num-prompts N benches prompts F+1..F+N: the same run as a file of only those."""
    texts = ["abc", "hello there", "def add(a, b):", "Once upon a time"]
    every, tail = tmp_path / "every.jsonl", tmp_path / "tail.jsonl"
    every.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    tail.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts[1:3]))
    reps, stdout = [], []
    for ds, extra in ((every, ["--first-prompt", "1"]), (tail, [])):
        out = tmp_path / f"{ds.stem}.json"
        r = _cli("bench", "decode", "--target", "tiny-qwen3", "--dataset", str(ds), "--num-prompts", "2",
                 "--modes", "ar,dflow",
                 "--max-new-tokens", "12", "--block-size", "4", "--json-out", str(out), *extra)
        assert r.returncode == 0, r.stdout + r.stderr
        reps.append(json.loads(out.read_text()))
        stdout.append(r.stdout)
    assert reps[0]["first_prompt"] == 1 and "prompts 2–3" in stdout[0]
    for k in ("new_tokens", "tau", "acceptance_by_position", "prompt_taus"):
        assert reps[0]["modes"]["dflow"][k] == reps[1]["modes"]["dflow"][k], k
    _one_line_error(_cli("bench", "decode", "--target", "tiny-qwen3", "--dataset", str(every), "--first-prompt", "4"),
                    "has 4 prompts", "--first-prompt 4")


def test_bench_bad_dataset():
    _one_line_error(_cli("bench", "decode", "--target", "tiny-qwen3", "--dataset", "nope"), "unknown dataset")


def test_generate_backend_onnxruntime_equals_torch(tmp_path):
    """`--backend onnxruntime` (graphs exported into --build-dir on first use) equals `--backend torch`."""
    prompts = ["hello world", "def add(a, b):", "The capital of France"]
    for mode in ("ar", "dflash", "dflow"):
        for prompt in prompts:
            got = {}
            for backend in ("torch", "onnxruntime"):
                r = _cli("generate", "--target", "tiny-qwen3", "--mode", mode, "--prompt", prompt,
                         "--max-new-tokens", "16", "--block-size", "4", "--json", "--backend", backend,
                         "--build-dir", str(tmp_path / "build"))
                assert r.returncode == 0, r.stderr
                got[backend] = json.loads(r.stdout)
            assert got["onnxruntime"]["backend"] == "onnxruntime"
            assert got["onnxruntime"]["token_ids"] == got["torch"]["token_ids"], (mode, prompt)
            assert 0 < len(got["torch"]["token_ids"]) <= 16


def test_fp8_check_subcommand_registered():
    r = _cli("fp8-check", "--help")
    assert r.returncode == 0 and "--json-out" in r.stdout
    r = _cli("build", "--target", "no-such-target", "--no-fp8-check")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: unknown target 'no-such-target'")


def test_bench_tau_standard_error():
    from dflow_trt.benchmarks.decode import ModeRun

    r = ModeRun(tokens=[[0] * 6], acceptance=[1, 2, 3], seconds=1.0, drafter="d", block_size=4)
    assert r.tau == 2 and r.tau_se == pytest.approx((1 / 3) ** 0.5)  # sample variance 1 over 3 rounds
    assert ModeRun([[0]], [2], 1.0, "d", 4).tau_se == 0.0


def test_bench_pairs_dflow_with_dflash_per_prompt():
    from dflow_trt.benchmarks.decode import ModeRun, _paired

    # prompt τs: dflash 2, 1, 3; dflow 3, 1, 2.5 -> differences +1, 0, -0.5
    a = ModeRun([[0]] * 3, [2, 2, 1, 1, 3], 1.0, "a", 4, rounds_per_prompt=[2, 2, 1])
    b = ModeRun([[0]] * 3, [3, 1, 1, 2, 3], 1.0, "b", 4, rounds_per_prompt=[1, 2, 2])
    p = _paired({"dflash": a, "dflow": b})
    assert p["tau_diff_mean"] == pytest.approx(0.5 / 3) and p["prompts"] == 3
    assert (p["dflow_ahead"], p["dflash_ahead"]) == (1, 1)
    d = [1, 0, -0.5]
    m = sum(d) / 3
    assert p["tau_diff_se"] == pytest.approx((sum((x - m) ** 2 for x in d) / 2 / 3) ** 0.5)
    assert _paired({"dflash": a}) is None


def test_demo_shows_the_whole_block_then_the_cpu_threshold():
    """The main job prints one table per setting; every mode equals ar in each."""
    r = _cli("demo", "--target", "tiny-qwen3", "--num-prompts", "2", "--max-new-tokens", "8")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("matches ar") == 2 and "verify threshold 0.05" in r.stdout
    assert r.stdout.count(" yes ") == 6 and " NO " not in r.stdout
    r = _cli("demo", "--target", "tiny-qwen3", "--num-prompts", "1", "--max-new-tokens", "8", "--verify-threshold", "0.3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("matches ar") == 1 and "verify threshold 0.3" in r.stdout and " NO " not in r.stdout
