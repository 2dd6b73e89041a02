"""megatrain_ds: train models far larger than GPU memory, behind DeepSpeed's API.

import megatrain_ds as deepspeed engine, optimizer, _, scheduler = deepspeed.initialize(model=model,
model_parameters=model.parameters(),
                                                       config="ds_config.json")
"""

from __future__ import annotations

import dataclasses

import importlib
import os
import weakref

import torch

from . import _moved

# the flat layout's import paths (megatrain_ds.config, ...) reach the same modules in their packages
_moved.install()

from . import ops, runtime

# deepspeed.zero, deepspeed.utils, deepspeed.checkpointing
from .api import checkpointing, utils, zero
from .api import module_getattr
from .parallel import comm  # deepspeed.comm
from .parallel import init_distributed
from .errors import ConfigError
from .planning import (
    OptimizerSettings,
    TrainConfig,
    collective_timeout_of,
    parse_config,
    warn_not_acted_on,
)
from .engine import MegaTrainEngine
from .model import UnsupportedModelError, RecomputeMismatch
from ._version import MEGATRAIN_VERSION, __version__  # (in a module of their own: no import circle)

DeepSpeedEngine = MegaTrainEngine


def __getattr__(name: str):
    """``megatrain_ds.<name>`` not defined here: a module of the flat layout
    (``megatrain_ds.config``, ...: the same module in its package, _moved.py), else DeepSpeed's
    top-level name (``deepspeed.<name>``: DeepSpeed's own, or an error naming it;
    api/surface.py)."""
    if f"{__name__}.{name}" in _moved.MOVED:
        return importlib.import_module(f"{__name__}.{name}")
    return module_getattr(name)


def _build_scheduler(spec: dict | None, optimizer):
    """DeepSpeed's own LR schedules (deepspeed.runtime.lr_schedules), by the config's name."""
    if spec is None or optimizer is None:
        return None
    from deepspeed.runtime import lr_schedules

    name = spec.get("type")
    cls = getattr(lr_schedules, name, None) if name in lr_schedules.VALID_LR_SCHEDULES else None
    if cls is None:
        raise ConfigError(
            f"scheduler.type {name!r} is not one of {', '.join(lr_schedules.VALID_LR_SCHEDULES)}"
        )
    return cls(optimizer, **spec.get("params", {}))


def initialize(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port=29500,
    mpu=None,
    dist_init_required=None,
    collate_fn=None,
    config=None,
    mesh_param=None,
    config_params=None,
):
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, dataloader, lr_scheduler)``.

    One process, or N under a launcher (torchrun, ``deepspeed``, ``accelerate launch``): data
    parallel, see dp.py. It leaves ``torch.distributed`` and ``deepspeed.comm`` initialized, as
    DeepSpeed does. The config is validated here, and every accepted setting that megatrain_ds does
    not act on (config keys, ``mpu``, a missing optimizer) is named in ONE warning."""
    if model is None:
        raise ValueError("initialize() needs model=")
    config = _config_argument(args, config, config_params)
    local_rank = getattr(args, "local_rank", None)
    if isinstance(local_rank, int) and local_rank >= 0:  # deepspeed launcher passes --local_rank
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
    # a process group made here waits megatrain.collective_timeout in a collective (dp.py's Note),
    # NCCL's included
    init_distributed(distributed_port=distributed_port, timeout=collective_timeout_of(config))
    launched = int(os.environ.get("WORLD_SIZE", comm.get_world_size()) or 1)
    # e.g. a group of one made before WORLD_SIZE was set: never train apart
    if launched != comm.get_world_size():
        raise RuntimeError(
            f"WORLD_SIZE is {launched} but torch.distributed's process group has "
            f"{comm.get_world_size()} rank(s): initialize the process group over every launched "
            "process (or let megatrain_ds.initialize do it), or launch that many processes"
        )
    settings = parse_config(config, world_size=comm.get_world_size(), warn=False)
    # (imported here: `python -m megatrain_ds.versions` runs it as __main__)
    from .versions import check_installed

    # one warning per process naming a dependency outside the tested range (versions.py)
    check_installed()
    notes = list(settings.not_acted_on)
    _check_parallelism(mpu, mesh_param, notes)
    client_groups = None
    if optimizer is not None:
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            params = model_parameters if model_parameters is not None else model.parameters()
            optimizer = optimizer(params)
        client_settings, model_parameters = optimizer_from_client(optimizer)
        settings = dataclasses.replace(settings, optimizer=client_settings)  # settings are values
        client_groups = optimizer.param_groups
    # legitimate for a frozen reference model (DPO): said once, not an error
    if settings.optimizer is None:
        notes.append(
            "no optimizer (no 'optimizer' block and no optimizer= argument): engine.step() will "
            "not "
            "update the weights"
        )
    warn_not_acted_on(notes)
    settings = dataclasses.replace(settings, not_acted_on=tuple(notes))
    engine = MegaTrainEngine(model, settings, model_parameters=model_parameters)
    engine_optimizer = engine.optimizer  # the host optimizer the engine built (None without one)
    if client_groups is not None:
        _share_param_groups(engine_optimizer, client_groups)
        _report_steps_to(optimizer, engine_optimizer)
    scheduler = lr_scheduler(engine_optimizer) if callable(lr_scheduler) else lr_scheduler
    if scheduler is None:
        scheduler = _build_scheduler(settings.scheduler, engine_optimizer)
    engine.lr_scheduler = scheduler
    dataloader = None
    if training_data is not None:
        dataloader = torch_dataloader(
            training_data,
            settings.micro_batch_size,
            collate_fn,
            drop_last=settings.dataloader_drop_last,
            num_replicas=comm.get_world_size(),
            rank=comm.get_rank(),
        )
    engine.training_dataloader = dataloader  # as DeepSpeed's engine keeps it
    return engine, engine_optimizer, dataloader, scheduler


def _config_argument(args, config, config_params):
    """The config, from ``config=``, ``config_params=`` or ``args.deepspeed_config`` (DeepSpeed's
    rules: the legacy ``args.deepscale_config`` counts as ``deepspeed_config``; a config both in
    args and in the call is an error)."""
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None and config is not None:
        raise ConfigError(
            "a DeepSpeed config is given both in args.deepspeed_config and to "
            "initialize(config=...): "
            "pass one (DeepSpeed refuses this too)"
        )
    return config if config is not None else from_args


# mpu methods whose size > 1 means a kind of parallelism megatrain_ds does not implement (Megatron's
# mpu, accelerate's Ulysses sequence-parallel mpu, DeepSpeed's groups)
_MPU_SIZES = (
    "get_model_parallel_world_size",
    "get_tensor_model_parallel_world_size",
    "get_pipeline_model_parallel_world_size",
    "get_sequence_parallel_world_size",
    "get_data_parallel_world_size",
    "get_expert_parallel_world_size",
)


def _check_parallelism(mpu, mesh_param, notes: list[str]) -> None:
    """``mpu`` / ``mesh_param``: an error when they ask for model, sequence or data parallelism
    (sizes > 1); with every size 1 there is nothing to do, which the not-acted-on warning says."""
    if mpu is not None:
        sizes = {
            name: int(getattr(mpu, name)())
            for name in _MPU_SIZES
            if callable(getattr(mpu, name, None))
        }
        bigger = {name.removeprefix("get_"): n for name, n in sizes.items() if n > 1}
        if bigger:
            raise NotImplementedError(
                f"initialize(mpu=...): {', '.join(f'{k}={v}' for k, v in bigger.items())}: "
                "megatrain_ds trains the "
                "whole model in one process (model, sequence and data parallelism are not "
                "implemented); pass no mpu"
            )
        notes.append(
            "mpu: every parallel world size is 1; megatrain_ds uses none of its process groups"
        )
    if mesh_param is not None:
        sizes = [int(n) for n in mesh_param]
        if any(n > 1 for n in sizes):
            raise NotImplementedError(
                f"initialize(mesh_param={tuple(mesh_param)}): data / sequence parallelism is "
                "not implemented; megatrain_ds trains in one process (pass no mesh_param)"
            )
        notes.append("mesh_param: every size is 1; no device mesh is made")


def optimizer_from_client(optimizer) -> tuple[OptimizerSettings, list[dict]]:
    """A client optimizer (torch Adam/AdamW, DeepSpeed's DeepSpeedCPUAdam/FusedAdam) -> the host
    optimizer's settings and param groups. Its hyperparameters and groups are used; its own state is
    not."""
    name = type(optimizer).__name__
    if name not in ("AdamW", "Adam", "DeepSpeedCPUAdam", "FusedAdam"):
        raise NotImplementedError(
            f"initialize(optimizer={name}): megatrain_ds runs the optimizer on the host and maps "
            "only Adam-family "
            "optimizers (torch.optim.Adam/AdamW, deepspeed.ops.adam.DeepSpeedCPUAdam/FusedAdam); "
            "put the optimizer "
            "in the config ({'optimizer': {'type': 'AdamW', 'params': {...}}}) or pass one of those"
        )
    groups = optimizer.param_groups
    for g in groups:
        if g.get("amsgrad") or g.get("maximize") or not g.get("bias_correction", True):
            raise NotImplementedError(
                f"initialize(optimizer={name}): amsgrad/maximize/bias_correction=False "
                "are not supported by the host optimizer"
            )
    if name == "AdamW":
        adam_w = True
    elif name == "Adam":
        adam_w = False  # torch's Adam folds weight decay into the gradient (L2)
    else:
        adam_w = bool(getattr(optimizer, "adam_w_mode", True))
    g0 = groups[0]
    settings = OptimizerSettings(
        type="AdamW" if adam_w else "Adam",
        lr=float(g0["lr"]),
        betas=tuple(g0["betas"]),
        eps=float(g0["eps"]),
        weight_decay=float(g0["weight_decay"]),
        adam_w_mode=adam_w,
    )
    return settings, [dict(g) for g in groups]


def _share_param_groups(host_optimizer, client_groups: list[dict]) -> None:
    """As in DeepSpeed, the engine's optimizer works on the client optimizer's own group dicts, so
    an LR scheduler the script built on its optimizer (e.g. a torch LambdaLR, stepped by accelerate)
    drives the engine's learning rate. The groups correspond one to one
    (``optimizer_from_client``)."""
    for k, group in enumerate(client_groups):
        for key, value in host_optimizer.param_groups[k].items():
            # "params" stays the client's list; the engine keeps its own layout
            group.setdefault(key, value)
        host_optimizer.param_groups[k] = group


def _report_steps_to(client_optimizer, host_optimizer) -> None:
    """A torch LR scheduler the script built on its own optimizer checks, at its first ``step()``,
    that this optimizer has stepped (``optimizer._opt_called``, set by the wrapper torch's scheduler
    puts on ``optimizer.step``), and otherwise warns "Detected call of `lr_scheduler.step()` before
    `optimizer.step()`". The engine steps the host optimizer instead: each of its steps marks the
    client's as stepped too (a weak reference: the hook does not keep the client optimizer
    alive)."""
    client = weakref.ref(client_optimizer)

    def mark_stepped(_optimizer, _args, _kwargs) -> None:
        target = client()
        if target is not None:
            target._opt_called = True

    host_optimizer.register_step_post_hook(mark_stepped)


def add_config_arguments(parser):
    """DeepSpeed's command-line flags: ``--deepspeed`` and ``--deepspeed_config PATH``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="enable the DeepSpeed-style engine (megatrain_ds)",
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file"
    )
    return parser


def torch_dataloader(
    data,
    batch_size: int,
    collate_fn=None,
    drop_last: bool = False,
    num_replicas: int = 1,
    rank: int = 0,
):
    """The batches DeepSpeed's ``DeepSpeedDataLoader`` gives a rank: a ``DistributedSampler`` over
    the data-parallel world (a seeded shuffle, seed 0; DeepSpeed never calls ``set_epoch``, so every
    epoch has the same order) and ``dataloader_drop_last`` from the config."""
    import torch.utils.data

    sampler = torch.utils.data.DistributedSampler(data, num_replicas=num_replicas, rank=rank)
    return torch.utils.data.DataLoader(
        data, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last
    )


__all__ = [
    "initialize",
    "add_config_arguments",
    "init_distributed",
    "comm",
    "zero",
    "ops",
    "runtime",
    "checkpointing",
    "utils",
    "optimizer_from_client",
    "DeepSpeedEngine",
    "MegaTrainEngine",
    "ConfigError",
    "UnsupportedModelError",
    "RecomputeMismatch",
    "TrainConfig",
    "parse_config",
    "__version__",
    "MEGATRAIN_VERSION",
]
