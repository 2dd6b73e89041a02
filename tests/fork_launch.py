"""Run a script as N ranks of one node, forked from one process that imported the heavy libraries once.

    python -m tests.fork_launch NPROC SCRIPT [ARGS...]

Why: on the 2-core CI machine a Python process that imports torch, a transformers model class and megatrain_ds
spends 8-10 CPU-seconds on imports alone, and the suite's multi-rank numerics tests (tests/integration/test_dp.py
and the files that use its ``run``) launched about twenty 2-rank runs through torchrun: an agent process plus two
ranks each importing everything. Here the imports happen once and each rank is a ``fork`` of that process (as a
DataLoader worker is), with the environment torchrun gives a rank on one node (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT). The script then runs as ``__main__`` and the rank exits as
a process does (atexit handlers, interpreter finalization). The real launchers themselves (torchrun, the deepspeed
launcher, accelerate launch) are still tested as users run them: tests/integration/test_dp_launchers.py.

As torchrun does, the first rank to fail stops the others (SIGTERM), and the exit status is the first failure's
(a rank killed by a signal: 128 + its number).
"""
from __future__ import annotations

import importlib
import os
import runpy
import signal
import socket
import sys
import traceback

PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.llama.modeling_llama", "deepspeed", "megatrain_ds", "peft")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, nproc: int, port: int, script: str, args: list[str]) -> int:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      GROUP_RANK="0", ROLE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 (a rank's failure is printed and is its exit status)
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main(argv: list[str]) -> int:
    nproc, script, args = int(argv[0]), argv[1], argv[2:]
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    port = int(os.environ.get("MASTER_PORT") or _free_port())
    sys.stdout.flush()
    sys.stderr.flush()
    children = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:  # the rank: leaves through SystemExit, so the interpreter exits as a process's does
            sys.exit(_rank(rank, nproc, port, script, args))
        children.append(pid)
    status, alive = 0, set(children)
    while alive:
        pid, wait_status = os.wait()
        alive.discard(pid)
        code = os.waitstatus_to_exitcode(wait_status)
        code = 128 - code if code < 0 else code
        if code != 0 and status == 0:
            status = code
            for other in alive:  # as torchrun: one rank failed, the run is over
                try:
                    os.kill(other, signal.SIGTERM)
                except ProcessLookupError:
                    pass
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
