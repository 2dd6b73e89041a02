"""16-bit export: the whole model's weights from the fp32 masters (``gather_full_masters``,
``consolidated_state_dict``, ``save_16bit_model``). With N ranks (data parallel, dp.py) each layer's
master comes from its owner over the gloo group, one layer at a time; collectives every rank calls,
as DeepSpeed's.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .checkpoint_folder import CheckpointWorld, clean_stale
from .checksums import save_file as _save
from .parts import CheckpointParts


def _frozen_ids(parts: CheckpointParts) -> set[int]:
    """What ``exclude_frozen_parameters`` leaves out: parameters with ``requires_grad`` False
    (DeepSpeed's rule) and, when the engine has an optimizer, parameters in none of its groups
    (never trained here)."""
    in_optimizer = None
    if parts.optimizer is not None:
        in_optimizer = {id(p) for group in parts.optimizer.param_groups for p in group["params"]}
    return {
        id(p)
        for p in parts.module.parameters()
        if not p.requires_grad or (in_optimizer is not None and id(p) not in in_optimizer)
    }


def gather_full_masters(
    parts: CheckpointParts, dst: int | None = None, dtype: torch.dtype | None = None
) -> dict | None:
    """Every parameter's whole fp32 master keyed like ``master_state_dict()`` (cast to ``dtype``, as
    a copy, when given).

    One process: views of the host masters (no copy unless ``dtype``; frozen weights of a compact
    store are their compute-dtype copy, host_state.py). Data parallel: a collective (every rank
    calls it): streamed layers and trained resident parameters go from their owner to rank ``dst``
    (None: to every rank), one at a time, over the gloo group. Ranks other than ``dst`` get None.
    What a rank receives is its own copy (4 bytes per parameter; ``dtype`` casts each layer as it
    arrives)."""
    parts.sync_masters_to_host()
    world, states = CheckpointWorld(parts.dp), parts.layer_states
    if dst is not None and world.rank != dst and world.size > 1:
        out = None
    else:
        out = {}
    cast = (lambda t: t.to(dtype, copy=True)) if dtype is not None else (lambda t: t)  # noqa: E731
    for i, layout in enumerate(states.layouts):
        if world.size == 1:
            # views (frozen weights of a compact store: their compute-dtype copy)
            for slot in layout.slots:
                out[f"{parts.block_name}.{i}.{slot.name}"] = cast(states.param_master(i, slot.name))
            continue
        else:
            owner = world.owner(i)
            mine = states.full_master(i) if world.rank == owner else None
            if dst is None:
                flat = mine if mine is not None else torch.empty(layout.numel, dtype=torch.float32)
                if layout.numel:
                    dist.broadcast(flat, src=world.peer(owner), group=world.group)
            elif owner == dst:
                flat = mine
            elif world.rank == owner:
                if layout.numel:
                    dist.send(mine, dst=world.peer(dst), group=world.group)
                continue
            elif world.rank == dst:
                flat = torch.empty(layout.numel, dtype=torch.float32)
                if layout.numel:
                    dist.recv(flat, src=world.peer(owner), group=world.group)
            else:
                continue
        if out is None:
            continue
        for slot in layout.slots:
            start = slot.offset + (0 if slot.trainable else layout.n_train)
            value = flat[start : start + slot.numel].view(slot.shape)
            out[f"{parts.block_name}.{i}.{slot.name}"] = cast(value)
    names, res = {id(p): n for n, p in parts.module.named_parameters()}, parts.resident
    for k, (p, master) in enumerate(zip(res.params, res.master)):
        if world.size > 1 and res.trained[k]:  # its owner's (dp.py): a collective, as the layers'
            master = res.master_copy(k, dst)
        if out is not None:
            out[names[id(p)]] = cast(master.view(p.shape).cpu())
    return out


def consolidated_state_dict(
    parts: CheckpointParts,
    dtype: torch.dtype | None = None,
    exclude_frozen_parameters: bool = False,
) -> dict[str, torch.Tensor] | None:
    """The whole model's ``state_dict()`` on the CPU, parameters from their fp32 masters cast to
    ``dtype`` (default: the compute dtype), persistent buffers as they are; tied names each get
    their tensor. Data parallel: a collective (every rank calls it); the state dict is rank 0's,
    other ranks get None (DeepSpeed's ``_zero3_consolidated_16bit_state_dict``)."""
    dtype = dtype or parts.compute_dtype
    masters = gather_full_masters(parts, dst=0, dtype=dtype)  # copies in dtype, one layer at a time
    if masters is None:
        return None
    kept = {id(p): n for n, p in parts.module.named_parameters()}  # tied names share one master
    skip = _frozen_ids(parts) if exclude_frozen_parameters else set()
    out, used = {}, set()
    for name, tensor in parts.module.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.nn.Parameter):
            if id(tensor) not in skip:
                value = masters[kept[id(tensor)]]
                # a tied name: a tensor of its own
                out[name] = value.clone() if id(value) in used else value
                used.add(id(value))
        else:  # persistent buffer
            out[name] = tensor.detach().cpu().clone()
    return out


def save_16bit_model(
    parts: CheckpointParts,
    save_dir: str,
    save_filename: str = "pytorch_model.bin",
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Consolidated weights in the compute dtype, written atomically; ``*.safetensors`` names use
    safetensors. Data parallel: every rank calls it (the weights are gathered to rank 0, which
    writes the file; every rank returns once it is in place), as DeepSpeed's."""
    world = CheckpointWorld(parts.dp)
    state = consolidated_state_dict(parts, exclude_frozen_parameters=exclude_frozen_parameters)
    error = None
    if world.rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            clean_stale(save_dir)  # a killed export's .<file>.tmp-<pid>
            final = os.path.join(save_dir, save_filename)
            tmp = os.path.join(save_dir, f".{save_filename}.tmp-{os.getpid()}")
            if save_filename.endswith(".safetensors"):
                from safetensors.torch import save_file

                save_file(
                    {k: v.contiguous() for k, v in state.items()}, tmp, metadata={"format": "pt"}
                )
            else:
                _save(state, tmp)
            os.replace(tmp, final)
        except Exception as exc:  # noqa: BLE001
            error = exc
    world.agree(error, f"write {save_filename}")
    return True
