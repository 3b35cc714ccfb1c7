"""Start the real Triton server (from the nvidia-pytriton wheel) on loopback with triton_repo/.

    python scripts/serve.py [--model-repository triton_repo] [--http-port 8000] [--grpc-port 8001]

Stays in the foreground until SIGTERM/SIGINT, which stop the server cleanly. On a host with an
NVIDIA Triton image run `tritonserver --model-repository triton_repo` instead.
"""

import argparse
import os
import signal
import sys

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
    a = ap.parse_args(argv)
    try:
        server = start_server(a.model_repository, a.http_port, a.grpc_port, a.metrics_port, log_path=a.log)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"ready: HTTP {server.http_url}  gRPC {server.grpc_url}  (Ctrl-C stops)", file=sys.stderr, flush=True)
    stop = lambda *_: server.stop()  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.proc.wait()
    return 0 if server.proc.returncode in (0, -signal.SIGTERM) else server.proc.returncode


if __name__ == "__main__":
    sys.exit(main())
