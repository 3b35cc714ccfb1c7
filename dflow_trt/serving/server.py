"""Start a real `tritonserver` (2.51, from the nvidia-pytriton wheel) on loopback, and stop it.

The wheel ships the server binary, the Python backend and per-Python stubs; the backend folder
it expects is assembled from symlinks (copying the stub breaks its libcudart lookup). On hosts
with an NVIDIA Triton image, run `tritonserver` with the flags `safety_args` gives (README,
"Serving safety").

Safety (README, "Serving safety"): every interface binds 127.0.0.1; the shared-memory, model
config/repository, trace and logging APIs need a secret header (`--http-restricted-api`,
`--grpc-restricted-protocol`); the server runs in its own process group with its own
shared-memory prefix, so `stop()` can end every process it started and remove every file it made.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from .lifecycle import ADMIN_KEY_ENV, SESSION_KEY_ENV, STOP_FILE_ENV, end_group, remove_shm, signal_group

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_REPOSITORY = REPO_ROOT / "triton_repo"
# APIs no inference client needs: registering shared memory (a client could map the Python
# backend's own regions), model control, configs (they hold server paths), trace and log settings
RESTRICTED_APIS = "shared-memory,model-config,model-repository,trace,logging"
ADMIN_HEADER = "dflow-admin-key"
# tritonserver's own wait when it stops, spent first on open HTTP connections (an idle keep-alive
# client holds it the whole time), then on in-flight requests and model unloads (~5 s here)
EXIT_TIMEOUT_S = 5


def _pytriton_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise UserError("nvidia-pytriton is not installed (it carries tritonserver); run ./scripts/setup.sh")
    return Path(spec.origin).parent


def prepare_backends(dest: Path) -> Path:
    """`dest/python/` with the Python backend and this interpreter's stub, as symlinks."""
    tri = _pytriton_dir() / "tritonserver"
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = tri / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.is_file():
        raise UserError(f"nvidia-pytriton has no Python backend stub for Python {ver}")
    py = dest / "python"
    py.mkdir(parents=True, exist_ok=True)
    for src in (tri / "backends" / "python" / "libtriton_python.so",
                tri / "backends" / "python" / "triton_python_backend_utils.py", stub):
        link = py / src.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(src)
    return dest


def safety_args(admin_key: str, address: str = "127.0.0.1") -> list[str]:
    """The flags every documented command line carries: loopback, restricted APIs, exit timeout."""
    restricted = f"{RESTRICTED_APIS}:{ADMIN_HEADER}={admin_key}"  # <apis>:<header>=<value>
    return [f"--http-address={address}", f"--grpc-address={address}", f"--metrics-address={address}",
            f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}",
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}"]


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    libs = [sysconfig.get_config_var("LIBDIR") or "", str(_pytriton_dir().parent / "nvidia_pytriton.libs")]
    env["LD_LIBRARY_PATH"] = ":".join([p for p in libs if p] + [env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")  # the stub's python
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


@dataclass
class TritonServer:
    """A running server; use as a context manager or call stop()."""

    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    log_path: Path | None
    shm_prefix: str = ""  # the Python backend's shared-memory files: /dev/shm/<shm_prefix>*
    stop_file: Path | None = None  # appears at stop(): the models cancel their running requests
    admin_key: str = ""  # header `dflow-admin-key` for the restricted APIs
    session_key: str = ""  # what the `target` model wants with a session call
    killed: bool = False  # stop() had to kill a process

    @property
    def pgid(self) -> int:
        return self.proc.pid  # started with start_new_session: the server leads its own group

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout_s: float = 600, should_stop=lambda: False) -> bool:
        """True once ready; False as soon as should_stop() says so (e.g. a signal during start-up)."""
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if should_stop():
                return False
            if self.proc.poll() is not None:
                raise UserError(f"tritonserver exited with code {self.proc.returncode} while loading; "
                                f"see {self.log_path or 'its output'}")
            if self.ready():
                return True
            time.sleep(0.5)
        raise UserError(f"tritonserver not ready after {timeout_s:.0f} s; see {self.log_path or 'its output'}")

    def stop(self, timeout_s: float = 10) -> int:
        """Stop within about timeout_s + 2 s, at any moment (start-up included), leaving nothing.

        The stop file makes the decoding models cancel their running requests at the next round
        (the client gets "the server is shutting down"); tritonserver stops taking requests, unloads
        its models and exits on SIGTERM. Whatever is left after timeout_s (a model still loading,
        a stuck stub, tritonserver hanging after its own exit timeout) is killed with its process
        group, and its shared-memory files are removed. Never call this from a signal handler: it
        waits for processes (serve.py sets a flag instead).
        """
        if self.stop_file is not None:
            self.stop_file.touch()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.proc.poll() is None:
                self.killed = True
                signal_group(self.pgid, signal.SIGKILL)
        self.proc.wait()
        end_group(self.pgid)  # stubs that outlived tritonserver
        remove_shm(self.shm_prefix)
        if self.stop_file is not None:
            self.stop_file.unlink(missing_ok=True)
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_server(model_repository: str | Path = DEFAULT_REPOSITORY, http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, work_dir: str | Path | None = None, log_path: str | Path | None = None,
                 wait: bool = True, timeout_s: float = 600, extra_args: tuple[str, ...] = (),
                 admin_key: str | None = None, session_key: str | None = None) -> TritonServer:
    """Start tritonserver on loopback with the safety flags; the keys default to $DFLOW_TRT_ADMIN_KEY /
    $DFLOW_TRT_SESSION_KEY, else to fresh secrets."""
    repo = Path(model_repository).resolve()
    if not repo.is_dir():
        raise UserError(f"no model repository at {repo}; pass --model-repository")
    work = Path(work_dir) if work_dir else repo.parent / "build" / "triton"
    backends = prepare_backends(work / "backends")
    tag = secrets.token_hex(6)
    shm_prefix, stop_file = f"dflow_trt_{tag}_", work / f"stop-{tag}"
    admin_key = admin_key or os.environ.get(ADMIN_KEY_ENV) or secrets.token_urlsafe(24)
    session_key = session_key or os.environ.get(SESSION_KEY_ENV) or secrets.token_urlsafe(24)
    cmd = [str(_pytriton_dir() / "tritonserver" / "bin" / "tritonserver"), f"--model-repository={repo}",
           f"--backend-directory={backends}", *safety_args(admin_key), f"--http-port={http_port}",
           f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}", "--log-info=true",
           f"--backend-config=python,shm-region-prefix-name={shm_prefix}", *extra_args]
    env = {**server_env(), STOP_FILE_ENV: str(stop_file), SESSION_KEY_ENV: session_key}
    out = open(log_path, "ab") if log_path else None
    proc = subprocess.Popen(cmd, env=env, stdout=out or None, stderr=subprocess.STDOUT if out else None,
                            cwd=str(repo.parent), start_new_session=True)
    if out:
        out.close()  # the child holds its own descriptor
    server = TritonServer(proc, http_port, grpc_port, Path(log_path) if log_path else None, shm_prefix=shm_prefix,
                          stop_file=stop_file, admin_key=admin_key, session_key=session_key)
    if wait:
        try:
            server.wait_ready(timeout_s)
        except BaseException:
            server.stop()
            raise
    return server
