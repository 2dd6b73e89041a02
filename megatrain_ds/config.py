"""DeepSpeed-style JSON config, parsed once into typed settings.

Top-level keys the engine does not use are ignored (as DeepSpeed does), except DeepSpeed features that would
act on the run: removed ones are errors with DeepSpeed's message, enabled ones megatrain_ds does not implement
(``FEATURES_NOT_IMPLEMENTED``) a warning naming them; unknown keys inside a block the engine does use are
rejected with an error naming the key. ``"auto"`` must have been resolved by the
caller (accelerate / HF Trainer do that); an unresolved ``"auto"`` is an error naming its key.
"""
from __future__ import annotations

import base64
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from .loss_scale import LossScaler
from .monitor import monitor_config


class ConfigError(ValueError):
    """A config value megatrain_ds cannot use; the message names the key."""


def _check_keys(block: dict, allowed: set[str], where: str) -> None:
    for key in block:
        if key not in allowed:
            raise ConfigError(f"unknown key '{where}.{key}' (allowed: {', '.join(sorted(allowed))})")


def validation_error_parts(exc: Exception) -> tuple[str, str]:
    """(key, reason) of a pydantic ValidationError from one of DeepSpeed's config models: the first line
    after the title names the key, the next says why."""
    lines = str(exc).splitlines()
    return (lines[1].strip() if len(lines) > 1 else "?"), (lines[2].strip() if len(lines) > 2 else str(exc))


def _num(value: Any, key: str, cast=float):
    if value == "auto":
        raise ConfigError(f"'{key}' is \"auto\": resolve it before initialize() (accelerate and the HF "
                          "Trainer fill it in; a plain script must give a number)")
    try:
        return cast(value)
    except (TypeError, ValueError):
        raise ConfigError(f"'{key}' must be a number, got {value!r}") from None


@dataclass(kw_only=True, slots=True)
class OptimizerSettings:
    """The ``optimizer`` block."""

    type: str = "AdamW"  # "Adam" (AdamW unless adam_w_mode is false) or "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adam_w_mode: bool = True  # decoupled weight decay; False gives Adam with L2 folded into the gradient

    def __post_init__(self) -> None:
        if self.type.lower() not in ("adam", "adamw", "torch_adam"):
            raise ConfigError(f"optimizer.type {self.type!r} is not supported by the host optimizer; use "
                              "\"AdamW\" or \"Adam\"")
        if self.type.lower() == "adamw":
            self.adam_w_mode = True


@dataclass(kw_only=True, slots=True)
class MegatrainSettings:
    """The ``megatrain`` block: knobs of the streaming engine (DeepSpeed ignores it)."""

    num_slots: int = 2  # device weight slots (2 = double buffering); more = deeper prefetch
    loss_chunk_rows: int = 0  # rows per LM-head chunk; 0 = about 256 MiB of fp32 logits per chunk
    use_liger: bool = True  # liger-kernel's fused linear cross-entropy on CUDA when installed
    liger_kernels: bool = False  # CUDA: liger-kernel's fused RMSNorm, SwiGLU MLP and RoPE in the decoder layers
    # (liger's own instance patching, as the HF Trainer's use_liger_kernel; RoPE is patched module-wide)
    trace: bool = False  # record the executor's schedule (h2d/fwd/bwd/d2h per layer) for inspection
    fp32_grad_landing: bool = False  # GA 1, bf16: land gradients in fp32 (GPU converts; +2 host bytes/param,
    # 2x D2H bytes) so the host optimizer skips its bf16->fp32 pass
    stream_fp32_master: bool = True  # bf16: stream the pinned fp32 master and cast on the GPU instead of
    # keeping a bf16 wire copy: 2x H2D bytes, but no host bf16 copy and no host cast pass in the optimizer;
    # implies fp32 landing; 16 host bytes/param. Measured on 3B/16K/H200: 1.72 s/step vs 2.22 (bf16 wire,
    # bf16 landing) and 1.88 (bf16 wire, fp32 landing). False suits H2D-bound runs (small batches).
    offload_activations: bool = False  # keep each layer's saved input in pinned host memory, not on the GPU
    gpu_optimizer_layers: int | str = -1  # leading layers whose optimizer state lives on the GPU; -1 = from
    # zero_optimization.offload_optimizer.ratio (fraction of optimizer state on the CPU; default 1.0 = none);
    # "auto" = after the first step, as many leading layers as fit in the GPU memory that step left free
    gpu_memory_reserve: float = 0.1  # "auto": fraction of the GPU's memory kept free above the first step's peak

    def __post_init__(self) -> None:
        if self.num_slots < 2:
            raise ConfigError(f"megatrain.num_slots must be >= 2 for double buffering, got {self.num_slots}")
        n = self.gpu_optimizer_layers
        if not (n == "auto" or (isinstance(n, int) and not isinstance(n, bool) and n >= -1)):
            raise ConfigError(f"megatrain.gpu_optimizer_layers must be a layer count >= 0, -1 (from "
                              f"offload_optimizer.ratio) or \"auto\", got {n!r}")
        if not 0.0 <= float(self.gpu_memory_reserve) < 1.0:
            raise ConfigError(f"megatrain.gpu_memory_reserve must be a fraction in [0, 1), got "
                              f"{self.gpu_memory_reserve!r}")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything the engine reads from a DeepSpeed config."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    optimizer: OptimizerSettings | None
    scheduler: dict | None  # {"type": name, "params": {...}} passed to deepspeed.runtime.lr_schedules
    compute_dtype: str = "fp32"  # "bf16" | "fp16" | "fp32"
    loss_scaler: LossScaler | None = None  # fp16 only
    gradient_clipping: float = 0.0
    steps_per_print: float = 10
    wall_clock_breakdown: bool = False
    zero_stage: int = 0
    offload_optimizer_ratio: float = 1.0  # zero_optimization.offload_optimizer.ratio
    megatrain: MegatrainSettings = field(default_factory=MegatrainSettings)
    monitor: Any = None  # DeepSpeed's monitor config when a tensorboard/wandb/csv_monitor/comet block is enabled
    raw: dict = field(default_factory=dict)


def load_config_source(config) -> dict:
    """A dict, a JSON/HJSON file path, or a base64-encoded JSON string -> dict."""
    if config is None:
        raise ConfigError("no DeepSpeed config given: pass config=dict/path or args.deepspeed_config")
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
            raise ConfigError(f"config {path!r} is neither an existing file nor base64-encoded JSON") from None
    raise ConfigError(f"config must be a dict, a path or a base64 string, got {type(config).__name__}")


def _batch(cfg: dict, world: int) -> tuple[int, int, int]:
    tb = cfg.get("train_batch_size")
    mb = cfg.get("train_micro_batch_size_per_gpu")
    ga = cfg.get("gradient_accumulation_steps")
    tb = None if tb is None else _num(tb, "train_batch_size", int)
    mb = None if mb is None else _num(mb, "train_micro_batch_size_per_gpu", int)
    ga = None if ga is None else _num(ga, "gradient_accumulation_steps", int)
    if tb is not None and mb is not None and ga is None:
        ga = tb // (mb * world)
    elif tb is not None and ga is not None and mb is None:
        mb = tb // (ga * world)
    elif mb is not None and tb is None:
        ga = ga or 1
        tb = mb * ga * world
    elif tb is not None and mb is None and ga is None:
        ga, mb = 1, tb // world
    elif tb is None and mb is None:
        raise ConfigError("set 'train_batch_size' or 'train_micro_batch_size_per_gpu'")
    if min(tb, mb, ga) <= 0 or tb != mb * ga * world:
        raise ConfigError(f"batch triple does not hold: train_batch_size {tb} != "
                          f"train_micro_batch_size_per_gpu {mb} * gradient_accumulation_steps {ga} * "
                          f"world size {world}")
    return tb, mb, ga


def _optimizer(cfg: dict) -> OptimizerSettings | None:
    block = cfg.get("optimizer")
    if block is None:
        return None
    _check_keys(block, {"type", "params"}, "optimizer")
    params = dict(block.get("params", {}))
    _check_keys(params, {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction",
                         "torch_adam", "amsgrad", "fused"}, "optimizer.params")
    if params.pop("amsgrad", False):
        raise ConfigError("optimizer.params.amsgrad=true is not supported by the host optimizer")
    params.pop("torch_adam", None), params.pop("fused", None)
    if not params.pop("bias_correction", True):
        raise ConfigError("optimizer.params.bias_correction=false is not supported by the host optimizer")
    kwargs = {k: _num(v, f"optimizer.params.{k}") for k, v in params.items()
              if k in ("lr", "eps", "weight_decay")}
    if "betas" in params:
        kwargs["betas"] = tuple(_num(b, "optimizer.params.betas") for b in params["betas"])
    if "adam_w_mode" in params:
        kwargs["adam_w_mode"] = bool(params["adam_w_mode"])
    return OptimizerSettings(type=str(block.get("type", "AdamW")), **kwargs)


FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"}


def _precision(cfg: dict) -> tuple[str, LossScaler | None]:
    bf16 = cfg.get("bf16", cfg.get("bfloat16", {})) or {}
    fp16 = cfg.get("fp16", {}) or {}
    _check_keys(fp16, FP16_KEYS, "fp16")
    _check_keys(bf16, {"enabled", "immediate_grad_update", "check_grad_overflow"}, "bf16")
    bf16_on, fp16_on = bf16.get("enabled", False) is True, fp16.get("enabled", False) is True
    if bf16_on and fp16_on:
        raise ConfigError("fp16.enabled and bf16.enabled are both true: choose one")
    if not fp16_on:
        return ("bf16" if bf16_on else "fp32"), None
    static = _num(fp16.get("loss_scale", 0), "fp16.loss_scale")
    power = _num(fp16.get("initial_scale_power", 16), "fp16.initial_scale_power", int)
    scaler = LossScaler(scale=static if static > 0 else 2.0 ** power, dynamic=static == 0,
                        window=_num(fp16.get("loss_scale_window", 1000), "fp16.loss_scale_window", int),
                        min_scale=_num(fp16.get("min_loss_scale", 1), "fp16.min_loss_scale"),
                        hysteresis=_num(fp16.get("hysteresis", 2), "fp16.hysteresis", int),
                        consecutive_hysteresis=bool(fp16.get("consecutive_hysteresis", False)))
    return "fp16", scaler


# zero_optimization keys that mean something to a host-resident streaming engine; every other key DeepSpeed
# accepts (bucket sizes, overlap_comm, prefetch/persistence thresholds, ...) tunes ZeRO's partitioning and
# collectives, which do not exist here: accepted, with one warning naming them.
ZERO_KEYS_USED = {"stage", "offload_param", "offload_optimizer", "stage3_gather_16bit_weights_on_model_save",
                  "gather_16bit_weights_on_model_save"}


def _zero(cfg: dict) -> tuple[int, float]:
    block = cfg.get("zero_optimization", {}) or {}
    try:  # DeepSpeed's own config model: unknown keys and bad types are rejected as DeepSpeed rejects them
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except ImportError:  # deepspeed is a dependency; without it only our own checks run
        DeepSpeedZeroConfig = None
    if DeepSpeedZeroConfig is not None:
        try:
            DeepSpeedZeroConfig(**block)
        except Exception as exc:  # pydantic.ValidationError
            key, why = validation_error_parts(exc)
            raise ConfigError(f"zero_optimization.{key}: {why}") from None
    stage = int(_num(block.get("stage", 0), "zero_optimization.stage", int))
    ratio = _num((block.get("offload_optimizer") or {}).get("ratio", 1.0), "zero_optimization.offload_optimizer.ratio")
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"zero_optimization.offload_optimizer.ratio must be in [0, 1], got {ratio}")
    for key in ("offload_param", "offload_optimizer"):
        device = (block.get(key) or {}).get("device", "none")
        if device == "nvme":
            warnings.warn(f"zero_optimization.{key}.device=nvme: megatrain_ds keeps state in host memory "
                          "(no NVMe tier yet)", stacklevel=3)
    unused = sorted(set(block) - ZERO_KEYS_USED)
    if unused:
        warnings.warn("zero_optimization keys with no effect on megatrain_ds (it streams layers instead of "
                      f"partitioning them): {', '.join(unused)}", stacklevel=3)
    return stage, ratio


# DeepSpeed features that act on a run but that megatrain_ds does not implement: accepted when enabled (they do
# not change what is trained), with one warning naming each and what happens instead.
FEATURES_NOT_IMPLEMENTED = {
    "flops_profiler": "no FLOPs profile is printed (wall_clock_breakdown gives the step breakdown; "
                      "benchmarks/ computes model TFLOPS)",
    "comms_logger": "one process: no collectives to log",
    "autotuning": "no autotuning experiments are run",
    "data_efficiency": "no curriculum sampling or random-LTD: batches are used as given",
    "activation_checkpointing": "every streamed layer is recomputed in its backward already; the block's "
                                "options (partitioning, CPU checkpointing, ...) do not apply",
    "torch_autocast": "mixed precision comes from the bf16 / fp16 blocks: compute stays fp32 unless one is "
                      "enabled",
}


def _features(cfg: dict) -> None:
    """Keys DeepSpeed itself rejects (removed features) are errors with DeepSpeed's message; enabled features
    megatrain_ds does not implement are a warning naming them."""
    try:
        from deepspeed.runtime.config import _reject_removed_config_keys
    except ImportError:  # deepspeed is a dependency; an older one without the check: ours only
        _reject_removed_config_keys = None
    if _reject_removed_config_keys is not None:
        try:
            _reject_removed_config_keys(cfg)
        except Exception as exc:  # DeepSpeedConfigError
            raise ConfigError(str(exc)) from None
    def enabled(key: str) -> bool:  # activation_checkpointing has no "enabled" flag: present means used
        block = cfg[key]
        return not isinstance(block, dict) or bool(block.get("enabled", key == "activation_checkpointing"))

    ignored = [k for k in FEATURES_NOT_IMPLEMENTED if k in cfg and enabled(k)]
    if ignored:
        warnings.warn("DeepSpeed features megatrain_ds does not implement, ignored: "
                      + "; ".join(f"{k}: {FEATURES_NOT_IMPLEMENTED[k]}" for k in ignored), stacklevel=3)


def parse_config(config, world_size: int = 1) -> TrainConfig:
    """Parse a DeepSpeed config (dict/path/base64) into ``TrainConfig``."""
    cfg = load_config_source(config)
    _features(cfg)
    tb, mb, ga = _batch(cfg, world_size)
    sched = cfg.get("scheduler")
    if sched is not None:
        _check_keys(sched, {"type", "params"}, "scheduler")
    mt = dict(cfg.get("megatrain", {}) or {})
    _check_keys(mt, set(MegatrainSettings.__dataclass_fields__), "megatrain")
    clip = _num(cfg.get("gradient_clipping", 0.0), "gradient_clipping")
    zero_stage, ratio = _zero(cfg)
    dtype, scaler = _precision(cfg)
    spp = cfg.get("steps_per_print", 10)
    return TrainConfig(
        train_batch_size=tb, micro_batch_size=mb, gradient_accumulation_steps=ga,
        optimizer=_optimizer(cfg), scheduler=sched, compute_dtype=dtype, loss_scaler=scaler, gradient_clipping=clip,
        steps_per_print=float("inf") if spp in (None, "inf", float("inf")) else _num(spp, "steps_per_print"),
        wall_clock_breakdown=bool(cfg.get("wall_clock_breakdown", False)), zero_stage=zero_stage,
        offload_optimizer_ratio=ratio,
        megatrain=MegatrainSettings(**mt), monitor=monitor_config(cfg), raw=cfg)
