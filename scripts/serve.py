"""Start the real Triton server (from the nvidia-pytriton wheel) on loopback with triton_repo/.

    python scripts/serve.py [--model-repository triton_repo] [--http-port 8000] [--grpc-port 8001]

Stays in the foreground until SIGTERM/SIGINT, which stop it within seconds at any moment (while
models load too): running requests are cancelled at their next round, tritonserver exits, and
whatever is left of its process group is killed; its shared-memory files are removed. The signal
handler only sets a flag; the main thread does the stopping. On a host with an NVIDIA Triton
image, run `tritonserver` with the flags the README gives ("Serving safety").
"""

import argparse
import os
import signal
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dflow_trt.errors import UserError  # noqa: E402
from dflow_trt.serving.server import DEFAULT_REPOSITORY, start_server  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY))
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--log", default=None, help="server log file (default: this terminal)")
    ap.add_argument("--ready-timeout", type=float, default=900, help="seconds the models may take to load")
    a = ap.parse_args(argv)
    stop = threading.Event()

    def on_signal(signum, frame):  # only a flag: stopping waits for processes, which a handler must not
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)  # before the server starts: a signal during start-up counts
    signal.signal(signal.SIGINT, on_signal)
    try:
        server = start_server(a.model_repository, a.http_port, a.grpc_port, a.metrics_port, log_path=a.log, wait=False)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    code = 0
    try:
        if server.wait_ready(a.ready_timeout, should_stop=stop.is_set):
            print(f"ready: HTTP {server.http_url}  gRPC {server.grpc_url}  (Ctrl-C stops)", file=sys.stderr, flush=True)
        while not stop.is_set() and server.proc.poll() is None:
            stop.wait(0.5)
        if not stop.is_set():
            print(f"error: tritonserver exited on its own with code {server.proc.returncode}; see "
                  f"{a.log or 'its output above'}", file=sys.stderr)
            code = 1
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    finally:
        print("stopping: cancelling running requests", file=sys.stderr, flush=True)
        server.stop()
    print("stopped" + (" (tritonserver had to be killed)" if server.killed else ""), file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
