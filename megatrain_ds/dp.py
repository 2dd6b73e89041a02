"""Data parallelism over the processes of a run: who owns which layer, and the process groups.

[Note: data parallel] N processes (one per GPU; ``torchrun``, the ``deepspeed`` launcher, ``accelerate launch``)
train one model on N micro-batches at once. Every persistent tensor stays in host memory, once per run:

- **Layer ownership.** Streamed layer i is owned by rank ``i % N``. Only the owner holds layer i's host state
  (fp32 master, Adam moments, gradient, pinned wire copy): host bytes per parameter summed over the ranks are
  those of one process, and each rank's host AdamW steps 1/N of the layers, on its own cores.
- **Weights in.** The owner copies layer i's wire H2D into a slot (or casts its GPU-held master), then the
  slot is broadcast from the owner to every rank (NCCL over NVLink; gloo on CPU). Round-robin ownership means
  consecutive layers come over different PCIe links: the links share the step's H2D bytes, 1/N each.
- **Gradients out.** Layer i's flat gradient is reduced (sum) to its owner, which scales it by 1/N (the mean
  over ranks, as DeepSpeed averages data-parallel gradients) and lands it in host memory (D2H) as one process
  does. Ranks that do not own it move nothing over PCIe.
- **Resident parameters** (embeddings, final norm, head) are replicated: their gradients are all-reduced
  (mean) after the backward, and every rank steps its own copy identically.
- **The global norm** is the sum of each rank's squared norms over the layers it owns (plus the resident
  parameters, counted on rank 0), all-reduced as one scalar by the landing thread over a gloo group of its
  own: clipping is exact and every rank reaches the same skip / clip decision (fp16 overflow included).

Ordering. The collectives of the default group (broadcast, reduce, resident all-reduce) are issued by the main
thread only, in the order the executor loads and evacuates layers, which is the same on every rank as long as
every rank runs the same forwards and backwards (as DeepSpeed ZeRO-3 requires) and agrees on which layers are
kept on the GPU (the auto placement takes the minimum over ranks) and which slots are stale (a rollback
invalidates every layer on every rank). On CUDA a collective issued with ``h2d`` (broadcast) or ``d2h``
(reduce) current runs on NCCL's stream after that stream's queued work, and that stream waits for it: the
three-stream overlap is kept, NCCL's stream being the fourth.
Host-side scalars (the norm, placement budgets) and checkpoint exchange go over gloo groups, so a collective
on one thread never interleaves with another thread's.

[Note: collective timeouts] A rank that does not arrive (a stalled data loader, a debugger, a branch only some ranks
take, a crash) must not leave the others waiting for ever, and the rank that gives up must say who it waited for.
- **Bounded waits.** Every group the engine makes waits at most ``megatrain.collective_timeout`` seconds
  (``CollectiveError``): the gloo groups (norm, host scalars, checkpoints) and, on gloo (CPU), the engine's own group
  for the layer collectives. NCCL's collectives run on the GPU, so the host never waits in one; the engine checks
  arrival over gloo instead, where a rank can stall in the script's own code: a barrier at the top of every
  ``forward()`` and ``backward()`` (one gloo round trip each), while ``step()``'s norm all-reduce is one already.
  The NCCL group itself keeps its own timeout (its watchdog aborts the process: set
  ``init_process_group(timeout=)``, which megatrain_ds sets to ``collective_timeout`` when it creates the group).
- **Who did not arrive.** At each engine call (forward, backward and its return, step and its return,
  save_checkpoint, load_checkpoint, GatheredParameters) and each collective the calling thread enters, a rank leaves
  its position in the process group's store (``_Board``: a background thread writes the latest one, at most every
  50 ms; the main thread never waits on the store). A rank whose wait ends reads every rank's last report (bounded:
  5 s). Every rank makes the same calls and collectives in the same order, so the ranks whose (call, collective)
  count is behind its own did not arrive; their report says where they are ("between backward() and step() of
  micro-step 3: backward() returned, step() not called yet", host, pid). With two ranks it is the other one. A
  closed connection (a peer that died) is said as such, naming the rank whose pid is gone where it ran on this host.
- **Exit.** Nothing is left waiting: gloo's operations fail at the timeout, so a script that lets the error
  propagate exits (its process groups destroyed at exit, comm.py); the rank that stalled fails in its next collective
  once it resumes (its peers are gone).
"""
from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0  # megatrain.collective_timeout's default (NCCL's own default wait, 10 minutes)
BOARD_READ_TIMEOUT_S = 5.0  # reading the other ranks' reports after a failed collective: never longer
WRITE_INTERVAL_S = 0.05  # a rank's reports reach the store at most this often (the latest one; a stalled rank's is)
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Read error",
              "Connection refused", "Socket closed")


def done(value=None) -> Future:
    """A future that has already completed with ``value``."""
    fut = Future()
    fut.set_result(value)
    return fut


class CollectiveError(RuntimeError):
    """A collective of the engine failed on this rank: a peer did not arrive within ``megatrain.collective_timeout``
    seconds, or its connection closed (its process died). The message names this rank, the collective and where
    (micro-step, global step, layer), the ranks that did not arrive and where they last reported being, and what to
    do. ``rank``, ``collective`` and ``missing`` (the ranks that did not arrive, as far as known) say it to code."""

    def __init__(self, message: str, rank: int, collective: str, missing: list[int]) -> None:
        super().__init__(message)
        self.rank, self.collective, self.missing = rank, collective, missing


_PHASES = {  # what a rank's last report means, for the message of the rank that waited for it
    "initialize": "initialize()",
    "forward": "in forward() of micro-step {m}",
    "backward": "in backward() of micro-step {m}",
    "backward_done": "between backward() and step() of micro-step {m}: backward() returned, step() not called yet",
    "step": "in step() of micro-step {m} (global step {g})",
    "step_done": "after step() (global step {g}): in the script's own code (the next batch?), forward() not called "
                 "yet",
    "gather": "in GatheredParameters (global step {g})",
    "save": "in save_checkpoint() (global step {g})",
    "load": "in load_checkpoint() (global step {g} before it)",
}
_instances = itertools.count()  # one board per engine: every rank makes its engines in the same order


class DataParallel:
    """This process's place in the run: rank, world size, layer ownership and the groups collectives use.

    With one process every method is a no-op and the rank owns every layer (the single-GPU engine)."""

    def __init__(self, device: torch.device, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0
        self.device = device
        self.timeout_s = float(timeout)
        self.group = None  # the layer collectives: NCCL's default group on CUDA, a gloo group of ours on CPU
        self.cpu_group = None  # gloo, main thread: host scalars and checkpoint exchange
        self.norm_group = None  # gloo, the landing thread: the global norm
        # this rank's last report: the engine call it is in (seq counts them) and the collectives the calling
        # thread has entered in it (c; the last one: "in")
        self.position = {"phase": "initialize", "seq": 0, "m": 0, "g": 0, "c": 0, "in": None}
        self._caller = threading.get_ident()
        self._board = None
        if self.world > 1:
            self.backend = dist.get_backend()
            if device.type == "cuda" and self.backend != "nccl":
                raise RuntimeError(f"data parallel on CUDA needs the NCCL backend; the process group uses "
                                   f"{self.backend!r} (init_distributed(dist_backend='nccl'), or let "
                                   "megatrain_ds initialize it)")
            self.cpu_group = self._gloo_group()
            self.norm_group = self._gloo_group()
            if self.backend == "gloo":  # ours, so its waits are bounded too (the default group's are the script's)
                self.group = self._gloo_group()
            self._board = _Board(self.rank, self.world, next(_instances))
            self._board.report(self._entry())
            from .comm import destroy_at_exit
            destroy_at_exit()  # gloo groups left alive at exit can abort the process (comm.py)

    def _gloo_group(self):
        """A gloo group whose collectives wait at most ``collective_timeout``. Made with a longer wait (connecting
        its pairs waits for every rank to get here: the ranks reach initialize() as far apart as their model
        loading), then set to ``collective_timeout`` for its collectives."""
        timeout = timedelta(seconds=self.timeout_s)
        try:
            from torch.distributed.distributed_c10d import _set_pg_timeout
        except ImportError:  # an older torch: the connection wait is the collectives' one
            return dist.new_group(backend="gloo", timeout=timeout)
        group = dist.new_group(backend="gloo", timeout=max(timeout, timedelta(minutes=5)))
        _set_pg_timeout(timeout, group)
        return group

    @property
    def active(self) -> bool:
        return self.world > 1

    def owner(self, i: int) -> int:
        return i % self.world

    def owns(self, i: int) -> bool:
        return i % self.world == self.rank

    def owned_mask(self, n_layers: int) -> list[bool]:
        return [self.owns(i) for i in range(n_layers)]

    # --- where this rank is (the engine reports its calls; see [Note: collective timeouts]) ---------------
    def mark(self, phase: str, micro_step: int, global_step: int, arrive: bool = False) -> None:
        """Report this rank's position (``_PHASES``); with ``arrive``, wait (bounded) until every rank has reached
        the same point, before any collective of the call is issued (NCCL's never raise on the host)."""
        if not self.active:
            return
        self.position = {"phase": phase, "seq": self.position["seq"] + 1, "m": micro_step, "g": global_step,
                         "c": 0, "in": None}
        self._caller = threading.get_ident()
        self._board.report(self._entry())
        if arrive:
            with self.watch(f"the arrival check at the start of {phase}()"):
                dist.barrier(group=self.cpu_group)

    def _entry(self) -> dict:
        return {**self.position, "t": time.time(), "host": self._board.host, "pid": self._board.pid}

    @contextmanager
    def watch(self, collective: str):
        """Around one collective (or a few, on one thread): a failure of the collective machinery (gloo's timeout,
        a peer's closed connection, NCCL's blocking-wait timeout) becomes a ``CollectiveError`` that names this
        rank, ``collective``, where this rank is, and the ranks that did not arrive."""
        start = time.monotonic()
        if self._board is not None and threading.get_ident() == self._caller:  # the calling thread's, in order
            self.position = {**self.position, "c": self.position["c"] + 1, "in": collective}
            self._board.report(self._entry())
        try:
            yield
        except CollectiveError:
            raise
        except RuntimeError as exc:  # gloo raises RuntimeError; NCCL's DistBackendError is one
            if not self.active or not _collective_failure(exc):
                raise
            raise self.explain(exc, collective, time.monotonic() - start) from exc

    def explain(self, exc: BaseException, collective: str, waited: float) -> CollectiveError:
        """The error for ``exc`` in ``collective``: who did not arrive, where they are, what to do."""
        text = str(exc)
        gone = any(marker in text for marker in _PEER_GONE)
        timed_out = not gone and ("Timed out" in text or "timed out" in text or "Timeout" in text or
                                  waited >= 0.9 * self.timeout_s)
        reports = self._board.read() if self._board is not None else None
        me, seq = self.rank, self.position["seq"]
        where = _PHASES.get(self.position["phase"], self.position["phase"]).format(**self.position)
        if reports is not None:
            reports[me] = self._entry()  # this rank's own, current (its last write may still be queued)
        lines = []
        if reports is None:
            missing, dead = ([1 - me], []) if self.world == 2 else ([], [])  # two ranks: the other one
            lines.append("  (the other ranks' reports could not be read: the store's host -- rank 0 under a plain "
                         "launch, the launcher's agent under torchrun -- may be gone)")
        else:
            dead = [r for r, e in reports.items() if r != me and not _alive(e)]
            order = (seq, self.position["c"])  # every rank makes the same calls and collectives in the same order
            behind = [r for r in range(self.world) if r != me and
                      (r not in reports or (reports[r]["seq"], reports[r].get("c", 0)) < order)]
            missing = sorted(set(dead) | set(behind))
            if not missing and self.world == 2:  # two ranks: the other one (stalled on another thread, say)
                missing = [1 - me]
            now = time.time()
            for r in range(self.world):
                e = reports.get(r)
                if e is None:
                    lines.append(f"  rank {r}: no report (it never reached this engine's initialize())")
                    continue
                state = _PHASES.get(e["phase"], e["phase"]).format(**e)
                if e.get("in"):
                    state += f"; its last collective entered: {e['in']}"
                tag = ("this rank" if r == me else "its process is gone" if r in dead else
                       "did not arrive" if r in missing else "arrived")
                lines.append(f"  rank {r} ({tag}; host {e['host']}, pid {e['pid']}): {state} "
                             f"[report {now - e['t']:.1f} s ago]")
        who = (", ".join(f"rank {r}" for r in missing) if missing else
               "no rank is behind by the reports (a rank stalled inside the same call)" if reports else "unknown")
        if gone:
            what = (f"a peer's connection closed while rank {me} waited in {collective}, {where}: "
                    f"{'the process of ' + who if missing else 'a peer process'} exited or crashed")
            todo = ("its own log says why; this run cannot go on without it: restart from the last checkpoint (every "
                    "rank exits)")
        else:
            what = (f"{collective}, {where}, did not complete within megatrain.collective_timeout = "
                    f"{self.timeout_s:g} s" + (f" (waited {waited:.1f} s)" if not timed_out else "") +
                    f"; did not arrive: {who}")
            todo = ("every rank must make the same engine calls in the same order (forward, backward, step, "
                    "save_checkpoint, GatheredParameters). Find what the rank that did not arrive is doing -- e.g. "
                    "`py-spy dump --pid <pid>` on its host: a stalled data loader, a debugger, slow I/O, a branch "
                    "only some ranks take -- or, if ranks legitimately drift apart for longer (a slow checkpoint "
                    "write, evaluation on one rank), raise megatrain.collective_timeout")
        cause = text.splitlines()[0][:300] if text else type(exc).__name__
        message = (f"[megatrain_ds] rank {me} of {self.world}: {what}.\n" + "\n".join(lines) +
                   f"\nWhat to do: {todo}.\n({self.backend}: {cause})")
        return CollectiveError(message, me, collective, missing)

    # --- device collectives (main thread) -----------------------------------------------------------------
    def broadcast_layer(self, buf: torch.Tensor, i: int) -> None:
        """Layer i's weights, from its owner's slot into every rank's (called with ``h2d`` current on CUDA)."""
        with self.watch(f"the broadcast of layer {i}'s weights from rank {self.owner(i)}"):
            dist.broadcast(buf, src=self.owner(i), group=self.group)

    def reduce_layer_grad(self, flat: torch.Tensor, i: int) -> None:
        """Sum layer i's flat gradient into its owner's ``flat`` and take the mean there (``d2h`` current)."""
        with self.watch(f"the reduce of layer {i}'s gradient to rank {self.owner(i)}"):
            dist.reduce(flat, dst=self.owner(i), group=self.group)
        if self.owns(i):
            flat.div_(self.world)

    def mean_grad(self, grad: torch.Tensor) -> None:
        """A replicated (resident) parameter's gradient: the mean over the ranks, on every rank."""
        with self.watch("the all-reduce of a resident parameter's gradient"):
            dist.all_reduce(grad, group=self.group)
        grad.div_(self.world)

    # --- host collectives ---------------------------------------------------------------------------------
    def sum_norm(self, local_sq: float) -> float:
        """Landing thread: the sum over ranks of each rank's squared-norm share."""
        if not self.active:
            return local_sq
        t = torch.tensor([local_sq], dtype=torch.float64)
        with self.watch("the all-reduce of the global gradient norm"):
            dist.all_reduce(t, group=self.norm_group)
        return float(t)

    def min_int(self, value: int) -> int:
        """Main thread: the smallest ``value`` over the ranks (placement decisions every rank must share)."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        with self.watch("the all-reduce of a decision every rank must share (placement, recompute check)"):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t)

    def barrier(self) -> None:
        if self.active:
            with self.watch("a barrier of the engine's ranks"):
                dist.barrier(group=self.cpu_group)


def _collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is the collective machinery failing (a timeout, a lost peer), not a usage error (a shape or
    dtype the collective refused before sending anything)."""
    text = str(exc)
    return isinstance(exc, getattr(dist, "DistError", ())) or any(
        marker in text for marker in _PEER_GONE + ("Timed out waiting", "gloo/transport", "gloo/"))


def _alive(entry: dict) -> bool:
    """False when the report's process is known to be gone (same host, no such pid); True when it lives or cannot be
    checked from here."""
    if entry.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(entry["pid"]), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError, KeyError):
        return True
    return True


class _Board:
    """Every rank's last reported position, in the process group's store (``megatrain_ds/dp<k>/<rank>``). Written by
    one background thread per process (the latest report only; the caller never waits on the store), read after a
    failed collective in a thread joined with a bound (an unreachable store cannot hang the error)."""

    _lock = threading.Condition()
    _pending: dict = {}  # board -> its latest entry not written yet
    _thread = None

    def __init__(self, rank: int, world: int, instance: int) -> None:
        self.rank, self.world = rank, world
        self.host, self.pid = socket.gethostname(), os.getpid()
        try:
            self.store = dist.PrefixStore(f"megatrain_ds/dp{instance}/", dist.distributed_c10d._get_default_store())
        except Exception:  # noqa: BLE001 - no store (a group made some other way): the message says "unknown"
            self.store = None

    def report(self, entry: dict) -> None:
        if self.store is None:
            return
        with _Board._lock:
            _Board._pending[self] = entry
            if _Board._thread is None:
                _Board._thread = threading.Thread(target=_Board._write_loop, name="megatrain-dp-board", daemon=True)
                _Board._thread.start()
            _Board._lock.notify()

    @staticmethod
    def _write_loop() -> None:
        while True:
            with _Board._lock:
                while not _Board._pending:
                    _Board._lock.wait()
                board, entry = _Board._pending.popitem()
            try:
                if board.store is not None:
                    board.store.set(str(board.rank), json.dumps(entry))
            except Exception:  # noqa: BLE001 - the store's host is gone: stop reporting (collectives will say so)
                board.store = None
            time.sleep(WRITE_INTERVAL_S)  # at most this often: the reports of a burst of collectives coalesce

    def read(self) -> dict[int, dict] | None:
        """rank -> its last report (ranks that never reported are absent); None when the store cannot be read."""
        if self.store is None:
            return None
        result = {}

        def read_all():
            out = {}
            try:
                for r in range(self.world):
                    if self.store.check([str(r)]):
                        out[r] = json.loads(self.store.get(str(r)))
            except Exception:  # noqa: BLE001 - the store's host is gone: "could not be read"
                return
            result["reports"] = out
        reader = threading.Thread(target=read_all, name="megatrain-dp-board-read", daemon=True)
        reader.start()
        reader.join(BOARD_READ_TIMEOUT_S)
        return result.get("reports")
