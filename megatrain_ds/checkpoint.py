"""Checkpoints in DeepSpeed's ZeRO-3 layout, written crash-safely.

    save_dir/latest                                           the tag, as text (written last)
    save_dir/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt  buffers, parameter shapes, frozen parameters,
                                                              counters, scheduler, loss scaler, client state
    save_dir/<tag>/zero_pp_rank_0_mp_rank_00_optim_states.pt  fp32 master weights as ``fp32_flat_groups``,
                                                              Adam moments, group hyperparameters, RNG

The default tag is ``global_step{N}``. The fp32 masters are written as DeepSpeed ZeRO-3 (one process)
writes them: flat fp32 groups consumed in ``param_shapes`` order, so DeepSpeed's ``zero_to_fp32`` reads a
megatrain_ds checkpoint. Here each streamed layer's trainable region is one group (a view of the host
master: ``torch.save`` writes the underlying buffer once, no second copy in RAM), then the resident
parameters; frozen parameters go in ``frozen_param_fragments``, tied names in ``shared_params``.

A save goes to ``save_dir/.<tag>.tmp-<pid>``, every file is fsynced, the directory is renamed into place,
and only then is ``latest`` replaced (through a temporary file and ``os.replace``): a process killed at any
moment leaves the previous checkpoint and ``latest`` intact.
"""
from __future__ import annotations

import os
import shutil

import torch

MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"
OPTIM_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
_RESERVED = {"module", "global_steps", "global_samples", "micro_steps", "skipped_steps", "lr_scheduler",
             "loss_scaler", "ds_config", "ds_version", "hf_config", "buffer_names", "param_shapes",
             "frozen_param_shapes", "frozen_param_fragments", "shared_params"}


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


def _unflatten(model_states: dict, groups: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameter name -> fp32 tensor (views of the loaded groups), as zero_to_fp32 reconstructs them."""
    flat = groups[0] if len(groups) == 1 else torch.cat([g.reshape(-1) for g in groups])
    out, offset = {}, 0
    for shapes in model_states["param_shapes"]:
        for name, shape in shapes.items():
            n = torch.Size(shape).numel()
            out[name] = flat[offset:offset + n].view(shape)
            offset += n
    for name, fragment in (model_states.get("frozen_param_fragments") or {}).items():
        out[name] = fragment.view(model_states["frozen_param_shapes"][name])
    return out


def _shared_params(module: torch.nn.Module) -> dict[str, str]:
    """Tied names: {name that is dropped by named_parameters(): the name that is kept}."""
    kept = {id(p): n for n, p in module.named_parameters()}
    return {n: kept[id(p)] for n, p in module.named_parameters(remove_duplicate=False) if kept[id(p)] != n}


def save_checkpoint(engine, save_dir: str, tag=None, client_state=None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> bool:
    from . import __version__

    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    os.makedirs(save_dir, exist_ok=True)
    groups, param_shapes, frozen = _fp32_layout(engine)
    if exclude_frozen_parameters:
        frozen = {}
    buffers = {n: b.detach().cpu() for n, b in engine.module.named_buffers()
               if n in engine.module.state_dict(keep_vars=True)}
    scaler = engine.config_settings.loss_scaler
    model_states = {
        "module": buffers, "buffer_names": list(buffers), "param_shapes": param_shapes,
        "frozen_param_shapes": {n: t.shape for n, t in frozen.items()},
        "frozen_param_fragments": {n: t.reshape(-1) for n, t in frozen.items()},
        "shared_params": _shared_params(engine.module),
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scaler": None if scaler is None else {k: getattr(scaler, k) for k in scaler.__slots__},
        "ds_config": engine.config, "ds_version": __version__,
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
    if save_latest:
        latest_tmp = os.path.join(save_dir, f".latest.tmp-{os.getpid()}")
        with open(latest_tmp, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, os.path.join(save_dir, "latest"))
        _fsync_dir(save_dir)
    return True


def load_checkpoint(engine, load_dir: str, tag=None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False):
    """Returns ``(path, client_state)``, or ``(None, None)`` when there is nothing to load."""
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            return None, None
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(load_dir, str(tag))
    if not os.path.isfile(os.path.join(path, MODEL_FILE)):
        return None, None
    engine.synchronize()
    model_states = torch.load(os.path.join(path, MODEL_FILE), map_location="cpu", weights_only=False)
    optim = torch.load(os.path.join(path, OPTIM_FILE), map_location="cpu", weights_only=False, mmap=True)
    engine.load_master_state_dict(_unflatten(model_states, optim["optimizer_state_dict"]["fp32_flat_groups"]),
                                  strict=load_module_strict)
    if not load_module_only:
        if load_optimizer_states and engine.optimizer is not None:
            engine.optimizer.load_host_state_dict(optim["optimizer_state_dict"]["optimizer_state_dict"])
            torch.set_rng_state(optim["rng"]["torch"])
            if "cuda" in optim["rng"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(optim["rng"]["cuda"])
        if load_lr_scheduler_states and engine.lr_scheduler is not None and model_states["lr_scheduler"]:
            engine.lr_scheduler.load_state_dict(model_states["lr_scheduler"])
        engine.global_steps = model_states["global_steps"]
        engine.global_samples = model_states["global_samples"]
        engine.micro_steps = model_states["micro_steps"]
        engine.skipped_steps = model_states["skipped_steps"]
        scaler = engine.config_settings.loss_scaler
        if scaler is not None and model_states.get("loss_scaler"):
            for key, value in model_states["loss_scaler"].items():
                setattr(scaler, key, value)
    client_state = {k: v for k, v in model_states.items() if k not in _RESERVED}
    return path, client_state


def consolidated_state_dict(engine, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The whole model's ``state_dict()`` on the CPU, parameters from their fp32 masters cast to ``dtype``
    (default: the compute dtype), persistent buffers as they are; tied names each get their tensor."""
    masters = engine.master_state_dict()  # one sync; views of the host masters
    dtype = dtype or engine.compute_dtype
    kept = {id(p): n for n, p in engine.module.named_parameters()}  # tied names share one master
    out = {}
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.nn.Parameter):
            out[name] = masters[kept[id(tensor)]].to(dtype, copy=True)
        else:  # persistent buffer
            out[name] = tensor.detach().cpu().clone()
    return out


def save_16bit_model(engine, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
    """Consolidated weights in the compute dtype, written atomically; ``*.safetensors`` names use safetensors."""
    os.makedirs(save_dir, exist_ok=True)
    state = consolidated_state_dict(engine)
    final = os.path.join(save_dir, save_filename)
    tmp = os.path.join(save_dir, f".{save_filename}.tmp-{os.getpid()}")
    if save_filename.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, tmp, metadata={"format": "pt"})
    else:
        _save(state, tmp)
    os.replace(tmp, final)
    return True
