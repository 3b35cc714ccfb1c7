"""`dflow-trt bench <what>`: each benchmark that runs on a CPU in seconds runs on a tiny model and
writes a JSON report with its keys and the machine it ran on; bad flags end in one `error:` line and
exit 2 before any work. (Decode's own report is checked in test_cli.py.)"""

import json

import pytest
import torch

from dflow_trt.benchmarks import report
from dflow_trt.cli import main
from dflow_trt.drafter import train_log
from test_cli_bad_input import refused

T = ["--target", "tiny-qwen3"]
MACHINE = {"cpu", "cpu_flags", "cpu_count", "threads", "torch", "date"}


@pytest.fixture(autouse=True)
def _keep_threads():
    """A benchmark's --threads sets torch's for the process; the tests after it keep theirs."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def bench(capsys, *argv) -> str:
    """Run `dflow-trt bench argv` in this process; it must succeed. Returns its stdout."""
    rc = main(["bench", *(str(x) for x in argv)])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    return out


def read(path) -> dict:
    rep = json.loads(path.read_text())
    assert MACHINE <= set(rep["machine"]), rep["machine"]
    return rep


def test_kv(capsys, tmp_path):
    out = tmp_path / "kv.json"
    bench(capsys, "kv", *T, "--contexts", "8,16", "--repeats", "1", "--threads", "1", "--json-out", out)
    rep = read(out)
    assert rep["contexts"] == [8, 16] and rep["threads"] == 1 and rep["repeats"] == 1
    assert [(r["context"], r["tokens"]) for r in rep["rows"]] == [(c, k) for c in (8, 16) for k in (1, 2, 3, 5, 16)]
    assert all(r["DynamicCache"] > 0 and r["in place"] > 0 for r in rep["rows"])


def test_round(capsys, tmp_path):
    out = tmp_path / "round.json"
    stdout = bench(capsys, "round", *T, "--context", "12", "--repeats", "1", "--json-out", out)
    rep = read(out)
    block = len(rep["rows"]) + 1  # one row per number of drafts, 1..block-1
    assert [r["drafts"] for r in rep["rows"]] == list(range(1, block))
    assert rep["context"] == 12 and rep["mode"] == "dflash" and rep["packed_linear"] is True
    assert rep["ar_step_ms"] > 0 and rep["draft_ms"] > 0
    for r in rep["rows"]:  # the break-even τ is (draft + verify) / ar step
        assert r["break_even_tau"] == pytest.approx((rep["draft_ms"] + r["verify_ms"]) / rep["ar_step_ms"])
    assert set(rep["mlp_up_linear_us_by_rows"]) == {str(m) for m in sorted({1, 2, 4, 8, block})}
    assert "--verify-threshold" in stdout


def test_scale_smoke_preset_on_cpu(capsys, tmp_path):
    out = tmp_path / "scale.json"
    bench(capsys, "scale", "--device", "cpu", "--preset", "smoke", "--contexts", "8,16", "--block", "4",
          "--repeats", "1", "--generate-tokens", "6", "--json-out", out)
    rep = read(out)
    assert rep["preset"] == "smoke" and [r["context"] for r in rep["rows"]] == [8, 16]
    assert set(rep["rows"][0]["verify_ms"]) == {"1", "3"}  # drafts beyond the block are not timed
    assert rep["generate"]["dflow_matches_ar"] is True and rep["generate"]["ar"]["tau"] == 1


def test_hints(capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n{"prompt": "def add(a, b):"}\n{"prompt": "unused"}\n')
    out = tmp_path / "hints.json"
    bench(capsys, "hints", *T, "--dataset", prompts, "--num-prompts", "2", "--max-new-tokens", "10", "--json-out", out)
    rep = read(out)
    assert rep["num_prompts"] == 2 and rep["rounds"] >= 1 and rep["dataset"] == str(prompts)
    assert set(rep["replay_tau"]) == {"0.0", "0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.9", "1.0"}
    assert all(1 <= v for v in rep["replay_tau"].values())
    assert 0 <= rep["hint_right"] <= 1 and rep["consistent_hints"] == sum(p["n"] for p in rep["by_position"].values())


def test_zlab_vocab(capsys, tmp_path, tiny_qwen3):
    from dflow_trt.drafter.defaults import untrained_config
    from dflow_trt.drafter.io import build_drafter, save_drafter

    c = untrained_config(tiny_qwen3, flow=False, block_size=4)
    reduced = save_drafter(build_drafter(tiny_qwen3, type(c)(**{**c.__dict__, "draft_vocab_size": 64}), seed=0),
                           tmp_path / "reduced")
    out = tmp_path / "z.json"
    bench(capsys, "zlab-vocab", *T, "--drafter", reduced, "--prompts", "2", "--tokens", "6", "--anchors", "2",
          "--json-out", out)
    rep = read(out)
    assert rep["draft_vocab_size"] == 64 and rep["prompts"] == 2
    assert rep["positions"] == 2 * 2 * 3 and 0 <= rep["same_proposal"] < 1  # sequences x anchors x drafts
    # a draft vocabulary of every token in another order drafts what the full head drafts: the bench must
    # compare token ids (draft indices against token ids, or the reduced head twice, would not give 1)
    V = tiny_qwen3.info.vocab_size
    m = build_drafter(tiny_qwen3, type(c)(**{**c.__dict__, "draft_vocab_size": V}), seed=0)
    m.draft_vocab.copy_(torch.arange(V).flip(0))
    bench(capsys, "zlab-vocab", *T, "--drafter", save_drafter(m, tmp_path / "permuted"), "--prompts", "2",
          "--tokens", "6", "--anchors", "2", "--json-out", out)
    assert read(out)["same_proposal"] == 1.0
    bench(capsys, "zlab-vocab", *T, "--prompts", "1", "--json-out", out)  # the full vocabulary: nothing to compare
    assert read(out)["draft_vocab_size"] is None


def test_make_data(capsys, tmp_path, tiny_qwen3):
    """Every way of batching answers a shard's prompts with its committed responses, and the ways were
    really the three (their names and speeds are in the report)."""
    from dflow_trt.training.data import generate_dataset

    d = generate_dataset(tiny_qwen3, tmp_path / "d", num_prompts=12, max_new_tokens=10, batch_size=4, shard_size=6,
                         heldout_every=4)
    out = tmp_path / "m.json"
    bench(capsys, "make-data", *T, "--data-dir", d, "--shard", "1", "--batch-size", "4", "--json-out", out)
    rep = read(out)
    assert rep["shard"] == "shard-0001.jsonl" and rep["prompts"] == 6 and rep["max_new_tokens"] == 10
    assert list(rep["ways"]) == ["eager, arrival order, 16", "eager, continuous, 4", "static, continuous, 4"]
    for w in rep["ways"].values():
        assert w["matches_data"] == w["matches_first_way"] == 6 and w["median_s"] > 0 and len(w["seconds"]) == 1
    refused(capsys, ["bench", "make-data", *T, "--data-dir", d, "--shard", "2"], "--shard 2", "0 to 1")
    refused(capsys, ["bench", "make-data", "--data-dir", d, "--target", "tiny-llama"], "another target", "--target")
    refused(capsys, ["bench", "make-data", *T, "--data-dir", tmp_path], "manifest.json is missing", "make-data")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text("{not json")
    refused(capsys, ["bench", "make-data", *T, "--data-dir", bad], "not readable JSON", "make-data")
    (bad / "manifest.json").write_text(json.dumps({"format": 1, "shards": ["shard-0000.jsonl"]}))
    refused(capsys, ["bench", "make-data", *T, "--data-dir", bad], "lacks target, target_fingerprint, max_new_tokens")
    m = json.loads((d / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps(m))
    refused(capsys, ["bench", "make-data", *T, "--data-dir", bad], "no complete shard")
    (bad / "shard-0000.jsonl.gz").write_bytes(b"\x1f\x8b" + bytes(30))
    refused(capsys, ["bench", "make-data", *T, "--data-dir", bad], "unreadable", "--shard")


def test_training_tau(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 10, "loss": 3.0}, {"step": 100, "eval_tau_noflow": 1.2, "train_seqs": 64},
        {"step": 200, "eval_tau_noflow": 1.4, "eval_tau_flow": 1.5, "train_seqs": 128}]))
    png = tmp_path / "tau.png"
    bench(capsys, "training-tau", run, "--plot-out", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the compressed form (the shipped drafters' logs) reads as the same records
    rows = train_log.read(run)
    packed = tmp_path / "packed"
    train_log.write(packed, rows, compress=True)
    assert [p.name for p in packed.iterdir()] == ["train_log.jsonl.gz"] and train_log.read(packed) == rows
    bench(capsys, "training-tau", packed, "--plot-out", tmp_path / "packed.png")
    assert (tmp_path / "packed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (packed / "train_log.jsonl.gz").write_bytes(b"\x1f\x8b not gzip")
    refused(capsys, ["bench", "training-tau", packed, "--plot-out", tmp_path / "bad.png"], "not a readable gzip")
    (run / "train_log.jsonl").write_text('{"step": 1}\n{not json\n')
    refused(capsys, ["bench", "training-tau", run, "--plot-out", tmp_path / "bad.png"], "train_log.jsonl:2")
    refused(capsys, ["bench", "training-tau", tmp_path, "--plot-out", tmp_path / "bad.png"], "no train_log.jsonl")
    assert not (tmp_path / "bad.png").exists()


def test_training_tau_compute_fit_and_own_pace(capsys, tmp_path):
    """τ against compute: a log-linear curve over two decades is fitted back to its slope, and the
    hours to a target come from the lineage's own pace, its wall time summed over two stages (each
    stage's clock restarts at 0; a resumed run's log would otherwise count the first stage twice)."""
    import math

    tp = tmp_path / "tp.json"
    tp.write_text(json.dumps({"summary": {"new/dflash": {"flops_per_step": 1e9, "achieved_flops": 1e10},
                                          "new_real/dflow": {"flops_per_step": 3e9, "achieved_flops": 1e10}}}))
    rows, evals = [], {round(10 ** (k / 10)) for k in range(10, 34)}  # log-spaced: 10 to 1995
    for step in range(1, 2001):
        elapsed = 0.5 * step if step <= 1000 else 0.25 * (step - 1000)  # stage 2: a new clock, twice as fast
        r = {"step": step, "loss": 1.0, "elapsed_s": elapsed}
        if step in evals:
            r["eval_tau_noflow"] = 1.0 + 0.3 * math.log10(step)
        rows.append(r)
    run = tmp_path / "lineage"
    train_log.write(run, rows, compress=True)
    out = tmp_path / "c.png"
    printed = bench(capsys, "training-tau", "--compute", "--throughput", tp, "--compute-out", out, run)
    fit = json.loads(out.with_suffix(".json").read_text())["fits"]["lineage: no flow"]  # from logs, no machine
    wall = 0.5 * 1000 + 0.25 * 1000
    assert fit["tau_per_decade"] == pytest.approx(0.3, rel=1e-3) and fit["train_hours"] == pytest.approx(wall / 3600)
    need = 10 ** ((2.5 - 1.0) / 0.3) * 1e9  # FLOPs at τ 2.5: step 10^5 at 1e9 a step
    assert fit["tau_2.5"]["flops"] == pytest.approx(need, rel=1e-2)
    assert fit["tau_2.5"]["hours_at_own_pace"] == pytest.approx(need / (2000 * 1e9 / wall) / 3600, rel=1e-2)
    assert fit["tau_2.5"]["cpu_hours_here"] == pytest.approx(need / 1e10 / 3600, rel=1e-2)
    assert "h at its own pace" in printed and out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv,needles", [
    (["kv", *T, "--contexts", "8,x"], ["--contexts"]),
    (["kv", *T, "--contexts", "8,,16"], ["--contexts"]),
    (["kv", *T, "--repeats", "0"], ["--repeats"]),
    (["kv", *T, "--threads", "0"], ["--threads"]),
    (["round", *T, "--context", "0"], ["--context"]),
    (["round", *T, "--mode", "ar"], ["--mode"]),
    (["verify", *T, "--block", "nan"], ["--block"]),
    (["scale", "--preset", "qwen3-70b"], ["--preset"]),
    (["scale", "--block", "1"], ["--block"]),
    (["scale", "--generate-tokens", "-1"], ["--generate-tokens"]),
    (["fp8-matmul", "--ms", "0"], ["--ms"]),
    (["serving", "--concurrency", "1,0"], ["--concurrency"]),
    (["serving", "--json-out", "load.csv"], ["--json-out", ".json"]),
    (["serving", "--start", "--url", "127.0.0.1:8001"], ["--start", "--url"]),
    (["hints", *T, "--num-prompts", "0"], ["--num-prompts"]),
    (["training", "--steps", "0"], ["--steps"]),
    (["training", "--objective", "ar"], ["--objective"]),
    (["zlab-vocab", *T, "--anchors", "0"], ["--anchors"]),
    (["make-data", "--batch-size", "0"], ["--batch-size"]),
    (["make-data", "--shard", "-1"], ["--shard"]),
    (["nope"], ["invalid choice", "nope"]),
    ([], ["WHAT"]),
    (["--dataset", "humaneval"], ["bench decode --dataset"]),  # the old `bench` flags name the new command
])
def test_bad_flags(capsys, argv, needles):
    refused(capsys, ["bench", *argv], *needles)


def test_refusals_that_need_the_machine(capsys, tmp_path):
    """Checked before any timing: a missing build, a missing GPU, an unwritable report, no server."""
    refused(capsys, ["bench", "verify", *T, "--build", tmp_path / "none"], "no exported target", "dflow-trt build")
    if not torch.cuda.is_available():
        refused(capsys, ["bench", "fp8-matmul", "--json-out", tmp_path / "f.json"], "compute capability")
        refused(capsys, ["bench", "scale", "--json-out", tmp_path / "s.json"], "no CUDA GPU")
    (tmp_path / "a-file").write_text("x")
    refused(capsys, ["bench", "kv", *T, "--json-out", tmp_path / "a-file" / "kv.json"], "--json-out")
    refused(capsys, ["bench", "serving", "--url", "127.0.0.1:9", "--dataset", "humaneval",
                     "--json-out", tmp_path / "load.json"], "no ready Triton server", "127.0.0.1:9")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_verify_times_a_built_target(capsys, tmp_path, tiny_qwen3):
    """Against an exported tiny target (exported once per session, shared with the ONNX tests)."""
    from onnx_cache import exported_target

    (tmp_path / "build" / "onnx").mkdir(parents=True)
    (tmp_path / "build" / "onnx" / "target").symlink_to(exported_target(tiny_qwen3))
    bench(capsys, "verify", *T, "--build", tmp_path / "build", "--block", "4", "--contexts", "8,16", "--repeats", "1")
    rep = read(tmp_path / "build" / "reports" / "bench_verify.json")  # the default report path
    assert rep["block"] == 4 and rep["target"] == "tiny-qwen3"
    for name in ("torch", "onnxruntime"):
        assert [r["context"] for r in rep[name]] == [8, 16]
        assert all(r["kv_ms"] > 0 and r["step_ms"] > 0 and r["no_cache_ms"] > 0 for r in rep[name])
    refused(capsys, ["bench", "verify", "--target", "tiny-llama", "--build", tmp_path / "build"], "tiny-qwen3")


def test_report_helpers():
    assert report.standard_error([1, 2, 3]) == pytest.approx((1 / 3) ** 0.5) and report.standard_error([5]) == 0
    calls = []
    times = report.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=2, warmup=1)
    assert calls == ["a", "b"] * 3 and {k: len(v) for k, v in times.items()} == {"a": 2, "b": 2}
    assert report.time_ms(lambda: calls.append("t"), 3) >= 0 and calls.count("t") == 4  # one warm-up call
