"""Who did not arrive at a collective that failed: where every rank last was, and the error that
names the ranks. It owns ``CollectiveError``; the board in the process group's store where each rank
leaves its last position (``Board``: written by one background thread, read with a bound after a
failure) and, at interpreter exit, its exit record (``_Exit``); ``collective_failure`` (is an
exception the collective machinery failing, not a usage error) and ``explain_failure`` (the message:
this rank, the collective and where, the ranks behind, exited or gone, what to do). ``DataParallel``
(dp.py) calls it: it makes one board per engine, reports to it at each engine call and collective
(``mark``, ``watch``), and turns a failed collective into the error (``DataParallel.explain``). The
design is dp.py's [Note: collective timeouts].
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time

import torch.distributed as dist

# reading the other ranks' reports after a failed collective: never longer
BOARD_READ_TIMEOUT_S = 5.0
# a rank's reports reach the store at most this often (the latest one; a stalled rank's is)
WRITE_INTERVAL_S = 0.05
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Read error",
    "Connection refused",
    "Socket closed",
)


class CollectiveError(RuntimeError):
    """A collective of the engine failed on this rank: a peer did not arrive within
    ``megatrain.collective_timeout`` seconds, or its connection closed (its process died). The
    message names this rank, the collective and where (micro-step, global step, layer), the ranks
    that did not arrive and where they last reported being, and what to do. ``rank``, ``collective``
    and ``missing`` (the ranks that did not arrive, as far as known) say it to code."""

    def __init__(self, message: str, rank: int, collective: str, missing: list[int]) -> None:
        super().__init__(message)
        self.rank, self.collective, self.missing = rank, collective, missing


_PHASES = {  # what a rank's last report means, for the message of the rank that waited for it
    "initialize": "initialize()",
    "forward": "in forward() of micro-step {m}",
    "backward": "in backward() of micro-step {m}",
    "backward_done": "between backward() and step() of micro-step {m}: backward() returned, step() "
    "not called yet",
    "step": "in step() of micro-step {m} (global step {g})",
    "step_done": "after step() (global step {g}): in the script's own code (the next batch?), "
    "forward() not called "
    "yet",
    "gather": "in GatheredParameters (global step {g})",
    "save": "in save_checkpoint() (global step {g})",
    "load": "in load_checkpoint() (global step {g} before it)",
}


def collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is the collective machinery failing (a timeout, a lost peer), not a usage
    error (a shape or dtype the collective refused before sending anything)."""
    text = str(exc)
    return isinstance(exc, getattr(dist, "DistError", ())) or any(
        marker in text for marker in _PEER_GONE + ("Timed out waiting", "gloo/transport", "gloo/")
    )


def explain_failure(
    par, exc: BaseException, collective: str, waited: float, reports: dict | None
) -> CollectiveError:
    """The error for ``exc`` in ``collective`` on ``par``, the ``DataParallel`` whose collective
    failed (its rank, world, timeout, backend and position), from ``reports``, every rank's board
    entry with this rank's own current one (None: the board could not be read): who did not
    arrive, where they are, what to do."""
    text = str(exc)
    gone = any(marker in text for marker in _PEER_GONE)
    timed_out = not gone and (
        "Timed out" in text
        or "timed out" in text
        or "Timeout" in text
        or waited >= 0.9 * par.timeout_s
    )
    me, seq = par.rank, par.position["seq"]
    where = _PHASES.get(par.position["phase"], par.position["phase"]).format(**par.position)
    lines = []
    exits: dict = {}
    if reports is None:
        # two ranks: the other one
        missing, dead = ([1 - me], []) if par.world == 2 else ([], [])
        lines.append(
            "  (the other ranks' reports could not be read: the store's host -- rank 0 under a "
            "plain "
            "launch, the launcher's agent under torchrun -- may be gone)"
        )
    else:
        exits = {r: e["exit"] for r, e in reports.items() if r != me and "exit" in e}
        dead = [r for r, e in reports.items() if r != me and (r in exits or not _alive(e))]
        # every rank makes the same calls and collectives in the same order
        order = (seq, par.position["c"])
        behind = [
            r
            for r in range(par.world)
            if r != me and (r not in reports or (reports[r]["seq"], reports[r].get("c", 0)) < order)
        ]
        missing = sorted(set(dead) | set(behind))
        # two ranks: the other one (stalled on another thread, say)
        if not missing and par.world == 2:
            missing = [1 - me]
        now = time.time()
        for r in range(par.world):
            e = reports.get(r)
            if e is None:
                lines.append(f"  rank {r}: no report (it never reached this engine's initialize())")
                continue
            if r in exits:
                x = exits[r]
                lines.append(
                    f"  rank {r} (exited; host {e['host']}, pid {e['pid']}): {_exit_text(x)}, "
                    f"{now - x['t']:.1f} s ago; its last engine call: {_last_call(e)}"
                )
                continue
            state = _PHASES.get(e["phase"], e["phase"]).format(**e)
            if e.get("in"):
                state += f"; its last collective entered: {e['in']}"
            tag = (
                "this rank"
                if r == me
                else "its process is gone: killed or crashed, no exit recorded"
                if r in dead
                else "did not arrive"
                if r in missing
                else "arrived"
            )
            lines.append(
                f"  rank {r} ({tag}; host {e['host']}, pid {e['pid']}): {state} "
                f"[report {now - e['t']:.1f} s ago]"
            )
    who = (
        ", ".join(f"rank {r}" for r in missing)
        if missing
        else "no rank is behind by the reports (a rank stalled inside the same call)"
        if reports
        else "unknown"
    )
    ended = [r for r in missing if r in exits and exits[r].get("raised") is None]
    if gone or (missing and all(r in exits for r in missing)):
        fate = (
            "exited"
            if missing and all(r in exits for r in missing)
            else "was killed or crashed (no exit recorded)"
            if missing and all(r in dead and r not in exits for r in missing)
            else "exited or crashed"
        )
        what = (
            f"a peer's connection closed while rank {me} waited in {collective}, {where}: "
            f"{'the process of ' + who if missing else 'a peer process'} {fate}"
        )
        todo = (
            "its own log says why; this run cannot go on without it: restart from the last "
            "checkpoint (every "
            "rank exits)"
        )
        if ended:
            scripts = "its script" if len(ended) == 1 else "their scripts"
            todo = (
                f"{', '.join(f'rank {r}' for r in ended)} ended {scripts} while rank {me} "
                "still made engine "
                "calls: every rank must make the same engine calls in the same order -- "
                "save_checkpoint() "
                "and GatheredParameters on every rank, not only on rank 0 (as with DeepSpeed) "
                "-- and the "
                "same number of steps"
            )
    else:
        what = (
            f"{collective}, {where}, did not complete within megatrain.collective_timeout = "
            f"{par.timeout_s:g} s"
            + (f" (waited {waited:.1f} s)" if not timed_out else "")
            + f"; did not arrive: {who}"
        )
        todo = (
            "every rank must make the same engine calls in the same order (forward, backward, "
            "step, "
            "save_checkpoint, GatheredParameters). Find what the rank that did not arrive is "
            "doing -- e.g. "
            "`py-spy dump --pid <pid>` on its host: a stalled data loader, a debugger, slow "
            "I/O, a branch "
            "only some ranks take -- or, if ranks legitimately drift apart for longer (a slow "
            "checkpoint "
            "write, evaluation on one rank), raise megatrain.collective_timeout"
        )
    cause = text.splitlines()[0][:300] if text else type(exc).__name__
    message = (
        f"[megatrain_ds] rank {me} of {par.world}: {what}.\n"
        + "\n".join(lines)
        + f"\nWhat to do: {todo}.\n({par.backend}: {cause})"
    )
    return CollectiveError(message, me, collective, missing)


def _alive(entry: dict) -> bool:
    """False when the report's process is known to be gone (same host: no such pid, or a zombie its
    launcher has not reaped yet -- torchrun's agent polls its workers); True when it lives or cannot
    be checked from here."""
    if entry.get("host") != socket.gethostname():
        return True
    try:
        pid = int(entry["pid"])
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError, KeyError):
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):  # no /proc (not Linux): the pid exists
        return True


def _exit_text(x: dict) -> str:
    """An exit record, said: how the script ended."""
    if x.get("raised"):
        return f"exited after an uncaught {x['raised']}" + (
            " (exit status 1)" if x.get("status") == 1 else ""
        )
    return "exited: its script ended without an uncaught exception (returned, or called sys.exit)"


def _last_call(e: dict) -> str:
    """A report's engine call, briefly: "step() returned (micro-step 4, global step 2)"."""
    name = e["phase"].removesuffix("_done")
    call = {
        "save": "save_checkpoint()",
        "load": "load_checkpoint()",
        "gather": "GatheredParameters",
        "initialize": "initialize()",
    }.get(name, f"{name}()")
    if name == "initialize":
        return call
    return (
        call
        + (" returned" if e["phase"].endswith("_done") else "")
        + f" (micro-step {e.get('m', 0)}, global step {e.get('g', 0)})"
    )


class _Exit:
    """How this process ends, for its exit records: the uncaught exception ``sys.excepthook`` saw
    (it runs before ``atexit`` handlers), if any. Python gives an ``atexit`` handler no exit status,
    so a script's clean end and its ``sys.exit(n)`` read the same ("without an uncaught
    exception")."""

    raised: str | None = None  # "TypeName: first line of its message"
    # 1 for an uncaught exception (Python's exit status), None when not known
    status: int | None = None
    boards: list = []  # the live boards of this process (one per engine), written at exit
    _hooked = False

    @classmethod
    def watch(cls, board: "Board") -> None:
        cls.boards.append(board)
        if cls._hooked:
            return
        cls._hooked = True
        previous = sys.excepthook

        def hook(kind, value, tb):
            text = str(value).splitlines()[0][:200] if str(value) else ""
            cls.raised = f"{kind.__name__}: {text}" if text else kind.__name__
            cls.status = 1 if not issubclass(kind, KeyboardInterrupt) else None
            previous(kind, value, tb)

        sys.excepthook = hook
        # after comm.destroy_at_exit's registration: runs before the groups go
        atexit.register(cls.write)

    @classmethod
    def write(cls) -> None:
        for board in cls.boards:
            board.exited({"raised": cls.raised, "status": cls.status, "t": time.time()})


class Board:
    """Every rank's last reported position, in the process group's store
    (``megatrain_ds/dp<k>/<rank>``). Written by one background thread per process (the latest report
    only; the caller never waits on the store), read after a failed collective in a thread joined
    with a bound (an unreachable store cannot hang the error)."""

    _lock = threading.Condition()
    _pending: dict = {}  # board -> its latest entry not written yet
    _thread = None

    def __init__(self, rank: int, world: int, instance: int) -> None:
        self.rank, self.world = rank, world
        self.host, self.pid = socket.gethostname(), os.getpid()
        try:
            self.store = dist.PrefixStore(
                f"megatrain_ds/dp{instance}/", dist.distributed_c10d._get_default_store()
            )
        # no store (a group made some other way): the message says "unknown"
        except Exception:  # noqa: BLE001
            self.store = None
        self.latest: dict | None = None  # the last report (its exit record repeats it)
        if self.store is not None:
            _Exit.watch(self)

    def report(self, entry: dict) -> None:
        if self.store is None:
            return
        self.latest = entry
        with Board._lock:
            Board._pending[self] = entry
            if Board._thread is None:
                Board._thread = threading.Thread(
                    target=Board._write_loop, name="megatrain-dp-board", daemon=True
                )
                Board._thread.start()
            Board._lock.notify()

    @staticmethod
    def _write_loop() -> None:
        while True:
            with Board._lock:
                while not Board._pending:
                    Board._lock.wait()
                board, entry = Board._pending.popitem()
            try:
                if board.store is not None:
                    board.store.set(str(board.rank), json.dumps(entry))
            # the store's host is gone: stop reporting (collectives will say so)
            except Exception:  # noqa: BLE001
                board.store = None
            # at most this often: the reports of a burst of collectives coalesce
            time.sleep(WRITE_INTERVAL_S)

    def exited(self, how: dict) -> None:
        """At exit: this rank's exit record (``exit/<rank>``: ``how`` and its last report), written
        now, bounded (a store whose host is gone cannot hold the exit up). Its own key: the writer
        thread may still be writing an older report to ``<rank>``."""
        store, latest = self.store, self.latest
        if store is None or latest is None:
            return
        record = json.dumps({**latest, "exit": how})
        _bounded(lambda: store.set(f"exit/{self.rank}", record), "megatrain-dp-board-exit")

    def read(self) -> dict[int, dict] | None:
        """rank -> its last report (ranks that never reported are absent), with ``"exit"`` where the
        rank exited (its exit record, which holds its last report); None when the store cannot be
        read."""
        store = self.store
        if store is None:
            return None

        def read_all():
            out = {}
            for r in range(self.world):
                if store.check([f"exit/{r}"]):
                    out[r] = json.loads(store.get(f"exit/{r}"))
                elif store.check([str(r)]):
                    out[r] = json.loads(store.get(str(r)))
            return out

        return _bounded(read_all, "megatrain-dp-board-read")


def _bounded(work, name: str):
    """``work()`` on a thread joined for at most ``BOARD_READ_TIMEOUT_S``: its result, or None if it
    raised (the store's host is gone) or is still waiting."""
    result = {}

    def run():
        try:
            result["value"] = work()
        except Exception:  # noqa: BLE001 - the store's host is gone: "could not be read"
            pass

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(BOARD_READ_TIMEOUT_S)
    return result.get("value")
