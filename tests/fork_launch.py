"""Run a script as N ranks of one node, forked from one process that imported the heavy libraries
once.

    python -m tests.fork_launch NPROC SCRIPT [ARGS...]

Why: on the 2-core CI machine a Python process that imports torch, a transformers model class and
megatrain_ds spends 8-10 CPU-seconds on imports alone, and the suite's multi-rank numerics tests
(tests/integration/test_dp.py and the files that use its ``run``) launched about twenty 2-rank runs
through torchrun: an agent process plus two ranks each importing everything. Here the imports happen
once and each rank is a ``fork`` of that process (as a DataLoader worker is), with the environment
torchrun gives a rank on one node (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT). The script then runs as ``__main__`` and the rank exits as a process does
(atexit handlers, interpreter finalization). The real launchers themselves (torchrun, the deepspeed
launcher, accelerate launch) are still tested as users run them:
tests/integration/test_dp_launchers.py.

As torchrun does, the first rank to fail stops the others (SIGTERM), and the exit status is the
first failure's (a rank killed by a signal: 128 + its number).

``warm_run`` goes one step further for the CPU runs of one pytest worker: a server process
(``--serve``) imports the libraries once per worker, and each launch is forked from it (its ranks
forked again as above), with the launch's own environment, working folder and log files; the launch
then exits as a process does. A launch whose environment differs from the server's in what the
imports read (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS, PYTHONPATH, DS_ACCELERATOR) runs as a fresh
``python -m tests.fork_launch`` instead. A launch that may use CUDA (``sees_gpu``) is never forked:
``python -m tests.fork_launch --spawn NPROC SCRIPT`` starts its ranks as fresh processes.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

SPAWN = "--spawn"  # the ranks as fresh processes (a launch that may use CUDA: sees_gpu)
PRELOAD = (
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
    "deepspeed",
    "megatrain_ds",
    "peft",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, nproc: int, port: int) -> dict:
    """The variables torchrun gives a rank of one node."""
    return dict(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _rank(rank: int, nproc: int, port: int, script: str, args: list[str]) -> int:
    os.environ.update(_rank_env(rank, nproc, port))
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


def _preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def main(argv: list[str]) -> int:
    if argv == ["--serve"]:
        return _serve()
    if argv[:1] == [SPAWN]:
        return _spawned_ranks(int(argv[1]), argv[2], argv[3:])
    _preload()
    return _ranks(int(argv[0]), argv[1], argv[2:])


def sees_gpu(env: dict) -> bool:
    """Whether a launch with ``env`` may use CUDA: its ranks are then started as fresh processes,
    as torchrun starts them, and never forked. A process that has initialized CUDA (an import of
    the preload may) cannot hand it to a forked child: torch raises "Cannot re-initialize CUDA in
    forked subprocess". Asked in the client (pytest's process), which never forks."""
    import torch

    return env.get("CUDA_VISIBLE_DEVICES") != "" and torch.cuda.is_available()


def _spawned_ranks(nproc: int, script: str, args: list[str]) -> int:
    """The script as ``nproc`` fresh processes of one node with torchrun's environment; as in
    ``_ranks``, the first rank to fail stops the others and its status is the launch's (one: a
    plain process, as ``_ranks`` runs it)."""
    if nproc == 1:
        code = subprocess.call([sys.executable, script, *args])
        return 128 - code if code < 0 else code
    port = int(os.environ.get("MASTER_PORT") or _free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, script, *args], env={**os.environ, **_rank_env(rank, nproc, port)}
        )
        for rank in range(nproc)
    ]
    status = 0
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed and status == 0:
            status = failed[0]
            for p in procs:  # as torchrun: one rank failed, the run is over
                if p.poll() is None:
                    p.terminate()
        time.sleep(0.2)
    codes = [p.returncode for p in procs]
    status = status or next((c for c in codes if c != 0), 0)
    return 128 - status if status < 0 else status


def _ranks(nproc: int, script: str, args: list[str]) -> int:
    """The script as ``nproc`` forked ranks of one node (one: run here, as a plain process
    would)."""
    if nproc == 1:
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")
        return 0
    port = int(os.environ.get("MASTER_PORT") or _free_port())
    sys.stdout.flush()
    sys.stderr.flush()
    children = []
    for rank in range(nproc):
        pid = os.fork()
        # the rank: leaves through SystemExit, so the interpreter exits as a process's does
        if pid == 0:
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


# ---------------------------------------------------------------------------------- the warm server
IMPORT_ENV = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "PYTHONPATH", "DS_ACCELERATOR")


def _serve() -> int:
    """One JSON request per stdin line: {nproc, script, args, env, cwd, stdout, stderr}. Each launch
    is forked (its own session, so the client can stop it whole), told {"pid"}, then waited for:
    {"rc"}. EOF ends the server. The replies go to the pipe that was stdout; stdout itself goes to
    stderr (the imports print: DeepSpeed's logs)."""
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    _preload()
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        # the launch: leaves through SystemExit, so the interpreter exits as a process's does
        if pid == 0:
            reply.close()
            os.setsid()
            os.environ.clear()
            os.environ.update(req["env"])
            os.chdir(req["cwd"])
            for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
                target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(target, fd)
                os.close(target)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.close(devnull)
            code = 0
            try:
                code = _ranks(req["nproc"], req["script"], req["args"])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
            sys.exit(code)
        print(json.dumps({"pid": pid}), file=reply, flush=True)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        print(json.dumps({"rc": 128 - code if code < 0 else code}), file=reply, flush=True)
    return 0


_SERVER: dict = {}


def _server(env: dict) -> subprocess.Popen | None:
    """This process's warm server for ``env`` (started on first use), or None where ``env`` needs a
    fresh one."""
    key = tuple(env.get(k) for k in IMPORT_ENV)
    if _SERVER and _SERVER["key"] != key:
        return None
    proc = _SERVER.get("proc")
    if proc is None or proc.poll() is not None:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fork_launch", "--serve"],
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        _SERVER.update(key=key, proc=proc, buf=b"")
        atexit.register(proc.stdin.close)
    return proc


def _reply(proc: subprocess.Popen, timeout: float) -> dict:
    """The server's next line, read from its pipe's descriptor (not the buffered file: two lines can
    arrive in one read), within ``timeout`` seconds."""
    fd = proc.stdout.fileno()
    while b"\n" not in _SERVER["buf"]:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            raise subprocess.TimeoutExpired("tests.fork_launch --serve", timeout)
        chunk = os.read(fd, 65536)
        if not chunk:
            raise RuntimeError(
                f"the warm launch server exited (status {proc.wait()}); its stderr is the test's"
            )
        _SERVER["buf"] += chunk
    line, _, _SERVER["buf"] = _SERVER["buf"].partition(b"\n")
    return json.loads(line)


def warm_run(
    nproc: int,
    script: str,
    args: list[str],
    env: dict,
    timeout: float = 900,
    cwd: str | None = None,
) -> subprocess.CompletedProcess:
    """``python -m tests.fork_launch NPROC SCRIPT ARGS`` (or ``python SCRIPT ARGS`` for one rank)
    with ``env``, as ``subprocess.run(..., capture_output=True, text=True)`` returns it, forked from
    this process's warm server."""
    cmd = [sys.executable, "-m", "tests.fork_launch", str(nproc), script, *args]
    cwd = cwd or os.getcwd()
    if sees_gpu(env):
        cmd.insert(3, SPAWN)
    server = None if sees_gpu(env) else _server(env)
    if server is None:
        return subprocess.run(
            cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
        )
    with tempfile.TemporaryDirectory() as logs:
        out, err = os.path.join(logs, "stdout"), os.path.join(logs, "stderr")
        server.stdin.write(
            json.dumps(
                {
                    "nproc": nproc,
                    "script": script,
                    "args": list(args),
                    "env": env,
                    "cwd": cwd,
                    "stdout": out,
                    "stderr": err,
                }
            )
            + "\n"
        )
        server.stdin.flush()
        pid = _reply(server, 60)["pid"]
        try:
            rc = _reply(server, timeout)["rc"]
        except BaseException:
            # the time is up, or the test was stopped (Ctrl-C): the launch goes with it (its own
            # session got no SIGINT), and its {"rc"} is read so the next request gets its own
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _reply(server, 60)
            raise
        with open(out) as o, open(err) as e:
            return subprocess.CompletedProcess(cmd, rc, o.read(), e.read())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
