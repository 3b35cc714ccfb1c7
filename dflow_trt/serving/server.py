"""Start a real `tritonserver` (2.51, from the nvidia-pytriton wheel) on loopback, and stop it.

The wheel ships the server binary, the Python backend and per-Python stubs; the backend folder
it expects is assembled from symlinks (copying the stub breaks its libcudart lookup). On hosts
with an NVIDIA Triton image, run `tritonserver --model-repository triton_repo` instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_REPOSITORY = REPO_ROOT / "triton_repo"


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

    def wait_ready(self, timeout_s: float = 600) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise UserError(f"tritonserver exited with code {self.proc.returncode} while loading; "
                                f"see {self.log_path or 'its output'}")
            if self.ready():
                return
            time.sleep(1)
        raise UserError(f"tritonserver not ready after {timeout_s:.0f} s; see {self.log_path or 'its output'}")

    def stop(self, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # tritonserver unloads models and exits on SIGTERM
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_server(model_repository: str | Path = DEFAULT_REPOSITORY, http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, work_dir: str | Path | None = None, log_path: str | Path | None = None,
                 wait: bool = True, timeout_s: float = 600, extra_args: tuple[str, ...] = ()) -> TritonServer:
    repo = Path(model_repository).resolve()
    if not repo.is_dir():
        raise UserError(f"no model repository at {repo}; pass --model-repository")
    work = Path(work_dir) if work_dir else repo.parent / "build" / "triton"
    backends = prepare_backends(work / "backends")
    cmd = [str(_pytriton_dir() / "tritonserver" / "bin" / "tritonserver"), f"--model-repository={repo}",
           f"--backend-directory={backends}", "--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
           "--metrics-address=127.0.0.1", f"--http-port={http_port}", f"--grpc-port={grpc_port}",
           f"--metrics-port={metrics_port}", "--log-info=true", *extra_args]
    out = open(log_path, "ab") if log_path else None
    proc = subprocess.Popen(cmd, env=server_env(), stdout=out or None, stderr=subprocess.STDOUT if out else None,
                            cwd=str(repo.parent))
    server = TritonServer(proc, http_port, grpc_port, Path(log_path) if log_path else None)
    if wait:
        try:
            server.wait_ready(timeout_s)
        except BaseException:
            server.stop()
            raise
    return server
