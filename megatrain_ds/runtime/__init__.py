"""``deepspeed.runtime`` as a script reaches it by attribute after ``import megatrain_ds as
deepspeed``.

    # DeepSpeed-Chat's lora.py
    deepspeed.runtime.zero.partition_parameters.ZeroParamStatus.NOT_AVAILABLE
    # DeepSpeed's schedulers
    deepspeed.runtime.lr_schedules.WarmupLR(optimizer, ...)
    # isinstance checks
    deepspeed.runtime.engine.DeepSpeedEngine
    # pipeline_parallelism/train.py
    deepspeed.runtime.utils.set_random_seed(seed)

A ``from deepspeed.runtime... import X`` line in such a script still imports real DeepSpeed (only
the ``import deepspeed`` line was renamed), so only the attribute path lands here. ``engine`` and
``zero`` are megatrain_ds's; ``lr_schedules``, ``utils``, ``config`` (constants such as
``LAMB_OPTIMIZER``), ``config_utils`` and ``checkpoint_engine`` are DeepSpeed's own modules (pure
Python, they work beside megatrain_ds); what megatrain_ds cannot run raises AttributeError naming
it. docs/deepspeed_surface.md lists all of it.
"""

from __future__ import annotations

import importlib

from . import engine, zero

# DeepSpeed's own modules, imported on first use (importing deepspeed costs a second or two)
_REAL = ("lr_schedules", "utils", "config", "config_utils", "checkpoint_engine")

_UNSUPPORTED = {
    "pipe": "pipeline parallelism (PipelineModule / PipelineEngine): megatrain_ds streams the "
    "layers of a plain "
    "nn.Module on one GPU; pass that module to initialize",
    "data_pipeline": "DeepSpeed's data efficiency library (curriculum learning, random-LTD, data "
    "sampling) is "
    "not provided; build the DataLoader in the script",
    "domino": "Domino tensor-parallel overlap needs several GPUs; megatrain_ds trains on one",
    "sequence_parallel": "Ulysses sequence parallelism needs several GPUs; megatrain_ds trains on "
    "one",
    "tensor_parallel": "AutoTP tensor parallelism needs several GPUs; megatrain_ds trains on one",
    "activation_checkpointing": "use deepspeed.checkpointing (megatrain_ds.api.checkpointing) or "
    "the model's "
    "gradient_checkpointing_enable(); the engine recomputes streamed layers itself",
    "superoffload": "SuperOffload is DeepSpeed's own CPU-offload optimizer; megatrain_ds runs its "
    "host "
    "optimizer for every offload setting",
    "zenflow": "ZenFlow is DeepSpeed's own offload scheduler; megatrain_ds runs its host optimizer "
    "instead",
}


def __getattr__(name: str):
    if name in _REAL:
        return importlib.import_module(f"deepspeed.runtime.{name}")
    if name in _UNSUPPORTED:
        raise AttributeError(
            f"deepspeed.runtime.{name} (megatrain_ds imported as deepspeed): {_UNSUPPORTED[name]}"
        )
    raise AttributeError(
        f"module 'megatrain_ds.runtime' has no attribute {name!r} (docs/deepspeed_surface.md "
        "lists the deepspeed.runtime names megatrain_ds provides)"
    )


__all__ = ["engine", "zero", *_REAL]
