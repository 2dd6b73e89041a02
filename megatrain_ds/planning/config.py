"""DeepSpeed-style JSON config, parsed once into typed settings.

The rule is "never silently different from DeepSpeed":

- Defaults come from the installed DeepSpeed (``deepspeed.runtime.constants`` and its pydantic
  config models), so they follow its version (0.19: ``gradient_clipping`` 1.0, ``steps_per_print``
  off).
- Blocks DeepSpeed validates with a pydantic model (``fp16``, ``bf16``, ``zero_optimization``,
  ``compile``, the monitors) go through that model: what it accepts we accept, with the value it
  gives (``"true"`` is true); what it rejects is a ``ConfigError`` naming the key. Numbers DeepSpeed
  would only trip over later (a zero ``gradient_accumulation_steps``, one beta, a negative lr) are
  errors naming the key, at ``initialize``.
- An unresolved ``"auto"`` is an error naming its key: DeepSpeed's models quietly drop it to the
  default (an ``"auto"`` bf16 would train in fp32); accelerate and the HF Trainer resolve it before
  us.
- Top-level keys the engine does not use are ignored (as DeepSpeed does), except DeepSpeed features
  that act on a run: removed ones are errors with DeepSpeed's message; accepted ones megatrain_ds
  does not act on are collected in ``TrainConfig.not_acted_on`` and named in ONE warning per
  ``initialize`` (``warn_not_acted_on``). Unknown keys inside a block the engine uses are errors
  naming the key.
"""

from __future__ import annotations

import base64
import json
import math
import os
import warnings
from typing import Any

from .config_values import (  # noqa: F401
    as_bool,
    check_keys,
    ds_model,
    as_num,
    reject_auto,
    ds_default,
    monitor_config,
)
from ..errors import ConfigError, validation_error_parts  # noqa: F401 (importable from here too)
from ..optim import LossScaling
from .settings import MegatrainSettings, OptimizerSettings, TrainConfig  # noqa: F401 (their home)


def load_config_source(config) -> dict:
    """A dict, a JSON/HJSON file path, or a base64-encoded JSON string -> dict."""
    if config is None:
        raise ConfigError(
            "no DeepSpeed config given: pass config=dict/path or args.deepspeed_config"
        )
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.exists(path):
            with open(path) as f:
                text = f.read()
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                import hjson

                return dict(hjson.loads(text))
        try:
            return json.loads(base64.urlsafe_b64decode(path).decode())
        except Exception:
            raise ConfigError(
                f"config {path!r} is neither an existing file nor base64-encoded JSON"
            ) from None
    raise ConfigError(
        f"config must be a dict, a path or a base64 string, got {type(config).__name__}"
    )


def collective_timeout_of(config):
    """``megatrain.collective_timeout`` of a config (dict, path or base64) as a ``timedelta``, for
    the process group ``initialize`` creates before the config is parsed (its world size is needed
    first); the default when the key is absent, None when the config cannot be read
    (``parse_config`` names the problem right after)."""
    from datetime import timedelta

    try:
        value = (load_config_source(config).get("megatrain") or {}).get("collective_timeout")
        seconds = (
            MegatrainSettings(collective_timeout=value).collective_timeout
            if value is not None
            else MegatrainSettings.__dataclass_fields__["collective_timeout"].default
        )
        return timedelta(seconds=seconds)
    except Exception:  # noqa: BLE001 - parse_config reports it, with the key
        return None


def _batch(cfg: dict, world: int) -> tuple[int, int, int]:
    """DeepSpeed's batch rule (``DeepSpeedConfig._set_batch_related_parameters``): the missing ones
    of train = micro x GA x world are derived, then all three must be >= 1 and the product must
    hold."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    tb, mb, ga = (None if cfg.get(k) is None else as_num(cfg[k], k, int, minimum=1) for k in keys)
    if tb is not None and mb is not None and ga is None:
        ga = tb // (mb * world)
    elif tb is not None and ga is not None and mb is None:
        mb = tb // (ga * world)
    elif mb is not None and tb is None:
        ga = 1 if ga is None else ga
        tb = mb * ga * world
    elif tb is not None and mb is None and ga is None:
        ga, mb = 1, tb // world
    elif tb is None and mb is None:
        raise ConfigError("set 'train_batch_size' or 'train_micro_batch_size_per_gpu'")
    if min(tb, mb, ga) <= 0 or tb != mb * ga * world:
        raise ConfigError(
            f"batch triple does not hold: train_batch_size {tb} != "
            f"train_micro_batch_size_per_gpu {mb} * gradient_accumulation_steps {ga} * "
            f"world size {world}"
        )
    return tb, mb, ga


OPTIMIZER_PARAMS = {
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "adam_w_mode",
    "bias_correction",
    "torch_adam",
    "amsgrad",
    "fused",
    "foreach",
    "fp32_optimizer_states",
}


def _optimizer(cfg: dict, notes: list[str]) -> OptimizerSettings | None:
    block = cfg.get("optimizer")
    if block is None:
        return None
    check_keys(block, {"type", "params"}, "optimizer")
    params = dict(block.get("params") or {})
    if "max_grad_norm" in params:  # DeepSpeed's own error
        raise ConfigError(
            "optimizer.params.max_grad_norm is not supported: use the top-level 'gradient_clipping'"
        )
    check_keys(params, OPTIMIZER_PARAMS, "optimizer.params")
    flags = {
        k: as_bool(params.pop(k), f"optimizer.params.{k}")
        for k in (
            "adam_w_mode",
            "bias_correction",
            "torch_adam",
            "amsgrad",
            "fused",
            "fp32_optimizer_states",
        )
        if k in params
    }
    params.pop("foreach", None)  # torch_adam's foreach: a kernel choice, same numbers
    if flags.get("amsgrad"):
        raise ConfigError("optimizer.params.amsgrad=true is not supported by the host optimizer")
    if not flags.get("bias_correction", True):
        raise ConfigError(
            "optimizer.params.bias_correction=false is not supported by the host optimizer"
        )
    kwargs = {
        k: as_num(v, f"optimizer.params.{k}")
        for k, v in params.items()
        if k in ("lr", "eps", "weight_decay")
    }
    if "betas" in params:
        betas = params["betas"]
        reject_auto(betas, "optimizer.params.betas")
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ConfigError(
                f"optimizer.params.betas must be a list of two numbers, got {betas!r}"
            )
        kwargs["betas"] = tuple(as_num(b, "optimizer.params.betas") for b in betas)
    typ = _name(block.get("type", "AdamW"), "optimizer.type")
    if "adam_w_mode" in flags:
        kwargs["adam_w_mode"] = flags["adam_w_mode"]
    adam_w = typ.lower() == "adamw" or kwargs.get("adam_w_mode", True)
    if flags.get("torch_adam") and adam_w and "weight_decay" not in kwargs:
        # DeepSpeed builds torch.optim.AdamW(**params) here: torch's default decay (0.01), not
        # FusedAdam's 0
        import inspect

        import torch

        kwargs["weight_decay"] = (
            inspect.signature(torch.optim.AdamW).parameters["weight_decay"].default
        )
    return OptimizerSettings(type=typ, **kwargs)


def _name(value: Any, key: str) -> str:
    reject_auto(value, key)
    if not isinstance(value, str):
        raise ConfigError(f"'{key}' must be a name, got {value!r}")
    return value


def precision_blocks(cfg: dict) -> tuple[dict, dict]:
    """The fp16 and bf16 blocks' values after DeepSpeed's own models (its defaults, its
    coercions)."""
    fp16 = cfg.get("fp16") or {}
    # DeepSpeed's order
    bf16 = cfg["bf16"] if cfg.get("bf16") is not None else (cfg.get("bfloat16") or {})
    for block, where in ((fp16, "fp16"), (bf16, "bf16")):
        if not isinstance(block, dict):
            raise ConfigError(
                f"'{where}' must be a block like {{\"enabled\": true}}, got {block!r}"
            )
        reject_auto(block, where)
    fp16_model = ds_model("deepspeed.runtime.precision_config", "DeepSpeedFP16Config", fp16, "fp16")
    bf16_model = ds_model("deepspeed.runtime.precision_config", "DeepSpeedBF16Config", bf16, "bf16")
    if fp16_model is not None and bf16_model is not None:
        return (
            {k: getattr(fp16_model, k) for k in type(fp16_model).model_fields},
            {k: getattr(bf16_model, k) for k in type(bf16_model).model_fields},
        )
    # an older DeepSpeed without precision_config.py: its constants' defaults, our own checks
    defaults = {
        k: ds_default(f"FP16_{k.upper()}_DEFAULT")
        for k in (
            "enabled",
            "auto_cast",
            "loss_scale",
            "initial_scale_power",
            "loss_scale_window",
            "hysteresis",
            "consecutive_hysteresis",
            "min_loss_scale",
        )
    }
    check_keys(fp16, set(defaults) | {"fp16_master_weights_and_grads"}, "fp16")
    check_keys(bf16, {"enabled", "immediate_grad_update", "check_grad_overflow"}, "bf16")
    fp16_values = {**defaults, "fp16_master_weights_and_grads": False, **fp16}
    for k in ("enabled", "auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads"):
        as_bool(fp16_values[k], f"fp16.{k}")
    return fp16_values, {"enabled": as_bool(bf16.get("enabled", False), "bf16.enabled"), **bf16}


def _precision(cfg: dict, notes: list[str]) -> tuple[str, LossScaling | None, bool]:
    """(compute dtype, fp16 loss scaling, fp16 auto_cast)."""
    fp16, bf16 = precision_blocks(cfg)
    if fp16["enabled"] and bf16["enabled"]:
        raise ConfigError("fp16.enabled and bf16.enabled are both true: choose one")
    if fp16["auto_cast"] and not fp16["enabled"]:
        notes.append(
            "fp16.auto_cast without fp16.enabled: inputs are not cast to half (DeepSpeed would "
            "cast "
            "floating-point inputs to half on an fp32 model)"
        )
    if bf16["enabled"]:
        if bf16.get("check_grad_overflow") is False:
            notes.append(
                "bf16.check_grad_overflow=false: a step with non-finite gradients is still skipped "
                "(as DeepSpeed's ZeRO-3 does)"
            )
        return "bf16", None, False
    if not fp16["enabled"]:
        return "fp32", None, False
    if fp16.get("fp16_master_weights_and_grads"):
        notes.append(
            "fp16.fp16_master_weights_and_grads: master weights and gradients stay fp32 on the host"
        )
    static = as_num(fp16["loss_scale"], "fp16.loss_scale", minimum=0.0)
    hysteresis = as_num(fp16["hysteresis"], "fp16.hysteresis", int)
    # DeepSpeed's rule never halves the scale with hysteresis < 1: it would skip forever
    if hysteresis < 1:
        raise ConfigError(
            f"fp16.hysteresis must be >= 1 (overflows tolerated before the scale halves), got "
            f"{hysteresis}"
        )
    power = as_num(fp16["initial_scale_power"], "fp16.initial_scale_power", int)
    scaler = LossScaling(
        scale=static if static > 0 else 2.0**power,
        dynamic=static == 0,
        window=as_num(fp16["loss_scale_window"], "fp16.loss_scale_window", int, minimum=1),
        min_scale=as_num(fp16["min_loss_scale"], "fp16.min_loss_scale", minimum=0.0),
        hysteresis=hysteresis,
        consecutive_hysteresis=bool(fp16["consecutive_hysteresis"]),
    )
    return "fp16", scaler, bool(fp16["auto_cast"])


# zero_optimization keys that mean something to a host-resident streaming engine; every other key
# DeepSpeed accepts (bucket sizes, overlap_comm, prefetch/persistence thresholds, ...) tunes ZeRO's
# partitioning and collectives, which do not exist here: accepted, named in the not-acted-on
# warning. sub_group_size lays out the checkpoint's fp32 partitions as real DeepSpeed's would be
# (wayback.py), so that DeepSpeed can resume it.
ZERO_KEYS_USED = {
    "stage",
    "offload_param",
    "offload_optimizer",
    "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "sub_group_size",
}


def _nvme(cfg: dict, block: dict, notes: list[str]):
    """The NVMe tier's settings (nvme.NvmeSettings) from ``offload_optimizer`` (device nvme) and the
    ``aio`` block (DeepSpeed's own parse); None when the optimizer state is not sent to NVMe."""
    from ..host import NvmeSettings

    opt = block.get("offload_optimizer") or {}
    param = block.get("offload_param") or {}
    aio_block = cfg.get("aio")
    if aio_block is not None and not isinstance(aio_block, dict):
        raise ConfigError(
            f"'aio' must be a dict of DeepSpeed's async I/O settings, got {aio_block!r}"
        )
    from deepspeed.runtime.swap_tensor.aio_config import AIO_DEFAULT_DICT, get_aio_config

    unknown = sorted(set(aio_block or {}) - set(AIO_DEFAULT_DICT))
    if unknown:
        notes.append(
            f"aio keys DeepSpeed does not read: {', '.join(unknown)} (it reads "
            f"{', '.join(sorted(AIO_DEFAULT_DICT))})"
        )
    masters = param.get("device") == "nvme"
    if masters and opt.get("device") != "nvme":
        notes.append(
            "zero_optimization.offload_param.device=nvme: the fp32 masters stay in host memory; "
            "they go to "
            "NVMe with the Adam moments (of the same layers) when offload_optimizer.device is nvme "
            "too"
        )
    elif masters and param.get("nvme_path") and param.get("nvme_path") != opt.get("nvme_path"):
        notes.append(
            f"zero_optimization.offload_param.nvme_path={param.get('nvme_path')!r}: the masters "
            "share the "
            f"Adam moments' swap file under offload_optimizer.nvme_path={opt.get('nvme_path')!r}"
        )
    if masters and opt.get("device") == "nvme":
        staged = [k for k in ("buffer_count", "buffer_size", "max_in_cpu") if k in param]
        if staged:
            notes.append(
                f"zero_optimization.offload_param {', '.join(staged)}: the masters are staged "
                "whole layers at "
                "a time in the optimizer's swap buffers (offload_optimizer.buffer_count)"
            )
    if opt.get("device") == "nvme" and "fast_init" in opt:
        notes.append(
            "zero_optimization.offload_optimizer.fast_init: the swap file is preallocated at "
            "initialize "
            "either way"
        )
    if opt.get("device") != "nvme":
        if aio_block:
            notes.append("aio: no state is on NVMe (offload_optimizer.device is not nvme)")
        return None
    if (aio_block or {}).get("use_gds"):
        notes.append(
            "aio.use_gds: GPUDirect Storage is not used (moments are read into host buffers)"
        )
    return NvmeSettings(
        nvme_path=str(opt.get("nvme_path") or ""),
        buffer_count=int(opt.get("buffer_count", 4)),
        pipeline_read=bool(opt.get("pipeline_read", False)),
        pipeline_write=bool(opt.get("pipeline_write", False)),
        aio=get_aio_config(cfg),
        masters=masters,
    )


def _zero(cfg: dict, notes: list[str]) -> tuple[int, float]:
    block = cfg.get("zero_optimization", {}) or {}
    # DeepSpeed's own config model: unknown keys and bad types are rejected as DeepSpeed rejects
    # them
    ds_model("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig", block, "zero_optimization")
    stage = as_num(block.get("stage", 0), "zero_optimization.stage", int)
    # None: not set (gpu_optimizer_layers decides)
    ratio = (block.get("offload_optimizer") or {}).get("ratio")
    ratio = None if ratio is None else as_num(ratio, "zero_optimization.offload_optimizer.ratio")
    if ratio is not None and not 0.0 <= ratio <= 1.0:
        raise ConfigError(
            f"zero_optimization.offload_optimizer.ratio must be in [0, 1], got {ratio}"
        )
    unused = sorted(set(block) - ZERO_KEYS_USED)
    if unused:
        notes.append(
            "zero_optimization keys with no effect on megatrain_ds (it streams layers instead of "
            f"partitioning them): {', '.join(unused)}"
        )
    return stage, ratio


# DeepSpeed features that act on a run but that megatrain_ds does not implement: accepted when
# enabled (they do not change what is trained), named in the not-acted-on warning with what happens
# instead.
FEATURES_NOT_IMPLEMENTED = {
    "flops_profiler": "no FLOPs profile is printed (wall_clock_breakdown gives the step breakdown; "
    "benchmarks/ computes model TFLOPS)",
    "comms_logger": "one process: no collectives to log",
    "autotuning": "no autotuning experiments are run",
    "data_efficiency": "no curriculum sampling or random-LTD: batches are used as given",
    "activation_checkpointing": "every streamed layer is recomputed in its backward already; the "
    "block's "
    "options (partitioning, CPU checkpointing, ...) do not apply",
    "torch_autocast": "mixed precision comes from the bf16 / fp16 blocks: compute stays fp32 "
    "unless one is "
    "enabled",
    "memory_breakdown": "no per-step memory report is printed",
}

# Keys with no effect in one process, in DeepSpeed too, so nothing is said about them:
# prescale_gradients divides the gradients by the data-parallel world size before the all-reduce
# instead of after, and gradient_predivide_factor f scales them by 1/f before and f/world after;
# with one process there is no all-reduce and world = 1. checkpoint.tag_validation compares the tag
# across ranks: one rank always agrees. communication_data_type, sparse_gradients and
# zero_allow_untested_optimizer likewise concern collectives / ZeRO's optimizer wrapping only.

# checkpoint block keys that would change how checkpoints are written or read, each with its
# DeepSpeed default (a predicate) and what megatrain_ds does instead; checkpoint.py writes
# DeepSpeed's layout with torch.save.
CHECKPOINT_NOT_ACTED_ON = {
    "load_universal": (
        lambda v: v == ds_default("LOAD_UNIVERSAL_CHECKPOINT_DEFAULT"),
        "universal checkpoints are not loaded (DeepSpeed's layout only)",
    ),
    "use_node_local_storage": (
        lambda v: v == ds_default("USE_NODE_LOCAL_STORAGE_CHECKPOINT_DEFAULT"),
        "one process: every file is written from it",
    ),
    "parallel_write": (
        lambda v: not (v or {}).get("pipeline_stage", False),
        "no pipeline stages: files are written by the one process",
    ),
    "writer": (
        lambda v: v is None,
        "files are written with torch.save (no fast / decoupled writer)",
    ),
    "checkpoint_serialization": (
        lambda v: v is True,
        "torch.save's default (zipfile) serialization is used",
    ),
}


def _features(cfg: dict, notes: list[str]) -> None:
    """Keys DeepSpeed itself rejects (removed features) are errors with DeepSpeed's message; enabled
    features megatrain_ds does not implement, and model/pipeline parallelism asked for, are
    named."""
    try:
        from deepspeed.runtime.config import _reject_removed_config_keys
    except ImportError:  # deepspeed is a dependency; an older one without the check: ours only
        _reject_removed_config_keys = None
    if _reject_removed_config_keys is not None:
        try:
            _reject_removed_config_keys(cfg)
        except Exception as exc:  # DeepSpeedConfigError
            raise ConfigError(str(exc)) from None

    # activation_checkpointing has no "enabled" flag: present means used
    def enabled(key: str) -> bool:
        block = cfg[key]
        if isinstance(block, bool):
            return block
        return not isinstance(block, dict) or bool(
            block.get("enabled", key == "activation_checkpointing")
        )

    ignored = [k for k in FEATURES_NOT_IMPLEMENTED if k in cfg and enabled(k)]
    notes.extend(f"{k}: {FEATURES_NOT_IMPLEMENTED[k]}" for k in ignored)
    _parallelism(cfg, notes)
    compile_block = cfg.get("compile") or {}
    model = ds_model("deepspeed.compile.config", "CompileConfig", compile_block, "compile")
    if model is not None:
        changed = [
            k for k in compile_block if getattr(model, k) != type(model).model_fields[k].default
        ]
        if changed:
            notes.append(
                f"compile ({', '.join(changed)}): no DeepCompile passes are run; the model runs "
                "eagerly"
            )
    checkpoint = cfg.get("checkpoint") or {}
    notes.extend(
        f"checkpoint.{k}: {CHECKPOINT_NOT_ACTED_ON[k][1]}"
        for k, v in checkpoint.items()
        if k in CHECKPOINT_NOT_ACTED_ON and not CHECKPOINT_NOT_ACTED_ON[k][0](v)
    )


def _parallelism(cfg: dict, notes: list[str]) -> None:
    """Model / sequence / pipeline parallelism: one process trains the whole model, so sizes > 1 are
    errors."""
    for key in ("sequence_parallel_size", "data_parallel_size"):
        if key in cfg and as_num(cfg[key], key, int) > 1:
            raise ConfigError(
                f"'{key}': {cfg[key]} needs several processes; megatrain_ds trains in one process "
                "(data/sequence parallelism is not implemented): remove the key"
            )
    autotp = (cfg.get("tensor_parallel") or {}).get("autotp_size", 0)
    if autotp and as_num(autotp, "tensor_parallel.autotp_size", int) > 1:
        raise ConfigError(
            f"tensor_parallel.autotp_size={autotp}: tensor parallelism is not implemented; "
            "megatrain_ds trains the whole model in one process (remove the block)"
        )
    pipeline = cfg.get("pipeline") or {}
    default = {
        "stages": "auto",
        "partition": "best",
        "seed_layers": False,
        "activation_checkpoint_interval": 0,
        # DeepSpeed's get_pipeline_config
        "pipe_partitioned": True,
        "grad_partitioned": True,
    }
    changed = [k for k, v in pipeline.items() if default.get(k, object()) != v]
    if changed:
        notes.append(
            f"pipeline ({', '.join(changed)}): no pipeline parallelism; the model is trained whole "
            "(DeepSpeed reads this block only for a PipelineModule)"
        )


def warn_not_acted_on(notes: list[str], stacklevel: int = 3) -> None:
    """ONE warning naming every accepted setting megatrain_ds does not act on (the header is stable:
    tests and users grep for it)."""
    if notes:
        warnings.warn(
            "DeepSpeed settings megatrain_ds does not implement or act on (accepted, ignored): "
            + "; ".join(notes),
            stacklevel=stacklevel,
        )


def _steps_per_print(cfg: dict) -> float:
    spp = cfg.get("steps_per_print", ds_default("STEPS_PER_PRINT_DEFAULT"))
    # DeepSpeed: None = no progress lines (its 0.19 default)
    if spp is None or spp in ("inf", math.inf):
        return math.inf
    return as_num(spp, "steps_per_print", int, minimum=1)


def _compact_moments(cfg: dict, dtype: str, bf16_masters: bool, notes: list[str]) -> bool:
    """Whether the streamed layers' Adam moments are bf16 ([Note: compact moments] in
    host_update.py), as DeepSpeed decides it: ``bf16.bf16_optimizer_states`` (which requires
    ``bf16_master_weights_and_grads``), or ``optimizer.params.fp32_optimizer_states: false``
    (DeepSpeedCPUAdam's moments then take the parameters' dtype: bf16 beside bf16 masters, fp32
    beside fp32 ones)."""
    bf16 = cfg.get("bf16") or {}
    asked = dtype == "bf16" and as_bool(
        bf16.get("bf16_optimizer_states", False), "bf16.bf16_optimizer_states"
    )
    if asked and not bf16_masters:
        raise ConfigError(
            "bf16.bf16_optimizer_states requires bf16.bf16_master_weights_and_grads: true (as "
            "DeepSpeed requires it): bf16 Adam moments beside bf16 master weights"
        )
    fp32_states = ((cfg.get("optimizer") or {}).get("params") or {}).get("fp32_optimizer_states")
    if fp32_states is False and not bf16_masters:
        notes.append(
            "optimizer.params.fp32_optimizer_states=false: the Adam moments stay fp32, as "
            "DeepSpeedCPUAdam's "
            "do beside fp32 master weights (they take the masters' dtype; bf16 with "
            "bf16.bf16_master_weights_and_grads)"
        )
    if asked and fp32_states is True:
        notes.append(
            "optimizer.params.fp32_optimizer_states=true: overridden by bf16.bf16_optimizer_states "
            "(bf16 "
            "moments), as DeepSpeed overrides it"
        )
    return asked or (fp32_states is False and bf16_masters)


def check_combinations(settings: TrainConfig) -> None:
    """Settings valid one by one that exclude each other: a ``ConfigError`` naming both, at parse
    time."""
    mt, fp32, low = settings.megatrain, settings.compute_dtype == "fp32", settings.bf16_masters
    on_gpu = isinstance(mt.gpu_optimizer_layers, int) and mt.gpu_optimizer_layers > 0
    # no fp32 master to stream, none on the GPU either
    if low and (mt.stream_fp32_master is True or on_gpu):
        raise ConfigError(
            "bf16.bf16_master_weights_and_grads keeps bf16 master weights: it excludes "
            "megatrain.stream_fp32_master=true and megatrain.gpu_optimizer_layers > 0"
        )
    if settings.bf16_moments and settings.nvme is not None:
        raise ConfigError(
            "bf16.bf16_optimizer_states (bf16 Adam moments) excludes "
            "zero_optimization.offload_optimizer.device=nvme: the NVMe tier holds fp32 moments. "
            "Use "
            "one or the other"
        )
    if (
        settings.nvme is not None
        and settings.nvme.masters
        and (fp32 or low or mt.stream_fp32_master is True)
    ):
        what = (
            "fp32 compute"
            if fp32
            else "bf16.bf16_master_weights_and_grads"
            if low
            else "megatrain.stream_fp32_master=true"
        )
        raise ConfigError(
            "zero_optimization.offload_param.device=nvme puts the fp32 masters of the NVMe layers "
            "on "
            "disk beside a separate compute-dtype wire copy, which streams from RAM; here the "
            "master is "
            f"what streams ({what}). Use offload_param.device=cpu (the Adam moments still go to "
            "NVMe), "
            "or bf16/fp16 compute with stream_fp32_master false or auto"
        )


def parse_config(config, world_size: int = 1, *, warn: bool = True) -> TrainConfig:
    """Parse a DeepSpeed config (dict/path/base64) into ``TrainConfig``. ``warn``: warn about the
    settings not acted on now (``initialize`` passes False and warns once, with its own arguments'
    notes added)."""
    cfg = load_config_source(config)
    notes: list[str] = []
    _features(cfg, notes)
    tb, mb, ga = _batch(cfg, world_size)
    sched = cfg.get("scheduler")
    if sched is not None:
        check_keys(sched, {"type", "params"}, "scheduler")
    mt = dict(cfg.get("megatrain", {}) or {})
    check_keys(mt, set(MegatrainSettings.__dataclass_fields__), "megatrain")
    clip = as_num(
        cfg.get("gradient_clipping", ds_default("GRADIENT_CLIPPING_DEFAULT")), "gradient_clipping"
    )
    zero_stage, ratio = _zero(cfg, notes)
    nvme = _nvme(cfg, cfg.get("zero_optimization", {}) or {}, notes)
    dtype, scaler, auto_cast = _precision(cfg, notes)
    bf16_masters = dtype == "bf16" and as_bool(
        (cfg.get("bf16") or {}).get("bf16_master_weights_and_grads", False),
        "bf16.bf16_master_weights_and_grads",
    )
    settings = TrainConfig(
        train_batch_size=tb,
        micro_batch_size=mb,
        gradient_accumulation_steps=ga,
        optimizer=_optimizer(cfg, notes),
        scheduler=sched,
        compute_dtype=dtype,
        loss_scaling=scaler,
        fp16_auto_cast=auto_cast,
        gradient_clipping=clip,
        steps_per_print=_steps_per_print(cfg),
        wall_clock_breakdown=as_bool(
            cfg.get("wall_clock_breakdown", ds_default("WALL_CLOCK_BREAKDOWN_DEFAULT")),
            "wall_clock_breakdown",
        ),
        dataloader_drop_last=as_bool(
            cfg.get("dataloader_drop_last", ds_default("DATALOADER_DROP_LAST_DEFAULT")),
            "dataloader_drop_last",
        ),
        zero_stage=zero_stage,
        offload_optimizer_ratio=ratio,
        nvme=nvme,
        bf16_masters=bf16_masters,
        bf16_moments=_compact_moments(cfg, dtype, bf16_masters, notes),
        megatrain=MegatrainSettings(**mt),
        monitor=monitor_config(cfg),
        not_acted_on=tuple(notes),
        raw=cfg,
    )
    check_combinations(settings)
    if warn:
        warn_not_acted_on(notes)
    return settings
