"""Safe to serve and safe to stop (issue 30), through `scripts/serve.py` and a real tritonserver.

One server (all four models, tiny-qwen3) answers the request tests, then is stopped with SIGTERM
while it streams; two short-lived servers (the `dflow` model only) are stopped idle and while
their models load. "Nothing left" is checked by process group and by the server's /dev/shm files.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from dflow_trt.errors import UserError
from dflow_trt.serving.client import _inputs, generate_grpc, generate_http, request_arrays
from dflow_trt.serving.lifecycle import group_pids, remove_shm
from dflow_trt.serving.repository import MODELS, write_repository
from dflow_trt.serving.server import ADMIN_HEADER
from test_serving import _ports

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

SERVE = Path(__file__).resolve().parents[1] / "scripts" / "serve.py"
SESSION_KEY, ADMIN_KEY = "test-session-key", "test-admin-key"
STOP_S = 15  # a stop must take less (serve.py waits 10 s for tritonserver's own exit, then kills the group)


class Served:
    """`scripts/serve.py` in a subprocess, with what a test needs to check that it left nothing."""

    def __init__(self, repo: Path, tmp: Path, wait: bool = True):
        self.http, self.grpc, self.metrics = _ports()
        tmp.mkdir(parents=True, exist_ok=True)
        self.log = tmp / "server.log"
        env = {**os.environ, "DFLOW_TRT_SESSION_KEY": SESSION_KEY, "DFLOW_TRT_ADMIN_KEY": ADMIN_KEY}
        self.proc = subprocess.Popen([sys.executable, str(SERVE), "--model-repository", str(repo), "--http-port",
                                      str(self.http), "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics),
                                      "--log", str(self.log)], env=env, stderr=subprocess.PIPE, text=True)
        self.http_url, self.grpc_url = f"127.0.0.1:{self.http}", f"127.0.0.1:{self.grpc}"
        self.pgid = self._server_pid()
        self.shm: set[str] = set()  # the regions its stubs were given (their 2nd argument)
        if wait:
            lines = []
            while not lines or not (lines[-1].startswith("ready:") or lines[-1] == ""):
                lines.append(self.proc.stderr.readline())
            assert lines[-1].startswith("ready:"), "".join(lines) + self.proc.stderr.read()
            self.note_shm()

    def _server_pid(self, timeout_s=30) -> int:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            kids = [p for p in _children(self.proc.pid) if "tritonserver" in _cmdline(p)]
            if kids:
                return kids[0]
            time.sleep(0.1)
        raise AssertionError("serve.py started no tritonserver")

    def stubs(self) -> list[int]:
        return [p for p in group_pids(self.pgid) if "triton_python_backend_stub" in _cmdline(p)]

    def note_shm(self) -> None:
        for p in self.stubs():
            args = _cmdline(p).split("\0")
            # the stub's command line names its shared-memory region third; a stub caught before its
            # exec shows its launcher's arguments there instead (a path: no region name has a slash)
            if len(args) > 2 and "/" not in args[2]:
                self.shm.add(args[2])

    def stop(self, sig=signal.SIGTERM) -> tuple[float, int, str]:
        t0 = time.time()
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(STOP_S + 30)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        took = time.time() - t0
        print(f"\nserve.py stopped in {took:.1f} s")  # shown with pytest -s
        return took, rc, self.proc.stderr.read()

    def kill(self) -> None:  # teardown after a failure: never leave a server behind
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for p in group_pids(self.pgid):
            os.kill(p, signal.SIGKILL)
        for q in {n.rsplit("_", 1)[0] for n in self.shm}:
            remove_shm(q + "_")

    def assert_nothing_left(self) -> None:
        assert group_pids(self.pgid) == [], "processes of the server's group are left"
        left = [n for n in self.shm if (Path("/dev/shm") / n).exists()]
        prefix = {n.rsplit("_", 1)[0] for n in self.shm}
        left += [p.name for q in prefix for p in Path("/dev/shm").glob(f"{q}_*")]
        assert left == [], f"shared memory left in /dev/shm: {left}"


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("triton_safety")
    over = {m: {"target": "tiny-qwen3"} for m in MODELS}
    over["target"].update(max_sessions="2", session_idle_s="6", max_response_mb="1")
    s = Served(write_repository(tmp / "repo", over), tmp)
    yield s
    s.kill()


def _stream_error(url, model, arrays):
    """The message of the first error response (a stream's errors carry no status code; HTTP
    shows it, see `_post`), or None after a final response."""
    c = grpcclient.InferenceServerClient(url)
    q = queue.Queue()
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        c.async_stream_infer(model, _inputs(grpcclient, arrays))
        while True:
            r, e = q.get(timeout=120)
            if e is not None:
                return e.message()
            if r.as_numpy("stats") is not None and r.as_numpy("stats").reshape(-1)[0]:
                return None
    finally:
        c.stop_stream(cancel_requests=True)
        c.close()


def _one_line(msg: str) -> None:
    assert "\n" not in msg and "Traceback" not in msg and ".py" not in msg and "/work" not in msg, msg


def _good(url, model="dflow"):
    assert len(generate_grpc(url, model, prompt="hi", mode="dflow", max_tokens=3, block_size=2).token_ids) == 3


BAD = [  # (request changes, raw input changes, the error's exact text)
    ({"temperature": float("nan")}, {}, "temperature must be 0 (greedy) or between 0.001 and 100.0, got nan"),
    ({"temperature": 1e-45}, {}, "temperature must be 0 (greedy) or between 0.001 and 100.0, got 1.401298464324817e-45"),
    ({"temperature": float("inf")}, {}, "temperature must be 0 (greedy) or between 0.001 and 100.0, got inf"),
    ({"top_p": float("nan")}, {}, "top-p must be in (0, 1], got nan"),
    ({"top_k": -1}, {}, "top-k must be an integer >= 0 (0: no cut), got -1"),
    ({"seed": -5}, {}, "seed must be an integer in [0, 2**63 - 1], got -5"),
    ({"verify_threshold": float("nan")}, {}, "verify_threshold must be in [0, 1), got nan"),
    ({"hint_trust": float("inf")}, {}, "hint_trust must be in [0, 1], got inf"),
    ({"max_tokens": 0}, {}, "max_tokens must be in 1..1024, got 0"),
    ({"block_size": 10**6}, {}, "block_size must be in 2..64 (anchor + drafts), or 0 for the drafter's own; got 1000000"),
    ({"prompt": ""}, {}, "empty prompt: send a non-empty `text_input` or `input_ids`"),
    ({"prompt": "x" * 70000}, {}, "text_input is 70000 bytes, more than the limit 65536; send a shorter prompt"),
    ({"stop_words": ["a"] * 17}, {}, "17 stop_words, more than the limit 16"),
    ({"stop_words": ["x" * 300]}, {}, "a stop word is 300 bytes, more than the limit 256"),
    ({"prompt": None, "input_ids": [1] * 5000}, {}, "prompt has 5000 tokens, more than the limit 4096; send a shorter prompt"),
    ({"prompt": None, "input_ids": [1, 999]}, {}, "input_ids [999] are outside the vocabulary 0..259"),
    ({"prompt": None, "input_ids": [1] * 3500, "max_tokens": 1000}, {},
     "prompt (3500 tokens) + max new tokens (1000) exceed the target's context of 4096 tokens; shorten the prompt "
     "or ask for fewer new tokens"),
    ({"prompt": None}, {"input_ids": np.zeros((0,), np.int32)}, "empty prompt: send a non-empty `text_input` or `input_ids`"),
    ({}, {"mode": np.array([b"x" * 300000], dtype=object)},
     "request is 300019 bytes, more than the limit 262144; send a shorter prompt or fewer stop words"),
]


@pytest.mark.parametrize("model", ["dflow", "dflow_bls"])
def test_malformed_requests_get_named_errors_and_the_server_keeps_serving(served, model):
    for change, raw, text in BAD:
        arrays = request_arrays(**{"prompt": "hi", "mode": "dflow", "max_tokens": 4, **change})
        arrays.update(raw)
        msg = _stream_error(served.grpc_url, model, arrays)
        assert msg == f"{model}: {text}", change or list(raw)
        _one_line(msg)
    _good(served.grpc_url, model)


def _post(served, body: bytes, model="dflow"):
    req = urllib.request.Request(f"http://{served.http_url}/v2/models/{model}/generate_stream", data=body)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_http_bad_bodies_get_named_errors(served):
    def post(body):
        return _post(served, body)

    # Triton's own HTTP front end parses the JSON and answers 500 before any model runs (its code)
    assert post(b"not json") == (500, '{"error":"failed to parse the request JSON buffer: Invalid value. at 1"}')
    # what reaches the model is refused with 400 and the model's line
    assert post(json.dumps({"text_input": "hi", "max_tokens": 4, "top_k": -1}).encode()) == (
        400, 'data: {"error":"dflow: top-k must be an integer >= 0 (0: no cut), got -1"}\n\n')
    with pytest.raises(UserError, match=r"^server error: dflow: temperature must be 0 \(greedy\) or between"):
        generate_http(served.http_url, prompt="hi", max_tokens=3, temperature=float("nan"))
    assert len(generate_http(served.http_url, prompt="hi", max_tokens=3).token_ids) == 3


def _target(url, inputs: dict, outputs=("logits",)):
    c = grpcclient.InferenceServerClient(url)
    try:
        r = c.infer("target", _inputs(grpcclient, inputs))
        return None, {n: r.as_numpy(n) for n in outputs}
    except InferenceServerException as e:
        return (str(e.status()), e.message()), None
    finally:
        c.close()


def _op(op, sid="s1", key=SESSION_KEY):
    x = {"op": np.array([op.encode()], dtype=object), "session_id": np.array([sid.encode()], dtype=object)}
    if key:
        x["session_key"] = np.array([key.encode()], dtype=object)
    return x


def _ids(n, rows=1):
    return {"input_ids": (np.arange(n, dtype=np.int64) % 250 + 1)[None].repeat(rows, 0),
            "prompt_lens": np.full(rows, n, np.int64), "num_last": np.array([n], np.int32)}


def test_target_model_answers_one_named_line(served):
    """What used to send a traceback with file paths now names the problem on one line."""
    cases = [
        (_ids(3) | {"prompt_lens": np.array([5], np.int64)}, "target: prompt_lens must be in 1..3 (the padded length)"),
        (_ids(3) | {"num_last": np.array([0], np.int32)},
         "target: target inputs: input_ids [B, T], prompt_lens [B], 1 <= num_logits <= num_last <= T; got [1, 3], [1], 0, 0"),
        ({"input_ids": np.array([[1, 2]], np.int64)},
         "target: missing inputs ['prompt_lens', 'num_last'] (a stateless call needs input_ids, prompt_lens, num_last)"),
        (_ids(3, rows=9), "target: input_ids must have 1..8 rows, got 9"),
        (_op("verify") | {"input_ids": np.array([[1, 2]], np.int64)},
         "target: no target session 's1' (never opened, released, or evicted after 6 s idle)"),
        (_op("rewind"), "target: unknown target op 'rewind'; use prefill, verify, commit or release"),
    ]
    for inputs, text in cases:
        err, _ = _target(served.grpc_url, inputs)
        assert err == ("StatusCode.INVALID_ARGUMENT", text)
        _one_line(err[1])
    assert _target(served.grpc_url, _ids(3))[0] is None


def test_bad_commit_leaves_the_session_usable(served):
    ids = [5, 6, 7]
    assert _target(served.grpc_url, _op("prefill", "c") | _ids(3) | {"input_ids": np.array([ids], np.int64)})[0] is None
    assert _target(served.grpc_url, _op("verify", "c") | {"input_ids": np.array([[40, 41, 42]], np.int64)})[0] is None
    for kept, text in (([99], "target: num_kept needs 1 values in 1..3 (the verified block), got [99]"),
                       ([1, 1], "target: num_kept needs 1 values in 1..3 (the verified block), got [1, 1]")):
        err, _ = _target(served.grpc_url, _op("commit", "c") | {"num_kept": np.array(kept, np.int64)}, ("info",))
        assert err == ("StatusCode.INVALID_ARGUMENT", text)
    err, _ = _target(served.grpc_url, _op("verify", "c") | {"input_ids": np.array([[1]], np.int64)})
    assert err == ("StatusCode.INVALID_ARGUMENT", "target: this session has a verified block awaiting commit; "
                   "commit it before the next verify")
    assert _target(served.grpc_url, _op("commit", "c") | {"num_kept": np.array([2])}, ("info",))[0] is None
    err, got = _target(served.grpc_url, _op("verify", "c") | {"input_ids": np.array([[60, 61]], np.int64)})
    assert err is None
    full = [5, 6, 7, 40, 41, 60, 61]
    _, ref = _target(served.grpc_url, {"input_ids": np.array([full], np.int64), "prompt_lens": np.array([7]),
                                       "num_last": np.array([2], np.int32)})
    np.testing.assert_allclose(got["logits"], ref["logits"], rtol=1e-4, atol=1e-4)
    assert _target(served.grpc_url, _op("release", "c"), ("info",))[0] is None


def test_session_budget_cannot_be_taken_by_clients(served):
    """Without the server's session key a client opens no session; the budget (2 here) is kept
    for keyed callers, a full one answers UNAVAILABLE, and an idle session is evicted (6 s here)."""
    err, _ = _target(served.grpc_url, _op("prefill", "x", key=None) | _ids(2))
    assert err == ("StatusCode.INVALID_ARGUMENT", "target: target sessions are internal to the dflow_bls model "
                   "(missing or wrong session_key); call the target without `op` for stateless outputs")
    err, _ = _target(served.grpc_url, _op("prefill", "x", key="guess") | _ids(2))
    assert err[0] == "StatusCode.INVALID_ARGUMENT"
    _good(served.grpc_url, "dflow_bls")  # nothing was taken
    for sid in ("a", "b"):  # a keyed caller that fills the budget and goes away
        assert _target(served.grpc_url, _op("prefill", sid) | _ids(2))[0] is None
    err, _ = _target(served.grpc_url, _op("prefill", "c") | _ids(2))
    assert err[0] == "StatusCode.UNAVAILABLE", err
    busy = ("dflow_bls: BLS call to 'target' failed: target: all 2 target sessions are busy (one idle for 6 s is "
            "evicted); retry shortly, or raise the target model's max_sessions")
    assert _stream_error(served.grpc_url, "dflow_bls", request_arrays(prompt="hi", max_tokens=3)) == busy
    # (Triton's generate_stream answers 400 for any model error, UNAVAILABLE included)
    assert _post(served, b'{"text_input": "hi", "max_tokens": 3}', "dflow_bls") == (
        400, 'data: {"error":"' + busy + '"}\n\n')
    _good(served.grpc_url, "dflow")  # the in-process model does not use them
    time.sleep(6.5)
    _good(served.grpc_url, "dflow_bls")  # the abandoned sessions were evicted
    info, _ = _target(served.grpc_url, {"info_only": np.array([True])}, ("info",))
    assert info is None


def test_responses_are_bounded(served):
    """1 MiB here (max_response_mb=1): ~1000 positions of logits are refused before any work."""
    err, _ = _target(served.grpc_url, _ids(1100))
    assert err == ("StatusCode.INVALID_ARGUMENT", "target: this prefill would return 1.9 MiB, more than the limit "
                   "of 1 MiB; ask for fewer rows or positions (or raise the model's max_response_mb)")
    err, out = _target(served.grpc_url, _ids(1100) | {"num_logits": np.array([1], np.int32)})
    assert err is None and out["logits"].shape == (1, 1, 260)
    _good(served.grpc_url, "dflow_bls")  # its prefill asks for the last position's logits only


def test_restricted_apis_need_the_admin_header(served):
    region = sorted(served.shm)[0]
    h = httpclient.InferenceServerClient(served.http_url)
    with pytest.raises(InferenceServerException, match=f"This API is restricted, expecting header '{ADMIN_HEADER}'"):
        h.register_system_shared_memory("leak", "/" + region, 1024)
    with pytest.raises(InferenceServerException, match="This API is restricted"):
        h.get_model_config("dflow")
    g = grpcclient.InferenceServerClient(served.grpc_url)
    with pytest.raises(InferenceServerException,
                       match=f"This protocol is restricted, expecting header 'triton-grpc-protocol-{ADMIN_HEADER}'"):
        g.register_system_shared_memory("leak", "/" + region, 1024)
    with pytest.raises(InferenceServerException, match="This API is restricted"):
        h.load_model("dflow")
    assert h.get_model_config("dflow", headers={ADMIN_HEADER: ADMIN_KEY})["name"] == "dflow"  # the operator's way
    assert h.get_system_shared_memory_status(headers={ADMIN_HEADER: ADMIN_KEY}) == []
    h.close()
    g.close()


def test_every_interface_listens_on_loopback_only(served):
    ports = {served.http, served.grpc, served.metrics}
    found = {}
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(f).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, port = local.split(":")
            if state == "0A" and int(port, 16) in ports:  # LISTEN
                found[int(port, 16)] = addr
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, as itself or IPv4-mapped (gRPC)
    assert set(found) == ports and set(found.values()) <= loopback, found


def test_client_ctrl_c_cancels_its_request(served):
    # Python leaves SIGINT ignored when it starts with it ignored, as under a shell's background job
    # (`pytest &`): the client then ran to its end and exited 0; Ctrl-C at a terminal is what is tested
    code = ("import signal, sys, time\nfrom dflow_trt.serving.client import generate_grpc\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "try:\n"
            f"    generate_grpc('{served.grpc_url}', prompt='Once upon a time', mode='dflow', max_tokens=1000,"
            " block_size=2, on_tokens=lambda i, t: print('tokens', flush=True))\n"
            "except KeyboardInterrupt:\n    print('interrupted', flush=True)\n    time.sleep(120)\n")
    before = served.log.read_text().count("cancelled after")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "tokens"
        p.send_signal(signal.SIGINT)
        line = p.stdout.readline().strip()
        while line == "tokens":  # rounds that streamed in before the signal was handled
            line = p.stdout.readline().strip()
        if line != "interrupted":  # the client died instead: say how (it failed in two whole runs, 2026-12)
            try:
                rc = p.wait(timeout=5)  # its own exit status (a signal shows as its negative number)
            except subprocess.TimeoutExpired:
                rc = "still running"
            p.kill()
            pytest.fail(f"the client printed {line!r}, not 'interrupted'; exit status {rc}; its stderr: "
                        f"{p.communicate()[1][-3000:]}")
        deadline = time.time() + 30
        while time.time() < deadline and served.log.read_text().count("cancelled after") == before:
            time.sleep(0.2)
        assert served.log.read_text().count("cancelled after") == before + 1
        assert p.poll() is None  # the server cancelled it while the client process lives on
    finally:
        p.kill()
        p.wait()


def test_sigterm_with_a_running_stream_stops_within_seconds(served):
    """Last in this file: it stops the module's server."""
    c = grpcclient.InferenceServerClient(served.grpc_url)
    q = queue.Queue()
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    c.async_stream_infer("dflow_bls", _inputs(grpcclient, request_arrays(prompt="Once upon a time", max_tokens=1000,
                                                                         mode="dflow", block_size=2)))
    assert q.get(timeout=60)[1] is None  # the first round arrived: it is decoding
    took, rc, err = served.stop()
    assert rc == 0 and took < STOP_S, (took, rc, err)
    assert err.endswith("stopped\n") or err.endswith("stopped (tritonserver had to be killed)\n"), err
    served.assert_nothing_left()
    errors = []
    while not q.empty():
        r, e = q.get()
        if e is not None:
            errors.append(e.message())
    # cancelled at its next round ("... after N tokens"), or, when SIGTERM beat the round to the
    # BLS call, answered the same way (tritonserver refuses BLS calls once it is stopping)
    assert errors and errors[0].startswith("dflow_bls: the server is shutting down; the request was cancelled"), errors
    c.stop_stream()


@pytest.fixture(scope="module")
def small_repo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("triton_small")
    return write_repository(tmp / "repo", {"dflow": {"target": "tiny-qwen3"}}, models=("dflow",)), tmp


def test_sigterm_when_idle_stops_within_seconds(small_repo):
    repo, tmp = small_repo
    s = Served(repo, tmp / "idle")
    try:
        assert len(s.stubs()) == 1 and len(s.shm) == 1
        took, rc, err = s.stop()
        assert rc == 0 and took < STOP_S and "stopped" in err, (took, rc, err)
        s.assert_nothing_left()
    finally:
        s.kill()


def test_sigterm_during_start_up_stops_within_seconds(small_repo):
    repo, tmp = small_repo
    s = Served(repo, tmp / "startup", wait=False)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (s.stubs() and s.shm):  # the model is loading in its stub
            s.note_shm()  # a stub just forked may not show its command line yet: look again
            time.sleep(0.05)
        assert s.stubs() and s.shm
        took, rc, err = s.stop()
        assert rc == 0 and took < STOP_S and "ready:" not in err and "stopped" in err, (took, rc, err)
        s.assert_nothing_left()
    finally:
        s.kill()
