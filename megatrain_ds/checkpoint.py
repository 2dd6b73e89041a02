"""Checkpoints in DeepSpeed's ZeRO-3 layout: written crash-safely, loaded only once they are known to fit.

    save_dir/latest                                           the tag, as text (written last)
    save_dir/zero_to_fp32.py, zero_to_torch.py                DeepSpeed's recovery scripts, copied as DS does
    save_dir/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt  buffers, parameter shapes, frozen parameters,
                                                              counters, scheduler, loss scaler, client state
    save_dir/<tag>/zero_pp_rank_0_mp_rank_00_optim_states.pt  fp32 master weights as ``fp32_flat_groups``,
                                                              Adam moments, group hyperparameters, RNG

The default tag is ``global_step{N}``. The fp32 masters are written as DeepSpeed ZeRO-3 (one process)
writes them: flat fp32 groups, each consumed in its ``param_shapes`` entry's order, so DeepSpeed's
``zero_to_fp32`` reads a megatrain_ds checkpoint. Here each streamed layer's trainable region is one group (a
view of the host master: ``torch.save`` writes the underlying buffer once, no second copy in RAM), then the
resident parameters; frozen parameters go in ``frozen_param_fragments``, tied names in ``shared_params``.

Writing. A save goes to ``save_dir/.<tag>.tmp-<pid>``, every file is fsynced, the directory is renamed into
place (a previous folder of the same tag is first moved aside to ``.<tag>.old-<pid>``), and only then is
``latest`` replaced (through ``.latest.tmp-<pid>`` and ``os.replace``). A process killed at any moment leaves
the previous checkpoint and ``latest`` intact; what it leaves behind is cleaned by the next save
(``clean_stale``) or put back when the kill landed between the two renames (``_restore_moved_aside``).

Reading. ``load_checkpoint`` reads both files into a ``_Checkpoint`` (every tensor by parameter name), checks
it against the engine (names and shapes of every parameter and buffer, the optimizer state's parameters and
group count, the scheduler's and scaler's keys) and only then writes masters, buffers, moments, counters,
scheduler, scaler and RNG: a checkpoint that does not fit raises ``CheckpointMismatchError`` listing every
problem, with the engine untouched. Two sources are read, told apart by their optimizer state:

- megatrain_ds: moments as flat buffers (``HostAdamW.host_state_dict``): the streamed layers' moments laid out
  as their fp32 groups, then one tensor per resident parameter;
- DeepSpeed ZeRO-3 saved by one rank (its ``stage3._rigid_state_dict``): the torch optimizer's state dict,
  one flat ``exp_avg``/``exp_avg_sq`` per sub-group, sub-group k aligned with ``fp32_flat_groups[k]`` and
  ``param_shapes[k]``; no RNG and no ``micro_steps`` (derived from the step count).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import stat
import warnings
from dataclasses import dataclass

import torch

MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"
OPTIM_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
BF16_OPTIM_FILE = "bf16_" + OPTIM_FILE  # DeepSpeed's name for it when bf16 is on
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # what DeepSpeed's _copy_recovery_script copies
# keys of the model-states file that are not the client's (ours and DeepSpeed's)
_RESERVED = {"module", "global_steps", "global_samples", "micro_steps", "skipped_steps", "lr_scheduler",
             "loss_scaler", "ds_config", "ds_version", "megatrain_version", "hf_config", "buffer_names", "param_shapes",
             "frozen_param_shapes", "frozen_param_fragments", "shared_params",
             "optimizer", "dp_world_size", "mp_world_size", "data_sampler", "random_ltd",
             "sparse_tensor_module_names", "checkpoint_parallel_dimensions", "universal_checkpoint_info"}
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")  # what an interrupted save leaves
_MAX_LISTED = 20  # problems listed in one error


class CheckpointMismatchError(RuntimeError):
    """The checkpoint does not fit this engine (or is not a one-rank ZeRO-3 checkpoint). Raised before anything
    was written: the engine is as it was."""


# ---------------------------------------------------------------------------------------------- writing
def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process on this host (another user's counts as live)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _restore_moved_aside(save_dir: str, tag: str) -> str | None:
    """A save of an existing tag moves the old folder to ``.<tag>.old-<pid>`` before renaming the new one in. A
    kill between the two renames leaves no ``<tag>`` folder: put the old one (complete) back. Returns it."""
    final = os.path.join(save_dir, tag)
    for name in sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else []:
        m = _LEFTOVER.match(name)
        if m and m["kind"] == "old" and m["name"] == tag and not _pid_alive(int(m["pid"])):
            try:
                os.rename(os.path.join(save_dir, name), final)  # fails if another process restored it first
            except OSError:
                continue
            _fsync_dir(save_dir)
            warnings.warn(f"{final} was missing (a save of tag {tag!r} was killed between its renames): put back "
                          f"the previous checkpoint from {name}", stacklevel=3)
            return final
    return None


def clean_stale(save_dir: str) -> list[str]:
    """Remove what saves killed part-way left in ``save_dir`` (``.<tag>.tmp-<pid>`` folders, ``.latest.tmp-<pid>``
    and ``.<script>.tmp-<pid>`` files, ``.<tag>.old-<pid>`` folders whose tag folder exists again; one whose
    tag folder is missing is put back instead). Only entries of processes that are no longer alive: a running
    save's files are never touched. Pids are host-local: one host saves into a save_dir (as DeepSpeed's
    rank 0 does). Returns the paths handled."""
    handled = []
    for name in sorted(os.listdir(save_dir)):
        m = _LEFTOVER.match(name)
        if m is None or _pid_alive(int(m["pid"])):
            continue
        path = os.path.join(save_dir, name)
        if m["kind"] == "old" and not os.path.lexists(os.path.join(save_dir, m["name"])):
            if _restore_moved_aside(save_dir, m["name"]):
                handled.append(path)
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:  # another process cleaned it first
                continue
        handled.append(path)
    return handled


def _deepspeed_file(relative: str) -> str | None:
    """A file of the installed deepspeed package, found without importing it (that takes seconds): the
    distribution's files first (whatever ``sys.modules["deepspeed"]`` is), else the package on sys.path
    (an editable install)."""
    try:
        path = str(importlib.metadata.distribution("deepspeed").locate_file(f"deepspeed/{relative}"))
        if os.path.isfile(path):
            return path
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("deepspeed")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        if os.path.isfile(os.path.join(root, relative)):
            return os.path.join(root, relative)
    return None


def _copy_recovery_scripts(save_dir: str) -> None:
    """DeepSpeed puts its ``zero_to_fp32.py`` (and ``zero_to_torch.py``) in every save_dir so that the fp32
    weights can be recovered without the training code; users and tools expect them there. Copied from the
    installed deepspeed (never vendored), with DeepSpeed's mode (``copyfile`` + the owner's exec bit), through
    a temporary name so that a kill never leaves half a script."""
    for script in RECOVERY_SCRIPTS:
        src = _deepspeed_file(f"utils/{script}")
        if src is None:
            continue
        tmp = os.path.join(save_dir, f".{script}.tmp-{os.getpid()}")
        shutil.copyfile(src, tmp)
        os.chmod(tmp, os.stat(tmp).st_mode | stat.S_IEXEC)
        os.replace(tmp, os.path.join(save_dir, script))


def _fp32_layout(engine):
    """(fp32 flat groups, param_shapes per group, frozen name -> tensor), as ZeRO-3 with one process lays
    them out: the groups are views of the host masters, in the order their parameters are listed."""
    engine.sync_masters_to_host()
    store, groups, shapes, frozen = engine.store, [], [], {}
    for i, layout in enumerate(store.layouts):
        master = store.master_of(i)
        names = {}
        for slot in layout.slots:
            key = f"{engine.block_name}.{i}.{slot.name}"
            if slot.trainable:
                names[key] = torch.Size(slot.shape)
            else:
                start = layout.n_train + slot.offset
                frozen[key] = master[start:start + slot.numel].view(slot.shape)
        if names:
            groups.append(master[:layout.n_train])
            shapes.append(names)
    by_id = {id(p): n for n, p in engine.module.named_parameters()}
    for p, m, g in zip(engine.resident.params, engine.resident.master, engine.resident.grad):
        if g is None:  # not trained: stored as a frozen parameter
            frozen[by_id[id(p)]] = m.detach().cpu().view(p.shape)
        else:
            groups.append(m.detach().cpu().reshape(-1))
            shapes.append({by_id[id(p)]: torch.Size(p.shape)})
    return groups, shapes, frozen


def _shared_params(module: torch.nn.Module) -> dict[str, str]:
    """Tied names: {name that is dropped by named_parameters(): the name that is kept}."""
    kept = {id(p): n for n, p in module.named_parameters()}
    return {n: kept[id(p)] for n, p in module.named_parameters(remove_duplicate=False) if kept[id(p)] != n}


def _persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``state_dict()`` holds (DeepSpeed's ``_get_buffer_names``: non-persistent ones are left out)."""
    out = {}
    for prefix, sub in module.named_modules():
        for name, buf in sub._buffers.items():
            if buf is not None and name not in sub._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def save_checkpoint(engine, save_dir: str, tag=None, client_state=None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> bool:
    # ds_version: the DeepSpeed whose file format this follows and whose zero_to_fp32 reads it (the installed one;
    # megatrain_ds.__version__ is that); megatrain_version: who wrote it
    from . import MEGATRAIN_VERSION, __version__

    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    os.makedirs(save_dir, exist_ok=True)
    clean_stale(save_dir)
    groups, param_shapes, frozen = _fp32_layout(engine)
    buffers = {n: b.detach().cpu() for n, b in _persistent_buffers(engine.module).items()}
    scaler = engine.config_settings.loss_scaler
    model_states = {
        "module": buffers, "buffer_names": list(buffers), "param_shapes": param_shapes,
        # None when excluded, as DeepSpeed writes it: the loader then expects no frozen weights
        "frozen_param_shapes": None if exclude_frozen_parameters else {n: t.shape for n, t in frozen.items()},
        "frozen_param_fragments": None if exclude_frozen_parameters else {n: t.reshape(-1) for n, t in frozen.items()},
        "shared_params": _shared_params(engine.module),
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
        "dp_world_size": 1, "mp_world_size": 1,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scaler": None if scaler is None else {k: getattr(scaler, k) for k in scaler.__slots__},
        "ds_config": engine.config, "ds_version": __version__, "megatrain_version": MEGATRAIN_VERSION,
        "hf_config": engine.module.config.to_dict() if hasattr(getattr(engine.module, "config", None), "to_dict")
        else None, **dict(client_state or {})}
    optim_states = {"optimizer_state_dict": {
        "zero_stage": 3, "partition_count": 1, "fp32_flat_groups": groups,
        "optimizer_state_dict": engine.optimizer.host_state_dict() if engine.optimizer else None},
        "rng": _rng_state(), "ds_version": __version__}
    tmp = os.path.join(save_dir, f".{tag}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    _save(model_states, os.path.join(tmp, MODEL_FILE))
    _save(optim_states, os.path.join(tmp, OPTIM_FILE))
    _fsync_dir(tmp)
    final = os.path.join(save_dir, tag)
    old = None
    if os.path.exists(final):  # replacing a checkpoint of the same tag: keep it until the new one is in place
        old = os.path.join(save_dir, f".{tag}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(save_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _copy_recovery_scripts(save_dir)
    if save_latest:
        latest_tmp = os.path.join(save_dir, f".latest.tmp-{os.getpid()}")
        with open(latest_tmp, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, os.path.join(save_dir, "latest"))
    _fsync_dir(save_dir)
    return True


# ---------------------------------------------------------------------------------------------- reading
@dataclass(slots=True)
class _Checkpoint:
    """A checkpoint read into memory, every tensor by parameter or buffer name (views of the loaded files)."""

    path: str
    masters: dict[str, torch.Tensor]  # fp32 weights, trainable and frozen
    trainable: list[str]  # the names in param_shapes: parameters the saving optimizer owned
    frozen_excluded: bool  # saved with exclude_frozen_parameters: frozen weights are absent
    moments: dict | None  # name -> (exp_avg, exp_avg_sq), or None (no state yet: zeros); None: no optimizer
    step: int  # the optimizer's step count (bias correction)
    param_groups: list[dict] | None  # hyperparameters per group, without "params"
    group_keys_shared_only: bool  # DeepSpeed's groups carry keys ours lack (bias_correction, amsgrad)
    buffers: dict[str, torch.Tensor]
    model_states: dict  # counters, scheduler, client state
    loss_scaler: dict | None  # as LossScaler fields
    rng: dict | None


def _checkpoint_path(load_dir: str, tag) -> str | None:
    """The folder to load, or None where DeepSpeed loads nothing (no tag and no ``latest``: it warns)."""
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            warnings.warn(f"Unable to find latest file at {latest}, if trying to load latest checkpoint please ensure "
                          "this file exists or pass an explicit checkpoint tag when loading a checkpoint.",
                          stacklevel=4)  # the caller of engine.load_checkpoint
            return None
        with open(latest) as f:
            tag = f.read().strip()
        if not tag:
            raise FileNotFoundError(f"{latest} is empty: it should name a checkpoint folder of {load_dir}; "
                                    "pass tag= to load one explicitly")
        origin = f"{latest} names tag {tag!r}"
    else:
        origin = f"tag {tag!r} was asked for"
    path = os.path.join(load_dir, str(tag))
    if not os.path.isdir(path):
        _restore_moved_aside(load_dir, str(tag))
    if not os.path.isdir(path):
        others = sorted(n for n in os.listdir(load_dir) if os.path.isdir(os.path.join(load_dir, n))
                        and not n.startswith(".")) if os.path.isdir(load_dir) else []
        raise FileNotFoundError(f"{origin}, but {path} does not exist (moved or deleted?); checkpoints in "
                                f"{load_dir}: {others or 'none'}. Pass tag= to load one of them.")
    return path


def _split(flat: torch.Tensor, shapes: dict, what: str) -> dict[str, torch.Tensor]:
    """Views of ``flat`` shaped by ``shapes`` (name -> shape), consumed in order; padding at the end is ignored
    (DeepSpeed may pad a group for alignment)."""
    need = sum(torch.Size(s).numel() for s in shapes.values())
    if flat.numel() < need:
        raise CheckpointMismatchError(f"{what} holds {flat.numel()} elements but its param_shapes entry needs "
                                      f"{need}: a truncated file, or not a one-rank ZeRO-3 checkpoint")
    out, offset = {}, 0
    for name, shape in shapes.items():
        n = torch.Size(shape).numel()
        out[name] = flat[offset:offset + n].view(shape)
        offset += n
    return out


def _unflatten(model_states: dict, groups: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameter name -> fp32 tensor (views of the loaded groups), as zero_to_fp32 reconstructs them."""
    shapes = model_states.get("param_shapes")
    if shapes is None or len(shapes) != len(groups):
        raise CheckpointMismatchError(f"{len(groups)} fp32_flat_groups but "
                                      f"{'no' if shapes is None else len(shapes)} param_shapes groups: the two "
                                      "files are not from one ZeRO-3 save (or it was saved without an optimizer)")
    out = {}
    for k, (flat, group) in enumerate(zip(groups, shapes)):
        out.update(_split(flat.reshape(-1), group, f"fp32_flat_groups[{k}]"))
    fragments = model_states.get("frozen_param_fragments") or {}
    for name, shape in (model_states.get("frozen_param_shapes") or {}).items():
        fragment = fragments[name].reshape(-1)
        if fragment.numel() != torch.Size(shape).numel():
            raise CheckpointMismatchError(f"frozen parameter {name}: {fragment.numel()} elements saved for shape "
                                          f"{tuple(shape)} (a checkpoint of several ranks?)")
        out[name] = fragment.view(shape)
    return out


def _moments_ours(state: dict, shapes: list[dict]) -> dict:
    """megatrain_ds's moments by name: the streamed layers' flat buffer covers the first groups (layer by layer,
    as ``fp32_flat_groups``), then one tensor per trained resident parameter (None entries: not trained)."""
    flat_m, flat_v = state["exp_avg"].reshape(-1), state["exp_avg_sq"].reshape(-1)
    out, offset, k = {}, 0, 0
    while offset < flat_m.numel() and k < len(shapes):
        n = sum(torch.Size(s).numel() for s in shapes[k].values())
        m = _split(flat_m[offset:offset + n], shapes[k], f"exp_avg (group {k})")
        v = _split(flat_v[offset:offset + n], shapes[k], f"exp_avg_sq (group {k})")
        out.update({name: (m[name], v[name]) for name in shapes[k]})
        offset, k = offset + n, k + 1
    if offset != flat_m.numel():
        raise CheckpointMismatchError(f"the layers' Adam moments hold {flat_m.numel()} elements, which do not end on "
                                      "a parameter group of param_shapes: the files are not from one save")
    resident = [(m, v) for m, v in zip(state["resident_exp_avg"], state["resident_exp_avg_sq"]) if m is not None]
    if len(resident) != len(shapes) - k:
        raise CheckpointMismatchError(f"{len(resident)} resident moment tensors for {len(shapes) - k} resident "
                                      "parameter groups: the files are not from one save")
    for group, (m, v) in zip(shapes[k:], resident):
        (name, shape), = group.items()
        out[name] = (m.reshape(shape), v.reshape(shape))
    return out


def _moments_deepspeed(inner: dict, shapes: list[dict]) -> tuple[dict, int]:
    """DeepSpeed ZeRO-3's moments by name, and the step count. Its torch optimizer numbers the fp32 sub-groups
    param group by param group, sub-group order within each (stage3 ``_set_fp32_optimizer_param_groups``):
    the k-th index listed is sub-group k."""
    order = [index for group in inner["param_groups"] for index in group["params"]]
    if len(order) != len(shapes):
        raise CheckpointMismatchError(f"DeepSpeed optimizer state lists {len(order)} sub-groups for {len(shapes)} "
                                      "fp32_flat_groups: not a one-rank ZeRO-3 checkpoint of this layout")
    out, steps = {}, []
    for k, (index, group) in enumerate(zip(order, shapes)):
        state = inner["state"].get(index) or {}
        if "exp_avg" not in state:  # the sub-group never stepped: fresh moments
            out.update({name: None for name in group})
            continue
        steps.append(int(state["step"]))
        m = _split(state["exp_avg"].reshape(-1), group, f"exp_avg of sub-group {k}")
        v = _split(state["exp_avg_sq"].reshape(-1), group, f"exp_avg_sq of sub-group {k}")
        out.update({name: (m[name], v[name]) for name in group})
    return out, max(steps, default=0)


def _scaler_fields(saved) -> dict | None:
    """A loss-scaler state as our LossScaler's fields: ours is saved as a dict, DeepSpeed pickles its object (a
    static one, as in fp32 and bf16 runs, carries nothing to resume: scale 1 would only overwrite ours)."""
    if saved is None or isinstance(saved, dict):
        return saved or None
    if getattr(saved, "dynamic", False) is not True:
        return None
    mapping = {"cur_scale": "scale", "cur_iter": "_iter", "last_overflow_iter": "_last_overflow",
               "cur_hysteresis": "_hysteresis_left"}
    return {ours: getattr(saved, theirs) for theirs, ours in mapping.items() if hasattr(saved, theirs)} or None


def _read(path: str) -> _Checkpoint:
    model_file = os.path.join(path, MODEL_FILE)
    optim_file = next((os.path.join(path, f) for f in (OPTIM_FILE, BF16_OPTIM_FILE)
                       if os.path.isfile(os.path.join(path, f))), None)
    for needed, found in ((model_file, os.path.isfile(model_file)), (os.path.join(path, OPTIM_FILE), optim_file)):
        if not found:
            raise FileNotFoundError(f"{needed} is missing (the folder holds {sorted(os.listdir(path))}): not a "
                                    "complete one-rank ZeRO-3 checkpoint")
    model_states = torch.load(model_file, map_location="cpu", weights_only=False)
    optim = torch.load(optim_file, map_location="cpu", weights_only=False, mmap=True)
    zero = optim.get("optimizer_state_dict") or {}
    stage, partitions = zero.get("zero_stage"), zero.get("partition_count")
    ranks = max(partitions) if isinstance(partitions, (list, tuple)) else partitions
    if stage != 3 or ranks != 1 or model_states.get("dp_world_size", 1) != 1:
        raise CheckpointMismatchError(
            f"{optim_file}: ZeRO stage {stage} saved by {ranks} rank(s); megatrain_ds loads ZeRO-3 checkpoints of "
            "one rank. Convert others with DeepSpeed's zero_to_fp32.py and load the weights into the model.")
    shapes = model_states.get("param_shapes")
    masters = _unflatten(model_states, zero["fp32_flat_groups"])
    inner = zero.get("optimizer_state_dict")
    moments, step, groups, deepspeed_groups = None, 0, None, False
    if inner is not None and "state" in inner:  # DeepSpeed: a torch optimizer's state dict
        moments, step = _moments_deepspeed(inner, shapes)
        groups, deepspeed_groups = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]], True
    elif inner is not None:  # megatrain_ds: HostAdamW.host_state_dict()
        moments, step, groups = _moments_ours(inner, shapes), inner["step_count"], inner["param_groups"]
    buffer_names = model_states.get("buffer_names") or []
    module = model_states.get("module") or {}
    return _Checkpoint(
        path=path, masters=masters, trainable=[name for group in shapes for name in group],
        frozen_excluded=model_states.get("frozen_param_shapes") is None, moments=moments, step=step,
        param_groups=groups, group_keys_shared_only=deepspeed_groups,
        buffers={name: module[name] for name in buffer_names if name in module}, model_states=model_states,
        loss_scaler=_scaler_fields(model_states.get("loss_scaler", zero.get("loss_scaler"))), rng=optim.get("rng"))


# ---------------------------------------------------------------------------------------------- checking
def _engine_params(engine) -> dict[str, tuple[tuple, bool]]:
    """name -> (shape, trained by the optimizer) for every parameter, named as ``master_state_dict()``."""
    out = {}
    for i, layout in enumerate(engine.store.layouts):
        for slot in layout.slots:
            out[f"{engine.block_name}.{i}.{slot.name}"] = (tuple(slot.shape), slot.trainable)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    for k, p in enumerate(engine.resident.params):
        out[names[id(p)]] = (tuple(getattr(p, "ds_shape", p.shape)), engine.resident.grad[k] is not None)
    return out


def _name_problems(what: str, saved: dict, expected: dict[str, tuple], strict: bool, may_miss=frozenset()):
    """Shape mismatches (always: they cannot be loaded) and, when strict, missing and unexpected names."""
    problems = [f"{what} {name}: shape {tuple(t.shape)} in the checkpoint, {expected[name]} in the model"
                for name, t in saved.items() if name in expected and tuple(t.shape) != tuple(expected[name])]
    if strict:
        missing = [n for n in expected if n not in saved and n not in may_miss]
        unexpected = [n for n in saved if n not in expected]
        if missing:
            problems.append(f"{what}s missing from the checkpoint ({len(missing)}): {missing[:8]}")
        if unexpected:
            problems.append(f"{what}s in the checkpoint that the model lacks ({len(unexpected)}): {unexpected[:8]}")
    return problems


def _validate(engine, ckpt: _Checkpoint, strict: bool, load_optimizer: bool, load_scheduler: bool,
              module_only: bool) -> None:
    params = _engine_params(engine)
    frozen = {n for n, (_, trained) in params.items() if not trained}
    problems = _name_problems("parameter", ckpt.masters, {n: s for n, (s, _) in params.items()}, strict,
                              may_miss=frozen if ckpt.frozen_excluded else frozenset())
    buffers = {n: tuple(b.shape) for n, b in _persistent_buffers(engine.module).items()}
    problems += _name_problems("buffer", ckpt.buffers, buffers, strict)
    hint = "load_module_strict=False loads what matches"
    if not module_only and load_optimizer and engine.optimizer is not None:
        hint += "; load_optimizer_states=False loads the weights without the optimizer state"
        if ckpt.moments is None:
            problems.append("the checkpoint has no optimizer state (saved by an engine without an optimizer)")
        else:
            trained, saved = {n for n in params if n not in frozen}, set(ckpt.trainable)
            if trained != saved:
                problems.append(f"optimizer state: trained here but not in the checkpoint's optimizer: "
                                f"{sorted(trained - saved)[:8]}; in the checkpoint's optimizer but not trained here: "
                                f"{sorted(saved - trained)[:8]}")
            if len(ckpt.param_groups) != len(engine.optimizer.param_groups):
                problems.append(f"optimizer: {len(ckpt.param_groups)} param groups in the checkpoint, "
                                f"{len(engine.optimizer.param_groups)} here")
    saved_sched = ckpt.model_states.get("lr_scheduler")
    if not module_only and load_scheduler and engine.lr_scheduler is not None and saved_sched:
        hint += "; load_lr_scheduler_states=False keeps this engine's schedule"
        lacking = sorted(set(engine.lr_scheduler.state_dict()) - set(saved_sched))
        if lacking:
            problems.append(f"lr scheduler: the saved state lacks {lacking} that this "
                            f"{type(engine.lr_scheduler).__name__} needs (a different scheduler?)")
    scaler = engine.config_settings.loss_scaler
    if not module_only and scaler is not None and ckpt.loss_scaler:
        unknown = sorted(set(ckpt.loss_scaler) - set(type(scaler).__slots__))
        if unknown:
            problems.append(f"loss scaler: unknown fields {unknown}")
    if problems:
        listed = "\n  - ".join(problems[:_MAX_LISTED])
        raise CheckpointMismatchError(f"checkpoint {ckpt.path} does not fit this engine; nothing was loaded:\n"
                                      f"  - {listed}\n({hint})")


# ---------------------------------------------------------------------------------------------- applying
def _write_buffers(engine, saved: dict[str, torch.Tensor]) -> None:
    """In place, so every holder of the tensor sees it; a streamed layer's buffer may also have a separate
    device copy in the executor (layer i = names under ``<block_name>.<i>.``)."""
    prefix = engine.block_name + "."
    for name, buf in _persistent_buffers(engine.module).items():
        if name not in saved:
            continue
        buf.copy_(saved[name])
        if name.startswith(prefix):
            index, _, local = name[len(prefix):].partition(".")
            copy = engine.executor.buffers[int(index)].get(local)
            if copy is not None and copy is not buf:
                copy.copy_(saved[name])


def _write_moments(engine, moments: dict) -> None:
    """Adam moments into the host buffers (and the GPU-held layers' copies); a name without state gets zeros."""
    def put(dst, pair, which):
        if pair is None:
            dst.zero_()
        else:
            dst.copy_(pair[which].reshape(dst.shape))

    store = engine.store
    for i, layout in enumerate(store.layouts):
        m, v = store.train_slice(store.exp_avg, i), store.train_slice(store.exp_avg_sq, i)
        for slot in layout.slots:
            if slot.trainable:
                pair = moments.get(f"{engine.block_name}.{i}.{slot.name}")
                put(m[slot.offset:slot.offset + slot.numel], pair, 0)
                put(v[slot.offset:slot.offset + slot.numel], pair, 1)
    res, names = engine.resident, {id(p): n for n, p in engine.module.named_parameters()}
    for k, p in enumerate(res.params):
        if res.exp_avg[k] is not None:
            put(res.exp_avg[k], moments.get(names[id(p)]), 0)
            put(res.exp_avg_sq[k], moments.get(names[id(p)]), 1)
    ds = engine.executor.device_state
    if ds is not None:
        ds.exp_avg.copy_(store.exp_avg[ds.train0:ds.train1])
        ds.exp_avg_sq.copy_(store.exp_avg_sq[ds.train0:ds.train1])


def _apply(engine, ckpt: _Checkpoint, load_optimizer: bool, load_scheduler: bool, module_only: bool) -> None:
    engine.synchronize()  # no queued optimizer task may write the masters after this
    # strictness was checked by _validate (it knows which names a frozen-excluded checkpoint may lack)
    engine.load_master_state_dict(ckpt.masters, strict=False)
    _write_buffers(engine, ckpt.buffers)
    if module_only:
        return
    optimizer, states = engine.optimizer, ckpt.model_states
    if load_optimizer and optimizer is not None:
        _write_moments(engine, ckpt.moments)
        optimizer.step_count = ckpt.step
        for group, saved in zip(optimizer.param_groups, ckpt.param_groups):
            group.update({k: v for k, v in saved.items() if k in group or not ckpt.group_keys_shared_only})
        if ckpt.rng is not None:
            torch.set_rng_state(ckpt.rng["torch"])
            if "cuda" in ckpt.rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(ckpt.rng["cuda"])
    if load_scheduler and engine.lr_scheduler is not None and states.get("lr_scheduler"):
        engine.lr_scheduler.load_state_dict(states["lr_scheduler"])
    settings = engine.config_settings
    engine.global_steps = states["global_steps"]
    engine.global_samples = states.get("global_samples", engine.global_steps * settings.train_batch_size)
    # DeepSpeed does not save micro_steps: a checkpoint is taken at an accumulation boundary
    engine.micro_steps = states.get("micro_steps", engine.global_steps * settings.gradient_accumulation_steps)
    engine.skipped_steps = states.get("skipped_steps", 0)
    if settings.loss_scaler is not None and ckpt.loss_scaler:
        for key, value in ckpt.loss_scaler.items():
            setattr(settings.loss_scaler, key, value)


def load_checkpoint(engine, load_dir: str, tag=None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False):
    """Returns ``(path, client_state)``; ``(None, None)`` with DeepSpeed's warning when no tag is given and
    ``load_dir`` has no ``latest``. A tag (given or named by ``latest``) whose files are missing raises
    ``FileNotFoundError``; a checkpoint that does not fit raises ``CheckpointMismatchError`` before any write."""
    path = _checkpoint_path(load_dir, tag)
    if path is None:
        return None, None
    ckpt = _read(path)
    _validate(engine, ckpt, load_module_strict, load_optimizer_states, load_lr_scheduler_states, load_module_only)
    _apply(engine, ckpt, load_optimizer_states, load_lr_scheduler_states, load_module_only)
    return path, {k: v for k, v in ckpt.model_states.items() if k not in _RESERVED}


# ---------------------------------------------------------------------------------------------- 16-bit export
def _frozen_ids(engine) -> set[int]:
    """What ``exclude_frozen_parameters`` leaves out: parameters with ``requires_grad`` False (DeepSpeed's
    rule) and, when the engine has an optimizer, parameters in none of its groups (never trained here)."""
    in_optimizer = None
    if engine.optimizer is not None:
        in_optimizer = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    return {id(p) for p in engine.module.parameters()
            if not p.requires_grad or (in_optimizer is not None and id(p) not in in_optimizer)}


def consolidated_state_dict(engine, dtype: torch.dtype | None = None,
                            exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's ``state_dict()`` on the CPU, parameters from their fp32 masters cast to ``dtype``
    (default: the compute dtype), persistent buffers as they are; tied names each get their tensor."""
    masters = engine.master_state_dict()  # one sync; views of the host masters
    dtype = dtype or engine.compute_dtype
    kept = {id(p): n for n, p in engine.module.named_parameters()}  # tied names share one master
    skip = _frozen_ids(engine) if exclude_frozen_parameters else set()
    out = {}
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.nn.Parameter):
            if id(tensor) not in skip:
                out[name] = masters[kept[id(tensor)]].to(dtype, copy=True)
        else:  # persistent buffer
            out[name] = tensor.detach().cpu().clone()
    return out


def save_16bit_model(engine, save_dir: str, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """Consolidated weights in the compute dtype, written atomically; ``*.safetensors`` names use safetensors."""
    os.makedirs(save_dir, exist_ok=True)
    clean_stale(save_dir)  # a killed export's .<file>.tmp-<pid>
    state = consolidated_state_dict(engine, exclude_frozen_parameters=exclude_frozen_parameters)
    final = os.path.join(save_dir, save_filename)
    tmp = os.path.join(save_dir, f".{save_filename}.tmp-{os.getpid()}")
    if save_filename.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, tmp, metadata={"format": "pt"})
    else:
        _save(state, tmp)
    os.replace(tmp, final)
    return True
