"""End to end through a real tritonserver (nvidia-pytriton's 2.51) and tritonclient."""

import gc
import json
import queue
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from dflow_trt.loading import load_backends
from dflow_trt.decoding.flow import HINT_TRUST
from dflow_trt.decoding.loop import generate
from dflow_trt.decoding.options import DecodeOptions
from dflow_trt.errors import UserError
from dflow_trt.prompting import encode_prompt
from dflow_trt.serving.client import _inputs, generate_grpc, generate_http, request_arrays
from dflow_trt.serving.repository import MODELS, write_repository
from dflow_trt.serving.server import DEFAULT_REPOSITORY, start_server

grpcclient = pytest.importorskip("tritonclient.grpc")
PROMPTS = ["hello world", "def add(a, b):", "The capital of France is", "1, 2, 3, 5, 8,",
           "Once upon a time", "import numpy as np", "Q: what is 7 * 6?", "The quick brown fox"]


def _ports(n=3):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _serve(repo, tmp, **kw):
    h, g, m = _ports()
    return start_server(repo, h, g, m, work_dir=tmp / "work", log_path=tmp / "server.log", timeout_s=900, **kw)


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("triton_tiny")
    repo = write_repository(tmp / "repo", {m: {"target": "tiny-qwen3"} for m in MODELS})
    with _serve(repo, tmp) as s:
        yield s


@pytest.fixture(scope="module")
def tiny_reference():
    cache = {}

    def ref(prompt, mode, max_tokens, block_size):
        if mode not in cache:
            cache[mode] = load_backends("tiny-qwen3", None, mode, "torch", None, log=lambda m: None)
        target, drafter = cache[mode]
        ids = encode_prompt(target.tokenizer, prompt, False)
        options = DecodeOptions(mode=mode, max_new_tokens=max_tokens, block_size=block_size if mode != "ar" else None)
        return generate(target, drafter, [ids], options).token_ids[0]

    return ref


@pytest.mark.parametrize("model", ["dflow", "dflow_bls"])
def test_greedy_over_triton_equals_generate(tiny_server, tiny_reference, model):
    for mode in ("ar", "dflash", "dflow"):
        for prompt in PROMPTS[:3]:
            for S in (2, 4):
                got = generate_grpc(tiny_server.grpc_url, model, prompt=prompt, mode=mode, max_tokens=24, block_size=S)
                assert got.token_ids == tiny_reference(prompt, mode, 24, S), (model, mode, prompt, S)
                assert got.stats["mode"] == mode and got.stats["num_tokens"] == len(got.token_ids)
                assert got.stats["block_size"] == (1 if mode == "ar" else S)


@pytest.mark.parametrize("model", ["dflow", "dflow_bls"])
def test_verify_threshold_over_triton_keeps_the_tokens(tiny_server, tiny_reference, model):
    """Shortened verification (the drafter model returns its confidences in the BLS layout)."""
    for mode in ("dflash", "dflow"):
        got = generate_grpc(tiny_server.grpc_url, model, prompt=PROMPTS[0], mode=mode, max_tokens=24, block_size=4,
                            verify_threshold=0.99)
        assert got.token_ids == tiny_reference(PROMPTS[0], mode, 24, 4), (model, mode)
        # the untrained drafter is sure (0.996 per draft, its mask token) but not 0.99-sure of three
        assert got.stats["rounds"] <= got.stats["verified_drafts"] < 3 * got.stats["rounds"], got.stats


@pytest.mark.parametrize("model", ["dflow", "dflow_bls"])
def test_hint_trust_over_triton_reaches_the_loop(tiny_server, model):
    """The request's hint_trust reaches the decoding loop: the server reports the hints a local
    decode at the same trust takes (none at 0, more at 1 than at the default), with its tokens."""
    target, drafter = load_backends("tiny-qwen3", None, "dflow", "torch", None, log=lambda m: None)
    ids = encode_prompt(target.tokenizer, PROMPTS[4], False)
    local = {t: generate(target, drafter, [ids], DecodeOptions(mode="dflow", max_new_tokens=40, block_size=8, hint_trust=t))
             for t in (0.0, HINT_TRUST, 1.0)}
    assert local[0.0].hints_taken == 0 < local[HINT_TRUST].hints_taken < local[1.0].hints_taken
    for trust, res in local.items():
        got = generate_grpc(tiny_server.grpc_url, model, prompt=PROMPTS[4], mode="dflow", max_tokens=40, block_size=8,
                            hint_trust=None if trust == HINT_TRUST else trust)  # None: the server's default
        assert got.token_ids == res.token_ids[0], (model, trust)
        assert got.stats["hints_taken"] == res.hints_taken, (model, trust)
        assert got.stats["acceptance_lengths"] == res.acceptance_lengths[0], (model, trust)


@pytest.mark.parametrize("model", ["dflow", "dflow_bls"])
def test_alternatives_over_triton_reach_the_loop(tiny_server, model):
    """The request's alternatives reach the loop on both layouts (BLS: the drafter model returns the
    runner-ups, the target model verifies the tree in its KV session and commits the kept branch):
    tokens, rounds, verified drafts (runner-ups included) and runner-ups taken equal a local decode's."""
    target, drafter = load_backends("tiny-qwen3", None, "dflash", "torch", None, log=lambda m: None)
    for prompt in PROMPTS[1:4]:
        ids = encode_prompt(target.tokenizer, prompt, False)
        local = generate(target, drafter, [ids], DecodeOptions(mode="dflash", max_new_tokens=24, block_size=4,
                                                               alternatives=5))
        assert local.verified_drafts == (3 + 5) * local.rounds  # every round sends 3 drafts + 5 runner-ups
        got = generate_grpc(tiny_server.grpc_url, model, prompt=prompt, mode="dflash", max_tokens=24, block_size=4,
                            alternatives=5)
        assert got.token_ids == local.token_ids[0], (model, prompt)
        assert got.stats["acceptance_lengths"] == local.acceptance_lengths[0]
        assert got.stats["verified_drafts"] == local.verified_drafts
        assert got.stats["alternatives_taken"] == local.alternatives_taken


def test_bls_tree_verify_equals_a_local_one(tiny_server):
    """RemoteTarget over the real target model: a tree verify and a committed runner-up branch give
    the logits and cache a local HFTarget does, and a malformed tree is refused by name."""
    from dflow_trt.serving.bls import RemoteTarget

    c = grpcclient.InferenceServerClient(tiny_server.grpc_url)

    def remote(model, inputs, names):  # as the BLS adapter's: an error response becomes a UserError
        from tritonclient.utils import InferenceServerException

        try:
            r = c.infer(model, _inputs(grpcclient, inputs), outputs=[grpcclient.InferRequestedOutput(n) for n in names])
        except InferenceServerException as e:
            raise UserError(str(e)) from None
        return {n: r.as_numpy(n) for n in names}

    rt = RemoteTarget(remote, session_key=tiny_server.session_key)
    assert rt.supports_tree
    local, _ = load_backends("tiny-qwen3", None, "ar", "torch", None, log=lambda m: None)
    import torch

    ids = torch.tensor([encode_prompt(local.tokenizer, PROMPTS[2], False)])
    block, parents = torch.tensor([[5, 6, 7, 8]]), torch.tensor([-1, 0, 1, 0])
    outs = []
    for t in (rt, local):
        cache, _ = t.prefill(ids, torch.tensor([ids.shape[1]]))
        tree = t.verify(cache, block, parents)
        t.commit(cache, torch.tensor([2]), torch.tensor([[0, 3, 2, 3]]))  # keep [anchor, runner-up 8]
        outs.append((tree.logits, t.verify(cache, torch.tensor([[9]])).logits))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)
    cache, _ = rt.prefill(ids, torch.tensor([ids.shape[1]]))
    with pytest.raises(UserError, match="parents"):
        rt.verify(cache, block, torch.tensor([-1, 2, 0, 0]))
    del cache  # releases the target session (RemoteTarget finalizes it), as later tests count them
    gc.collect()


def test_streaming_delivers_rounds(tiny_server):
    res = generate_grpc(tiny_server.grpc_url, prompt=PROMPTS[0], mode="dflow", max_tokens=20, block_size=4)
    acc = res.stats["acceptance_lengths"]
    # first response: the prefill's token; then one response per round with its committed tokens
    assert res.chunk_sizes[0] == 1 and len(res.chunk_sizes) == 1 + len(acc) == 1 + res.stats["rounds"]
    assert res.chunk_sizes[1:-1] == acc[:-1] and res.chunk_sizes[-1] <= acc[-1]
    assert res.chunk_times == sorted(res.chunk_times) and len(res.chunk_times) > 2
    assert sum(res.chunk_sizes) == len(res.token_ids) == 20
    assert res.text and res.stats["tau"] == pytest.approx(sum(acc) / len(acc))


def test_http_generate_stream_equals_grpc(tiny_server, tiny_reference):
    for mode in ("ar", "dflash", "dflow"):
        kw = dict(prompt=PROMPTS[1], mode=mode, max_tokens=20, block_size=4)
        h, g = generate_http(tiny_server.http_url, **kw), generate_grpc(tiny_server.grpc_url, **kw)
        assert h.token_ids == g.token_ids == tiny_reference(PROMPTS[1], mode, 20, 4), mode
        assert h.chunk_sizes == g.chunk_sizes and h.text == g.text  # the same rounds, as server-sent events
        assert h.stats["acceptance_lengths"] == g.stats["acceptance_lengths"]
    cut = generate_http(tiny_server.http_url, prompt=PROMPTS[1], mode="dflow", max_tokens=20, block_size=4,
                        stop_words=[g.text[len(g.text) // 2:][:2]])
    assert cut.stats["finish_reason"] == "stop_word"
    with pytest.raises(UserError, match="unknown mode"):
        generate_http(tiny_server.http_url, prompt="hi", mode="beam", max_tokens=4)
    with pytest.raises(UserError, match="max_tokens"):
        generate_http(tiny_server.http_url, prompt="hi", max_tokens=0)


def test_cli_client_over_both_protocols(tiny_server, tiny_reference):
    outs = {}
    for proto, url in (("grpc", tiny_server.grpc_url), ("http", tiny_server.http_url)):
        r = subprocess.run([sys.executable, "-m", "dflow_trt.cli", "client", "--protocol", proto, "--url", url,
                            "--prompt", PROMPTS[2], "--mode", "dflow", "--max-new-tokens", "12", "--block-size", "4",
                            "--json"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        outs[proto] = json.loads(r.stdout)
        assert {"token_ids", "text", "tau"} <= set(outs[proto])
    assert outs["grpc"]["token_ids"] == outs["http"]["token_ids"] == tiny_reference(PROMPTS[2], "dflow", 12, 4)
    r = subprocess.run([sys.executable, "-m", "dflow_trt.cli", "client", "--protocol", "http", "--url",
                        tiny_server.http_url, "--prompt", "", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "empty prompt" in r.stderr and "Traceback" not in r.stderr


def test_eight_concurrent_requests_keep_their_own_state(tiny_server, tiny_reference):
    jobs = [(PROMPTS[i], ("ar", "dflash", "dflow")[i % 3], 16 + 4 * (i % 3), (2, 4, 8)[i % 3]) for i in range(8)]
    out = [None] * 8

    def run(i):
        p, mode, n, S = jobs[i]
        out[i] = generate_grpc(tiny_server.grpc_url, prompt=p, mode=mode, max_tokens=n, block_size=S)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, (p, mode, n, S) in enumerate(jobs):
        assert out[i] is not None and out[i].token_ids == tiny_reference(p, mode, n, S), jobs[i]


def test_cancelled_request_frees_its_state(tiny_server):
    c = grpcclient.InferenceServerClient(tiny_server.grpc_url)
    q = queue.Queue()
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    c.async_stream_infer("dflow", _inputs(grpcclient, request_arrays(prompt=PROMPTS[4], max_tokens=1000, mode="dflow",
                                                                     block_size=2)))
    r, e = q.get(timeout=60)  # the first round arrived: the request is in flight
    assert e is None
    c.stop_stream(cancel_requests=True)
    c.close()
    deadline = time.time() + 60
    while time.time() < deadline and "cancelled after" not in tiny_server.log_path.read_text():
        time.sleep(0.5)
    assert "cancelled after" in tiny_server.log_path.read_text()
    after = generate_grpc(tiny_server.grpc_url, prompt=PROMPTS[0], mode="ar", max_tokens=4)
    assert after.stats["active_requests"] == 0 and len(after.token_ids) == 4


def test_grpc_client_that_dies_frees_its_state(tiny_server):
    """A client process killed mid-stream (no cancel call): Triton sees the stream go and cancels."""
    before = tiny_server.log_path.read_text().count("cancelled after")
    code = ("import sys, queue, tritonclient.grpc as g\n"
            "from dflow_trt.serving.client import _inputs, request_arrays\n"
            f"c = g.InferenceServerClient('{tiny_server.grpc_url}'); q = queue.Queue()\n"
            "c.start_stream(callback=lambda result, error: q.put(error))\n"
            "c.async_stream_infer('dflow', _inputs(g, request_arrays(prompt='Once upon a time', max_tokens=1000, "
            "mode='dflow', block_size=2)))\n"
            "assert q.get(timeout=60) is None\nprint('streaming', flush=True)\nimport time; time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "streaming"  # its first round arrived
    p.kill()
    p.wait()
    deadline = time.time() + 60
    while time.time() < deadline and tiny_server.log_path.read_text().count("cancelled after") == before:
        time.sleep(0.5)
    assert tiny_server.log_path.read_text().count("cancelled after") > before
    assert generate_grpc(tiny_server.grpc_url, prompt="hi", mode="ar", max_tokens=1).stats["active_requests"] == 0


def test_http_client_disconnect_does_not_leak_state(tiny_server):
    """Triton 2.51's HTTP frontend does not cancel a request whose client went away (gRPC does:
    see above), so the request runs to its max_tokens, and then its state must be gone."""
    import http.client

    host, port = tiny_server.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"text_input": PROMPTS[5], "max_tokens": 120, "mode": "dflow", "block_size": 2})
    conn.request("POST", "/v2/models/dflow/generate_stream", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data:")  # the first round arrived
    conn.sock.close()  # the client goes away mid-stream
    deadline, active = time.time() + 120, None
    while time.time() < deadline and active != 0:
        active = generate_grpc(tiny_server.grpc_url, prompt="hi", mode="ar", max_tokens=1).stats["active_requests"]
        time.sleep(0.5)
    assert active == 0


def _target_info(url):
    c = grpcclient.InferenceServerClient(url)
    i = grpcclient.InferInput("info_only", [1], "BOOL")
    i.set_data_from_numpy(np.array([True]))
    return json.loads(bytes(c.infer("target", [i]).as_numpy("info").reshape(-1)[0]))


def test_bls_target_sessions_are_released(tiny_server, tiny_reference):
    """dflow_bls verifies through KV sessions of the `target` model; finished and cancelled requests
    release theirs."""
    assert _target_info(tiny_server.grpc_url)["kv_sessions"]
    got = generate_grpc(tiny_server.grpc_url, "dflow_bls", prompt=PROMPTS[6], mode="dflow", max_tokens=16, block_size=4)
    assert got.token_ids == tiny_reference(PROMPTS[6], "dflow", 16, 4)
    c = grpcclient.InferenceServerClient(tiny_server.grpc_url)
    q = queue.Queue()
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    c.async_stream_infer("dflow_bls", _inputs(grpcclient, request_arrays(prompt=PROMPTS[7], max_tokens=500,
                                                                         mode="dflash", block_size=2)))
    assert q.get(timeout=60)[1] is None
    c.stop_stream(cancel_requests=True)
    c.close()
    deadline, n = time.time() + 60, None
    while time.time() < deadline and n != 0:
        n = _target_info(tiny_server.grpc_url)["active_sessions"]
        time.sleep(0.5)
    assert n == 0


@pytest.mark.parametrize("change,needle", [
    ({"prompt": ""}, "empty prompt"),
    ({"mode": "beam"}, "unknown mode"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"block_size": 1}, "block_size"),
    ({"temperature": -1.0}, "temperature"),
    ({"verify_threshold": 1.5}, "verify_threshold"),
    ({"hint_trust": -0.1}, "hint_trust"),
    ({"alternatives": 8}, "alternatives"),
    ({"alternatives": 2, "temperature": 1.0}, "greedy"),
])
def test_bad_requests_get_an_error_and_the_server_keeps_serving(tiny_server, change, needle):
    req = {"prompt": "hi", "mode": "dflow", "max_tokens": 4, **change}
    with pytest.raises(UserError, match=needle):
        generate_grpc(tiny_server.grpc_url, **req)
    assert len(generate_grpc(tiny_server.grpc_url, prompt="hi", mode="dflow", max_tokens=4).token_ids) == 4


def test_wrong_dtype_is_refused_by_triton(tiny_server):
    c = grpcclient.InferenceServerClient(tiny_server.grpc_url)
    arrays = request_arrays(prompt="hi", max_tokens=4)
    arrays["max_tokens"] = np.array([4.0], np.float32)
    q = queue.Queue()
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    c.async_stream_infer("dflow", _inputs(grpcclient, arrays))
    r, e = q.get(timeout=60)
    c.stop_stream()
    assert e is not None and "max_tokens" in str(e), e
    assert len(generate_grpc(tiny_server.grpc_url, prompt="hi", max_tokens=3).token_ids) == 3


def test_stop_words_cut_the_output(tiny_server):
    full = generate_grpc(tiny_server.grpc_url, prompt=PROMPTS[1], mode="dflow", max_tokens=24, block_size=4)
    word = full.text[len(full.text) // 2:][:2]
    cut = generate_grpc(tiny_server.grpc_url, prompt=PROMPTS[1], mode="dflow", max_tokens=24, block_size=4,
                        stop_words=[word])
    assert cut.stats["finish_reason"] == "stop_word" and word in cut.text
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)] and len(cut.token_ids) < len(full.token_ids)


def test_missing_artefact_fails_the_model_load_with_a_clear_line(tmp_path):
    repo = write_repository(tmp_path / "repo", {"dflow": {"target": "tiny-qwen3", "dflow_drafter": "/nonexistent/drafter"}},
                            models=("dflow",))
    with pytest.raises(UserError, match="exited with code"):
        _serve(repo, tmp_path)
    log = (tmp_path / "server.log").read_text()
    assert "dflow: failed to load: drafter /nonexistent/drafter does not exist" in log


@pytest.mark.slow
def test_default_repository_serves_smollm2_like_generate(tmp_path):
    """The checked-in triton_repo (smollm2-135m + shipped drafters) equals `dflow-trt generate`."""
    with _serve(DEFAULT_REPOSITORY, tmp_path) as s:
        for prompt in ("Write a Python function that reverses a string.", "What is 12 times 7?"):
            for mode in ("ar", "dflash", "dflow"):
                r = subprocess.run([sys.executable, "-m", "dflow_trt.cli", "generate", "--mode", mode, "--chat",
                                    "--prompt", prompt, "--max-new-tokens", "24", "--json"],
                                   capture_output=True, text=True, timeout=600)
                assert r.returncode == 0, r.stderr
                ref = json.loads(r.stdout)
                for model in ("dflow", "dflow_bls"):
                    got = generate_grpc(s.grpc_url, model, prompt=prompt, mode=mode, max_tokens=24, chat=True)
                    assert got.token_ids == ref["token_ids"], (model, mode, prompt)
                    assert got.text == ref["text"]


def test_load_generator_reports_a_sweep(tiny_server, tmp_path):
    from dflow_trt.serving.load import held_state, perf_analyzer_inputs, run_point, write_report

    pts = [run_point(tiny_server.grpc_url, PROMPTS, m, c, 4, 8, chat=False) for m in ("ar", "dflow") for c in (1, 2)]
    for p in pts:
        assert p.requests == 4 and p.output_tokens_per_s > 0 and p.ttft_ms["p50"] <= p.latency_ms["p99"]
        assert p.itl_ms["p50"] is not None and p.ttft_ms["p50"] <= p.ttft_ms["p90"] <= p.ttft_ms["p99"]
    assert max(p.batch_rows for p in pts if p.concurrency == 2) > 1  # concurrent requests shared rounds
    held = held_state(tiny_server.grpc_url)
    assert held == {"waiting": 0, "rows": 0, "batches": 0}  # nothing left after the load run
    files = write_report(pts, tmp_path / "load", {"held_after_run": held})
    assert all(f.stat().st_size > 0 for f in files)
    assert json.loads(files[0].read_text())["held_after_run"] == held
    assert json.loads(files[0].read_text())["points"][3]["concurrency"] == 2
    cmd = perf_analyzer_inputs(PROMPTS[:2], "dflow", 8, tmp_path / "pa.json")
    assert "--streaming" in cmd and json.loads((tmp_path / "pa.json").read_text())["data"][0]["text_input"] == [PROMPTS[0]]
