"""Checkpoints in DeepSpeed's ZeRO-3 layout: written crash-safely, loaded only once they are known
to fit.

    save_dir/latest
        the tag, as text (written last)
    save_dir/zero_to_fp32.py, zero_to_torch.py
        DeepSpeed's recovery scripts, copied as DS does
    save_dir/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt
        buffers, parameter shapes, frozen parameters, counters, scheduler, loss scaler, client state
    save_dir/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt
        fp32 master weights as ``fp32_flat_groups``, Adam state, DeepSpeed's loss scaler, RNG
        (``bf16_zero_pp_rank_...`` in bf16 runs, as DS)
    save_dir/<tag>/zero_pp_rank_<r>_checksums.sha256
        the SHA-256 of both files (checksums.py)

one pair of files per rank r of the run that saved (N ranks: r = 0 .. N-1). The default tag is
``global_step<global_steps>``. The optimizer file is what real DeepSpeed ZeRO-3 on N ranks writes,
and reads back by position in its ``load_checkpoint`` (wayback.py computes its layout;
docs/wayback.md): its fp32 sub-groups (the trained parameters in its optimizer groups' order, cut at
``zero_optimization.sub_group_size``), each a flat fp32 tensor holding, for each of its parameters,
rank r's ZeRO-3 partition (``ceil(numel / N)`` elements, zero-padded past the end), listed in
``param_shapes``; the torch state dict of its CPU Adam (one state per sub-group: step and moments,
partitioned as the masters); its loss-scaler object. megatrain_ds reads the same files (one set
serves both), as does DeepSpeed's ``zero_to_fp32``. Frozen parameters go in
``frozen_param_fragments`` (rank r's partition of each, as ZeRO-3's ``ds_tensor``), tied names in
``shared_params``; ``module`` lists every state_dict name as DeepSpeed's does (empty parameters,
buffers with their values), and ``deepspeed_resume`` why DeepSpeed could not resume it (empty: it
can).

Each rank plans its two files first (checkpoint_stream.py: the objects pickled, every record laid
out), so their exact sizes are known before anything is written; rank 0 checks the free space
against them (``prepare_folder``: an OSError naming the bytes needed and free, nothing written,
where the disk cannot hold the checkpoint), then every rank has the file system give each of its
files (and its manifest) its exact size (``reserve_files``, posix_fallocate: a ``DiskSpaceError``
naming the file and the bytes, nothing written, where it does not). Then each rank streams its files
into them: the big tensors (fp32 sub-groups, moments, frozen fragments) are produced chunk by chunk
from the host state while their records are written (views of it with one rank: nothing is copied,
in memory or on disk; checkpoint_partition.py), so a save takes the disk of the checkpoint it writes
and no more. With N ranks (data parallel, dp.py) a layer's state is held by its owner rank only, so
the owner scatters each rank its partitions of the layer over the gloo group as the records are
written (transient memory: one layer's partitions of one kind); a rank whose write fails keeps
producing its chunks (the exchanges) until its files are done, then every rank raises. Resident
parameters are replicated: each rank cuts its partitions locally. (megatrain_ds before the way back
wrote one group per layer and its own flat moments; those files still load.)

Writing. A save goes to ``save_dir/.<tag>.tmp-<pid>`` (rank 0's pid: every rank writes into one
folder), every file is fsynced, the ranks agree that all files are written, then rank 0 renames the
directory into place (a previous folder of the same tag is first moved aside to
``.<tag>.old-<pid>``, kept until the new one is in place; where the disk cannot hold both, it is
removed first, with a warning) and only then replaces ``latest`` (through ``.latest.tmp-<pid>`` and
``os.replace``); the other ranks return once it has. A process killed at any moment leaves the
previous checkpoint and ``latest`` intact; what it leaves behind is cleaned by the next save
(``clean_stale``) or put back when the kill landed between the two renames
(``_restore_moved_aside``): the folder's life across the ranks is checkpoint_folder.py.

Reading. ``load_checkpoint`` reads every rank's files into a ``CheckpointFiles``
(checkpoint_files.py: it reads ours and real DeepSpeed ZeRO-3's, saved by any number of ranks),
checks it against the engine (names and shapes of every parameter and buffer, the optimizer state's
parameters and group count, the scheduler's and scaler's keys), the ranks agree that it fits
everywhere, and only then does each rank write what it holds (its own layers' masters and moments,
the replicated resident ones), buffers, counters, scheduler, scaler and RNG: a checkpoint that does
not fit raises ``CheckpointMismatchError`` listing every problem, on every rank, with the engine
untouched. A checkpoint of N ranks loads into an engine of any M ranks; the RNG state comes back
only when N == M (rank r's own).

Full weights (``consolidated_state_dict``, ``save_16bit_model``, ``gather_full_masters``) are in
export.py, and ``fp32_state_dict(path)`` (the whole fp32 weights of a folder saved by any number of
ranks) in checkpoint_files.py; ``fp32_state_dict`` and the file names are importable from here as
well.
"""

from __future__ import annotations

import shutil
import time
import warnings

import torch

from .. import _version
from . import wayback
from ..log import log
from .adapters import is_peft_model, save_adapter
from .checksums import MANIFEST, manifest_bytes, write_manifest
from .checksums import verify as verify_checksums
from .checkpoint_files import (
    CheckpointMismatchError,
    CheckpointFiles,
    read_states,
    model_file,
    optim_file,
)

# re-exported
from .checkpoint_files import BF16_OPTIM_FILE, MODEL_FILE, OPTIM_FILE, fp32_state_dict  # noqa: F401
from .checkpoint_folder import RECOVERY_SCRIPTS, clean_stale  # noqa: F401 (re-exported)
from .checkpoint_folder import (
    checkpoint_path_of,
    commit_folder,
    fsync_dir,
    prepare_folder,
    reserve_files,
)
from .checkpoint_folder import CheckpointWorld
from .checkpoint_partition import PartitionParam, partition_plan, RankState
from .checkpoint_stream import SaveTimes, StreamedFile, write_files
from .parts import CheckpointParts, CheckpointSaved
from .step_counters import StepCounters

# keys of the model-states file that are not the client's (ours and DeepSpeed's)
_RESERVED = {
    "module",
    *StepCounters.keys(),
    "lr_scheduler",
    "loss_scaler",
    "ds_config",
    "ds_version",
    "megatrain_version",
    "hf_config",
    "buffer_names",
    "param_shapes",
    "frozen_param_shapes",
    "frozen_param_fragments",
    "shared_params",
    "optimizer",
    "dp_world_size",
    "mp_world_size",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "checkpoint_parallel_dimensions",
    "universal_checkpoint_info",
    "deepspeed_resume",
}
_MAX_LISTED = 20  # problems listed in one error


# ------------------------------------------------------------------------------------------ writing
def _module_states(
    module: torch.nn.Module, buffers: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The ``module`` entry as DeepSpeed's ZeRO-3 writes it: every state_dict name, a parameter as
    an empty tensor of its dtype (its values are in the optimizer files' fp32 partitions), a buffer
    with its values. Real DeepSpeed's ``load_checkpoint`` loads it into its partitioned module
    strictly, so a megatrain_ds checkpoint resumes there."""
    return {
        name: buffers[name] if name in buffers else torch.empty(0, dtype=t.dtype)
        for name, t in module.state_dict(keep_vars=True).items()
    }


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _shared_params(module: torch.nn.Module) -> dict[str, str]:
    """Tied names: {name that is dropped by named_parameters(): the name that is kept}."""
    kept = {id(p): n for n, p in module.named_parameters()}
    return {
        n: kept[id(p)]
        for n, p in module.named_parameters(remove_duplicate=False)
        if kept[id(p)] != n
    }


def _persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``state_dict()`` holds (DeepSpeed's ``_get_buffer_names``: non-persistent ones
    are left out)."""
    out = {}
    for prefix, sub in module.named_modules():
        for name, buf in sub._buffers.items():
            if buf is not None and name not in sub._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def save_checkpoint(
    parts: CheckpointParts,
    save_dir: str,
    tag=None,
    client_state=None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
) -> CheckpointSaved:
    """DeepSpeed's ``save_checkpoint`` of the engine's ``parts``. With data parallel every rank
    calls it (a collective, as DeepSpeed's). Returns the save's phase times and whether it warned
    about DeepSpeed's resume."""
    # ds_version: the DeepSpeed whose file format this follows and whose zero_to_fp32 reads it (the
    # installed one; megatrain_ds.__version__ is that, _version.py); megatrain_version: who wrote it
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    world = CheckpointWorld(parts.dp)
    tag = str(tag if tag is not None else f"global_step{parts.counters.global_steps}")
    tags = world.gather(tag)
    if len(set(tags)) > 1:
        raise ValueError(
            f"save_checkpoint: the ranks asked for different tags {tags}; every rank must save the "
            "same "
            "tag (DeepSpeed's checkpoint tag validation)"
        )
    started = time.perf_counter()
    parts.sync_masters_to_host()
    synced = time.perf_counter()
    partial = parts.counters.window_micro_steps
    if partial and world.rank == 0:
        warnings.warn(
            f"save_checkpoint after {partial} micro-step(s) of an accumulation window "
            f"of {parts.settings.gradient_accumulation_steps}: the window's partial "
            "gradient is not saved; a resume restarts the window (save at a boundary, "
            "right after engine.step() closes a window, to lose nothing)",
            stacklevel=3,
        )
    # every rank plans its files (their exact sizes) before anything is written
    files, said, error = None, parts.deepspeed_resume_said, None
    try:
        files, said = _rank_files(
            parts,
            world,
            client_state,
            exclude_frozen_parameters,
            _version.MEGATRAIN_VERSION,
            _version.__version__,
        )
    except Exception as exc:  # noqa: BLE001 (every rank must learn of it, then it is raised)
        error = exc
    world.agree(error, "prepare its checkpoint files")
    sizes = world.gather(sum(f.nbytes for f in files))
    # rank 0 checks the free space and makes the one temporary folder every rank writes into (named
    # with its pid)
    tmp, error = None, None
    if world.rank == 0:
        try:
            tmp = prepare_folder(save_dir, tag, sizes)
        except Exception as exc:  # noqa: BLE001
            error = exc
    world.agree(error, "create the checkpoint's temporary folder")
    tmp = world.broadcast(tmp)
    times, writing = SaveTimes(), time.perf_counter()
    try:
        error = None
        try:  # every byte of every rank's files is asked of the file system before any is written
            reserve_files(
                tmp,
                {
                    **{f.name: f.nbytes for f in files},
                    MANIFEST.format(rank=world.rank): manifest_bytes(f.name for f in files),
                },
                tag,
                world.rank,
            )
        except Exception as exc:  # noqa: BLE001
            error = exc
        world.agree(error, "reserve the disk for its checkpoint files (nothing was written)")
        error = None
        # streamed from the host state; with N ranks a failed rank drains its exchanges so no rank
        # waits
        try:
            digests = write_files(files, tmp, drain=world.size > 1, times=times)
            write_manifest(tmp, world.rank, digests)  # verified by load_checkpoint before it reads
            fsync_dir(tmp)
        except Exception as exc:  # noqa: BLE001
            error = exc
        world.agree(error, "write its checkpoint files")
        if is_peft_model(parts.module):  # the adapter as peft saves it, in the same folder
            error = None
            try:
                save_adapter(parts, tmp, is_main_process=world.rank == 0)
            # every rank must learn of it, then it is raised
            except Exception as exc:  # noqa: BLE001
                error = exc
            world.agree(error, "write the peft adapter")
    except BaseException:
        if world.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    # every rank's files are in: rank 0 puts the folder in place and names it in latest
    error = None
    if world.rank == 0:
        try:
            commit_folder(save_dir, tmp, tag, save_latest)
        except Exception as exc:  # noqa: BLE001
            error = exc
    # no rank returns before the checkpoint is complete
    world.agree(error, "put the checkpoint in place")
    done = time.perf_counter()
    log(
        f"save_checkpoint {tag}: "
        f"{times.summary(done - started, synced - started, writing - synced)}"
        + (f" (rank {world.rank}'s files, {world.size} ranks)" if world.size > 1 else "")
    )
    return CheckpointSaved(times, said)


def _untrained(parts: CheckpointParts, frozen: list[PartitionParam]) -> list[str]:
    """Frozen here (in no optimizer group) although they require grad: DeepSpeed ZeRO-3 would not
    restore them."""
    params = dict(parts.module.named_parameters())
    return [p.name for p in frozen if p.numel and p.name in params and params[p.name].requires_grad]


def _deepspeed_resume(
    parts: CheckpointParts, world: CheckpointWorld, frozen: list[PartitionParam], zero
) -> tuple[list[str], bool]:
    """(Why real DeepSpeed could not resume this checkpoint (wayback.py), whether that is said now);
    said once per engine (``parts.deepspeed_resume_said``), on rank 0, when the config is a ZeRO-3
    one (a run that could go back to DeepSpeed as it is)."""
    problems = wayback.resume_problems(parts.ds_config, _untrained(parts, frozen), zero)
    zero3 = not any(p.startswith("zero_optimization.stage") for p in problems)
    said = parts.deepspeed_resume_said
    if problems and zero3 and world.rank == 0 and not said:
        said = True
        warnings.warn(
            "save_checkpoint: megatrain_ds resumes this checkpoint, real DeepSpeed ZeRO-3 could "
            "not: "
            + "; ".join(problems)
            + " (recorded as 'deepspeed_resume' in the model-states files)",
            stacklevel=5,
        )  # the caller of engine.save_checkpoint
    return problems, said


def _rank_files(
    parts: CheckpointParts,
    world: CheckpointWorld,
    client_state,
    exclude_frozen: bool,
    megatrain_version: str,
    ds_version: str,
) -> tuple[list[StreamedFile], bool]:
    """This rank's model-states and optimizer-states files, planned (checkpoint_stream.py): what
    they hold, their exact sizes; their big tensors are streamed from the host state when they are
    written. And whether DeepSpeed's resume has been warned about (``_deepspeed_resume``)."""
    zero = wayback.zero_config(parts.ds_config)  # DeepSpeed's reading: its ZeRO-3's layout
    groups, group_of, frozen = partition_plan(parts, world.size, wayback.sub_group_size(zero))
    problems, said = _deepspeed_resume(parts, world, frozen, zero)
    state = RankState(
        parts, world, groups, [] if exclude_frozen else frozen, moments=parts.optimizer is not None
    )
    module, scheduler = parts.module, parts.lr_scheduler
    buffers = {n: b.detach().cpu() for n, b in _persistent_buffers(module).items()}
    scaler = parts.loss_scaler
    model_states = {
        "module": _module_states(module, buffers),
        "buffer_names": list(buffers),
        "param_shapes": [{p.name: p.shape for p in group} for group in groups],
        # None when excluded, as DeepSpeed writes it: the loader then expects no frozen weights
        "frozen_param_shapes": None if exclude_frozen else {p.name: p.shape for p in frozen},
        "frozen_param_fragments": None if exclude_frozen else state.fragments,
        "shared_params": _shared_params(module),
        # (a save inside an accumulation window: its partial gradient is not saved, the resume
        # restarts it)
        **parts.counters.state(),
        "dp_world_size": world.size,
        "mp_world_size": 1,
        "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        "loss_scaler": None if scaler is None else scaler.state(),
        "deepspeed_resume": problems,  # empty: real DeepSpeed ZeRO-3 resumes it (docs/wayback.md)
        "ds_config": parts.ds_config,
        "ds_version": ds_version,
        "megatrain_version": megatrain_version,
        "hf_config": module.config.to_dict()
        if hasattr(getattr(module, "config", None), "to_dict")
        else None,
        **dict(client_state or {}),
    }
    optim_states = {
        "optimizer_state_dict": {
            # what DeepSpeed ZeRO-3's _rigid_load_state_dict reads, in its layout (wayback.py)
            "zero_stage": 3,
            "partition_count": world.size,
            "loss_scaler": wayback.loss_scaler(scaler, parts.compute_dtype),
            "dynamic_loss_scale": bool(scaler is not None and scaler.dynamic),
            "overflow": False,
            "fp32_flat_groups": state.fp32,
            "optimizer_state_dict": state.optimizer_state(group_of),
        },
        "rng": _rng_state(),
        "ds_version": ds_version,
    }
    # DeepSpeed names the optimizer file bf16_... in bf16 runs, and a bf16 engine looks for that
    # name only
    optim_name = optim_file(world.rank, bf16=parts.compute_dtype == torch.bfloat16)
    files = [
        StreamedFile(model_states, model_file(world.rank)),
        StreamedFile(optim_states, optim_name),
    ]
    return files, said


# ----------------------------------------------------------------------------------------- checking
def _engine_params(parts: CheckpointParts) -> dict[str, tuple[tuple, bool]]:
    """name -> (shape, trained by the optimizer) for every parameter, named as
    ``master_state_dict()``."""
    out = {}
    for i, layout in enumerate(parts.layer_states.layouts):
        for slot in layout.slots:
            out[f"{parts.block_name}.{i}.{slot.name}"] = (tuple(slot.shape), slot.trainable)
    names = {id(p): n for n, p in parts.module.named_parameters()}
    for k, p in enumerate(parts.resident.params):
        out[names[id(p)]] = (tuple(getattr(p, "ds_shape", p.shape)), parts.resident.trained[k])
    return out


def _name_problems(
    what: str, saved: dict, expected: dict[str, tuple], strict: bool, may_miss=frozenset()
):
    """Shape mismatches (always: they cannot be loaded) and, when strict, missing and unexpected
    names."""
    problems = [
        f"{what} {name}: shape {tuple(t.shape)} in the checkpoint, {expected[name]} in the model"
        for name, t in saved.items()
        if name in expected and tuple(t.shape) != tuple(expected[name])
    ]
    if strict:
        missing = [n for n in expected if n not in saved and n not in may_miss]
        unexpected = [n for n in saved if n not in expected]
        if missing:
            problems.append(f"{what}s missing from the checkpoint ({len(missing)}): {missing[:8]}")
        if unexpected:
            problems.append(
                f"{what}s in the checkpoint that the model lacks ({len(unexpected)}): "
                f"{unexpected[:8]}"
            )
    return problems


def _validate(
    parts: CheckpointParts,
    ckpt: CheckpointFiles,
    strict: bool,
    load_optimizer: bool,
    load_scheduler: bool,
    module_only: bool,
) -> None:
    params = _engine_params(parts)
    frozen = {n for n, (_, trained) in params.items() if not trained}
    problems = _name_problems(
        "parameter",
        ckpt.masters,
        {n: s for n, (s, _) in params.items()},
        strict,
        may_miss=frozen if ckpt.frozen_excluded else frozenset(),
    )
    buffers = {n: tuple(b.shape) for n, b in _persistent_buffers(parts.module).items()}
    problems += _name_problems("buffer", ckpt.buffers, buffers, strict)
    hint = "load_module_strict=False loads what matches"
    optimizer, scheduler = parts.optimizer, parts.lr_scheduler
    if not module_only and load_optimizer and optimizer is not None:
        hint += "; load_optimizer_states=False loads the weights without the optimizer state"
        if ckpt.moments is None:
            problems.append(
                "the checkpoint has no optimizer state (saved by an engine without an optimizer)"
            )
        else:
            trained, saved = {n for n in params if n not in frozen}, set(ckpt.trainable)
            if trained != saved:
                problems.append(
                    f"optimizer state: trained here but not in the checkpoint's optimizer: "
                    f"{sorted(trained - saved)[:8]}; in the checkpoint's optimizer but not trained "
                    "here: "
                    f"{sorted(saved - trained)[:8]}"
                )
            if len(ckpt.param_groups) != len(optimizer.param_groups):
                problems.append(
                    f"optimizer: {len(ckpt.param_groups)} param groups in the checkpoint, "
                    f"{len(optimizer.param_groups)} here"
                )
    saved_sched = ckpt.model_states.get("lr_scheduler")
    if not module_only and load_scheduler and scheduler is not None and saved_sched:
        hint += "; load_lr_scheduler_states=False keeps this engine's schedule"
        lacking = sorted(set(scheduler.state_dict()) - set(saved_sched))
        if lacking:
            problems.append(
                f"lr scheduler: the saved state lacks {lacking} that this "
                f"{type(scheduler).__name__} needs (a different scheduler?)"
            )
    scaler = parts.loss_scaler
    if not module_only and scaler is not None and ckpt.loss_scaler:
        unknown = sorted(set(ckpt.loss_scaler) - set(scaler.state()))
        if unknown:
            problems.append(f"loss scaler: unknown fields {unknown}")
    if problems:
        listed = "\n  - ".join(problems[:_MAX_LISTED])
        raise CheckpointMismatchError(
            f"checkpoint {ckpt.path} does not fit this engine; nothing was loaded:\n"
            f"  - {listed}\n({hint})"
        )


# ----------------------------------------------------------------------------------------- applying
def _held(parts: CheckpointParts, masters: dict) -> dict:
    """The entries of ``masters`` this rank writes: its own layers' parameters and the (replicated)
    resident ones (data parallel: the layers whose host state this rank holds; one process: all)."""
    states = parts.layer_states
    held = set(states.owned_layers())
    if len(held) == len(states.layouts):
        return masters
    skip = {
        f"{parts.block_name}.{i}.{slot.name}"
        for i, layout in enumerate(states.layouts)
        if i not in held
        for slot in layout.slots
    }
    return {name: t for name, t in masters.items() if name not in skip}


def _write_buffers(parts: CheckpointParts, saved: dict[str, torch.Tensor]) -> None:
    """In place, so every holder of the tensor sees it; a streamed layer's buffer may also have a
    separate device copy in the executor (layer i = names under ``<block_name>.<i>.``)."""
    prefix = parts.block_name + "."
    for name, buf in _persistent_buffers(parts.module).items():
        if name not in saved:
            continue
        buf.copy_(saved[name])
        if name.startswith(prefix):
            index, _, local = name[len(prefix) :].partition(".")
            copy = parts.layer_buffers[int(index)].get(local)
            if copy is not None and copy is not buf:
                copy.copy_(saved[name])


def _write_moments(parts: CheckpointParts, moments: dict) -> None:
    """Adam moments into the host buffers of the layers this rank holds, the resident ones (and the
    GPU-held layers' copies); a name without state gets zeros."""

    def put(dst, pair, which):
        if pair is None:
            dst.zero_()
        else:
            dst.copy_(pair[which].reshape(dst.shape))

    states = parts.layer_states
    for i in states.owned_layers():
        layout = states.layouts[i]
        disk = states.moments_on_disk(i)  # NVMe tier: assembled here, then written to disk
        m, v = (
            (torch.empty(layout.n_train), torch.empty(layout.n_train))
            if disk
            else states.host_moments(i)
        )
        for slot in layout.slots:
            if slot.trainable:
                pair = moments.get(f"{parts.block_name}.{i}.{slot.name}")
                put(m[slot.offset : slot.offset + slot.numel], pair, 0)
                put(v[slot.offset : slot.offset + slot.numel], pair, 1)
        if disk:
            states.write_moments(i, m, v)
    res, names = parts.resident, {id(p): n for n, p in parts.module.named_parameters()}
    for k, p in enumerate(res.params):
        if res.exp_avg[k] is not None:
            put(res.exp_avg[k], moments.get(names[id(p)]), 0)
            put(res.exp_avg_sq[k], moments.get(names[id(p)]), 1)
    states.push_moments_to_device()


def _apply(
    parts: CheckpointParts,
    ckpt: CheckpointFiles,
    load_optimizer: bool,
    load_scheduler: bool,
    module_only: bool,
    world: CheckpointWorld,
) -> None:
    parts.synchronize()  # no queued optimizer task may write the masters after this
    # strictness was checked by _validate (it knows which names a frozen-excluded checkpoint may
    # lack)
    parts.load_master_state_dict(_held(parts, ckpt.masters), strict=False)
    _write_buffers(parts, ckpt.buffers)
    if module_only:
        return
    optimizer, states = parts.optimizer, ckpt.model_states
    if load_optimizer and optimizer is not None:
        _write_moments(parts, ckpt.moments)
        optimizer.step_count = ckpt.step
        for group, saved in zip(optimizer.param_groups, ckpt.param_groups):
            group.update(
                {k: v for k, v in saved.items() if k in group or not ckpt.group_keys_shared_only}
            )
        if ckpt.rng is not None:
            torch.set_rng_state(ckpt.rng["torch"])
            if "cuda" in ckpt.rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(ckpt.rng["cuda"])
        elif ckpt.rng_dropped and world.rank == 0:
            warnings.warn(
                f"{ckpt.path} was saved by {ckpt.world} rank(s) and is loaded by {world.size}: the "
                "random "
                "number generators' states were not restored (each rank's state belongs to its "
                "rank)",
                stacklevel=3,
            )
    if load_scheduler and parts.lr_scheduler is not None and states.get("lr_scheduler"):
        parts.lr_scheduler.load_state_dict(states["lr_scheduler"])
    settings = parts.settings
    # DeepSpeed does not save micro_steps: a checkpoint is taken at an accumulation boundary. One
    # saved inside a window holds none of its partial gradient, so the resumed run restarts that
    # window (as DeepSpeed's does)
    parts.counters.load_state(
        states, settings.train_batch_size, settings.gradient_accumulation_steps
    )
    partial = int(states.get("window_micro_steps", 0) or 0)
    if partial and world.rank == 0:
        warnings.warn(
            f"{ckpt.path} was saved after {partial} micro-step(s) of an accumulation window, whose "
            "partial "
            "gradient a checkpoint does not hold: the window restarts at its first micro-step (as "
            "DeepSpeed's resume does)",
            stacklevel=3,
        )
    if parts.loss_scaler is not None and ckpt.loss_scaler:
        parts.loss_scaler.load_state(ckpt.loss_scaler)


def load_checkpoint(
    parts: CheckpointParts,
    load_dir: str,
    tag=None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
):
    """Returns ``(path, client_state)``; ``(None, None)`` with DeepSpeed's warning when no tag is
    given and ``load_dir`` has no ``latest``. A tag (given or named by ``latest``) whose files are
    missing raises ``FileNotFoundError``; a checkpoint that does not fit raises
    ``CheckpointMismatchError`` before any write. With data parallel every rank calls it: rank 0
    resolves the folder, every rank reads and checks it, and nothing is written on any rank unless
    it fits on every rank."""
    world = CheckpointWorld(parts.dp)
    path, error = None, None
    if world.rank == 0:
        try:
            # may put back a moved-aside folder: one rank does
            path = checkpoint_path_of(load_dir, tag)
        except Exception as exc:  # noqa: BLE001
            error = exc
    world.agree(error, "find the checkpoint")
    path = world.broadcast(path)
    if path is None:
        return None, None
    ckpt, error = None, None
    try:
        # a corrupted file is refused before anything is read
        verify_checksums(path, world.rank, world.size)
        ckpt = read_states(path, world.rank, world.size)
        _validate(
            parts,
            ckpt,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
        )
    except Exception as exc:  # noqa: BLE001
        error = exc
    world.agree(error, f"load {path} (nothing was loaded on any rank)")
    _apply(parts, ckpt, load_optimizer_states, load_lr_scheduler_states, load_module_only, world)
    return path, {k: v for k, v in ckpt.model_states.items() if k not in _RESERVED}
