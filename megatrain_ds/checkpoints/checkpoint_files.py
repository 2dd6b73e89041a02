"""Reading checkpoints in DeepSpeed's ZeRO-3 layout (checkpoint.py writes them; its docstring
describes the layout): every rank's files of one checkpoint folder (``save_dir/<tag>``), saved by
one rank or N, by megatrain_ds or by real DeepSpeed.

``read_states`` reads every rank's files (``torch.load(mmap=True)``: pages are read as they are
used) into a ``CheckpointFiles`` (every tensor by parameter name: with N > 1, a parameter's N
partitions, joined when it is used); checkpoint.py's ``load_checkpoint`` checks it against the
engine, then writes it. Two sources are read, told apart by their optimizer state:

- megatrain_ds before the way back (wayback.py): moments as flat buffers;
- DeepSpeed ZeRO-3 saved by N ranks (its ``stage3._rigid_state_dict``), and megatrain_ds now, which
  writes that layout (checkpoint.py) so that DeepSpeed resumes it: each rank's torch optimizer state
  dict, one flat ``exp_avg``/``exp_avg_sq`` per sub-group (rank r's partitions, as its
  ``fp32_flat_groups``), sub-group k aligned with ``fp32_flat_groups[k]`` and ``param_shapes[k]``
  (DeepSpeed's own files hold no RNG and no ``micro_steps``: derived from the step count).

``fp32_state_dict(path)`` reads the whole fp32 weights of a folder saved by any number of ranks.
What the writer shares with the reader is here too: the file names, ``CheckpointMismatchError``,
ZeRO-3's partition size.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"
OPTIM_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
BF16_OPTIM_FILE = "bf16_" + OPTIM_FILE  # DeepSpeed's name for it when bf16 is on
# rank r's files (DeepSpeed's _get_ckpt_name / _get_zero_ckpt_name); the optimizer's may carry
# DeepSpeed's bf16_ prefix
_RANK_FILE = re.compile(
    r"^(?P<bf16>bf16_)?zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_"
    r"(?P<kind>model|optim)_states\.pt$"
)


def model_file(rank: int) -> str:
    """Rank ``rank``'s model-states file name."""
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def optim_file(rank: int, bf16: bool = False) -> str:
    """Rank ``rank``'s optimizer-states file name; ``bf16_`` first in bf16 runs (DeepSpeed's name
    then: its bf16 engine reads no other)."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


class CheckpointMismatchError(RuntimeError):
    """The checkpoint does not fit this engine (or is not a ZeRO-3 checkpoint this reads). Raised
    before anything was written: the engine is as it was."""


def partition_of(numel: int, world: int) -> int:
    """ZeRO-3's partition of a parameter of ``numel`` elements over ``world`` ranks: ``ceil(numel /
    world)``."""
    return -(-numel // world)


# ------------------------------------------------------------------------------------------ reading
class _Gathered:
    """One parameter of an N-rank checkpoint: its N ZeRO-3 partitions (views of the mmapped files),
    joined into the whole tensor only when it is used (one parameter's copy at a time). ``shape``
    and ``dtype`` need no join; ``reshape``/``view`` (and any other tensor attribute) join."""

    __slots__ = ("shape", "pieces")

    def __init__(self, shape, pieces: list[torch.Tensor]) -> None:
        self.shape, self.pieces = torch.Size(shape), pieces

    @property
    def dtype(self) -> torch.dtype:
        return self.pieces[0].dtype

    def numel(self) -> int:
        return self.shape.numel()

    def full(self) -> torch.Tensor:
        return torch.cat([p.reshape(-1) for p in self.pieces])[: self.numel()].view(self.shape)

    def reshape(self, *shape) -> torch.Tensor:
        return self.full().reshape(*shape)

    def view(self, *shape) -> torch.Tensor:
        return self.full().view(*shape)

    def __getattr__(self, name: str):
        if name in _Gathered.__slots__:
            raise AttributeError(name)
        return getattr(self.full(), name)


def _whole(t):
    """A parameter's whole tensor (``_Gathered`` joined; a tensor as it is)."""
    return t.full() if isinstance(t, _Gathered) else t


@dataclass(slots=True)
class CheckpointFiles:
    """A checkpoint read into memory, every tensor by parameter or buffer name (views of the loaded
    files; with N > 1 saving ranks, ``_Gathered`` partitions)."""

    path: str
    world: int  # ranks that saved it
    masters: dict  # fp32 weights, trainable and frozen
    trainable: list[str]  # the names in param_shapes: parameters the saving optimizer owned
    frozen_excluded: bool  # saved with exclude_frozen_parameters: frozen weights are absent
    # name -> (exp_avg, exp_avg_sq), or None (no state yet: zeros); None: no optimizer
    moments: dict | None
    step: int  # the optimizer's step count (bias correction)
    param_groups: list[dict] | None  # hyperparameters per group, without "params"
    # DeepSpeed's groups carry keys ours lack (bias_correction, amsgrad)
    group_keys_shared_only: bool
    buffers: dict[str, torch.Tensor]
    model_states: dict  # counters, scheduler, client state (this rank's file, else rank 0's)
    loss_scaler: dict | None  # as LossScaler fields
    rng: dict | None  # this rank's (saved by as many ranks as load it), else None
    rng_dropped: bool  # the checkpoint has RNG states, but of another number of ranks: not restored


def _split(flat: torch.Tensor, shapes: dict, what: str, world: int = 1) -> dict:
    """``shapes`` (name -> shape) consumed in order from one rank's ``flat`` group: each parameter's
    partition of ``ceil(numel / world)`` elements (with one rank: a view shaped as the parameter).
    Padding at the end is ignored (DeepSpeed may pad a group for alignment). Detached: DeepSpeed
    saves its fp32 partitions as tensors that require grad, and a master ``copy_``-ed from one would
    join autograd."""
    flat = flat.detach().reshape(-1)
    need = sum(partition_of(torch.Size(s).numel(), world) for s in shapes.values())
    if flat.numel() < need:
        raise CheckpointMismatchError(
            f"{what} holds {flat.numel()} elements but its param_shapes entry needs "
            f"{need} ({world} rank(s)): a truncated file, or not a ZeRO-3 checkpoint of "
            f"{world} rank(s)"
        )
    out, offset = {}, 0
    for name, shape in shapes.items():
        n = partition_of(torch.Size(shape).numel(), world)
        out[name] = (
            flat[offset : offset + n].view(shape) if world == 1 else flat[offset : offset + n]
        )
        offset += n
    return out


def _join(shapes: list[dict], per_rank: list[list], what: str) -> dict:
    """name -> whole tensor (one rank: a view) or ``_Gathered`` from every rank's per-group flat
    tensors (``per_rank[r][k]``: rank r's group k; None: no state for that group, every name of it
    maps to None)."""
    world, out = len(per_rank), {}
    for k, group in enumerate(shapes):
        pieces = []
        for r in range(world):
            flat = per_rank[r][k]
            pieces.append(
                None if flat is None else _split(flat, group, f"{what}[{k}] of rank {r}", world)
            )
        for name, shape in group.items():
            if any(p is None for p in pieces):
                out[name] = None
            elif world == 1:
                out[name] = pieces[0][name]
            else:
                out[name] = _Gathered(shape, [p[name] for p in pieces])
    return out


def _frozen(states: list[dict]) -> dict:
    """Frozen parameters by name from every rank's ``frozen_param_fragments`` (rank r's ZeRO-3
    partition each)."""
    world, out = len(states), {}
    for name, shape in (states[0].get("frozen_param_shapes") or {}).items():
        numel, fragments = torch.Size(shape).numel(), []
        for r, state in enumerate(states):
            fragment = (state.get("frozen_param_fragments") or {}).get(name)
            want = numel if world == 1 else partition_of(numel, world)
            if fragment is None or fragment.numel() != want:
                raise CheckpointMismatchError(
                    f"frozen parameter {name}: {'no' if fragment is None else fragment.numel()} "
                    "elements saved by "
                    f"rank {r} for shape {tuple(shape)}, {want} expected of each of {world} "
                    "rank(s) (files of "
                    "different saves?)"
                )
            fragments.append(fragment.detach().reshape(-1))
        out[name] = fragments[0].view(shape) if world == 1 else _Gathered(shape, fragments)
    return out


def _masters(states: list[dict], groups: list[list]) -> dict:
    shapes = states[0].get("param_shapes")
    for r, rank_groups in enumerate(groups):
        if shapes is None or len(shapes) != len(rank_groups):
            raise CheckpointMismatchError(
                f"{len(rank_groups)} fp32_flat_groups (rank {r}) but "
                f"{'no' if shapes is None else len(shapes)} param_shapes groups: the files "
                "are not from one ZeRO-3 save (or it was saved without an optimizer)"
            )
    out = _join(shapes, groups, "fp32_flat_groups")
    out.update(_frozen(states))
    return out


def _moment_groups_ours(state: dict, shapes: list[dict], world: int) -> tuple[list, list]:
    """megatrain_ds's moments as per-group flat tensors: the flat buffers cover the first groups
    (one rank: the streamed layers'; N ranks: every group), then one tensor per trained resident
    parameter (None entries: not trained)."""
    flat_m, flat_v = state["exp_avg"].reshape(-1), state["exp_avg_sq"].reshape(-1)
    ms, vs, offset, k = [], [], 0, 0
    while offset < flat_m.numel() and k < len(shapes):
        n = sum(partition_of(torch.Size(s).numel(), world) for s in shapes[k].values())
        ms.append(flat_m[offset : offset + n])
        vs.append(flat_v[offset : offset + n])
        offset, k = offset + n, k + 1
    if offset != flat_m.numel():
        raise CheckpointMismatchError(
            f"the Adam moments hold {flat_m.numel()} elements, which do not end on a "
            "parameter group of param_shapes: the files are not from one save"
        )
    resident = [
        (m, v)
        for m, v in zip(state["resident_exp_avg"], state["resident_exp_avg_sq"])
        if m is not None
    ]
    if len(resident) != len(shapes) - k:
        raise CheckpointMismatchError(
            f"{len(resident)} resident moment tensors for {len(shapes) - k} resident "
            "parameter groups: the files are not from one save"
        )
    return ms + [m for m, _ in resident], vs + [v for _, v in resident]


def _moment_groups_deepspeed(inner: dict, shapes: list[dict]) -> tuple[list, list, list[int]]:
    """DeepSpeed ZeRO-3's moments as per-group flat tensors (None: the sub-group never stepped), and
    the step counts. Its torch optimizer numbers the fp32 sub-groups param group by param group,
    sub-group order within each (stage3 ``_set_fp32_optimizer_param_groups``): the k-th index listed
    is sub-group k."""
    order = [index for group in inner["param_groups"] for index in group["params"]]
    if len(order) != len(shapes):
        raise CheckpointMismatchError(
            f"DeepSpeed optimizer state lists {len(order)} sub-groups for {len(shapes)} "
            "fp32_flat_groups: not a ZeRO-3 checkpoint of this layout"
        )
    ms, vs, steps = [], [], []
    for index in order:
        state = inner["state"].get(index) or {}
        if "exp_avg" not in state:  # the sub-group never stepped: fresh moments
            ms.append(None)
            vs.append(None)
            continue
        steps.append(int(state["step"]))
        ms.append(state["exp_avg"])
        vs.append(state["exp_avg_sq"])
    return ms, vs, steps


def _moments(shapes: list[dict], inners: list[dict]) -> tuple[dict, int, bool]:
    """name -> (exp_avg, exp_avg_sq) or None, the step count, and whether the state is
    DeepSpeed's."""
    world = len(inners)
    if "state" in inners[0]:  # DeepSpeed: a torch optimizer's state dict per rank
        parts = [_moment_groups_deepspeed(inner, shapes) for inner in inners]
        step = max((s for _, _, steps in parts for s in steps), default=0)
        deepspeed = True
    else:  # megatrain_ds: HostAdamW.host_state_dict() (N ranks: flat over every group)
        parts = [_moment_groups_ours(inner, shapes, world) for inner in inners]
        step, deepspeed = inners[0]["step_count"], False
    m = _join(shapes, [p[0] for p in parts], "exp_avg")
    v = _join(shapes, [p[1] for p in parts], "exp_avg_sq")
    return (
        {name: None if m[name] is None or v[name] is None else (m[name], v[name]) for name in m},
        step,
        deepspeed,
    )


def _scaler_fields(saved) -> dict | None:
    """A loss-scaler state as our LossScaler's fields: ours is saved as a dict, DeepSpeed pickles
    its object (a static one, as in fp32 and bf16 runs, carries nothing to resume: scale 1 would
    only overwrite ours)."""
    if saved is None or isinstance(saved, dict):
        return saved or None
    if getattr(saved, "dynamic", False) is not True:
        return None
    mapping = {
        "cur_scale": "scale",
        "cur_iter": "_iter",
        "last_overflow_iter": "_last_overflow",
        "cur_hysteresis": "_hysteresis_left",
    }
    return {
        ours: getattr(saved, theirs) for theirs, ours in mapping.items() if hasattr(saved, theirs)
    } or None


def _torch_load(path: str, mmap: bool = True):
    """A checkpoint file, memory-mapped where its format allows (pages are read as they are
    used)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except RuntimeError as exc:
        if mmap and "mmap" in str(exc):  # the legacy (non-zip) format cannot be mapped
            return torch.load(path, map_location="cpu", weights_only=False)
        raise


def _rank_files(path: str) -> tuple[dict[int, str], dict[int, str]]:
    """{rank: model-states file}, {rank: optimizer-states file} of a checkpoint folder
    (model-parallel rank 0; other model-parallel ranks are refused)."""
    models, optims, mp = {}, {}, set()
    for name in os.listdir(path):
        m = _RANK_FILE.match(name)
        if m is None:
            continue
        mp.add(int(m["mp"]))
        if int(m["mp"]) == 0:
            (models if m["kind"] == "model" else optims)[int(m["rank"])] = os.path.join(path, name)
    if mp - {0}:
        raise CheckpointMismatchError(
            f"{path} holds model-parallel ranks {sorted(mp)}: megatrain_ds loads "
            "checkpoints without model (tensor) parallelism (mp_rank_00 only)"
        )
    return models, optims


def read_states(path: str, rank: int = 0, world: int = 1) -> CheckpointFiles:
    """Every saving rank's files of ``path``, for this ``rank`` of an engine of ``world`` ranks."""
    models, optims = _rank_files(path)
    for needed, found in (
        (os.path.join(path, MODEL_FILE), models.get(0)),
        (os.path.join(path, OPTIM_FILE), optims.get(0)),
    ):
        if found is None:
            raise FileNotFoundError(
                f"{needed} is missing (the folder holds {sorted(os.listdir(path))}): not a "
                "complete ZeRO-3 checkpoint"
            )
    first = _torch_load(optims[0])
    zero = first.get("optimizer_state_dict") or {}
    stage, partitions = zero.get("zero_stage"), zero.get("partition_count")
    ranks = max(partitions) if isinstance(partitions, (list, tuple)) else partitions
    if stage != 3 or not isinstance(ranks, int) or ranks < 1:
        raise CheckpointMismatchError(
            f"{optims[0]}: ZeRO stage {stage} saved by {ranks} rank(s); megatrain_ds loads ZeRO-3 "
            "checkpoints. "
            "Convert others with DeepSpeed's zero_to_fp32.py and load the weights into the model."
        )
    missing = [
        f
        for r in range(ranks)
        for f, have in ((model_file(r), r in models), (optim_file(r), r in optims))
        if not have
    ]
    if missing:
        raise FileNotFoundError(
            f"{path} was saved by {ranks} ranks, but {missing[:8]} are missing (the folder holds "
            f"{sorted(os.listdir(path))}): an incomplete ZeRO-3 checkpoint"
        )
    extra = sorted(r for r in set(models) | set(optims) if r >= ranks)
    if extra:
        raise CheckpointMismatchError(
            f"{path} was saved by {ranks} ranks (partition_count) but also holds files of "
            f"ranks {extra}: files of different saves (DeepSpeed's zero_to_fp32 refuses "
            "it too)"
        )
    optim_states = [first] + [_torch_load(optims[r]) for r in range(1, ranks)]
    states = [_torch_load(models[r]) for r in range(ranks)]
    for r, (state, optim) in enumerate(zip(states, optim_states)):
        inner_zero = optim.get("optimizer_state_dict") or {}
        if (
            state.get("dp_world_size", ranks) != ranks
            or inner_zero.get("partition_count") != partitions
        ):
            raise CheckpointMismatchError(
                f"rank {r}'s files of {path} say {state.get('dp_world_size')} data-parallel "
                f"ranks / partition count {inner_zero.get('partition_count')}, rank 0's "
                f"optimizer file {partitions}: files of different saves"
            )
    # DeepSpeed: each rank reads its own model-states file
    own = states[rank] if rank < ranks else states[0]
    shapes = states[0].get("param_shapes")
    masters = _masters(
        states, [o["optimizer_state_dict"]["fp32_flat_groups"] for o in optim_states]
    )
    inners = [o["optimizer_state_dict"].get("optimizer_state_dict") for o in optim_states]
    moments, step, groups, deepspeed_groups = None, 0, None, False
    if inners[0] is not None:
        if any(inner is None for inner in inners):
            raise CheckpointMismatchError(
                f"{path}: some ranks saved optimizer state and some did not"
            )
        moments, step, deepspeed_groups = _moments(shapes, inners)
        groups = (
            [{k: v for k, v in g.items() if k != "params"} for g in inners[0]["param_groups"]]
            if deepspeed_groups
            else inners[0]["param_groups"]
        )
    buffer_names = own.get("buffer_names") or []
    module = own.get("module") or {}
    saved_rng = [o.get("rng") for o in optim_states]
    return CheckpointFiles(
        path=path,
        world=ranks,
        masters=masters,
        trainable=[name for group in shapes for name in group],
        frozen_excluded=states[0].get("frozen_param_shapes") is None,
        moments=moments,
        step=step,
        param_groups=groups,
        group_keys_shared_only=deepspeed_groups,
        buffers={name: module[name].detach() for name in buffer_names if name in module},
        model_states=own,
        loss_scaler=_scaler_fields(own.get("loss_scaler", zero.get("loss_scaler"))),
        rng=saved_rng[rank] if ranks == world else None,
        rng_dropped=ranks != world and any(s is not None for s in saved_rng),
    )


def fp32_state_dict(path: str, tied: bool = True) -> dict[str, torch.Tensor]:
    """The whole fp32 weights (trainable and frozen, by parameter name) and persistent buffers of
    the checkpoint folder ``path`` (``save_dir/<tag>``), whatever number of ranks saved it (ours or
    DeepSpeed ZeRO-3's); as DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``: tied names
    (``shared_params``) map to the tensor of the name they are tied to (``tied=False`` leaves them
    out: safetensors refuses shared tensors). One rank's tensors are views of the memory-mapped
    file; N ranks' are joined, one parameter at a time."""
    ckpt = read_states(path)
    out = {name: _whole(t) for name, t in ckpt.masters.items()}
    for name, kept in (ckpt.model_states.get("shared_params") or {}).items() if tied else ():
        if kept in out:
            out[name] = out[kept]
    out.update(ckpt.buffers)
    return out
