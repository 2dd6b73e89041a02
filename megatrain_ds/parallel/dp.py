"""Data parallelism over the processes of a run: who owns which layer, and the process groups.

[Note: data parallel] N processes (one per GPU; ``torchrun``, the ``deepspeed`` launcher,
``accelerate launch``) train one model on N micro-batches at once. Every persistent tensor stays in
host memory, once per host:

- **Shards.** The ranks that split the host state between them form a *shard*: the ranks of one node
  (host) with ``megatrain.host_sharding: "node"`` (the default), every rank of the job with
  ``"job"``. Which ranks share a node is asked of the launcher (torchrun's GROUP_RANK, the deepspeed
  launcher's CROSS_RANK, SLURM's SLURM_NODEID, and the host name; LOCAL_RANK / LOCAL_WORLD_SIZE
  agree with it), never assumed from WORLD_SIZE: two ``torchrun --nnodes 2`` launches on one machine
  are two hosts. With one node both modes are the same. ``Topology`` holds it.
- **Ownership.** Within a shard of S ranks, streamed layer i is owned by the rank at position ``i %
  S``; a trained resident parameter (embeddings, final norm, head) by the position its size is given
  to (``resident_positions``: largest first, to the position holding the fewest resident elements).
  Only an owner holds the host state (fp32 master, Adam moments, gradient, pinned wire copy) and
  steps it, on its own cores: host bytes summed over the shard are those of one process. With
  several shards ("node" mode, several nodes) each shard holds one copy: the owner at the same
  position of every shard steps the same bytes to the same result (a *replica*).
- **Weights in.** The owner copies layer i's wire H2D into a slot (or casts its GPU-held master),
  then the slot is broadcast from the owner to every rank of its shard (NCCL over NVLink; gloo on
  CPU). Round-robin ownership means consecutive layers come over different PCIe links. A resident
  parameter's compute copy is refreshed the same way before a forward (``ResidentParams.upload``).
  No weight crosses between shards.
- **Gradients out.** Layer i's (or a resident parameter's) gradient is reduced (sum) to its owner
  within the shard, then all-reduced among the replicas (the owners at that position of every shard:
  across nodes), then scaled by 1/N on the owner (the mean over ranks, as DeepSpeed averages
  data-parallel gradients), which lands it in host memory (D2H) as one process does. Ranks that do
  not own it move nothing over PCIe.
- **The global norm** is summed in one order whatever the topology: every squared norm (per layer,
  then per resident parameter) goes into its own entry of a vector, filled by the entry's owner in
  shard 0 only, the vector is all-reduced (each entry has one non-zero term: exact) by the landing
  thread over a gloo group of its own, and its entries are added in index order, as one process adds
  them: clipping is exact, every rank reaches the same skip / clip decision (fp16 overflow
  included), and two nodes of one rank train bit for bit as one node of two.

Ordering. The collectives of the device groups (broadcast, reduce, the replicas' all-reduce) are
issued by the main thread only, in the order the executor loads and evacuates layers, which is the
same on every rank as long as every rank runs the same forwards and backwards (as DeepSpeed ZeRO-3
requires) and agrees on which layers are kept on the GPU (the auto placement takes the minimum over
ranks) and which slots are stale (a rollback invalidates every layer on every rank). On CUDA a
collective issued with ``h2d`` (broadcast) or ``d2h`` (reduce) current runs on NCCL's stream after
that stream's queued work, and that stream waits for it: the three-stream overlap is kept, NCCL's
stream being the fourth. A replica all-reduce follows its shard's reduce on the same stream, on the
owner only: every rank enqueues its communicators' work in one order. Host-side scalars (the norm,
placement budgets) and checkpoint exchange go over gloo groups of every rank, so a collective on one
thread never interleaves with another thread's; their job-wide exchanges name one canonical owner
per layer (``owner``: shard 0's).

[Note: collective timeouts] A rank that does not arrive (a stalled data loader, a debugger, a branch
only some ranks take, a crash) must not leave the others waiting for ever, and the rank that gives
up must say who it waited for.
- **Bounded waits.** Every group the engine makes waits at most ``megatrain.collective_timeout``
  seconds (``CollectiveError``): the gloo groups (norm, host scalars, checkpoints) and, on gloo
  (CPU), the engine's own group for the layer collectives. NCCL's collectives run on the GPU, so the
  host never waits in one; the engine checks arrival over gloo instead, where a rank can stall in
  the script's own code: a barrier at the top of every ``forward()`` and ``backward()`` (one gloo
  round trip each), while ``step()``'s norm all-reduce is one already. The NCCL group itself keeps
  its own timeout (its watchdog aborts the process: set ``init_process_group(timeout=)``, which
  megatrain_ds sets to ``collective_timeout`` when it creates the group).
- **Who did not arrive.** At each engine call (forward, backward and its return, step and its
  return, save_checkpoint, load_checkpoint, GatheredParameters) and each collective the calling
  thread enters, a rank leaves its position in the process group's store (``Board`` in
  collective_watch.py, where the exit records below and the error are made too: a background thread
  writes the latest one, at most every 50 ms; the main thread never waits on the store). A rank
  whose wait ends reads every rank's last report (bounded: 5 s). Every rank makes the same calls and
  collectives in the same order, so the ranks whose (call, collective) count is behind its own did
  not arrive; their report says where they are ("between backward() and step() of micro-step 3:
  backward() returned, step() not called yet", host, pid). With two ranks it is the other one. A
  closed connection (a peer that died) is said as such, naming the rank whose pid is gone where it
  ran on this host.
- **Who exited.** A report is the rank's last position, not its fate: a rank whose script ended (or
  raised) reports nothing more. So at interpreter exit each rank writes an exit record of its own
  (``exit/<rank>``, synchronously, bounded, before its groups are destroyed: it is in the store
  before any peer sees the connection close), saying whether an exception escaped the script and its
  last engine call. A peer that waited for it says "exited" with that, not its last progress; a rank
  that left no record and whose pid is gone (same host) was killed or crashed (SIGKILL,
  ``os._exit``, a segfault: its launcher's log has the status).
- **Exit.** Nothing is left waiting: gloo's operations fail at the timeout, so a script that lets
  the error propagate exits (its process groups destroyed at exit, comm.py); the rank that stalled
  fails in its next collective once it resumes (its peers are gone).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .collective_watch import Board, CollectiveError, collective_failure, explain_failure

# megatrain.collective_timeout's default (NCCL's own default wait, 10 minutes)
DEFAULT_TIMEOUT_S = 600.0


def done(value=None) -> Future:
    """A future that has already completed with ``value``."""
    fut = Future()
    fut.set_result(value)
    return fut


# megatrain.host_sharding: which ranks split the host state (the Note)
HOST_SHARDING = ("node", "job")
# torchrun, the deepspeed launcher, SLURM: this node's index
NODE_ENV = ("GROUP_RANK", "CROSS_RANK", "SLURM_NODEID")


@dataclass(frozen=True)
class Topology:
    """Where the host state lives ([Note: data parallel]): ``shards`` are the groups of ranks that
    split it (global ranks, in rank order; the shard holding rank 0 first), ``nodes`` the ranks of
    each host. Every shard has the same size S; layer i is owned at position ``i % S`` of every
    shard. Pure: the planner builds one too."""

    shards: tuple[tuple[int, ...], ...]
    nodes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, node_keys: list, sharding: str = "node") -> "Topology":
        """From each rank's node key (equal keys: one host), in rank order. "node": a shard per node
        (every node with the same number of ranks); "job": one shard of every rank."""
        if sharding not in HOST_SHARDING:
            raise ValueError(
                f"megatrain.host_sharding must be one of {HOST_SHARDING}, got {sharding!r}"
            )
        groups: dict = {}
        for rank, key in enumerate(node_keys):
            groups.setdefault(key, []).append(rank)
        nodes = tuple(tuple(g) for g in sorted(groups.values(), key=min))
        if sharding == "job" or len(nodes) == 1:
            return cls((tuple(range(len(node_keys))),), nodes)
        sizes = sorted({len(g) for g in nodes})
        if len(sizes) > 1:
            from ..errors import ConfigError

            raise ConfigError(
                f"megatrain.host_sharding \"node\" holds one copy of the host state per node, "
                "split over "
                "its ranks: every node needs the same number of ranks, got "
                f"{[len(g) for g in nodes]} "
                "(launch the same --nproc_per_node on every node, or set megatrain.host_sharding "
                "\"job\": the state split over every rank of the job)"
            )
        return cls(nodes, nodes)

    @classmethod
    def uniform(cls, nodes: int, per_node: int, sharding: str = "node") -> "Topology":
        """``nodes`` hosts of ``per_node`` ranks each, ranks numbered node by node (torchrun, the
        deepspeed launcher)."""
        return cls.of([r // per_node for r in range(nodes * per_node)], sharding)

    @property
    def size(self) -> int:
        """S: the ranks of a shard."""
        return len(self.shards[0])

    def shard_of(self, rank: int) -> tuple[int, ...]:
        return next(s for s in self.shards if rank in s)

    def node_of(self, rank: int) -> tuple[int, ...]:
        return next(n for n in self.nodes if rank in n)

    def position(self, rank: int) -> int:
        """``rank``'s position in its shard (what it owns)."""
        return self.shard_of(rank).index(rank)

    def owned_mask(self, rank: int, n_layers: int) -> list[bool]:
        """Which streamed layers ``rank`` holds."""
        pos = self.position(rank)
        return [i % self.size == pos for i in range(n_layers)]

    def position_order(self) -> list[int]:
        """The shard's positions in the order resident parameters are dealt to them
        (``resident_positions``): the first rank of every node, then the second, ...: with "job"
        sharding the embedding and the head go to different hosts."""
        shard = self.shards[0]
        where = {r: (node.index(r), n) for n, node in enumerate(self.nodes) for r in node}
        return sorted(range(len(shard)), key=lambda p: where[shard[p]])

    def resident_mask(self, rank: int, positions: list[int | None]) -> list[bool]:
        """Which resident parameters ``rank`` holds the host state of (``resident_positions``; a
        frozen one, with no state: every rank)."""
        pos = self.position(rank)
        return [p is None or p == pos for p in positions]


def resident_positions(
    resident: list[tuple[int, bool]], size: int, order: list[int] | None = None
) -> list[int | None]:
    """Per resident parameter ``(elements, trained)``, the shard position that owns its host state:
    trained ones largest first (ties in order), each to the position holding the fewest resident
    elements so far (ties: the first in ``order``, default 0, 1, ...; ``Topology.position_order``);
    None for a frozen one (no state: nothing to own). An untied 14B's embedding and head go to
    different ranks of a 2-rank shard. Pure: the engine and the planner give the same answer."""
    load, out = [0] * max(1, size), [None] * len(resident)
    rank_of = {pos: i for i, pos in enumerate(order if order is not None else range(len(load)))}
    for k in sorted(
        (k for k, (_, trained) in enumerate(resident) if trained), key=lambda k: -resident[k][0]
    ):
        pos = min(range(len(load)), key=lambda r: (load[r], rank_of[r]))
        out[k] = pos
        load[pos] += resident[k][0]
    return out


def node_key() -> tuple[str, str]:
    """This process's host, as the launcher names it: (the node index the launcher set, the host
    name)."""
    index = next((os.environ[k] for k in NODE_ENV if os.environ.get(k, "") != ""), "")
    return index, socket.gethostname()


# one board per engine: every rank makes its engines in the same order
_instances = itertools.count()


class DataParallel:
    """This process's place in the run: rank, world size, layer ownership and the groups collectives
    use.

    With one process every method is a no-op and the rank owns every layer (the single-GPU
    engine)."""

    def __init__(
        self, device: torch.device, timeout: float = DEFAULT_TIMEOUT_S, sharding: str = "node"
    ) -> None:
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0
        self.device = device
        self.timeout_s = float(timeout)
        # every rank's device collectives: NCCL's default group on CUDA, a gloo group of ours on CPU
        self.group = None
        # the device collectives of this rank's shard (``group`` when it is every rank)
        self.shard_group = None
        # the owners at this rank's position of every shard (None: one shard)
        self.replica_group = None
        self.cpu_group = None  # gloo, main thread: host scalars and checkpoint exchange
        self.norm_group = None  # gloo, the landing thread: the global norm
        self.topology = Topology(((0,),), ((0,),))  # one process
        # its shard, its place there, its host's ranks
        self.shard, self.shard_pos, self.local_world = (0,), 0, 1
        # per resident parameter, its owning position (``set_resident``)
        self.resident_pos: list[int | None] = []
        # this rank's last report: the engine call it is in (seq counts them) and the collectives
        # the calling thread has entered in it (c; the last one: "in")
        self.position = {"phase": "initialize", "seq": 0, "m": 0, "g": 0, "c": 0, "in": None}
        self._caller = threading.get_ident()
        self._board = None
        if self.world > 1:
            self.backend = dist.get_backend()
            if device.type == "cuda" and self.backend != "nccl":
                raise RuntimeError(
                    f"data parallel on CUDA needs the NCCL backend; the process group uses "
                    f"{self.backend!r} (init_distributed(dist_backend='nccl'), or let "
                    "megatrain_ds initialize it)"
                )
            self.cpu_group = self._gloo_group()
            self.norm_group = self._gloo_group()
            # ours, so its waits are bounded too (the default group's are the script's)
            if self.backend == "gloo":
                self.group = self._gloo_group()
            keys = [None] * self.world  # which ranks share a host: as the launcher says (the Note)
            dist.all_gather_object(keys, node_key(), group=self.cpu_group)
            self.topology = Topology.of(keys, sharding)
            self._shard_groups()
            self._board = Board(self.rank, self.world, next(_instances))
            self._board.report(self._entry())
            from .comm import destroy_at_exit

            destroy_at_exit()  # gloo groups left alive at exit can abort the process (comm.py)

    def _gloo_group(self, ranks: list[int] | None = None):
        """A gloo group (of ``ranks``, default every rank) whose collectives wait at most
        ``collective_timeout``. Made with a longer wait (connecting its pairs waits for every rank
        to get here: the ranks reach initialize() as far apart as their model loading), then set to
        ``collective_timeout`` for its collectives. Every rank makes every group, in the same order
        (torch.distributed's rule), members or not: None where not a member."""
        timeout = timedelta(seconds=self.timeout_s)
        try:
            from torch.distributed.distributed_c10d import _set_pg_timeout
        except ImportError:  # an older torch: the connection wait is the collectives' one
            return dist.new_group(ranks, backend="gloo", timeout=timeout)
        group = dist.new_group(ranks, backend="gloo", timeout=max(timeout, timedelta(minutes=5)))
        if ranks is None or self.rank in ranks:
            _set_pg_timeout(timeout, group)
            return group
        return None

    def _device_group(self, ranks: list[int]):
        """A group of ``ranks`` for the device collectives (NCCL on CUDA, with
        ``collective_timeout``; gloo on CPU): made by every rank in the same order, returned to its
        members (None elsewhere)."""
        if self.backend == "gloo":
            return self._gloo_group(ranks)
        group = dist.new_group(ranks, timeout=timedelta(seconds=self.timeout_s))
        return group if self.rank in ranks else None

    def _shard_groups(self) -> None:
        """The groups of [Note: data parallel] beyond every rank's: with one shard, its group is
        every rank's; with several (one per node), a group per shard and one per position (the
        replicas), every rank making all."""
        topo = self.topology
        self.shard = topo.shard_of(self.rank)  # global ranks of this rank's shard
        self.shard_pos = topo.position(self.rank)
        # the ranks sharing this host's memory and cores
        self.local_world = len(topo.node_of(self.rank))
        if len(topo.shards) == 1:
            self.shard_group = self.group
            return
        for shard in topo.shards:
            group = self._device_group(list(shard))
            if group is not None:
                self.shard_group = group
        for pos in range(topo.size):
            group = self._device_group([shard[pos] for shard in topo.shards])
            if group is not None:
                self.replica_group = group

    @property
    def active(self) -> bool:
        return self.world > 1

    # --- who holds what ([Note: data parallel]) ---------------------------------------------------
    def owner(self, i: int) -> int:
        """The canonical holder of layer i (global rank, shard 0's): the source of job-wide
        exchanges (checkpoints, GatheredParameters, full state dicts), the same on every rank."""
        return self.topology.shards[0][i % self.topology.size]

    def owners(self, i: int) -> list[int]:
        """Every rank holding layer i's host state: its owner in each shard."""
        return [shard[i % self.topology.size] for shard in self.topology.shards]

    def owns(self, i: int) -> bool:
        return not self.active or i % self.topology.size == self.shard_pos

    def owned_mask(self, n_layers: int) -> list[bool]:
        return [self.owns(i) for i in range(n_layers)]

    @property
    def host_ranks(self) -> tuple[int, ...]:
        """The ranks on this rank's host (its node): they share its memory budget and its cores."""
        return self.topology.node_of(self.rank) if self.active else (0,)

    def set_resident(self, resident: list[tuple[int, bool]]) -> list[bool]:
        """Decide the owners of the resident parameters (``(elements, trained)`` each, in the
        engine's order); returns this rank's mask (``resident_positions``: the same on every
        rank)."""
        self.resident_pos = resident_positions(
            resident, self.topology.size, self.topology.position_order()
        )
        return (
            self.topology.resident_mask(self.rank, self.resident_pos)
            if self.active
            else [True] * len(resident)
        )

    def resident_owner(self, k: int) -> int:
        """The canonical holder of resident parameter k's state (shard 0's; rank 0 for a frozen
        one)."""
        pos = self.resident_pos[k] if self.active else None
        return 0 if pos is None else self.topology.shards[0][pos]

    # --- where this rank is (the engine reports its calls; see [Note: collective timeouts]) -------
    def mark(self, phase: str, micro_step: int, global_step: int, arrive: bool = False) -> None:
        """Report this rank's position (collective_watch.py's ``_PHASES``); with ``arrive``, wait
        (bounded) until every rank has reached the same point, before any collective of the call is
        issued (NCCL's never raise on the host)."""
        if not self.active:
            return
        self.position = {
            "phase": phase,
            "seq": self.position["seq"] + 1,
            "m": micro_step,
            "g": global_step,
            "c": 0,
            "in": None,
        }
        self._caller = threading.get_ident()
        self._board.report(self._entry())
        if arrive:
            with self.watch(f"the arrival check at the start of {phase}()"):
                dist.barrier(group=self.cpu_group)

    def _entry(self) -> dict:
        return {**self.position, "t": time.time(), "host": self._board.host, "pid": self._board.pid}

    @contextmanager
    def watch(self, collective: str):
        """Around one collective (or a few, on one thread): a failure of the collective machinery
        (gloo's timeout, a peer's closed connection, NCCL's blocking-wait timeout) becomes a
        ``CollectiveError`` that names this rank, ``collective``, where this rank is, and the ranks
        that did not arrive."""
        start = time.monotonic()
        # the calling thread's, in order
        if self._board is not None and threading.get_ident() == self._caller:
            self.position = {**self.position, "c": self.position["c"] + 1, "in": collective}
            self._board.report(self._entry())
        try:
            yield
        except CollectiveError:
            raise
        except RuntimeError as exc:  # gloo raises RuntimeError; NCCL's DistBackendError is one
            if not self.active or not collective_failure(exc):
                raise
            raise self.explain(exc, collective, time.monotonic() - start) from exc

    def explain(self, exc: BaseException, collective: str, waited: float) -> CollectiveError:
        """The error for ``exc`` in ``collective``: who did not arrive, where they are, what to
        do (collective_watch.py)."""
        reports = self._board.read() if self._board is not None else None
        if reports is not None:
            # this rank's own, current (its last write may still be queued)
            reports[self.rank] = self._entry()
        return explain_failure(self, exc, collective, waited, reports)

    # --- device collectives (main thread) ---------------------------------------------------------
    def broadcast_layer(self, buf: torch.Tensor, i: int) -> None:
        """Layer i's weights, from its owner's slot into every rank's of the shard (called with
        ``h2d`` current on CUDA). A shard of one rank loads its own: nothing to send."""
        self._broadcast(buf, i % self.topology.size, f"layer {i}'s weights")

    def broadcast_resident(self, data: torch.Tensor, k: int) -> None:
        """Resident parameter k's compute copy, from its owner into every rank's of the shard
        (``h2d`` current)."""
        self._broadcast(data, self.resident_pos[k], f"resident parameter {k}'s weights")

    def _broadcast(self, buf: torch.Tensor, pos: int, what: str) -> None:
        if self.topology.size > 1:
            with self.watch(f"the broadcast of {what} from rank {self.shard[pos]}"):
                dist.broadcast(buf, src=self.shard[pos], group=self.shard_group)

    def reduce_layer_grad(self, flat: torch.Tensor, i: int) -> None:
        """Sum layer i's flat gradient over every rank into its owners' ``flat`` and take the mean
        there (``d2h`` current): a reduce within the shard, then the replicas' all-reduce (several
        shards)."""
        self._reduce(flat, i % self.topology.size, f"layer {i}'s gradient")

    def reduce_resident_grad(self, grad: torch.Tensor, k: int) -> None:
        """Resident parameter k's gradient: the mean over every rank, on its owners."""
        self._reduce(grad, self.resident_pos[k], f"resident parameter {k}'s gradient")

    def _reduce(self, flat: torch.Tensor, pos: int, what: str) -> None:
        mine = pos == self.shard_pos
        # one watch for both: every rank counts the same collectives ([Note: collective timeouts]),
        # owners or not
        with self.watch(
            f"the reduce of {what} to rank {self.shard[pos]}"
            + (" and between the nodes" if self.replica_group is not None else "")
        ):
            if self.topology.size > 1:
                dist.reduce(flat, dst=self.shard[pos], group=self.shard_group)
            if mine and self.replica_group is not None:
                dist.all_reduce(flat, group=self.replica_group)
        if mine:
            flat.div_(self.world)

    # --- host collectives -------------------------------------------------------------------------
    def sum_norms(self, squares: list[float]) -> list[float]:
        """Landing thread: every entry's squared norm from its one filler (each rank passes its
        entries, 0.0 elsewhere; the sum is exact), on every rank."""
        if not self.active:
            return squares
        t = torch.tensor(squares, dtype=torch.float64)
        with self.watch("the all-reduce of the global gradient norm"):
            dist.all_reduce(t, group=self.norm_group)
        return t.tolist()

    def min_int(self, value: int) -> int:
        """Main thread: the smallest ``value`` over the ranks (placement decisions every rank must
        share)."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        with self.watch(
            "the all-reduce of a decision every rank must share (placement, recompute check)"
        ):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t)

    def barrier(self) -> None:
        if self.active:
            with self.watch("a barrier of the engine's ranks"):
                dist.barrier(group=self.cpu_group)
