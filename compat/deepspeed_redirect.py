"""What ``MEGATRAIN_DS=1`` changes in the real ``deepspeed`` package, right after it is imported,
and why.

- ``deepspeed.initialize`` -> ``initialize`` below: megatrain_ds's, printing the engine line (on
  each rank: every rank is a process of its own). Reached through accelerate's
  ``_prepare_deepspeed`` (the HF Trainer prepares through accelerate too). With N processes
  (``accelerate launch --num_processes N``, the Trainer under ``torchrun --nproc_per_node N``) every
  rank calls it with accelerate's config (``train_batch_size`` = micro x GA x N, as accelerate and
  the Trainer fill it for DeepSpeed) over accelerate's process group, and the engines train
  data-parallel (megatrain_ds/parallel/dp.py). accelerate shards the dataloader itself (each rank
  its batches).
- ``deepspeed.DeepSpeedEngine`` -> ``megatrain_ds.MegaTrainEngine``: accelerate's
  ``extract_model_from_parallel`` does ``from deepspeed import DeepSpeedEngine`` and ``isinstance``
  (unwrap_model, the Trainer's saves).
- ``deepspeed.zero.Init`` -> ``Init`` below: megatrain_ds's (builds the model whole on the CPU,
  never on the GPU; on every rank) plus DeepSpeed's process group (the launcher's, with N
  processes). Reached by transformers' ``from_pretrained`` / ``from_config`` when an
  ``HfDeepSpeedConfig`` says ZeRO-3 (accelerate's zero3_init_flag,
  ``TrainingArguments(deepspeed=...)``).
- ``deepspeed.zero.GatheredParameters`` -> megatrain_ds's (reads and writes the host masters):
  transformers' weight loading, initialization and embedding resizing under ZeRO-3; accelerate.
- ``deepspeed.ops.adam.DeepSpeedCPUAdam`` / ``FusedAdam`` -> megatrain_ds's descriptions (no op is
  compiled; the engine runs the updates): accelerate's ``map_pytorch_optim_to_deepspeed`` turns a
  script's torch optimizer into one when the optimizer is offloaded.
- ``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad``, ``deepspeed.ops.lion.DeepSpeedCPULion`` -> classes
  that raise, naming the optimizer (the same accelerate mapping, for Adagrad / Lion).
- ``megatrain_ds.zero.ZeroParamStatus`` -> DeepSpeed's enum, so client code comparing a parameter's
  ``ds_status`` with DeepSpeed's ``ZeroParamStatus`` sees the values it expects.

Left real: the distribution and its version (accelerate's ``is_deepspeed_available`` and version
gates read the metadata), ``deepspeed.comm`` (accelerate initializes it), ``deepspeed.utils``
(loggers), ``deepspeed.accelerator``, ``deepspeed.runtime.lr_schedules`` (megatrain_ds builds its
schedulers from it), ``deepspeed.runtime.zero.config`` (megatrain_ds validates ``zero_optimization``
with it), ``deepspeed.checkpoint``, the launcher (which exports ``MEGATRAIN_DS`` to every host:
compat/launcher_env.py).
"""

from __future__ import annotations

import sys

from .env import ENV

_announced = False


def _announce(engine) -> None:
    global _announced
    if _announced:
        return
    _announced = True
    import deepspeed
    import megatrain_ds

    world = megatrain_ds.comm.get_world_size()
    where = f" (rank {megatrain_ds.comm.get_rank()} of {world})" if world > 1 else ""
    print(
        f"[megatrain_ds] {ENV}=1: the engine is megatrain_ds {megatrain_ds.MEGATRAIN_VERSION} "
        f"({type(engine).__name__}), in place of DeepSpeed {deepspeed.__version__}{where}",
        file=sys.stderr,
        flush=True,
    )


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` under the switch: megatrain_ds's, on every rank; errors name what is
    unsupported."""
    import megatrain_ds

    try:
        result = megatrain_ds.initialize(*args, **kwargs)
    except (
        megatrain_ds.ConfigError,
        megatrain_ds.UnsupportedModelError,
        NotImplementedError,
    ) as exc:
        exc.args = (
            f"{ENV}=1 (megatrain_ds in place of DeepSpeed): {exc} -- unset {ENV} to run DeepSpeed",
            *exc.args[1:],
        )
        raise
    _announce(result[0])
    return result


def _ensure_process_group() -> None:
    """As DeepSpeed's ``zero.Init`` does: make sure a process group exists (transformers' ZeRO-3
    weight loading asks ``torch.distributed`` and ``deepspeed.comm`` for the rank). One process: an
    in-memory world of one; under a launcher: its group (accelerate's and the Trainer's exist
    already and are kept)."""
    from megatrain_ds.comm import ensure_deepspeed_comm

    ensure_deepspeed_comm()


def _zero_init_class():
    from megatrain_ds import zero

    class ZeroInit(zero.Init):
        """``deepspeed.zero.Init`` under the switch: megatrain_ds's (the model is built whole on the
        CPU; ``initialize`` moves its layers into host memory and streams them), plus DeepSpeed's
        process group."""

        def __enter__(self):
            if self.enabled:
                _ensure_process_group()
            return super().__enter__()

    ZeroInit.__name__ = ZeroInit.__qualname__ = "Init"
    return ZeroInit


def _unsupported_optimizer(name: str):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{ENV}=1: megatrain_ds's host optimizer runs AdamW/Adam only; {name} is not "
            "supported. Use "
            "torch.optim.AdamW in the script (or an AdamW block in the DeepSpeed config), or unset "
            f"{ENV} to run DeepSpeed."
        )

    return type(
        name, (), {"__init__": __init__, "__doc__": f"{name} is not supported under {ENV}=1."}
    )


def redirect(ds) -> None:
    """Point the real ``deepspeed`` package's entry points at megatrain_ds (see the table above)."""
    import deepspeed.ops.adagrad
    import deepspeed.ops.adam
    import deepspeed.ops.lion
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    import megatrain_ds
    from megatrain_ds import zero
    from megatrain_ds.ops import adam

    if getattr(ds, "__megatrain_ds__", False):
        return
    ds.initialize = initialize
    ds.DeepSpeedEngine = megatrain_ds.MegaTrainEngine
    ds.zero.Init = _zero_init_class()
    ds.zero.GatheredParameters = zero.GatheredParameters
    zero.ZeroParamStatus = ZeroParamStatus
    deepspeed.ops.adam.DeepSpeedCPUAdam = adam.DeepSpeedCPUAdam
    deepspeed.ops.adam.FusedAdam = adam.FusedAdam
    deepspeed.ops.adagrad.DeepSpeedCPUAdagrad = _unsupported_optimizer("DeepSpeedCPUAdagrad")
    deepspeed.ops.lion.DeepSpeedCPULion = _unsupported_optimizer("DeepSpeedCPULion")
    ds.__megatrain_ds__ = True


# module name -> what runs once it is imported (compat/import_hook.py)
HOOKS = {"deepspeed": redirect}
