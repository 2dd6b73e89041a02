"""megatrain_ds: train models far larger than GPU memory, behind DeepSpeed's API.

    import megatrain_ds as deepspeed
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                           config="ds_config.json")
"""
from __future__ import annotations

import os

import torch

from . import checkpointing, comm, ops, zero
from .comm import init_distributed
from .config import ConfigError, OptimizerSettings, TrainConfig, parse_config
from .engine import MegaTrainEngine
from .model_map import UnsupportedModelError

__version__ = "0.1.0"

DeepSpeedEngine = MegaTrainEngine


def _build_scheduler(spec: dict | None, optimizer):
    """DeepSpeed's own LR schedules (deepspeed.runtime.lr_schedules), by the config's name."""
    if spec is None or optimizer is None:
        return None
    from deepspeed.runtime import lr_schedules

    name = spec.get("type")
    cls = getattr(lr_schedules, name, None) if name in lr_schedules.VALID_LR_SCHEDULES else None
    if cls is None:
        raise ConfigError(f"scheduler.type {name!r} is not one of {', '.join(lr_schedules.VALID_LR_SCHEDULES)}")
    return cls(optimizer, **spec.get("params", {}))


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port=29500, mpu=None, dist_init_required=None, collate_fn=None,
               config=None, config_params=None, **kwargs):
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, dataloader, lr_scheduler)``."""
    if model is None:
        raise ValueError("initialize() needs model=")
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    local_rank = getattr(args, "local_rank", None)
    if isinstance(local_rank, int) and local_rank >= 0:  # deepspeed launcher passes --local_rank
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
    init_distributed(distributed_port=distributed_port)
    settings = parse_config(config)
    client_groups = None
    if optimizer is not None:
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            params = model_parameters if model_parameters is not None else model.parameters()
            optimizer = optimizer(params)
        settings.optimizer, model_parameters = optimizer_from_client(optimizer)
        client_groups = optimizer.param_groups
    engine = MegaTrainEngine(model, settings, model_parameters=model_parameters)
    if client_groups is not None:
        _share_param_groups(engine.optimizer, client_groups)
    scheduler = lr_scheduler(engine.optimizer) if callable(lr_scheduler) else lr_scheduler
    if scheduler is None:
        scheduler = _build_scheduler(settings.scheduler, engine.optimizer)
    engine.lr_scheduler = scheduler
    dataloader = None
    if training_data is not None:
        dataloader = torch_dataloader(training_data, settings.micro_batch_size, collate_fn)
    return engine, engine.optimizer, dataloader, scheduler


def optimizer_from_client(optimizer) -> tuple[OptimizerSettings, list[dict]]:
    """A client optimizer (torch Adam/AdamW, DeepSpeed's DeepSpeedCPUAdam/FusedAdam) -> the host optimizer's
    settings and param groups. Its hyperparameters and groups are used; its own state is not."""
    name = type(optimizer).__name__
    if name not in ("AdamW", "Adam", "DeepSpeedCPUAdam", "FusedAdam"):
        raise NotImplementedError(
            f"initialize(optimizer={name}): megatrain_ds runs the optimizer on the host and maps only Adam-family "
            "optimizers (torch.optim.Adam/AdamW, deepspeed.ops.adam.DeepSpeedCPUAdam/FusedAdam); put the optimizer "
            "in the config ({'optimizer': {'type': 'AdamW', 'params': {...}}}) or pass one of those")
    groups = optimizer.param_groups
    for g in groups:
        if g.get("amsgrad") or g.get("maximize") or not g.get("bias_correction", True):
            raise NotImplementedError(f"initialize(optimizer={name}): amsgrad/maximize/bias_correction=False "
                                      "are not supported by the host optimizer")
    if name == "AdamW":
        adam_w = True
    elif name == "Adam":
        adam_w = False  # torch's Adam folds weight decay into the gradient (L2)
    else:
        adam_w = bool(getattr(optimizer, "adam_w_mode", True))
    g0 = groups[0]
    settings = OptimizerSettings(type="AdamW" if adam_w else "Adam", lr=float(g0["lr"]), betas=tuple(g0["betas"]),
                                 eps=float(g0["eps"]), weight_decay=float(g0["weight_decay"]), adam_w_mode=adam_w)
    return settings, [dict(g) for g in groups]


def _share_param_groups(host_optimizer, client_groups: list[dict]) -> None:
    """As in DeepSpeed, the engine's optimizer works on the client optimizer's own group dicts, so an LR
    scheduler the script built on its optimizer (e.g. a torch LambdaLR, stepped by accelerate) drives the
    engine's learning rate. The groups correspond one to one (``optimizer_from_client``)."""
    for k, group in enumerate(client_groups):
        for key, value in host_optimizer.param_groups[k].items():
            group.setdefault(key, value)  # "params" stays the client's list; the engine keeps its own layout
        host_optimizer.param_groups[k] = group


def add_config_arguments(parser):
    """DeepSpeed's command-line flags: ``--deepspeed`` and ``--deepspeed_config PATH``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable the DeepSpeed-style engine (megatrain_ds)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file")
    return parser


def torch_dataloader(data, batch_size: int, collate_fn=None):
    import torch.utils.data

    return torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True, collate_fn=collate_fn)


__all__ = ["initialize", "add_config_arguments", "init_distributed", "comm", "zero", "ops", "checkpointing",
           "optimizer_from_client", "DeepSpeedEngine", "MegaTrainEngine", "ConfigError", "UnsupportedModelError",
           "TrainConfig", "parse_config", "__version__"]
