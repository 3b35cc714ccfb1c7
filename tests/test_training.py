"""The real trainer on tiny-qwen3 data: both objectives, torchrun DDP, kill + resume, bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import chat_ids, run_cli as _cli
from dflow_trt.decoding.loop import generate
from dflow_trt.decoding.options import DecodeOptions
from dflow_trt.drafter import train_log
from dflow_trt.drafter.io import load_drafter
from dflow_trt.drafter.runtime import TorchDrafter
from dflow_trt.targets import load_target
from dflow_trt.training.data import generate_dataset, read_shard

# Small enough for seconds per run; max_len keeps every sequence (prompts reach ~320 tokens).
TRAIN = ["--target", "tiny-qwen3", "--seqs-per-step", "2", "--anchors-per-seq", "4", "--block-size", "4",
         "--draft-vocab-size", "64", "--max-len", "400", "--eval-seqs", "4", "--threads", "1"]


def _error(r, *needles):
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "Traceback" not in r.stderr, r.stderr[-2000:]
    for n in needles:
        assert n in last, last


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, tiny_qwen3):
    d = tmp_path_factory.mktemp("data") / "tiny"
    # heldout_every=8: 6 of 48 prompts held out, so evaluation has sequences
    generate_dataset(tiny_qwen3, d, num_prompts=48, max_new_tokens=24, batch_size=8, shard_size=16, heldout_every=8)
    return d


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """One finished single-process run per objective: {objective: out_dir}."""
    outs = {}
    for obj in ("dflash", "dflow"):
        out = tmp_path_factory.mktemp(obj)
        r = _cli("train", *TRAIN, "--data-dir", str(data_dir), "--out-dir", str(out), "--objective", obj,
                 "--steps", "40", "--lr", "3e-3", "--eval-every", "20", "--ckpt-every", "10")
        assert r.returncode == 0, r.stderr[-3000:]
        outs[obj] = out
    return outs


def _log(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "drafter" / "train_log.jsonl").read_text().splitlines()]


def test_dataset_manifest_and_heldout(data_dir, tiny_qwen3):
    m = json.loads((data_dir / "manifest.json").read_text())
    assert m["target_fingerprint"] == tiny_qwen3.info.fingerprint and m["tokenizer_fingerprint"]
    assert m["shards"] == ["shard-0000.jsonl", "shard-0001.jsonl", "shard-0002.jsonl"]
    seqs = [r for s in m["shards"] for r in read_shard(data_dir / f"{s}.gz")]  # stored compressed
    assert not any((data_dir / s).exists() for s in m["shards"])
    assert sorted(s["id"] for s in seqs) == list(range(48))
    # the responses are the target's own greedy continuations: the data set was made on the static back
    # end, continuously batched 8 wide; each prompt decoded alone on the eager target gives the same tokens
    first = seqs[:16]
    assert len({len(s["prompt_ids"]) for s in first}) > 8  # prompts of many lengths, so the batches were reordered
    for s in first:
        ref = generate(tiny_qwen3, None, [s["prompt_ids"]], DecodeOptions(mode="ar", max_new_tokens=24)).token_ids[0]
        assert ref == s["response_ids"], s["id"]
    # a second call with the same settings resumes (nothing to do) and leaves the shards untouched
    before = {p.name: p.stat().st_mtime_ns for p in data_dir.glob("shard-*.jsonl.gz")}
    generate_dataset(tiny_qwen3, data_dir, num_prompts=48, max_new_tokens=24, batch_size=8, shard_size=16,
                     heldout_every=8)
    assert len(before) == 3 and before == {p.name: p.stat().st_mtime_ns for p in data_dir.glob("shard-*.jsonl.gz")}


def test_dataset_of_fresh_prompts_starts_further_down(tiny_qwen3, data_dir, tmp_path):
    from dflow_trt.errors import UserError
    from dflow_trt.training.data import load_dataset

    d = tmp_path / "fresh"
    generate_dataset(tiny_qwen3, d, num_prompts=16, max_new_tokens=8, batch_size=8, shard_size=8, heldout_every=8,
                     first_prompt=40)
    train, heldout = load_dataset(d, tiny_qwen3)
    assert sorted(s.id for s in train + heldout) == list(range(40, 56))  # the prompts' own ids
    assert [s.id for s in heldout] == [40, 48]  # the same held-out rule as a data set from the start
    # the prompt at id 40 is the one the first data set (48 prompts) holds under that id
    first = {s.id: s.prompt_ids for s in sum(load_dataset(data_dir, tiny_qwen3), [])}
    assert heldout[0].prompt_ids == first[40]
    m = json.loads((d / "manifest.json").read_text())
    assert m["first_prompt"] == 40 and m["num_prompts"] == 16
    with pytest.raises(UserError, match="first_prompt: 40 vs 0"):  # another start is another data set
        generate_dataset(tiny_qwen3, d, num_prompts=16, max_new_tokens=8, batch_size=8, shard_size=8, heldout_every=8)
    with pytest.raises(UserError, match="leaves none"):
        generate_dataset(tiny_qwen3, tmp_path / "none", num_prompts=4, first_prompt=10**6)


@pytest.mark.parametrize("objective", ["dflash", "dflow"])
def test_training_learns_and_decodes_losslessly(trained, objective, tiny_qwen3):
    out = trained[objective]
    log = _log(out)
    assert [r["step"] for r in log] == list(range(1, 41))
    first, last = sum(r["loss"] for r in log[:5]) / 5, sum(r["loss"] for r in log[-5:]) / 5
    assert last < first, (first, last)
    assert all(r["grad_norm"] == r["grad_norm"] for r in log)  # no NaN
    evals = [r for r in log if "eval_tau_noflow" in r]
    assert [r["step"] for r in evals] == [20, 40] and all(1 <= r["eval_tau_noflow"] <= 4 for r in evals)  # block 4
    assert ("eval_tau_flow" in evals[-1]) == (objective == "dflow")
    files = {p.name for p in (out / "drafter").iterdir()}
    assert {"config.json", "model.safetensors", "training_config.json", "train_log.jsonl",
            "data_manifest.json"} <= files
    # embeddings and LM head are the target's: not stored
    weights = load_file(out / "drafter" / "model.safetensors")
    assert not any("embed" in k or "lm_head" in k for k in weights), sorted(weights)
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    target = tiny_qwen3.with_taps(tuple(cfg["tap_layers"]))
    drafter = load_drafter(out / "drafter", target)
    prompts = [chat_ids(target, "What is 12 plus 30?"), chat_ids(target, "Write a haiku about rain.")]
    ar = generate(target, None, prompts, DecodeOptions(mode="ar", max_new_tokens=24, stop_token_ids=())).token_ids
    for S in (2, 4):
        res = generate(target, TorchDrafter(drafter), prompts, DecodeOptions(block_size=S, mode=objective, max_new_tokens=24, stop_token_ids=()))
        assert res.token_ids == ar, (objective, S)


def test_torchrun_two_processes_make_the_same_kind_of_checkpoint(trained, data_dir, tmp_path):
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "dflow_trt.cli", "train", *TRAIN, "--data-dir", str(data_dir), "--out-dir", str(out),
                        "--objective", "dflow", "--steps", "40", "--lr", "3e-3", "--eval-every", "20",
                        "--ckpt-every", "10"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    one = trained["dflow"]
    assert {p.name for p in (out / "drafter").iterdir()} == {p.name for p in (one / "drafter").iterdir()}
    w1, w2 = load_file(one / "drafter" / "model.safetensors"), load_file(out / "drafter" / "model.safetensors")
    assert {k: v.shape for k, v in w1.items()} == {k: v.shape for k, v in w2.items()}
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)  # two shards of data: another trajectory
    c1, c2 = (json.loads((d / "drafter" / "config.json").read_text()) for d in (one, out))
    assert c1 == c2
    ck = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ck["world"] == 2 and ck["step"] == 40 and len(ck["rng"]) == 2
    assert [r["step"] for r in _log(out)] == list(range(1, 41))
    # a 2-process checkpoint is not resumed by 1 process (its data shards and RNGs differ)
    r = _cli("train", *TRAIN, "--data-dir", str(data_dir), "--out-dir", str(out), "--objective", "dflow",
             "--steps", "50", "--lr", "3e-3", "--eval-every", "20", "--ckpt-every", "10")
    _error(r, "another config or process count")


def _ckpt_step(path: Path) -> int:
    try:
        return torch.load(path, weights_only=True)["step"]
    except Exception:  # noqa: BLE001 - not there yet
        return 0


def test_killed_run_resumes_to_the_same_drafter(data_dir, tmp_path):
    args = ["train", *TRAIN, "--data-dir", str(data_dir), "--objective", "dflow", "--steps", "300",
            "--lr", "1e-3", "--eval-every", "100", "--ckpt-every", "5"]
    whole = tmp_path / "whole"
    r = _cli(*args, "--out-dir", str(whole))
    assert r.returncode == 0, r.stderr[-3000:]

    cut = tmp_path / "cut"
    p = subprocess.Popen([sys.executable, "-m", "dflow_trt.cli", *args, "--out-dir", str(cut)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while _ckpt_step(cut / "checkpoint.pt") < 10 and p.poll() is None and time.time() - t0 < 300:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)  # what a stopping session does
    p.wait()
    step = _ckpt_step(cut / "checkpoint.pt")
    assert 10 <= step < 300, f"the run was not cut mid-way (checkpoint at step {step})"
    assert not (cut / "drafter").exists()

    r = _cli(*args, "--out-dir", str(cut))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from step {step}" in r.stdout
    assert [x["step"] for x in _log(cut)] == list(range(1, 301))
    a, b = load_file(whole / "drafter" / "model.safetensors"), load_file(cut / "drafter" / "model.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    la, lb = _log(whole), _log(cut)
    assert [x["loss"] for x in la] == [x["loss"] for x in lb]


def test_data_of_another_target_is_refused(data_dir, tmp_path):
    r = _cli("train", *TRAIN[2:], "--target", "tiny-llama", "--data-dir", str(data_dir),
             "--out-dir", str(tmp_path / "o"), "--steps", "2")
    _error(r, "generated by target 'tiny-qwen3'", "make-data --target tiny-llama")
    assert not (tmp_path / "o" / "checkpoint.pt").exists()


def test_corrupt_or_foreign_checkpoint_is_refused(trained, data_dir, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"\x80\x02 this is not a checkpoint")
    r = _cli("train", *TRAIN, "--data-dir", str(data_dir), "--out-dir", str(out), "--steps", "2")
    _error(r, "not a readable dflow_trt checkpoint", "delete it")
    # a checkpoint of the other objective is not silently continued
    shutil.copy(trained["dflash"] / "checkpoint.pt", out / "checkpoint.pt")
    r = _cli("train", *TRAIN, "--data-dir", str(data_dir), "--out-dir", str(out), "--objective", "dflow",
             "--steps", "40", "--lr", "3e-3")
    _error(r, "another config")


def test_mismatched_tokenizer_is_refused(tmp_path):
    from dflow_trt.targets.tiny import build_tiny, byte_tokenizer

    ckpt = tmp_path / "ckpt"
    model, tok = build_tiny("qwen3")  # its own copy: save_pretrained rewrites the config it saves
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    target = load_target(str(ckpt), num_taps=3)
    data = tmp_path / "data"
    generate_dataset(target, data, num_prompts=8, max_new_tokens=8, batch_size=8, shard_size=8, heldout_every=4)

    # same weights, a tokenizer with another chat template: the cached ids mean other text
    other = byte_tokenizer()
    other.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    other.save_pretrained(ckpt)
    r = _cli("train", *TRAIN[2:], "--target", str(ckpt), "--data-dir", str(data), "--out-dir",
             str(tmp_path / "o"), "--steps", "2")
    _error(r, "another tokenizer", "make-data")

    # a tokenizer with more tokens than the model's vocabulary belongs to another model
    other.add_tokens([f"<extra_{i}>" for i in range(8)])
    other.save_pretrained(ckpt)
    r = _cli("generate", "--target", str(ckpt), "--mode", "ar", "--prompt", "hi", "--max-new-tokens", "2")
    _error(r, "tokens but the model's vocabulary has 260")


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in _log(out)]


def test_cached_target_states_train_like_the_live_target(data_dir, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)  # its own copy: the other tests keep computing states live
    args = [*TRAIN, "--data-dir", str(data), "--steps", "3", "--eval-every", "3", "--flow-anchors-per-seq", "2"]
    live = {}
    for obj in ("dflash", "dflow"):
        r = _cli("train", *args, "--objective", obj, "--out-dir", str(tmp_path / f"live-{obj}"))
        assert r.returncode == 0 and "computed each step (cache none built)" in r.stdout, r.stderr[-2000:]
        live[obj] = _losses(tmp_path / f"live-{obj}")

    r = _cli("cache-states", "--target", "tiny-qwen3", "--data-dir", str(data), "--max-len", "400")
    assert r.returncode == 0, r.stderr[-2000:]
    states = data / "states"
    assert sorted(p.name for p in states.iterdir()) == ["manifest.json", "shard-0000.safetensors",
                                                        "shard-0001.safetensors", "shard-0002.safetensors"]
    for obj in ("dflash", "dflow"):
        out = tmp_path / f"cached-{obj}"
        r = _cli("train", *args, "--objective", obj, "--out-dir", str(out))
        assert r.returncode == 0 and f"cached in {states}" in r.stdout, r.stderr[-2000:]
        # bf16 storage: the same losses up to rounding (DFlow's verifier pass reads the cached K/V)
        assert _losses(out) == pytest.approx(live[obj], rel=1e-2), obj
        r = _cli("train", *args, "--objective", obj, "--out-dir", str(tmp_path / f"off-{obj}"), "--states", "off")
        assert r.returncode == 0 and _losses(tmp_path / f"off-{obj}") == live[obj]

    # a cache made for another max_len is not used (and says why); taps-only cannot serve DFlow
    r = _cli("train", *args, "--objective", "dflow", "--max-len", "300", "--out-dir", str(tmp_path / "o1"))
    assert r.returncode == 0 and "cache built with other max_len" in r.stdout, r.stdout
    shutil.rmtree(states)
    r = _cli("cache-states", "--target", "tiny-qwen3", "--data-dir", str(data), "--max-len", "400", "--no-kv")
    assert r.returncode == 0
    r = _cli("train", *args, "--objective", "dflow", "--out-dir", str(tmp_path / "o2"))
    assert r.returncode == 0 and "cache built with other kv" in r.stdout, r.stdout
    assert not list(states.glob(".*.tmp"))

    # states of another target are refused, by the trainer and by a rebuild
    m = json.loads((states / "manifest.json").read_text())
    (states / "manifest.json").write_text(json.dumps({**m, "target_fingerprint": "0" * 16}))
    r = _cli("train", *args, "--objective", "dflash", "--out-dir", str(tmp_path / "o3"))
    _error(r, "states of another target", "cache-states --target tiny-qwen3")
    r = _cli("cache-states", "--target", "tiny-qwen3", "--data-dir", str(data), "--max-len", "400")
    _error(r, "other settings", "delete it")


def test_data_set_grows_and_a_run_resumes_on_it(tiny_qwen3, tmp_path):
    from dflow_trt.errors import UserError
    from dflow_trt.training.data import load_dataset
    from dflow_trt.training.states import StateCache, build_states
    from dflow_trt.training.trainer import _draft_vocab

    data, out = tmp_path / "data", tmp_path / "run"
    kw = dict(max_new_tokens=24, batch_size=8, shard_size=16, heldout_every=8)
    generate_dataset(tiny_qwen3, data, num_prompts=20, **kw)  # shard 0 full, shard 1 holds 4
    build_states(tiny_qwen3, data, max_len=400)
    args = [*TRAIN, "--data-dir", str(data), "--out-dir", str(out), "--objective", "dflash", "--eval-every", "2",
            "--ckpt-every", "2"]
    assert _cli("train", *args, "--steps", "4").returncode == 0
    vocab = torch.load(out / "checkpoint.pt", weights_only=True)["drafter"]["draft_vocab"]
    shard = lambda i: read_shard(data / f"shard-{i:04d}.jsonl.gz")  # noqa: E731
    short = shard(1)
    mtimes = {p.name: p.stat().st_mtime_ns for p in [data / "shard-0000.jsonl.gz", data / "states/shard-0000.safetensors"]}

    generate_dataset(tiny_qwen3, data, num_prompts=40, **kw)
    assert not StateCache(data, tiny_qwen3, need_kv=False).covers([16])  # shard 1's states predate its regeneration
    assert json.loads((data / "manifest.json").read_text())["num_prompts"] == 40
    assert [len(shard(i)) for i in range(3)] == [16, 16, 8] and [s["id"] for s in shard(1)] == list(range(16, 32))
    assert shard(1)[:4] == short  # the same prompts in the same order: the same responses
    s = shard(2)[5]
    assert generate(tiny_qwen3, None, [s["prompt_ids"]], DecodeOptions(mode="ar", max_new_tokens=24)).token_ids[0] == s["response_ids"]
    build_states(tiny_qwen3, data, max_len=400)  # rebuilds the regenerated shard's states, keeps shard 0's
    assert mtimes == {p.name: p.stat().st_mtime_ns for p in [data / "shard-0000.jsonl.gz",
                                                             data / "states/shard-0000.safetensors"]}
    assert StateCache(data, tiny_qwen3, need_kv=False).covers(list(range(40)))

    grown = _draft_vocab(load_dataset(data, tiny_qwen3)[0], 64, tiny_qwen3.info.vocab_size, tiny_qwen3.info.eos_token_ids)
    assert not torch.equal(grown, vocab)  # the grown data alone would choose another draft vocabulary
    r = _cli("train", *args, "--steps", "8")  # resumes on the grown data, keeping its draft vocabulary
    assert r.returncode == 0 and "resumed from step 4" in r.stdout and "cached in" in r.stdout, r.stderr[-2000:]
    log = _log(out)
    n = [x["train_seqs"] for x in log if "train_seqs" in x]  # at steps 2, 4 (20 prompts) and 6, 8 (40 prompts)
    assert n[0] == n[1] <= 17 and n[2] == n[3] > n[1] + 10  # ids % 8 == 0 are held out
    assert torch.equal(load_file(out / "drafter" / "model.safetensors")["draft_vocab"], vocab)

    with pytest.raises(UserError, match="would drop some"):  # never shrinks
        generate_dataset(tiny_qwen3, data, num_prompts=30, **kw)
    with pytest.raises(UserError, match="heldout_every: 8 vs 4"):
        generate_dataset(tiny_qwen3, data, num_prompts=40, **{**kw, "heldout_every": 4})
    # a shard made from other prompts (another prompt-set version) is refused, not mixed in
    rows = shard(0)
    rows[0]["prompt_ids"] = rows[0]["prompt_ids"][:-1]
    (data / "shard-0000.jsonl.gz").unlink()  # a plain shard (as made before compression) is read the same
    (data / "shard-0000.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    with pytest.raises(UserError, match="other prompts"):
        generate_dataset(tiny_qwen3, data, num_prompts=48, **kw)


def test_prompt_set_is_prefix_stable_varied_and_holds_out_the_eval_sets():
    from dflow_trt.evalsets import humaneval_prompts, mtbench_prompts
    from dflow_trt.training.prompts import _shingles, build_prompts

    full = build_prompts(10**6)
    assert len(full) > 3000 and build_prompts(100) == full[:100] and build_prompts(2000) == full[:2000]
    assert [p["id"] for p in full] == list(range(len(full)))
    assert len({p["prompt"] for p in full}) == len(full)  # deduplicated
    kinds = {p["source"] for p in full[1000:3000]}  # the second pool mixes every kind of request
    assert {"code-def", "code", "explain", "writing", "roleplay", "reasoning", "extraction", "math"} <= kinds
    code_read = [p["prompt"] for p in full if p["source"] == "code-read"]  # the third pool: real stdlib source
    assert len(code_read) > 1000 and all("```python\n" in p and "def " in p for p in code_read)
    held = set().union(*(_shingles(p) for p in humaneval_prompts() + mtbench_prompts()))
    assert not any(_shingles(p["prompt"]) & held for p in full)


def test_first_prompt_pool_is_frozen():
    """runs/data-smollm2 was made from this pool: editing the shared template lists must not change it
    (the stdlib part depends on the Python version's docstrings and is checked per shard at run time)."""
    import hashlib

    from dflow_trt.training.prompts import _pool_v1

    templated = [x for x in _pool_v1(0) if x[0] != "code-stdlib"]
    assert hashlib.sha256(json.dumps(templated).encode()).hexdigest()[:16] == "5f0d244d12ee2466"


def test_init_from_fine_tunes_a_saved_drafter(trained, data_dir, tmp_path):
    src = trained["dflow"] / "drafter"
    out = tmp_path / "ft"
    args = [*TRAIN, "--data-dir", str(data_dir), "--objective", "dflow", "--lr", "1e-3", "--eval-every", "10",
            "--ckpt-every", "5", "--init-from", str(src)]
    r = _cli("train", *args, "--out-dir", str(out), "--steps", "50")
    assert r.returncode == 0, r.stderr[-3000:]
    log = _log(out)
    # the source's 40 steps are carried, then 10 more on a schedule of their own (back up, then down again)
    assert [x["step"] for x in log] == list(range(1, 51))
    assert log[:40] == _log(trained["dflow"])
    assert log[39]["lr"] < log[40]["lr"] > log[-1]["lr"] and "eval_tau_flow" in log[-1]
    w0, w1 = load_file(src / "model.safetensors"), load_file(out / "drafter" / "model.safetensors")
    assert w0["draft_vocab"].equal(w1["draft_vocab"]) and any(not torch.equal(w0[k], w1[k]) for k in w0)
    cfg = json.loads((out / "drafter" / "training_config.json").read_text())
    assert cfg["init_from"] == str(src) and cfg["steps"] == 50
    stages = json.loads((out / "drafter" / "earlier_stages.json").read_text())  # what the source trained on
    assert stages == [{"training_config": json.loads((src / "training_config.json").read_text()),
                       "data_manifest": json.loads((src / "data_manifest.json").read_text())}]
    # bad input: a DFlow drafter for a DFlash run, or no steps left to train
    dflash_args = [*TRAIN, "--data-dir", str(data_dir), "--objective", "dflash", "--init-from", str(src)]
    _error(_cli("train", *dflash_args, "--out-dir", str(tmp_path / "x"), "--steps", "50"),
           "--init-from", "another shape", "flow")
    _error(_cli("train", *args, "--out-dir", str(tmp_path / "y"), "--steps", "40"), "trained 40 steps", "more than 40")


def _probe_inputs(feature_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    """Fixed inputs for one drafter pass: context taps [2, 9, F], a block of 4 per row [2, 4], and
    the generator they came from (for further inputs)."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 9, feature_size, generator=g), torch.randint(0, 64, (2, 4), generator=g), g


def _draft_logits(m, taps, block, flow=None) -> torch.Tensor:
    """One drafter pass over `block` right after the 9 context positions, attending everything."""
    pos, mask = torch.arange(9, 13).expand(2, 4), torch.ones(2, 4, 13, dtype=torch.bool)
    kv = m.context_kv(taps, torch.arange(9).expand(2, 9))
    return m.draft_logits(m.hidden(m.block_inputs(block, flow), pos, kv, mask))


def _assert_dflow_lossless(target, drafter_dir: Path) -> None:
    dr = TorchDrafter(load_drafter(drafter_dir, target))
    for prompt in ("def add(a, b):", "Explain gravity."):
        ids = chat_ids(target, prompt)
        ref_ids = generate(target, None, [ids], DecodeOptions(mode="ar", max_new_tokens=24)).token_ids
        assert generate(target, dr, [ids], DecodeOptions(mode="dflow", max_new_tokens=24)).token_ids == ref_ids


def test_dflash_drafter_starts_a_dflow_run_unchanged(trained, data_dir, tiny_qwen3, tmp_path):
    """A DFlash drafter may start a DFlow run: the flow branch starts silent, so the upgraded
    drafter drafts exactly what the DFlash one does, with or without flow; training then grows it."""
    from dflow_trt.decoding.interfaces import FlowState
    from dflow_trt.training.trainer import TrainConfig, _init_from
    from dflow_trt.drafter.defaults import untrained_config
    from dflow_trt.drafter.io import build_drafter

    src_dir = trained["dflash"] / "drafter"
    src = load_drafter(src_dir, tiny_qwen3)
    cfg = untrained_config(tiny_qwen3, flow=True, block_size=4, num_layers=src.config.num_layers)
    cfg = type(cfg)(**{**cfg.__dict__, "draft_vocab_size": 64})
    up = build_drafter(tiny_qwen3, cfg, seed=1)
    log, base = _init_from(str(src_dir), tiny_qwen3, up, TrainConfig(objective="dflow", steps=50))
    assert base == 40 and log == _log(trained["dflash"])
    packed = tmp_path / "packed"  # a shipped drafter keeps its log compressed: the same lineage
    shutil.copytree(src_dir, packed)
    train_log.write(packed, log, compress=True)
    assert not (packed / "train_log.jsonl").exists()
    assert _init_from(str(packed), tiny_qwen3, build_drafter(tiny_qwen3, cfg, seed=1),
                      TrainConfig(objective="dflow", steps=50)) == (log, base)
    taps, block, g = _probe_inputs(cfg.feature_size)
    flow = FlowState(taps=torch.randn(2, 4, cfg.feature_size, generator=g), token_ids=block.flip(1),
                     hint_ids=block, valid=torch.tensor([[True, True, True, False], [True, False, False, False]]))
    with torch.no_grad():
        ref = _draft_logits(src, taps, block)
        assert torch.equal(_draft_logits(up, taps, block), ref)
        assert torch.equal(_draft_logits(up, taps, block, flow), ref)
    # the CLI run: the DFlash log is carried, the flow branch learns, decoding stays lossless
    out = tmp_path / "up"
    r = _cli("train", *TRAIN, "--data-dir", str(data_dir), "--objective", "dflow", "--lr", "3e-3", "--eval-every",
             "10", "--init-from", str(src_dir), "--out-dir", str(out), "--steps", "50")
    assert r.returncode == 0, r.stderr[-3000:]
    log = _log(out)
    assert log[:40] == _log(trained["dflash"]) and "eval_tau_flow" in log[-1] and "eval_tau_flow" not in log[39]
    w = load_file(out / "drafter" / "model.safetensors")
    assert w["hint_gate"].abs().item() > 0 and w["flow_norm.weight"].abs().max() > 0
    _assert_dflow_lossless(tiny_qwen3, out / "drafter")


def test_deeper_drafter_grows_from_a_shallower_one(trained, data_dir, tiny_qwen3, tmp_path):
    """--init-from a drafter into a run with more --num-layers: its layers come first and the new
    ones start silent, so step 0 drafts exactly as the source does; training then grows them, and
    a run with fewer layers than the source is refused."""
    from dflow_trt.training.trainer import TrainConfig, _init_from
    from dflow_trt.drafter.defaults import untrained_config
    from dflow_trt.drafter.io import build_drafter

    src_dir = trained["dflow"] / "drafter"
    src = load_drafter(src_dir, tiny_qwen3)
    n = src.config.num_layers
    cfg = untrained_config(tiny_qwen3, flow=True, block_size=4, num_layers=n + 1)
    deep = build_drafter(tiny_qwen3, type(cfg)(**{**cfg.__dict__, "draft_vocab_size": 64}), seed=1)
    _init_from(str(src_dir), tiny_qwen3, deep, TrainConfig(objective="dflow", steps=50))
    taps, block, _ = _probe_inputs(cfg.feature_size)
    with torch.no_grad():
        assert torch.equal(_draft_logits(deep, taps, block), _draft_logits(src, taps, block))
    out = tmp_path / "deep"
    r = _cli("train", *TRAIN, "--data-dir", str(data_dir), "--objective", "dflow", "--lr", "3e-3", "--eval-every",
             "10", "--num-layers", str(n + 1), "--init-from", str(src_dir), "--out-dir", str(out), "--steps", "50")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _log(out)[:40] == _log(trained["dflow"])
    w = load_file(out / "drafter" / "model.safetensors")
    assert w[f"layers.{n}.down_proj.weight"].abs().max() > 0 and w[f"layers.{n}.self_attn.o_proj.weight"].abs().max() > 0
    assert load_drafter(out / "drafter", tiny_qwen3).config.num_layers == n + 1
    _assert_dflow_lossless(tiny_qwen3, out / "drafter")
    # bad input: the deep drafter cannot start a shallower run
    _error(_cli("train", *TRAIN, "--data-dir", str(data_dir), "--objective", "dflow", "--num-layers", str(n),
                "--init-from", str(out / "drafter"), "--out-dir", str(tmp_path / "x"), "--steps", "60"),
           "--init-from", "another shape", "num_layers")


def test_flow_branch_gets_its_own_learning_rate(trained, data_dir, tiny_qwen3, tmp_path):
    """--flow-lr-mult puts exactly the flow branch in a second AdamW group whose learning rate is
    the multiple; the branch grown from a silent start moves that much further per step."""
    from dataclasses import asdict

    from dflow_trt.training.trainer import TrainConfig, _param_groups, _run_identity

    src_dir = trained["dflash"] / "drafter"
    up = load_drafter(trained["dflow"] / "drafter", tiny_qwen3)
    params = list(up.parameters())
    groups, mults = _param_groups(up, params, TrainConfig(objective="dflow", flow_lr_mult=10))
    names = {id(p): n for n, p in up.named_parameters()}
    flow_names = sorted(names[id(p)] for p in groups[1]["params"])
    assert mults == [1.0, 10.0] and len(groups[0]["params"]) + len(flow_names) == len(params)
    assert {n.split(".")[0] for n in flow_names} == set(up.FLOW_BRANCH)
    assert not any(n.startswith(up.FLOW_BRANCH) for n in (names[id(p)] for p in groups[0]["params"]))
    assert _param_groups(up, params, TrainConfig(objective="dflow"))[1] == [1.0]
    # a checkpoint written before the field existed resumes as multiplier 1
    old = {k: v for k, v in asdict(TrainConfig()).items() if k != "flow_lr_mult"}
    assert _run_identity(old) == _run_identity(asdict(TrainConfig()))

    gate = {}
    for mult in ("1", "10"):
        out = tmp_path / f"x{mult}"
        r = _cli("train", *TRAIN, "--data-dir", str(data_dir), "--objective", "dflow", "--lr", "1e-3",
                 "--warmup-frac", "0", "--init-from", str(src_dir), "--out-dir", str(out), "--steps", "45",
                 "--flow-lr-mult", mult)
        assert r.returncode == 0, r.stderr[-3000:]
        gate[mult] = load_file(out / "drafter" / "model.safetensors")["hint_gate"].abs().item()
    assert gate["10"] > 3 * gate["1"] > 0, gate
    _error(_cli("train", *TRAIN, "--data-dir", str(data_dir), "--objective", "dflash", "--flow-lr-mult", "10",
                "--out-dir", str(tmp_path / "bad"), "--steps", "5"), "--flow-lr-mult", "--objective dflow")


def test_relay_trains_alone_on_cached_first_rounds(trained, data_dir, tiny_qwen3, tmp_path):
    """`cache-flows` stores a frozen DFlash body's first rounds (anchors, accepted lengths, the
    verifier flow) equal to what the live DFlow step computes for them; `--train-part relay` then
    trains the relay branch alone on them: the body comes out bit for bit as it went in, the relay
    branch has grown, the log carries the relay's own gain on equal blocks, decoding stays lossless."""
    from dflow_trt.training.data import load_dataset
    from dflow_trt.training.flows import FlowCache, body_fingerprint, flows_dir
    from dflow_trt.training.objective import _labels, collate, drafter_blocks, target_states, verifier_flow
    from dflow_trt.training.trainer import _fits

    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    src_dir = trained["dflash"] / "drafter"
    src = load_drafter(src_dir, tiny_qwen3)
    flows_args = ["--target", "tiny-qwen3", "--drafter", str(src_dir), "--data-dir", str(data), "--anchors-per-seq",
                  "4", "--max-len", "400", "--eval-seqs", "4", "--precision", "fp32", "--threads", "1"]
    r = _cli("cache-flows", *flows_args)
    assert r.returncode == 0, r.stderr[-3000:]
    fdir = flows_dir(data, src)
    assert sorted(p.name for p in fdir.iterdir()) == ["manifest.json", "part-0000.safetensors"]  # 4 + 41 sequences

    # the cached first rounds equal the live ones, for sequences batched otherwise than at build time
    cache = FlowCache(fdir, tiny_qwen3, src, 4, 400, 0, "fp32")
    train_seqs, heldout = (_fits(x, 400) for x in load_dataset(data, tiny_qwen3))  # as the trainer filters them
    seqs = [train_seqs[5], heldout[0], train_seqs[20]]
    assert all(cache.covers(s.id) for s in train_seqs + heldout[:4]) and not cache.covers(heldout[4].id)
    batch = collate(seqs, 400)
    anchors, accepted, flow = cache.batch(batch.seq_ids)
    with torch.no_grad():
        taps, kv = target_states(tiny_qwen3, batch, keep_cache=True)
        labels = _labels(batch, anchors, 4)
        drafts = src.draft_vocab[drafter_blocks(src, taps, batch, anchors, None).argmax(-1)]
        live, live_acc = verifier_flow(tiny_qwen3, kv, batch, anchors, drafts, labels)
    assert torch.equal(accepted, live_acc) and torch.equal(flow.valid, live.valid) and flow.valid.any()
    assert torch.equal(flow.token_ids, live.token_ids) and torch.equal(flow.hint_ids, live.hint_ids)
    torch.testing.assert_close(flow.taps, live.taps.float(), rtol=2e-2, atol=2e-2)  # stored in bf16

    out = tmp_path / "relay"
    args = [*TRAIN, "--data-dir", str(data), "--objective", "dflow", "--train-part", "relay", "--precision", "fp32",
            "--lr", "3e-3", "--eval-every", "10", "--init-from", str(src_dir)]
    r = _cli("train", *args, "--out-dir", str(out), "--steps", "70")
    assert r.returncode == 0 and f"relay only: {len(train_seqs)} training and 4 held-out sequences" in r.stdout, r.stderr[-3000:]
    log = _log(out)
    assert log[:40] == _log(trained["dflash"]) and {"eval_tau_flow", "eval_tau_flow_off"} <= log[-1].keys()
    before, after = load_file(src_dir / "model.safetensors"), load_file(out / "drafter" / "model.safetensors")
    relay = set(src.FLOW_BRANCH)
    assert {k for k in after if k.split(".")[0] not in relay} == set(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the body did not move
    assert after["hint_gate"].abs().item() > 0 and after["flow_norm.weight"].abs().max() > 0
    assert not after["no_flow"].any()  # rounds without flow draft exactly as the DFlash drafter
    assert body_fingerprint(load_drafter(out / "drafter", tiny_qwen3)) == body_fingerprint(src)
    _assert_dflow_lossless(tiny_qwen3, out / "drafter")
    # the paper's relay trains alone on the same flows (its projection is the body's, so it stays)
    r = _cli("train", *args, "--relay", "paper", "--flow-rounds", "1", "--out-dir", str(tmp_path / "paper"),
             "--steps", "50")
    assert r.returncode == 0, r.stderr[-3000:]
    paper = load_file(tmp_path / "paper" / "drafter" / "model.safetensors")
    assert {k for k in paper if not k.startswith("relay_mlp.")} == set(before)
    assert all(torch.equal(paper[k], v) for k, v in before.items()) and paper["relay_mlp.2.weight"].abs().max() > 0
    _assert_dflow_lossless(tiny_qwen3, tmp_path / "paper" / "drafter")

    # bad input: no --init-from; a body whose flows were not built; flows of another seed
    _error(_cli("train", *TRAIN, "--data-dir", str(data), "--objective", "dflow", "--train-part", "relay",
                "--out-dir", str(tmp_path / "b1"), "--steps", "5"), "--train-part relay", "--init-from")
    _error(_cli("train", *args[:-1], str(trained["dflow"] / "drafter"), "--out-dir", str(tmp_path / "b2"),
                "--steps", "60"), "no verifier flows", "cache-flows")
    _error(_cli("train", *args, "--seed", "3", "--out-dir", str(tmp_path / "b3"), "--steps", "60"),
           "built with other seed")
    _error(_cli("cache-flows", *flows_args, "--seed", "3"), "other settings", "delete it")


def test_greedy_responses_keep_prompt_order_on_both_back_ends(tiny_qwen3, monkeypatch):
    """Rows are prefilled shortest first, join a running batch and leave it when finished (continuous
    batching), yet each prompt gets its own greedy answer, in the prompts' order, on either back end."""
    import dataclasses

    from dflow_trt.decoding.loop import DecodeBatch
    from dflow_trt.training import data

    prompts = [chat_ids(tiny_qwen3, x) for x in ("Hi", "Write a long story about a cat and a dog who meet.",
                                                  "2+2?", "Name three colours and say why you like them.", "Why?")]
    stop = generate(tiny_qwen3, None, [prompts[0]], DecodeOptions(mode="ar", max_new_tokens=12)).token_ids[0][5]
    options = DecodeOptions(mode="ar", max_new_tokens=12, stop_token_ids=(stop,))  # so rows end apart
    alone = [generate(tiny_qwen3, None, [p], options).token_ids[0] for p in prompts]
    assert len({len(r) for r in alone}) > 1 and len({tuple(r) for r in alone}) == 5
    calls = {"join": 0, "keep": 0}
    for name in calls:
        real = getattr(DecodeBatch, name)
        monkeypatch.setattr(DecodeBatch, name, lambda self, x, _r=real, _n=name: calls.__setitem__(_n, calls[_n] + 1)
                            or _r(self, x))
    prefilled = []
    real_init = DecodeBatch.__init__
    monkeypatch.setattr(DecodeBatch, "__init__", lambda self, t, d, ps, *a, **k: prefilled.append(list(map(len, ps)))
                        or real_init(self, t, d, ps, *a, **k))
    monkeypatch.setattr(data, "PREFILL_ROWS", 2)
    monkeypatch.setattr(tiny_qwen3, "info", dataclasses.replace(tiny_qwen3.info, eos_token_ids=(stop,)))
    for backend in ("static", "torch"):
        calls.update(join=0, keep=0)
        prefilled.clear()
        assert data.greedy_responses(tiny_qwen3, prompts, 12, batch_size=3, backend=backend) == alone, backend
        assert calls["join"] >= 2 and calls["keep"] >= 1, (backend, calls)  # rows joined and left mid-decode
        flat = [n for group in prefilled for n in group]
        assert flat == sorted(map(len, prompts)) and max(map(len, prefilled)) == 2  # shortest first, 2 at a time
    # rows done at prefill (one new token) leave at once
    one = [generate(tiny_qwen3, None, [p], DecodeOptions(mode="ar", max_new_tokens=1)).token_ids[0] for p in prompts]
    assert data.greedy_responses(tiny_qwen3, prompts, 1, batch_size=3) == one and all(len(r) == 1 for r in one)
    # a target whose rows cannot join (a sliding-window cache) decodes length-sorted batches instead
    monkeypatch.setattr(data, "can_batch", lambda t, d: False)
    calls.update(join=0, keep=0)
    assert data.greedy_responses(tiny_qwen3, prompts, 12, batch_size=3, backend="torch") == alone
    assert calls == {"join": 0, "keep": 0}
    assert data.greedy_responses(tiny_qwen3, [], 12, batch_size=3) == []
    from dflow_trt.errors import UserError

    with pytest.raises(UserError, match="lower --max-new-tokens"):
        data.greedy_responses(tiny_qwen3, prompts, tiny_qwen3.info.max_context, batch_size=3)


def test_shards_are_compressed_and_plain_ones_read_the_same(tiny_qwen3, tmp_path):
    """Shards are written as .jsonl.gz; a data set of plain .jsonl shards (made before) loads the same,
    its state cache stays current when compress_shards rewrites it, and a damaged shard is made again
    by make-data and refused in one line by the loader."""
    import gzip

    from dflow_trt.errors import UserError
    from dflow_trt.training.data import compress_shards, load_dataset
    from dflow_trt.training.states import StateCache, build_states

    d = tmp_path / "d"
    kw = dict(num_prompts=8, max_new_tokens=6, batch_size=4, shard_size=4, heldout_every=4)
    generate_dataset(tiny_qwen3, d, **kw)
    names = json.loads((d / "manifest.json").read_text())["shards"]
    gz = {s: (d / f"{s}.gz").read_bytes() for s in names}
    ref = load_dataset(d, tiny_qwen3)
    for s in names:  # the plain layout of data sets made before compression
        (d / s).write_bytes(gzip.decompress(gz[s]))
        (d / f"{s}.gz").unlink()
    assert load_dataset(d, tiny_qwen3) == ref
    build_states(tiny_qwen3, d, max_len=400, kv=False)
    assert compress_shards(d) == 2 and sorted(p.name for p in d.glob("shard-*")) == [f"{s}.gz" for s in names]
    assert load_dataset(d, tiny_qwen3) == ref
    assert StateCache(d, tiny_qwen3, need_kv=False).covers([s.id for s in ref[0] + ref[1]])  # still current
    generate_dataset(tiny_qwen3, d, **kw)  # nothing to make: the compressed shards are complete
    assert {s: (d / f"{s}.gz").read_bytes() for s in names} == {s: gzip.compress(gzip.decompress(gz[s]), 9, mtime=0)
                                                                  for s in names}
    (d / f"{names[1]}.gz").write_bytes(gz[names[1]][:20] + bytes(40))  # damaged
    with pytest.raises(UserError, match=f"{names[1]}.gz is unreadable.*make-data"):
        load_dataset(d, tiny_qwen3)
    generate_dataset(tiny_qwen3, d, **kw)  # made again
    assert load_dataset(d, tiny_qwen3) == ref
