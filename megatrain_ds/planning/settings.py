"""The parsed settings: what ``parse_config`` (config.py) makes of a DeepSpeed config, as values.

``TrainConfig`` is everything the engine reads, frozen (``dataclasses.replace`` makes a changed
copy); ``OptimizerSettings`` the ``optimizer`` block, ``MegatrainSettings`` the ``megatrain``
block, each field's meaning above it (docs/configuration.md has the same keys as a table). Each
block checks its own values in ``__post_init__`` and raises ``ConfigError`` naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..optim import LossScaling
from .config_values import ds_default

__all__ = ["MegatrainSettings", "OptimizerSettings", "TrainConfig"]


@dataclass(kw_only=True, slots=True)
class OptimizerSettings:
    """The ``optimizer`` block. Defaults are those of DeepSpeed's own Adam (``FusedAdam`` /
    ``DeepSpeedCPUAdam``, what it builds for an ``Adam``/``AdamW`` block;
    tests/engine/test_faults_config.py checks them against its signatures)."""

    type: str = "AdamW"  # "Adam" (AdamW unless adam_w_mode is false) or "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    # decoupled weight decay; False gives Adam with L2 folded into the gradient
    adam_w_mode: bool = True

    def __post_init__(self) -> None:
        if self.type.lower() not in ("adam", "adamw", "torch_adam"):
            raise ConfigError(
                f"optimizer.type {self.type!r} is not supported by the host optimizer; use "
                "\"AdamW\" or \"Adam\""
            )
        if self.type.lower() == "adamw":
            self.adam_w_mode = True  # as DeepSpeed: type AdamW forces decoupled decay
        # torch.optim.AdamW's own checks, at initialize instead of at the first step
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(
                f"optimizer.params.betas must be two numbers in [0, 1), got {list(self.betas)}"
            )
        for key in ("lr", "eps", "weight_decay"):
            if not getattr(self, key) >= 0.0:
                raise ConfigError(
                    f"optimizer.params.{key} must be >= 0, got {getattr(self, key)!r}"
                )


@dataclass(kw_only=True, slots=True)
class MegatrainSettings:
    """The ``megatrain`` block: knobs of the streaming engine (DeepSpeed ignores it)."""

    # device weight slots (2 = double buffering); more = deeper prefetch
    num_slots: int = 2
    # rows per LM-head chunk; 0 = about 256 MiB of fp32 logits per chunk
    loss_chunk_rows: int = 0
    # liger-kernel's fused linear cross-entropy on CUDA when installed
    use_liger: bool = True
    # step each layer's AdamW as its gradient lands (clip coefficient 1), undo + redo when clipping
    # fires or the step is skipped (speculation.py); false: the whole update after the norm
    speculative_step: bool = True
    # steps without speculation after a step that clipped, skipped or rolled back
    speculation_backoff: int = 8
    # where a layer's gradient waits for the norm: "host" (a landing buffer, 2 bytes/param) or "gpu"
    # (12 host bytes/param for fp32 masters; 2 bytes/param of GPU memory; GA 1, one process, no NVMe
    # tier, no speculative step or deferred moments: [Note: gradients held on the device] in
    # grad_hold.py); "auto": "gpu" where the host state fits the host budget with it but not without
    # (CUDA, GA 1, one process, no NVMe tier)
    gradient_hold: str = "auto"
    # labels= on a causal LM: LM head + cross-entropy in chunks, no whole logits (the output's
    # .logits is None); false runs the model's own forward and returns its logits
    fused_loss: bool = True
    # liger-kernel's fused RMSNorm, SwiGLU MLP and RoPE in the decoder layers (liger's own instance
    # patching, as the HF Trainer's use_liger_kernel; RoPE is patched module-wide). "auto": on CUDA
    # when liger-kernel is installed and supports the model type; true: required; false: off
    liger_kernels: bool | str = "auto"
    # trailing layers whose forward keeps its graph (no recompute in their backward; executor.py's
    # [Note: kept layers]); "auto": after the second step, as many as the GPU memory that step left
    # free holds (CUDA; 0 on CPU); 0: recompute every layer
    keep_activations: int | str = "auto"
    # layers whose weights keep a device buffer of their own from their forward to their backward
    # (the recompute reads them there: one H2D a step, not two; executor.py's [Note: weight
    # cache]); "auto": after the second step, as many as the GPU memory left after the optimizer
    # state and the kept layers holds (CUDA; 0 on CPU); 0: off
    weight_cache_layers: int | str = 0
    # record the executor's schedule (h2d/fwd/bwd/d2h per layer) for inspection
    trace: bool = False
    # GA 1, bf16: land gradients in fp32 (GPU converts; +2 host bytes/param, 2x D2H bytes). Only the
    # torch host kernel needs fp32 gradients to run in one pass; the native one reads bf16
    fp32_grad_landing: bool = False
    # the host AdamW (host_update.py, [Note: native host update]): "native" = one C pass per layer
    # (gradient in its landing dtype, master, moments and wire copy in one sweep; bit-identical to
    # torch's fused AdamW), built at first use with the machine's C compiler; "torch" = torch's
    # fused AdamW in cache-sized blocks; "auto" = native where it builds, else torch (said once)
    host_kernel: str = "auto"
    # the update after the norm in two passes of the native kernel ([Note: deferred moments] in
    # host_update.py): the new master first (the next forward waits for it: 18 of the update's 26
    # host bytes/param), the new Adam moments later, under the next forward and backward
    # (bit-identical; 36 bytes/param in all). "auto" = on with the native kernel for layers in host
    # RAM and AdamW (or Adam without weight decay), except in a step that speculated (clipping
    # quiet: one pass there, see the Note); true: in every step; false: one pass
    deferred_moments: bool | str = "auto"
    # bf16: stream the pinned fp32 master and cast on the GPU instead of keeping a bf16 wire copy:
    # 2x H2D bytes, but no host bf16 copy and no host cast pass in the optimizer; 14 host
    # bytes/param with the native host kernel (bf16 gradients), 16 with the torch one (fp32
    # landing). False suits H2D-bound runs (small batches). "auto": true, unless most streamed
    # weights are frozen (LoRA): then a bf16 wire, which is also the frozen weights' only copy (2
    # host bytes each, host_state.py); true keeps frozen weights in fp32 (4 bytes each)
    stream_fp32_master: bool | str = "auto"
    # keep each layer's saved input in pinned host memory, not on the GPU
    offload_activations: bool = False
    # each decoder layer's dense MLP (and RMSNorms without liger's) in row chunks, only its input
    # saved, each chunk recomputed in the backward (tiling.py: long context, where the [tokens,
    # intermediate] tensors dominate). "auto": when a call's tokens x intermediate size x dtype
    # bytes exceed 4 GiB (tiling.AUTO_THRESHOLD_BYTES), in chunks of ~512 MiB; true: always; false:
    # never; an int: rows (tokens) per chunk
    tiled_mlp: bool | int | str = "auto"
    # a recomputed layer skips its MLP's output projection (recompute_skip.py: nothing of the
    # backward reads its value; ~28% of a Qwen2.5 layer's forward FLOPs) where the layer's source
    # shows it safe (Llama, Qwen2/3, Mistral, Gemma); "auto": there; false: never
    skip_recompute_down_proj: bool | str = "auto"
    # leading layers whose optimizer state lives on the GPU; -1 = from
    # zero_optimization.offload_optimizer.ratio when the config sets it (fraction of optimizer
    # state on the CPU), else "auto"; "auto" = after the second step, the resident parameters'
    # state (embeddings, head) and then as many leading layers as fit in the GPU memory the steps
    # left free, after the kept layers, or before them when the host update was exposed
    # (engine_auto.py's [Note: auto placement order]; CUDA; 0 on CPU)
    gpu_optimizer_layers: int | str = -1
    # CUDA: the host optimizer's threads (placement.py, docs/placement.md): "auto" = every core of
    # the GPU's NUMA node but one, kept for the main thread (which would otherwise slow the update
    # down); an int = that many; "off" = leave torch's threads as they are
    host_threads: int | str = "auto"
    # "auto": fraction of the GPU's memory kept free above the first step's peak
    gpu_memory_reserve: float = 0.1
    # no-grad forwards (generate, eval): upload every streamed layer once into a device-resident
    # cache and reuse it until the weights change or a grad-enabled forward starts (inference.py,
    # docs/generate.md). "auto": on CUDA, in one process, when the layers in the compute dtype take
    # at most inference_cache_memory of the free device memory; true: always (CPU and data
    # parallel included); false: stream every layer for every no-grad forward
    inference_cache: bool | str = "auto"
    # "auto": the fraction of free device memory the cache may take
    inference_cache_memory: float = 0.5
    # with zero_optimization.offload_optimizer.device=nvme: how many trailing streamed layers keep
    # their Adam moments on disk (nvme.py); "auto": the fewest that let the host state fit in
    # host_memory_budget (0 when everything fits in RAM)
    nvme_layers: int | str = "auto"
    # GiB of host RAM the engine's state may take when placing layers on the NVMe tier; "auto": the
    # memory available at initialize (plus what the model's own weights free) less a margin
    # (host_bytes.py, host_budget_bytes)
    host_memory_budget: float | str = "auto"
    # compare each layer's backward recompute with its forward (outputs on the device, read at the
    # step; arguments changed in place, on the CPU) and stop with RecomputeMismatch naming the layer
    # when they differ (recompute_check.py): "auto" = the first 3 steps of every run; true = every
    # step; false = never; an int = the first that many steps
    check_recompute: bool | int | str = "auto"
    # relative L2 error allowed per output; "auto": 1e-4 (fp32), 2e-2 (bf16), 1e-2 (fp16)
    check_recompute_tolerance: float | str = "auto"
    # the NVMe tier's I/O: "aio" (DeepSpeed's async I/O op; libaio), "threads" (a thread pool over
    # an O_DIRECT file), "auto" (aio when it builds and loads, else threads)
    nvme_backend: str = "auto"
    # data parallel: which ranks split the host state (dp.py, [Note: data parallel]): "node" = the
    # ranks of each node (host) hold one copy between them, each node its own (gradients
    # all-reduced between the nodes; no weight crosses the network); "job" = every rank of the job
    # holds its share of one copy (each node 1/nodes of the state; every layer's weights broadcast
    # to every node). One node: the same
    host_sharding: str = "node"
    # data parallel: the seconds a rank waits in one of the engine's collectives for the other
    # ranks; then CollectiveError naming this rank, the collective (micro-step, step, layer), the
    # rank(s) that did not arrive and where they last were, and what to do (dp.py, [Note:
    # collective timeouts]). A rank stalled in the script's own code is caught too (an arrival check
    # at forward() and backward(), the norm in step()). Keep it above the longest time ranks
    # legitimately drift apart (a slow checkpoint write, evaluation on one rank); 600 is NCCL's own
    # default wait. Also the timeout of a process group megatrain_ds creates itself
    collective_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.num_slots < 2:
            raise ConfigError(
                f"megatrain.num_slots must be >= 2 for double buffering, got {self.num_slots}"
            )
        if (
            not isinstance(self.speculation_backoff, int)
            or isinstance(self.speculation_backoff, bool)
            or self.speculation_backoff < 0
        ):
            raise ConfigError(
                f"megatrain.speculation_backoff must be a step count >= 0, got "
                f"{self.speculation_backoff!r}"
            )
        if self.host_sharding not in ("node", "job"):
            raise ConfigError(
                f"megatrain.host_sharding must be \"node\" or \"job\", got {self.host_sharding!r}"
            )
        if self.gradient_hold not in ("host", "gpu", "auto"):
            raise ConfigError(
                "megatrain.gradient_hold must be \"host\", \"gpu\" or \"auto\", got "
                f"{self.gradient_hold!r}"
            )
        n = self.gpu_optimizer_layers
        if not (n == "auto" or (isinstance(n, int) and not isinstance(n, bool) and n >= -1)):
            raise ConfigError(
                f"megatrain.gpu_optimizer_layers must be a layer count >= 0, -1 (from "
                f"offload_optimizer.ratio) or \"auto\", got {n!r}"
            )
        k = self.keep_activations
        if not (k == "auto" or (isinstance(k, int) and not isinstance(k, bool) and k >= 0)):
            raise ConfigError(
                f"megatrain.keep_activations must be a layer count >= 0 or \"auto\", got {k!r}"
            )
        c = self.weight_cache_layers
        if not (c == "auto" or (isinstance(c, int) and not isinstance(c, bool) and c >= 0)):
            raise ConfigError(
                f"megatrain.weight_cache_layers must be a layer count >= 0 or \"auto\", got {c!r}"
            )
        from ..model import validate_recompute_skip
        from ..model import validate_tiling as validate_setting

        try:
            validate_setting(self.tiled_mlp)
            validate_recompute_skip(self.skip_recompute_down_proj)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        from ..host import parse_setting

        try:
            parse_setting(self.host_threads)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.host_kernel not in ("auto", "native", "torch"):
            raise ConfigError(
                f"megatrain.host_kernel must be \"auto\", \"native\" or \"torch\", got "
                f"{self.host_kernel!r}"
            )
        if self.deferred_moments not in (True, False, "auto"):
            raise ConfigError(
                f"megatrain.deferred_moments must be true, false or \"auto\", got "
                f"{self.deferred_moments!r}"
            )
        if self.stream_fp32_master not in (True, False, "auto"):
            raise ConfigError(
                f"megatrain.stream_fp32_master must be true, false or \"auto\", got "
                f"{self.stream_fp32_master!r}"
            )
        if self.liger_kernels not in (True, False, "auto"):
            raise ConfigError(
                f"megatrain.liger_kernels must be true, false or \"auto\", got "
                f"{self.liger_kernels!r}"
            )
        if not 0.0 <= float(self.gpu_memory_reserve) < 1.0:
            raise ConfigError(
                f"megatrain.gpu_memory_reserve must be a fraction in [0, 1), got "
                f"{self.gpu_memory_reserve!r}"
            )
        if not (isinstance(self.inference_cache, bool) or self.inference_cache == "auto"):
            raise ConfigError(
                f"megatrain.inference_cache must be true, false or \"auto\", got "
                f"{self.inference_cache!r}"
            )
        f = self.inference_cache_memory
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= float(f) <= 1.0:
            raise ConfigError(
                f"megatrain.inference_cache_memory must be a fraction in [0, 1], got {f!r}"
            )
        n = self.nvme_layers
        if not (n == "auto" or (isinstance(n, int) and not isinstance(n, bool) and n >= 0)):
            raise ConfigError(
                f"megatrain.nvme_layers must be a layer count >= 0 or \"auto\", got {n!r}"
            )
        b = self.host_memory_budget
        if not (b == "auto" or (isinstance(b, (int, float)) and not isinstance(b, bool) and b > 0)):
            raise ConfigError(
                f"megatrain.host_memory_budget must be a number of GiB > 0 or \"auto\", got {b!r}"
            )
        from ..model import validate_check

        try:
            validate_check(self.check_recompute)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        t = self.check_recompute_tolerance
        if not (t == "auto" or (isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0)):
            raise ConfigError(
                f"megatrain.check_recompute_tolerance must be a relative error > 0 or \"auto\", "
                "got "
                f"{t!r}"
            )
        t = self.collective_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
            raise ConfigError(
                f"megatrain.collective_timeout must be a number of seconds > 0, got {t!r}"
            )
        if self.nvme_backend not in ("auto", "aio", "threads"):
            raise ConfigError(
                f"megatrain.nvme_backend must be \"auto\", \"aio\" or \"threads\", got "
                f"{self.nvme_backend!r}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Everything the engine reads from a DeepSpeed config: a value (``dataclasses.replace`` makes a
    changed copy)."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    optimizer: OptimizerSettings | None
    # {"type": name, "params": {...}} passed to deepspeed.runtime.lr_schedules
    scheduler: dict | None
    compute_dtype: str = "fp32"  # "bf16" | "fp16" | "fp32"
    # fp16 only; the engine builds its live LossScaler from it
    loss_scaling: LossScaling | None = None
    # fp16.auto_cast: the engine's forward casts floating-point positional inputs to half, as
    # DeepSpeed's (loss_scale.cast_inputs_half)
    fp16_auto_cast: bool = False
    # <= 0: no clipping (as DeepSpeed)
    gradient_clipping: float = field(
        default_factory=lambda: float(ds_default("GRADIENT_CLIPPING_DEFAULT"))
    )
    steps_per_print: float = math.inf  # optimizer steps between progress lines; inf = never
    wall_clock_breakdown: bool = False
    dataloader_drop_last: bool = False  # initialize(training_data=...): drop the last partial batch
    zero_stage: int = 0
    # zero_optimization.offload_optimizer.ratio; None: not set
    offload_optimizer_ratio: float | None = None
    # nvme.NvmeSettings when zero_optimization.offload_optimizer.device is nvme (the NVMe tier)
    nvme: Any = None
    # bf16.bf16_master_weights_and_grads: the streamed layers' master weights in bf16 (opt-in
    # capacity over precision: 12 host bytes per parameter instead of 16; host_state.py)
    bf16_masters: bool = False
    # bf16.bf16_optimizer_states (or fp32_optimizer_states false) beside bf16 masters: the streamed
    # layers' Adam moments in bf16 too (8 host bytes per parameter; [Note: compact moments],
    # host_update.py)
    bf16_moments: bool = False
    megatrain: MegatrainSettings = field(default_factory=MegatrainSettings)
    # DeepSpeed's monitor config when a tensorboard/wandb/csv_monitor/comet block is enabled
    monitor: Any = None
    # accepted settings megatrain_ds ignores, each "key: what happens instead"; warned about once
    # per initialize (warn_not_acted_on)
    not_acted_on: tuple[str, ...] = ()
    raw: dict = field(default_factory=dict)
