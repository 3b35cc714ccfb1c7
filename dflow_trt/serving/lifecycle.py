"""What the server's processes share about starting and stopping, without Triton.

`start_server` (server.py) runs `tritonserver` in its own process group, with these variables in
its environment (the Python-backend stubs inherit them):

- `DFLOW_TRT_STOP_FILE`: a path that appears when the server is asked to stop; the decoding
  models check it at every round boundary and cancel their running requests, so Triton's
  shutdown does not wait for them.
- `DFLOW_TRT_SESSION_KEY`: a secret the `dflow_bls` model sends with every `target` session call;
  the `target` model refuses session calls without it (clients may still call it statelessly).

`DFLOW_TRT_ADMIN_KEY` (read by `start_server` only) is the value of the header that opens the
restricted APIs. Both keys are fresh random secrets unless these variables set them.

Stopping escalates: stop file + SIGTERM to tritonserver, then SIGTERM and SIGKILL to whatever is
left of its process group (the stubs), then the shared-memory files named with the server's
prefix are removed.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

STOP_FILE_ENV = "DFLOW_TRT_STOP_FILE"
SESSION_KEY_ENV = "DFLOW_TRT_SESSION_KEY"
ADMIN_KEY_ENV = "DFLOW_TRT_ADMIN_KEY"
SHM_DIR = Path("/dev/shm")


def stopping() -> bool:
    """True once the server that runs this process was asked to stop."""
    path = os.environ.get(STOP_FILE_ENV)
    return bool(path) and os.path.exists(path)


def session_key() -> str | None:
    return os.environ.get(SESSION_KEY_ENV) or None


def group_pids(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(d.name))
    return pids


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while group_pids(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def end_group(pgid: int, term_s: float = 2.0) -> None:
    """SIGTERM what is left of the group, then SIGKILL it; return once it is gone."""
    if not group_pids(pgid):
        return
    signal_group(pgid, signal.SIGTERM)
    if not wait_group_gone(pgid, term_s):
        signal_group(pgid, signal.SIGKILL)
        wait_group_gone(pgid, 10.0)


def remove_shm(prefix: str) -> list[str]:
    """Remove the /dev/shm files whose names start with `prefix` (the server's own regions)."""
    removed = []
    if not prefix:
        return removed
    for p in SHM_DIR.glob(f"{prefix}*"):
        try:
            p.unlink()
            removed.append(p.name)
        except FileNotFoundError:
            pass
    return removed
