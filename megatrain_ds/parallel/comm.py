"""``deepspeed.comm`` as scripts use it.

One process is a world: ``init_distributed()`` (and ``initialize``) leave ``torch.distributed`` and
``deepspeed.comm`` initialized with one process, as DeepSpeed does, so a script may ask for its rank
at once (``torch.distributed.get_rank()``). With no launcher that world is an in-memory store (no
MASTER_ADDR, no port).

Several processes (``WORLD_SIZE > 1``: ``torchrun``, the ``deepspeed`` launcher, ``accelerate
launch``, the HF Trainer under any of them) are one data-parallel run (megatrain_ds/parallel/dp.py,
[Note: data parallel]): ``init_distributed`` joins the launcher's group from its environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``), NCCL on CUDA and gloo on CPU, as
DeepSpeed's ``init_distributed`` does. A group the script, accelerate or the Trainer made already is
kept, whatever its backend. ``get_rank`` / ``get_world_size`` answer for that group (before it
exists: from the launcher's environment).

SLURM. ``srun -n N python train.py`` starts every rank as a task of its own, with SLURM's
environment and no ``RANK``: ``slurm_discovery`` fills the launcher's variables from SLURM's
(``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``, the step's node list), as
DeepSpeed's ``mpi_discovery`` fills them from MPI's (which needs mpi4py and an MPI-aware srun).
``srun torchrun ...`` sets RANK itself and is left alone.

The functions below answer without DeepSpeed (before any process group exists, too); every other
name is DeepSpeed's own ``deepspeed.comm`` (module ``__getattr__``), so ``deepspeed.comm.X`` under
the alias import is what it is under DeepSpeed.

At exit. A process that leaves without ``destroy_process_group()`` (most DeepSpeed scripts do) can
die by SIGABRT in interpreter finalization: gloo's worker threads still hold finished work whose
tensors drop their Python references after the interpreter is gone (pytorch/pytorch#179291). Once a
group exists, ``destroy_at_exit`` registers an ``atexit`` handler that destroys every group while
the interpreter is alive, after the worker threads have been joined; a script that destroyed them
itself makes it a no-op. (On the CPU test box a rank still died that way once, after this handler
had run: in finalization, past everything Python controls. The tests run such a launch once more:
tests/launch.py.)
"""

from __future__ import annotations

import atexit
import os
import warnings

import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout=None,
    init_method: str | None = None,
    dist_init_required=None,
    config=None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """DeepSpeed's ``init_distributed``: a world of one for one process (``ensure_deepspeed_comm``);
    under a launcher (WORLD_SIZE > 1), ``torch.distributed`` from its environment (NCCL on CUDA,
    gloo on CPU, unless ``dist_backend`` says otherwise). Idempotent: an existing group is kept."""
    world = _launcher_world(world_size, distributed_port)
    # as DeepSpeed's launcher-less discovery: scripts read these right after this call
    if world <= 1:
        for key in ("RANK", "LOCAL_RANK"):
            os.environ.setdefault(key, "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    if world > 1 and not is_initialized():
        _join_launcher_group(dist_backend, world, rank, distributed_port, timeout, init_method)
    ensure_deepspeed_comm(dist_backend)


def _launcher_world(world_size: int = -1, port: int = 29500) -> int:
    """The processes a launcher started: WORLD_SIZE (a SLURM step's tasks: ``slurm_discovery``),
    else the ``world_size`` argument, else 1."""
    slurm_discovery(port)
    return int(os.environ.get("WORLD_SIZE", "") or (world_size if world_size > 0 else 1))


def slurm_discovery(port: int = 29500) -> bool:
    """Inside a SLURM job step whose tasks are the ranks (``srun -n N python train.py``; no RANK or
    WORLD_SIZE in the environment), set torch.distributed's variables from SLURM's and return True:
    RANK = SLURM_PROCID, WORLD_SIZE = SLURM_STEP_NUM_TASKS, LOCAL_RANK = SLURM_LOCALID,
    LOCAL_WORLD_SIZE = this node's tasks of the step, MASTER_ADDR = the step's first host,
    MASTER_PORT = ``port`` (DeepSpeed's ``distributed_port``, 29500); a MASTER_ADDR / MASTER_PORT
    the environment has is kept (two jobs sharing a node need their own port: ``export
    MASTER_PORT=...`` before srun). Nothing is set under torchrun or the deepspeed launcher (RANK is
    set), or in a batch script's shell (one process: SLURM sets SLURM_STEP_NUM_TASKS only in a step
    srun starts)."""
    env = os.environ
    if (
        "RANK" in env
        or "WORLD_SIZE" in env
        or not env.get("SLURM_STEP_NUM_TASKS")
        or "SLURM_PROCID" not in env
    ):
        return False
    per_node = _expand_counts(env.get("SLURM_STEP_TASKS_PER_NODE", ""))
    node = int(env.get("SLURM_NODEID", 0))
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_STEP_NUM_TASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    if node < len(per_node):
        env["LOCAL_WORLD_SIZE"] = str(per_node[node])
    env.setdefault(
        "MASTER_ADDR",
        first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST", "")) or "127.0.0.1",
    )
    env.setdefault("MASTER_PORT", str(port))
    return True


def _expand_counts(spec: str) -> list[int]:
    """SLURM's per-node task counts, ``"2(x3),1"`` -> [2, 2, 2, 1]."""
    counts = []
    for part in filter(None, spec.split(",")):
        value, _, times = part.partition("(x")
        counts += [int(value)] * int(times.rstrip(")") or 1)
    return counts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``,
    ``"r[1-2]-n[01-04]"`` -> ``"r1-n01"`` (what ``scontrol show hostnames`` prints first)."""
    out, depth = [], 0
    for ch in nodelist:
        if ch == "," and depth == 0:
            break
        if ch == "[":
            depth, first = 1, []
            continue
        if depth:
            if ch == "]":
                out.append("".join(first).split(",")[0].split("-")[0])
                depth = 0
            else:
                first.append(ch)
            continue
        out.append(ch)
    return "".join(out)


def _join_launcher_group(
    backend: str | None,
    world: int,
    rank: int = -1,
    port: int = 29500,
    timeout=None,
    init_method: str | None = None,
) -> None:
    """``torch.distributed`` over the launcher's rendezvous (env://: MASTER_ADDR, MASTER_PORT,
    RANK)."""
    import torch

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    os.environ.setdefault("MASTER_PORT", str(port))
    rank = int(os.environ.get("RANK", rank))
    if rank < 0:
        raise RuntimeError(
            f"WORLD_SIZE={world} but no RANK in the environment: launch with torchrun, the "
            "deepspeed "
            "launcher or accelerate launch (they set RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)"
        )
    if backend == "nccl":  # each process on its own GPU (the engine uses cuda:LOCAL_RANK too)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    kwargs = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(
        backend=backend, init_method=init_method, rank=rank, world_size=world, **kwargs
    )


_exit_hook = False


def destroy_at_exit() -> None:
    """Destroy the process groups at exit (once registered, idempotent; see the module note)."""
    global _exit_hook
    if not _exit_hook:
        atexit.register(_destroy_groups)
        _exit_hook = True


def _destroy_groups() -> None:
    if is_initialized():
        try:
            dist.destroy_process_group()
        # a peer that died first: exiting matters more than a clean teardown
        except Exception as exc:
            warnings.warn(f"destroying the process group at exit failed: {exc}", stacklevel=1)


def ensure_deepspeed_comm(backend: str | None = None) -> None:
    """Make ``torch.distributed`` and ``deepspeed.comm`` answer, as DeepSpeed's own initialize
    leaves them (its monitors and transformers' ZeRO-3 loading ask them for the rank). One process:
    an in-memory world of one, no port, no launcher; ``backend`` defaults to gloo (collectives on
    CPU and CUDA tensors). Under a launcher (WORLD_SIZE > 1, e.g. ``zero.Init`` entered before
    ``initialize``): the launcher's group. A group that exists already (a launcher's, accelerate's,
    the script's own) is kept. Idempotent."""
    if not dist.is_initialized():
        world = _launcher_world()
        if world > 1:
            _join_launcher_group(backend, world)
        else:
            dist.init_process_group(backend or "gloo", store=dist.HashStore(), rank=0, world_size=1)
    destroy_at_exit()
    try:
        import deepspeed.comm
    except ImportError:  # deepspeed is a dependency; without it only torch.distributed is set up
        return
    if not deepspeed.comm.is_initialized():
        # over the existing group (DeepSpeed wraps it in its TorchBackend; nothing new is launched)
        try:
            deepspeed.comm.init_distributed(
                dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False
            )
        # its accelerator probing may fail on an unusual box: torch.distributed still works
        except Exception as exc:
            warnings.warn(
                f"deepspeed.comm could not be initialized over torch.distributed ({exc}); "
                "torch.distributed works, deepspeed.comm calls may not",
                stacklevel=3,
            )


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else int(os.environ.get("RANK", 0))


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def barrier(group=None) -> None:
    if is_initialized():
        dist.barrier(group)


def all_reduce(tensor, op=None, group=None, async_op: bool = False):
    """Sum (or ``op``: torch's ``ReduceOp`` or DeepSpeed's, as ``deepspeed.comm.ReduceOp`` gives it)
    over the world; with one process the tensor already holds the result."""
    if not is_initialized():
        return None
    if op is not None and not isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        op = getattr(dist.ReduceOp, op.name)  # DeepSpeed's enum: torch's member of the same name
    return dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=group, async_op=async_op)


def __getattr__(name: str):
    """Every other ``deepspeed.comm`` name (``all_gather``, ``all_gather_into_tensor``,
    ``broadcast``, ``reduce``, ``reduce_scatter``, ``ReduceOp``, ``get_global_rank``, ``new_group``,
    ``is_available``, ...) is DeepSpeed's own: it runs over the world ``init_distributed()`` /
    ``initialize()`` made (a world of one in one process)."""
    # module protocol probes (inspect, pickle, pytest): not DeepSpeed's to answer
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import deepspeed.comm

    try:
        return getattr(deepspeed.comm, name)
    except AttributeError:
        raise AttributeError(
            f"deepspeed.comm.{name}: neither megatrain_ds.comm nor DeepSpeed's deepspeed.comm "
            f"has {name!r}; torch.distributed may (the process group is initialized)"
        ) from None
