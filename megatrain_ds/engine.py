"""The training engine: DeepSpeed's calls on top of the streaming core.

    loss = engine(input_ids=x, labels=y).loss   # embeddings -> streamed layers -> chunked LM-head loss
    engine.backward(loss)                        # per-layer recompute + grad, D2H into host memory
    engine.step()                                # enqueue clip + AdamW on the host; returns at once

Reading order: ``__init__`` (how the model is split and where each tensor lives), ``forward``,
``backward``, ``step``. The executor (executor.py), the host state (host_state.py) and the optimizer
(optimizer.py) hold the mechanics.
"""
from __future__ import annotations

import os
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from .activations import HostActivations
from .adapters import save_adapter
from .checkpoint import load_checkpoint, save_checkpoint
from .config import ConfigError, TrainConfig
from .executor import StreamedLayers
from .recompute_check import RecomputeCheck, RecomputeMismatch
from .export import consolidated_state_dict, save_16bit_model
from .device_state import DeviceOptimizerState
from .dp import DataParallel
from .host_state import HostLayerStore
from .host_update import lands_fp32, resolve_kernel
from .lifecycle import close_tiers_at_exit, deferred_interrupt, refuse_a_model_in_use, refuse_empty_sequences
from .log import ALL_RANKS, log, logger
from .loss import linear_cross_entropy
from .loss_scale import cast_inputs_half
from .model_map import build_layout, find_block_list, plain_lm_head, shared_parameter_ids
from .monitor import Monitor
from .optimizer import HostAdamW, HostAdamWParts, ResidentParams
from .placement import apply_placement
from .placement import resolve as resolve_placement
from .speculation import SpeculationPolicy
from .streams import make_streams
from .surface import EngineSurface, adopt_zero3_model
from .timing import StepTimer
from .zero import ParamHome, mark_partitioned


def _apply_liger_kernels(model: nn.Module, device: torch.device, setting) -> str | None:
    """``megatrain.liger_kernels``: liger-kernel's RMSNorm, SwiGLU MLP and RoPE in place of the model's (CUDA
    only; the loss is megatrain_ds's own chunked / fused linear cross-entropy either way). ``setting`` "auto"
    applies them when liger-kernel is installed and knows the model type, silently otherwise; True requires
    them. Returns the model type patched, or None."""
    if setting is False:
        return None
    if device.type != "cuda":
        if setting is True:
            warnings.warn("megatrain.liger_kernels: liger-kernel runs on CUDA only; the model's own kernels are "
                          "used", stacklevel=3)
        return None
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        if setting == "auto":
            return None
        raise ConfigError("megatrain.liger_kernels needs liger-kernel (pip install 'megatrain-ds[gpu]'): "
                          f"{exc}") from exc
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: as HF Trainer does
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        if setting is True:
            warnings.warn(f"megatrain.liger_kernels: liger-kernel has no kernels for model type {model_type!r}; "
                          "the model's own kernels are used", stacklevel=3)
        return None
    _apply_liger_kernel_to_instance(model=base, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    return model_type


def _count(n: int) -> str:
    """A parameter count for people: 72.7 B, 210 M, 12.3 K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


def _sync_initial_weights(model: nn.Module, layers: nn.ModuleList, dp, shared_ids: set) -> None:
    """Data parallel: every rank trains from rank 0's weights (DeepSpeed broadcasts them from rank 0 too). A
    streamed layer's weights go to its owner only (the other ranks never hold them); resident parameters and
    buffers to every rank. Over the gloo group, one tensor at a time (host memory: one tensor above the model)."""
    import torch.distributed as dist

    def exchange(t: torch.Tensor, dst: int | None) -> None:
        host = t.detach().to("cpu", copy=True).contiguous() if t.device.type != "cpu" else t.detach()
        if dst is None:
            dist.broadcast(host, src=0, group=dp.cpu_group)
        elif dp.rank == 0:
            dist.send(host, dst=dst, group=dp.cpu_group)
        else:
            dist.recv(host, src=0, group=dp.cpu_group)
        if host is not t and (dst is None or dp.rank == dst):
            with torch.no_grad():
                t.copy_(host)

    in_layers = set()
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            if id(p) in shared_ids:  # resident (used by two layers, or a layer and the rest): every rank
                continue
            in_layers.add(id(p))
            if dp.owner(i) != 0 and dp.rank in (0, dp.owner(i)):
                exchange(p.data, dp.owner(i))
    for p in model.parameters():
        if id(p) not in in_layers:
            exchange(p.data, None)
    for buf in model.buffers():
        if buf.is_floating_point() or buf.dtype in (torch.int64, torch.int32):
            exchange(buf, None)


def _check_capacity(config: TrainConfig, layouts, model, layers, shared_ids, group_of, device, dp):
    """plan.py's check of what ``initialize`` is about to allocate (host RAM, the NVMe tier's disk, the GPU's
    persistent buffers): ``CapacityError`` with the numbers, before any buffer exists, instead of an allocation
    failure mid-build or mid-step. The model's own host weights count as free (the engine's copies replace them)."""
    from . import plan
    layer_ids = {id(p) for layer in layers for p in layer.parameters()} - shared_ids
    resident = [(p.numel(), id(p) in group_of) for p in model.parameters() if id(p) not in layer_ids]
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", dp.world) or 1)) if dp.active else 1
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters() if p.device.type == "cpu"}
    return plan.check_capacity(layouts, resident, config, device, world=local,
                               freed_bytes=local * sum(storages.values()),
                               model_name=getattr(getattr(model, "config", None), "name_or_path", "") or
                               type(model).__name__)


def _nvme_layers(config: TrainConfig, layouts, owned, wire_dtype, ga, grad_dtype, model, layers) -> int:
    """How many trailing streamed layers keep their Adam moments on the NVMe tier: ``megatrain.nvme_layers``, or
    ("auto") the fewest that let the host state fit in the budget (plan.py decides, as ``megatrain-ds plan``)."""
    setting = config.megatrain.nvme_layers
    if setting != "auto":
        return min(int(setting), len(layouts))
    from . import plan
    return plan.engine_nvme_layers(config, layouts, owned, wire_dtype, ga, grad_dtype, model, layers)


def _param_groups(model: nn.Module, model_parameters, defaults: dict) -> list[dict]:
    """User's ``model_parameters`` (None, params, or dicts) -> torch-style groups of trainable params."""
    if model_parameters is None:
        model_parameters = model.parameters()
    items = list(model_parameters)
    if not items or not isinstance(items[0], dict):
        items = [{"params": items}]
    groups = []
    for item in items:
        params = [p for p in item["params"] if p.requires_grad]
        groups.append({**defaults, **{k: v for k, v in item.items() if k != "params"}, "params": params})
    return groups


def _fused_loss_parts(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """(decoder, LM head) when ``model`` is a Hugging Face causal LM (possibly wrapped by PEFT) whose loss is
    the decoder's hidden states through a plain linear head into cross-entropy; None otherwise (the model's own
    forward then runs: heads that do more than a matmul, LoRA on the head)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # PEFT
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    name = type(base).__name__
    if not isinstance(head, nn.Linear) or not (name.endswith("ForCausalLM") or name.endswith("LMHeadModel")):
        return None
    decoder = getattr(base, getattr(base, "base_model_prefix", ""), None)
    if not isinstance(decoder, nn.Module) or decoder is base:
        return None
    head_name = next((n for n, m in base.named_children() if m is head), None)
    if head_name is None or plain_lm_head(base, head_name, base.base_model_prefix) is not None:
        return None  # the head does more than a matmul (soft-capping, logit scales), or another loss: own forward
    return decoder, head


class LogitsNotComputed:
    """``.logits`` of a training forward with ``labels=``: the fused LM head + cross-entropy computed the loss
    without ever forming the [tokens, vocab] logits. Any use says so (instead of a bare ``None`` error)."""

    _WHY = ("megatrain_ds computed this loss with the fused LM head + cross-entropy, so the logits were never "
            "formed; to get them, call the model without labels= and take the loss from the logits, or set "
            "\"megatrain\": {\"fused_loss\": false} in the config")

    def __getattr__(self, name):
        raise AttributeError(f"{self._WHY} (asked for .logits.{name})")

    def __getitem__(self, key):
        raise TypeError(self._WHY)

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "LogitsNotComputed(fused loss: logits were never formed)"


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


class MegaTrainEngine(EngineSurface, nn.Module):
    """Trains ``model`` with every persistent tensor in host memory and the GPU as a streaming engine."""

    def __init__(self, model: nn.Module, config: TrainConfig, model_parameters=None,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.config_settings = config
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if device is None:
            device = torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")
        self.device = device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.dp = DataParallel(device, config.megatrain.collective_timeout)  # rank, world, layer ownership (dp.py)
        compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.compute_dtype, torch.float32)
        mt = config.megatrain
        self.compute_dtype = compute_dtype
        model.train()
        # before the layer templates are made from the layers; "auto" in mixed precision only: fp32 training is
        # the exact mode (liger's kernels round differently from the model's own, below bf16's precision)
        liger = mt.liger_kernels if (mt.liger_kernels != "auto" or compute_dtype != torch.float32) else False
        self.liger_model_type = _apply_liger_kernels(model, device, liger)  # None: the model's own kernels
        settings = config.optimizer
        defaults = settings and dict(lr=settings.lr, betas=settings.betas, eps=settings.eps,
                                     weight_decay=settings.weight_decay)
        groups = _param_groups(model, model_parameters, defaults) if settings else []
        group_of = {id(p): g for g, group in enumerate(groups) for p in group["params"]}
        # what initialize decided to train (its layout and optimizer state follow): a later requires_grad_(False)
        # on one of them is refused at the next forward (_check_trained), not silently ignored
        self._trained = [(n, p) for n, p in model.named_parameters() if id(p) in group_of]

        refuse_a_model_in_use(model)
        adopt_zero3_model(model)  # built under real DeepSpeed's zero.Init (HfDeepSpeedConfig): made whole
        # 1. Split: streamed layers (host flat buffers) vs resident params (device copies).
        self.block_name, layers = find_block_list(model)
        shared_ids = shared_parameter_ids(model, layers)  # used by two layers (or a layer and the rest): resident
        layouts = [build_layout(i, layer, group_of, shared_ids) for i, layer in enumerate(layers)]
        if self.dp.active:  # every rank starts from rank 0's weights, as DeepSpeed's ZeRO-3 does
            _sync_initial_weights(model, layers, self.dp, shared_ids)
        # What crosses PCIe: the compute dtype, or the fp32 master itself (cast on the GPU). "auto": the master,
        # unless most streamed weights are frozen (LoRA): their compute-dtype wire copy is then their only copy.
        stream_fp32 = mt.stream_fp32_master
        if config.bf16_masters:  # opt-in bf16-master mode: no fp32 master to stream, none on the GPU either
            if stream_fp32 is True or (isinstance(mt.gpu_optimizer_layers, int) and mt.gpu_optimizer_layers > 0):
                raise ConfigError("bf16.bf16_master_weights_and_grads keeps bf16 master weights: it excludes "
                                  "megatrain.stream_fp32_master=true and megatrain.gpu_optimizer_layers > 0")
            stream_fp32 = False
        if config.nvme is not None and config.nvme.masters:  # masters on NVMe: the wire that streams stays in RAM
            if compute_dtype == torch.float32 or config.bf16_masters or stream_fp32 is True:
                raise ConfigError(
                    "zero_optimization.offload_param.device=nvme puts the fp32 masters of the NVMe layers on disk "
                    "beside a separate compute-dtype wire copy, which streams from RAM; here the master is what "
                    "streams (" + ("fp32 compute" if compute_dtype == torch.float32 else
                                   "bf16.bf16_master_weights_and_grads" if config.bf16_masters else
                                   "megatrain.stream_fp32_master=true") + "). Use offload_param.device=cpu "
                    "(the Adam moments still go to NVMe), or bf16/fp16 compute with stream_fp32_master false or auto")
            stream_fp32 = False
        if stream_fp32 == "auto":
            stream_fp32 = sum(lay.n_frozen for lay in layouts) <= sum(lay.n_train for lay in layouts)
        wire_dtype = torch.float32 if stream_fp32 else compute_dtype
        self.wire_dtype = wire_dtype
        ga = config.gradient_accumulation_steps
        self.streams = make_streams(device)
        pin = device.type == "cuda"
        self.host_kernel = resolve_kernel(mt.host_kernel)  # built now (about a second), not in the first step
        # GA 1: gradients land in fp32 or as the GPU made them (the compute dtype; host_update.lands_fp32)
        grad_dtype = torch.float32 if lands_fp32(mt.fp32_grad_landing, stream_fp32, self.host_kernel) \
            else compute_dtype
        owned = self.dp.owned_mask(len(layers))
        self.capacity = _check_capacity(config, layouts, model, layers, shared_ids, group_of, device, self.dp) \
            if settings is not None else None  # refused here, before any buffer, when the state cannot fit
        n_disk = _nvme_layers(config, layouts, owned, wire_dtype, ga, grad_dtype, model, layers) \
            if config.nvme is not None and settings is not None else 0
        if config.nvme is not None and n_disk == 0:  # nothing on disk now: the path is still checked up front
            from .nvme import check_path
            check_path(config.nvme.nvme_path, 0)
        self.store = HostLayerStore(layouts, wire_dtype, grad_accum_fp32=ga > 1, pin=pin, grad_dtype=grad_dtype,
                                    owned=owned, disk_from=len(layers) - n_disk, nvme=config.nvme, rank=self.dp.rank,
                                    nvme_backend=mt.nvme_backend,
                                    master_dtype=compute_dtype if config.bf16_masters else torch.float32)
        self.precision_mode = "bf16 masters" if config.bf16_masters else "fp32 masters"  # named in the step line
        if config.bf16_masters:
            logger.info("bf16 master weights (bf16.bf16_master_weights_and_grads): the streamed layers' "
                        "masters are bf16 (12 host bytes per parameter instead of 16); updates below bf16's resolution "
                        "round away. Speculative steps and GPU-held optimizer state are off in this mode.")
        if self.store.tier is not None:  # its writes must land, and its file go, even without destroy()
            close_tiers_at_exit(self)
        if self.store.tier is not None:
            tier = self.store.tier
            what = "fp32 masters and Adam moments" if self.store.masters_on_disk else "Adam moments"
            logger.info(f"NVMe tier: the {what} of layers {self.store.disk_from}..{len(layers) - 1} "
                        f"({n_disk} of {len(layers)}) live in {tier.path} ({tier.file_bytes / 2**30:.2f} GiB, "
                        f"{tier.backend}, {len(tier.buffers)} staging buffers of {tier.region_bytes / 2**20:.0f} MiB, "
                        f"pipeline_read={config.nvme.pipeline_read}, pipeline_write={config.nvme.pipeline_write})")
        # 2. One host worker thread: gradient landings and optimizer tasks, FIFO. See streams.py's Note.
        # Its threads are placed (placement.py) on CUDA only: on the CPU the main thread computes the model itself
        # (data parallel: each local rank within its own share of the host's cores)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.dp.world) or 1) if self.dp.active else 1
        self.placement = resolve_placement(mt.host_threads, device.index, local_rank=self.local_rank,
                                           local_world=local_world) if device.type == "cuda" else None
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-host",
                                         initializer=apply_placement, initargs=(self.placement,))
        # and the AdamW thread (speculative and post-norm updates; see [Note: host threads] in optimizer.py)
        self.opt_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-adamw",
                                             initializer=apply_placement, initargs=(self.placement,))
        check = RecomputeCheck(mt.check_recompute, mt.check_recompute_tolerance, compute_dtype,
                               type(model).__name__, input_from_next=mt.offload_activations)
        # the breakdown costs one device sync per step (see timing.py): only when the config asks for it
        self.timer = StepTimer(self.streams, enabled=config.wall_clock_breakdown)
        self.executor = StreamedLayers(layers, layouts, self.store, device, self.streams, self.worker,
                                       num_slots=mt.num_slots, compute_dtype=compute_dtype, dp=self.dp, check=check,
                                       timer=self.timer)
        from .tiling import apply_tiling  # long context: the templates' MLPs (and non-liger RMSNorms) in row chunks
        self.tiled_modules = apply_tiling(self.executor.templates, mt.tiled_mlp)  # "template:path" of each
        if mt.trace:
            self.executor.trace = []
        from .inference import InferenceCache  # no-grad forwards (generate) on device-resident layers
        self.executor.inference = InferenceCache(self.executor, mt.inference_cache, mt.inference_cache_memory)
        if mt.offload_activations:
            self.executor.activations = HostActivations(self.streams, device)
        for i, layer in enumerate(layers):
            self.store.load_layer(i, layer)  # copies weights to the host master, frees the module's storage
        self.store.finish_loading()  # page-locks the wire copy now that it is written (host_state.py)
        n_device = mt.gpu_optimizer_layers
        if n_device == -1:  # from DeepSpeed's offload_optimizer.ratio (the fraction of optimizer state on the
            ratio = config.offload_optimizer_ratio  # CPU) when the config sets it, else from measured memory
            n_device = "auto" if ratio is None else round((1.0 - ratio) * len(layers))
        # "auto" placements are decided after the first step, from its measured peak (see _place_auto)
        # (off CUDA nothing is measured, so nothing is placed: _auto_budget_bytes is None)
        self._auto_device_state = n_device == "auto" and settings is not None
        self._auto_keep = mt.keep_activations == "auto"
        self._auto_placed = ""  # what "auto" put on the GPU (named in an out-of-memory error)
        if config.bf16_masters:  # the GPU-held state keeps fp32 masters: not in bf16-master mode
            self._auto_device_state = False
        if n_device == "auto":
            n_device = 0
        n_device = min(n_device, self.store.disk_from)  # GPU-held layers lead; NVMe layers trail
        if n_device > 0:
            self.executor.device_state = DeviceOptimizerState(self.store, 0, min(n_device, len(layers)), device)
        if mt.keep_activations != "auto":
            self.executor.set_keep(mt.keep_activations)
        layer_ids = {id(p) for layer in layers for p in layer.parameters()} - shared_ids
        resident = [p for p in model.parameters() if id(p) not in layer_ids]
        self.resident = ResidentParams(resident, group_of, device, compute_dtype, self.streams, pin,
                                       state_on_device=n_device > 0, dp=self.dp)
        # The module may be called without the engine (the HF Trainer evaluates ``trainer.model``; generate):
        # a module owning resident parameters refreshes their device copies first (a no-op when current).
        resident_ids = {id(p) for p in resident}
        self._refresh_hooks = [
            module.register_forward_pre_hook(lambda _module, _args: self.resident.upload())
            for module in model.modules() if any(id(p) in resident_ids for p in module.parameters(recurse=False))]
        in_layers = {id(m) for m in layers.modules()}  # their buffers: the executor's per-layer device copies
        for module in model.modules():  # buffers outside the layers (e.g. rotary tables) live on the device
            if id(module) in in_layers:
                continue
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = buf.to(device)
        self.module = model
        self._fused = _fused_loss_parts(model)
        self._mark_params(layers)
        if (self._auto_device_state or self._auto_keep) and device.type == "cuda":
            torch.cuda.empty_cache()  # the model's GPU copy, if it was built there, is gone: so is its peak
            torch.cuda.reset_peak_memory_stats(device)

        # 3. Host optimizer over the fp32 masters.
        self.optimizer = None
        if settings is not None:
            parts = HostAdamWParts(executor=self.executor, store=self.store, schedule=self.executor.schedule,
                                   streams=self.streams, timer=self.timer, resident=self.resident, worker=self.worker,
                                   opt_worker=self.opt_worker, clip=config.gradient_clipping,
                                   scaler=config.loss_scaler, dp=self.dp, kernel=self.host_kernel)
            # a speculative step is undone exactly only on fp32 masters (bf16 rounding would not come back)
            policy = SpeculationPolicy(mt.speculative_step and not config.bf16_masters, mt.speculation_backoff)
            self.optimizer = HostAdamW(groups, defaults, parts, adam_w_mode=settings.adam_w_mode, policy=policy)
        self.lr_scheduler = None
        if self.optimizer is not None:
            policy = self.optimizer.policy
            tier = self.store.tier
            self.timer.counters = lambda: {"speculated_steps": policy.speculated,
                                           "rolled_back_steps": policy.rolled_back,
                                           **({"nvme_read_bytes": tier.read_bytes,
                                               "nvme_written_bytes": tier.written_bytes} if tier else {})}
        self.micro_steps = 0
        self.window_micro_steps = 0  # micro-steps of the current accumulation window (its partial gradient)
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0  # steps skipped on non-finite gradients (every precision; fp16 overflow)
        self._boundary_override: bool | None = None
        self._last_norm = None
        # DeepSpeed's monitors (tensorboard / wandb / csv_monitor / comet blocks), when one is enabled
        self.monitor = Monitor(config.monitor) if config.monitor is not None else None
        mem = self.host_memory()
        if self.optimizer is not None and mem["base"] > mem["trainable"]:  # LoRA-style
            logger.info(f"frozen base: {_count(mem['base'])} parameters kept in {compute_dtype} only; "
                        f"{_count(mem['trainable'])} trainable with fp32 master + AdamW; host state "
                        f"{mem['total_bytes'] / 2**30:.2f} GiB = {mem['bytes_per_base_param']:.3f} bytes per base "
                        "parameter" + (" (this rank's layers)" if self.dp.active else ""))

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        self.dp.mark("forward", self.micro_steps, self.global_steps, arrive=True)  # dp.py: collective timeouts
        refuse_empty_sequences(args, kwargs)
        self._check_trained()
        self._settle_speculation()  # a forward between backward() and step() sees the pre-step weights
        self.resident.upload()  # waits for the last step's resident update, then H2D (see the Note)
        if self.config_settings.fp16_auto_cast:  # DeepSpeed's fp16.auto_cast: floating positional inputs to half
            args = cast_inputs_half(args)
        args, kwargs = _to_device(args, self.device), _to_device(kwargs, self.device)
        self.timer.begin_forward()
        self.tput_timer.start()  # DeepSpeed's throughput timer, as its forward starts it (surface.py)
        try:
            if self._fused is not None and torch.is_grad_enabled() and self._fused_loss_applies(kwargs):
                return self._forward_fused_loss(args, kwargs)
            return self.module(*args, **kwargs)
        except torch.OutOfMemoryError as exc:
            self._explain_oom(exc)
            raise

    def _check_trained(self) -> None:
        """A parameter initialize set up for training whose requires_grad was turned off since: its flat layout,
        optimizer state and gradient landing are fixed at initialize, so it would go on training; refuse by name."""
        frozen = [n for n, p in self._trained if not p.requires_grad]
        if frozen:
            raise RuntimeError(
                f"requires_grad_(False) after initialize on {len(frozen)} parameter(s) megatrain_ds trains "
                f"({', '.join(frozen[:4])}{', ...' if len(frozen) > 4 else ''}): the set of trained parameters is "
                "fixed at initialize (their host layout and optimizer state). Freeze them before initialize (e.g. "
                "build a new engine for the new set), or turn requires_grad back on")

    def _explain_oom(self, exc: BaseException) -> None:
        """A device OOM after "auto" used the memory the first step left free: say which keys give it back."""
        if self._auto_placed:
            exc.args = (f"{exc.args[0] if exc.args else exc}\n[megatrain_ds] after the first step, \"auto\" "
                        f"placed {self._auto_placed} in the GPU memory that step left free; this batch needs more: "
                        "set megatrain.keep_activations and/or megatrain.gpu_optimizer_layers to 0 (or a smaller "
                        "count), or raise megatrain.gpu_memory_reserve", *exc.args[1:])

    def _fused_loss_applies(self, kwargs) -> bool:
        """The fused head + cross-entropy computes exactly the model's loss: plain causal-LM labels, nothing the
        model adds to it (MoE router aux loss: the model's own forward runs, logits and all) and no logits the
        caller asked to keep."""
        if kwargs.get("labels") is None or not self.config_settings.megatrain.fused_loss:
            return False
        config = getattr(self._fused[0], "config", None)
        if kwargs.get("output_router_logits", getattr(config, "output_router_logits", False)):
            return False
        return kwargs.get("logits_to_keep", 0) == 0 and kwargs.get("return_dict") is not False

    def _forward_fused_loss(self, args, kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast
        decoder, head = self._fused
        labels = kwargs.pop("labels")
        num_items = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)
        kwargs["use_cache"] = False
        out = decoder(*args, **kwargs)
        hidden = out[0]  # (B, S, h)
        mt = self.config_settings.megatrain
        with self.timer.span("compute", self.streams.compute()):
            loss = linear_cross_entropy(hidden, head.weight, head.bias, labels, num_items,
                                        chunk_rows=mt.loss_chunk_rows, use_liger=mt.use_liger)
        return CausalLMOutputWithPast(loss=loss, logits=LogitsNotComputed(),
                                      hidden_states=getattr(out, "hidden_states", None),
                                      attentions=getattr(out, "attentions", None))

    # ------------------------------------------------------------------ backward
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.config_settings.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary_override = bool(is_boundary)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backward through the head, the streamed layers (recompute + grad) and the embeddings."""
        self.dp.mark("backward", self.micro_steps, self.global_steps, arrive=True)
        done = getattr(self, "_backward_done_for", None)
        if done is not None and done[0]() is loss and not done[1]:
            raise RuntimeError(
                "Trying to backward through the graph a second time: engine.backward() already ran on this loss "
                "without retain_graph=True, and its graph is freed (PyTorch and DeepSpeed refuse this too). The "
                "first backward's gradient is kept. Pass retain_graph=True to the first backward to go through "
                "the graph again, or compute the loss again")
        user_loss = loss
        final = self.is_gradient_accumulation_boundary()
        ga = self.config_settings.gradient_accumulation_steps
        if scale_wrt_gas and ga > 1:
            loss = loss / ga
        if self.config_settings.loss_scaler is not None:  # fp16: the optimizer divides it back out
            loss = loss * self.config_settings.loss_scaler.scale
        stale = [p for p in self.resident.params if p.grad is not None]
        if stale:  # evacuate() leaves every .grad None: these came from a backward outside the engine
            for p in stale:
                p.grad = None
            warnings.warn(f"{len(stale)} parameter(s) held a .grad from a backward outside engine.backward(); it "
                          "was dropped", stacklevel=2)
        if final and self.optimizer is not None:  # layers step as their gradients land (speculation.py), when
            # each layer's backward loads it exactly once: one forward per layer into this loss, no retained graph
            once = not retain_graph and self.executor.schedule.one_forward_each()
            self.optimizer.begin_speculation(allowed=once)
        self.executor.begin_backward(final)
        try:
            loss.backward(retain_graph=retain_graph)
        except BaseException as exc:
            self._discard_gradients()
            if isinstance(exc, torch.OutOfMemoryError):
                self._explain_oom(exc)
            raise
        finally:
            self.executor.end_backward()
        if self.dp.active:  # the owners' accumulations ran on d2h after each reduce (executor._evacuate)
            self.streams.wait(self.streams.compute(), self.streams.record(self.streams.d2h))
        self.resident.evacuate(self.worker, final)
        self.executor.mark_backward_done()  # after the folds above
        self._backward_done_for = (weakref.ref(user_loss), retain_graph)  # a second backward of it is refused
        self.dp.mark("backward_done", self.micro_steps, self.global_steps)
        return loss

    # ------------------------------------------------------------------ step
    def step(self, lr_kwargs=None) -> None:
        """At an accumulation boundary: queue clip + AdamW (host) and advance counters and scheduler.

        Once the update is queued it will be applied, so a Ctrl-C (KeyboardInterrupt) that arrives after that is
        held until the counters, scheduler and monitors agree with the weights, then raised: a checkpoint the
        script saves in its ``except KeyboardInterrupt:`` has step N+1's weights with ``global_steps`` N+1
        (it had N, and a resume repeated a batch)."""
        self.dp.mark("step", self.micro_steps, self.global_steps)
        with deferred_interrupt() as deferred:
            self._step(lr_kwargs, deferred)
        self.dp.mark("step_done", self.micro_steps, self.global_steps)

    def _step(self, lr_kwargs, deferred) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        self.window_micro_steps = 0 if boundary else self.window_micro_steps + 1
        if boundary:
            deferred.hold()  # from here the step completes before a Ctrl-C is raised (see step())
            skipped = False
            if self.executor.check.active:  # the recompute check's errors, before any update is queued
                self._read_recompute_check()
            if self.optimizer is not None:
                self._last_norm = self.optimizer.step()
                # Wait for the norm task (it waits for the last gradient landings: a CPU-GPU sync), in every
                # precision: a step with non-finite gradients is skipped, as DeepSpeed skips it, and that decides
                # the counters and the lr scheduler below. It costs no overlap: the next forward waits for the
                # resident update, which waits for this norm, anyway; only the script's own work between step()
                # and the next forward (fetching a batch) no longer runs beside the last landings.
                with torch.profiler.record_function("megatrain.wait_norm"):
                    self._last_norm.result()
                if self.optimizer.step_error is not None:  # fp16: overflow at the minimum loss scale
                    raise self.optimizer.step_error
                skipped = self.optimizer.last_step_skipped
                if skipped:  # masters, moments and Adam's step count are untouched (optimizer._norm_task)
                    self.skipped_steps += 1
                    log(self.optimizer.skip_message, ranks=ALL_RANKS)
            else:
                self.executor.reset_window()
            self.global_steps += 1
            previous_samples = self.global_samples
            self.global_samples += self.config_settings.train_batch_size
            if self.lr_scheduler is not None and not skipped:  # DeepSpeed does not advance it on overflow
                self.lr_scheduler.step(**(lr_kwargs or {}))
            self.timer.end_step()
            if self._auto_device_state or self._auto_keep:
                self._place_auto()
            if self.monitor is not None:
                self.monitor.write_step(self, previous_samples)
            spp = self.config_settings.steps_per_print
            if spp != float("inf") and self.global_steps % spp == 0:  # DeepSpeed's progress line
                log(f"step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}, "
                    f"mom={self.get_mom()}, {self.precision_mode}", ranks=ALL_RANKS)
                if self.config_settings.wall_clock_breakdown:
                    log(f"step {self.global_steps}: {self.timer.format(self.timer.last)}", ranks=ALL_RANKS)
        self._end_step_surface(self.is_gradient_accumulation_boundary())  # tput_timer.stop, was_step_applied
        self.micro_steps += 1  # a set_gradient_accumulation_boundary() override stays until set again (as DS)

    def _auto_budget_bytes(self) -> int | None:
        """GPU bytes free for optimizer state after the first step: what the driver reports free now (other
        processes and non-PyTorch memory accounted for), less the step's transient peak above what the caching
        allocator holds now, less the reserve fraction of the GPU. None off CUDA (nothing to place)."""
        if self.device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        transient = torch.cuda.max_memory_reserved(self.device) - torch.cuda.memory_reserved(self.device)
        return int(free - max(transient, 0) - total * self.config_settings.megatrain.gpu_memory_reserve)

    def _place_auto(self) -> None:
        """The "auto" placements, once the first step has shown the working set (its measured peak): GPU memory
        the step left free goes, in this order, to (1) the resident parameters' optimizer state (embeddings,
        head: their update otherwise sits between the backward and the next forward), (2) kept layers (no
        recompute: a quarter of the FLOPs of each), (3) the optimizer state of leading layers. Later batches
        are assumed no larger than the first (a longer one may run out of memory: the error then names the
        keys). The reserve (``gpu_memory_reserve``) stays free."""
        auto_state, auto_keep = self._auto_device_state, self._auto_keep
        self._auto_device_state = self._auto_keep = False
        budget = self._auto_budget_bytes()
        if budget is None:
            return
        budget = self.dp.min_int(budget)  # every rank keeps the same layers (the collectives' order: dp.py)
        start, placed = budget, []
        if auto_state and self.optimizer is not None and not self.resident.on_device:
            need = self.resident.device_bytes()
            if 0 < need <= budget:
                self.synchronize()
                self.resident.move_state_to_device()
                budget -= need
                placed.append(f"resident optimizer state {need / 2**30:.1f} GiB")
        if auto_keep:
            ex = self.executor
            weights = max(l.numel for l in self.store.layouts) * ex.slots[0].buf.element_size()
            per_layer = int(ex.graph_bytes * 1.1) + weights  # 10% above the largest graph a recompute built
            n = min(len(self.store.layouts), max(0, budget) // per_layer) if ex.graph_bytes else 0
            n = self.dp.min_int(n)
            ex.set_keep(n)
            budget -= n * per_layer
            placed.append(f"{n} of {len(self.store.layouts)} layers kept without recompute "
                          f"({n * per_layer / 2**30:.1f} GiB)")
        if auto_state and self.optimizer is not None and self.executor.device_state is None:
            n_layers = min(len(self.store.layouts), self.store.disk_from)  # not the NVMe tier's (they trail)
            n = 0
            while n < n_layers and DeviceOptimizerState.nbytes(self.store, n + 1) <= budget:
                n += 1
            if n > 0:
                self.move_layer_state_to_device(n)
            placed.append(f"{n} of {n_layers} layers' optimizer state on the GPU "
                          f"({DeviceOptimizerState.nbytes(self.store, n) / 2**30:.1f} GiB)")
        self._auto_placed = "; ".join(p for p in placed if not p.startswith("0 of"))
        log(f"placed from the first step's peak ({max(start, 0) / 2**30:.1f} GiB free above it "
            f"and the reserve): {'; '.join(placed) or 'nothing'}", ranks=ALL_RANKS)

    def move_layer_state_to_device(self, n: int) -> None:
        """Keep the fp32 master, Adam moments and gradient of the leading ``n`` layers on the device from now on
        (between steps; the state so far comes along)."""
        if self.executor.device_state is not None:
            raise RuntimeError("layer optimizer state is already on the device "
                               f"(layers [0, {self.executor.device_state.hi}))")
        self.synchronize()  # every queued update has been applied to the host buffers
        if n > self.store.disk_from:
            raise ValueError(f"move_layer_state_to_device({n}): layers from {self.store.disk_from} on keep their "
                             "moments on the NVMe tier")
        self.executor.device_state = DeviceOptimizerState(self.store, 0, min(n, len(self.store.layouts)),
                                                          self.device, moments_from_host=True)

    # ------------------------------------------------------------------ queries
    def train_batch_size(self) -> int:
        return self.config_settings.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config_settings.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.config_settings.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.config_settings.zero_stage

    def bfloat16_enabled(self) -> bool:
        return self.config_settings.compute_dtype == "bf16"

    def fp16_enabled(self) -> bool:
        return self.config_settings.compute_dtype == "fp16"

    @property
    def config(self) -> dict:
        """The DeepSpeed config dict, as DeepSpeed's engine exposes it."""
        return self.config_settings.raw

    def __getattr__(self, name: str):
        """DeepSpeed's engine forwards unknown attributes to the wrapped module (e.g. ``engine.config`` is the
        DeepSpeed dict, but ``engine.generate`` or ``engine.gradient_checkpointing_enable`` are the model's)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules.get("module")
            if module is None:
                raise
            return getattr(module, name)

    def get_global_grad_norm(self) -> float | None:
        """Pre-clip global gradient norm of the last step (waits for the host norm task)."""
        return None if self._last_norm is None else self._last_norm.result()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """DeepSpeed's ``engine.zero_grad()``: the gradients of the accumulation window are the engine's, and it
        keeps them until the window's step (DeepSpeed's ZeRO keeps its accumulated partitions), so a script that
        calls it after every micro-step trains with the configured accumulation as on DeepSpeed. What it clears:
        ``.grad`` a backward outside the engine left on the resident parameters."""
        for p in self.resident.params:
            p.grad = None

    def _drop_window(self) -> None:
        """Drop the gradients accumulated since the last step (a failed backward, a refused step)."""
        self._settle_speculation()
        for p in self.resident.params:  # a failed backward may have left autograd's partial sums here
            p.grad = None
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        else:
            self.executor.reset_window()

    def _read_recompute_check(self) -> None:
        """Read the window's recompute comparisons ([Note: recompute check]); on a mismatch nothing of this step
        is applied: speculated layers are rolled back and the window's gradients dropped, then it raises."""
        if self.executor.backward_done is not None:  # a CPU-GPU sync, where step() waits for the last landing
            self.executor.backward_done.synchronize()  # anyway (the norm below): it costs no overlap
        try:
            self.executor.check.read(self.dp)
        except RecomputeMismatch:
            for fut in self.executor.sq_norm:
                if fut is not None:
                    fut.exception()  # the landings queued by the backward have run
            self._drop_window()  # rolls back speculated layers first
            raise

    def _discard_gradients(self) -> None:
        """A backward raised: whatever part of it ran must not reach a step. Waits for the landings it queued,
        then drops the accumulation window (earlier micro-batches of the window included: their sums share the
        buffers) and the resident parameters' partial ``.grad``; saved activations of the failed graph go too."""
        for fut in self.executor.sq_norm:
            if fut is not None:
                fut.exception()  # waits; an error of the landing itself is not this error
        self._drop_window()
        if self.executor.activations is not None:
            self.executor.activations.clear()
        warnings.warn("engine.backward() raised: the gradients accumulated since the last step were discarded "
                      "(the step that follows applies only later backwards)", stacklevel=3)

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer else []

    def get_mom(self) -> list:
        """Each group's Adam betas, as DeepSpeed's ``get_mom``."""
        return [g["betas"] for g in self.optimizer.param_groups] if self.optimizer else []

    def _settle_speculation(self) -> None:
        """Between backward() and step(), anything that reads or changes the weights first rolls back the
        layers stepped speculatively (step() then runs the plain update)."""
        if self.optimizer is not None and self.optimizer.spec is not None:
            self.optimizer.abandon_speculation()

    def synchronize(self) -> None:
        """Wait for every queued host task (landings, optimizer) and device work."""
        self._settle_speculation()
        for i, fut in enumerate(self.executor.wire_ready):
            if fut is not None:
                fut.result()
        if self.resident.update is not None:
            self.resident.update.result()
        if self.optimizer is not None and self.optimizer._closing is not None:
            self.optimizer._closing.result()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def sync_masters_to_host(self) -> None:
        """Wait for queued updates and copy GPU-held layer masters and moments into the host buffers."""
        self.synchronize()
        if self.executor.device_state is not None:
            self.executor.device_state.sync_to_host()

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights keyed like ``module.state_dict()`` (views of host memory, no copy); frozen
        parameters (no optimizer group) as they are kept, in the compute dtype when it is not fp32 (host_state.py).
        Data parallel: a collective (every rank calls it); the layers other ranks own come over gloo, as copies."""
        self.sync_masters_to_host()
        out = {}
        prefix = self.block_name + "."
        for i, layout in enumerate(self.store.layouts):
            if self.dp.active:  # from layer i's owner, one layer at a time
                import torch.distributed as dist
                flat = self.store.full_master(i) if self.store.owned[i] else torch.empty(layout.numel)
                dist.broadcast(flat, src=self.dp.owner(i), group=self.dp.cpu_group)
                for slot in layout.slots:
                    start = slot.offset + (0 if slot.trainable else layout.n_train)
                    value = flat[start:start + slot.numel].view(slot.shape)
                    if self.store.compact and not slot.trainable:  # as one process gives it: its kept dtype
                        value = value.to(self.store.wire_dtype)
                    elif self.store.master_dtype != torch.float32:  # bf16 masters (the wire): likewise
                        value = value.to(self.store.master_dtype)
                    out[f"{prefix}{i}.{slot.name}"] = value
                continue
            for slot in layout.slots:
                out[f"{prefix}{i}.{slot.name}"] = self.store.param_master(i, slot.name)
        names = {id(p): n for n, p in self.module.named_parameters()}
        for p, master in zip(self.resident.params, self.resident.master):
            out[names[id(p)]] = master.view(p.shape).cpu()
        return out

    # ------------------------------------------------------------------ checkpoints (checkpoint.py)
    def save_adapter(self, folder: str) -> None:
        """A peft model's adapter, written by peft's ``save_pretrained`` from the engine's weights (adapters.py);
        ``save_checkpoint`` also writes it into the tag folder. Data parallel: every rank calls it."""
        save_adapter(self, folder)

    def host_memory(self) -> dict:
        """Host bytes of the engine's persistent state, and per parameter. ``base``: parameters in no optimizer
        group (a LoRA base), kept in the compute dtype only; ``trainable``: with fp32 master and AdamW moments.
        Resident tensors on the host count (on a CPU device that includes their compute copies)."""
        res = self.resident
        host = lambda t: t is not None and t.device.type == "cpu"  # noqa: E731
        resident = sum(t.numel() * t.element_size()
                       for ts in (res.master, res.exp_avg, res.exp_avg_sq, res.grad, res.wire, res.landing)
                       for t in {id(x): x for x in ts if host(x)}.values())
        trainable = self.store.n_train + sum(m.numel() for m, g in zip(res.master, res.grad) if g is not None)
        params = self.store.n_full + sum(m.numel() for m in res.master)
        total = self.store.nbytes() + resident
        return {"layers_bytes": self.store.nbytes(), "resident_bytes": resident, "total_bytes": total,
                "disk_bytes": self.store.disk_nbytes(),
                "params": params, "trainable": trainable, "base": params - trainable,
                "bytes_per_param": total / max(params, 1),
                "bytes_per_base_param": total / max(params - trainable, 1)}

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 (DS's API)
                        exclude_frozen_parameters=False) -> bool:
        self.dp.mark("save", self.micro_steps, self.global_steps)  # data parallel: its exchanges, bounded (dp.py)
        with self.dp.watch("save_checkpoint()'s exchange between the ranks"):
            return save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False):
        self.dp.mark("load", self.micro_steps, self.global_steps)
        with self.dp.watch("load_checkpoint()'s exchange between the ranks"):
            return load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                                   load_lr_scheduler_states, load_module_only)

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False) -> bool:
        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's flag (``zero_optimization.stage3_gather_16bit_weights_on_model_save``): accelerate's
        ``get_state_dict`` and the HF Trainer's ``save_model`` export full weights only when it is set."""
        block = self.config.get("zero_optimization") or {}
        return bool(block.get("stage3_gather_16bit_weights_on_model_save",
                              block.get("gather_16bit_weights_on_model_save", False)))

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False) -> dict:
        """What accelerate's ``get_state_dict`` calls under ZeRO-3: the full model in the compute dtype."""
        return consolidated_state_dict(self, exclude_frozen_parameters=exclude_frozen_parameters)

    def load_master_state_dict(self, state: dict, strict: bool = True) -> None:
        """Write fp32 weights keyed like ``master_state_dict()`` into the host masters (and every copy
        derived from them: wire copy, GPU-held masters, resident device copies, slots). Everything is checked
        (names when ``strict``, shapes always) before the first write: a mismatch leaves the engine as it was."""
        self.synchronize()
        store, names = self.store, {id(p): n for n, p in self.module.named_parameters()}
        layer_keys = {f"{self.block_name}.{i}.{slot.name}": (i, slot)
                      for i, layout in enumerate(store.layouts) for slot in layout.slots}
        resident_keys = {names[id(p)]: k for k, p in enumerate(self.resident.params)}
        shapes = {key: tuple(slot.shape) for key, (_, slot) in layer_keys.items()}
        shapes.update({key: tuple(self.resident.master[k].shape) for key, k in resident_keys.items()})
        wrong = [f"{key}: {tuple(state[key].shape)} given, {shape} in the model" for key, shape in shapes.items()
                 if key in state and tuple(state[key].shape) != shape]
        missing, unexpected = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
        if wrong or (strict and (missing or unexpected)):
            raise RuntimeError(f"state does not match the model: wrong shapes {wrong[:5]}, missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]} (strict=False loads what matches; nothing was loaded)")
        staged = {}  # NVMe layers' masters: assembled here, written once per layer (below)
        for key, (i, slot) in layer_keys.items():
            if key in state and store.owned[i]:  # data parallel: each rank writes the layers it holds
                if store.master_on_disk(i) and slot.trainable:
                    if i not in staged:
                        staged[i] = store.read_master(i).clone()
                    staged[i][slot.offset:slot.offset + slot.numel].copy_(state[key].reshape(-1))
                else:
                    store.param_master(i, slot.name).copy_(state[key].reshape(slot.shape))
        for key, k in resident_keys.items():
            if key in state:
                p = self.resident.params[k]
                self.resident.master[k].copy_(state[key].reshape(self.resident.master[k].shape))
                if self.resident.wire[k] is not None:
                    self.resident.wire[k].copy_(self.resident.master[k])
                if p.data is not self.resident.master[k]:  # a frozen one's master is p.data
                    p.data.copy_(self.resident.master[k])
        for i in range(len(store.layouts)):
            if i in staged:
                store.write_master(i, staged[i])  # and its wire
            elif store.owned[i] and not store.master_on_disk(i):
                store.refresh_wire(i)
        ds = self.executor.device_state
        if ds is not None:
            ds.master.copy_(store.master[ds.full0:ds.full1])
        self.executor.schedule.invalidate()  # every slot is stale

    # ------------------------------------------------------------------ zero.GatheredParameters
    def _mark_params(self, layers) -> None:
        """ZeRO-3-style attributes and a home (where the fp32 master is) on every parameter; see zero.py."""
        for i, layer in enumerate(layers):
            by_name = dict(layer.named_parameters(remove_duplicate=False))
            for slot in self.store.layouts[i].slots:
                mark_partitioned(by_name[slot.name], ParamHome(self, i, slot.name, None), slot.shape)
                by_name[slot.name].ds_tensor = self._ds_tensor(i, slot)
        for k, p in enumerate(self.resident.params):
            mark_partitioned(p, ParamHome(self, None, None, k), tuple(p.shape))
            p.ds_tensor = p.data

    def _ds_tensor(self, i: int, slot) -> torch.Tensor:
        """A streamed parameter's ``ds_tensor``: a view of where it is kept (``param_master``); an NVMe layer's
        master has no RAM view, so its wire copy (compute dtype, as DeepSpeed's own ``ds_tensor``); empty for a layer
        another rank holds (data parallel)."""
        if not self.store.owned[i]:
            return torch.empty(0)
        if self.store.master_on_disk(i) and slot.trainable:
            return self.store.wire_of(i)[slot.offset:slot.offset + slot.numel].view(slot.shape)
        return self.store.param_master(i, slot.name)

    def _read_master(self, home: ParamHome) -> torch.Tensor:
        self.synchronize()  # the optimizer may be writing these bytes
        ds = self.executor.device_state
        if home.layer is None:
            return self.resident.master[home.resident_index].detach().to("cpu", torch.float32, copy=True)
        if self.dp.active:  # a collective, as DeepSpeed's GatheredParameters: the owner's master to every rank
            import torch.distributed as dist
            owned = self.store.owned[home.layer]
            if owned and ds is not None and ds.owns(home.layer):
                self.store.master_of(home.layer).copy_(ds.master_of(home.layer))
            slot = next(s for s in self.store.layouts[home.layer].slots if s.name == home.name)
            value = (self.store.param_master(home.layer, home.name).to(torch.float32, copy=True) if owned
                     else torch.empty(slot.shape, dtype=torch.float32))
            dist.broadcast(value, src=self.dp.owner(home.layer), group=self.dp.cpu_group)
            return value
        if ds is not None and ds.owns(home.layer):
            self.store.master_of(home.layer).copy_(ds.master_of(home.layer))  # this layer only
        return self.store.param_master(home.layer, home.name).to(torch.float32, copy=True)

    def _write_master(self, home: ParamHome, value: torch.Tensor) -> None:
        self.synchronize()
        if self.dp.active:  # GatheredParameters(modifier_rank=0): rank 0's value, on every rank / the owner
            import torch.distributed as dist
            value = value.detach().to("cpu", torch.float32, copy=True).contiguous()
            dist.broadcast(value, src=0, group=self.dp.cpu_group)
            if home.layer is not None and not self.store.owned[home.layer]:
                self.executor.schedule.invalidate(home.layer)  # every rank: the slots' versions stay in step
                return
        if home.layer is None:  # resident: fp32 master and the device copy the forward uses
            k = home.resident_index
            self.resident.master[k].copy_(value.reshape(self.resident.master[k].shape))
            if self.resident.wire[k] is not None:
                self.resident.wire[k].copy_(self.resident.master[k])
            self.resident.params[k].ds_tensor.copy_(self.resident.master[k])
            return
        i, store = home.layer, self.store
        ds = self.executor.device_state
        if ds is not None and ds.owns(i):  # the host copy of a GPU-held layer is stale: refresh it before the
            store.master_of(i).copy_(ds.master_of(i))  # whole layer is copied back (the other weights must stay)
        store.set_param_master(i, home.name, value)  # a frozen parameter of a compact store: its wire copy
        if ds is not None and ds.owns(i):
            ds.master_of(i).copy_(store.master_of(i))
        self.executor.schedule.invalidate(i)  # slots holding the old weights are stale

    def last_step_breakdown(self) -> dict:
        return self.timer.last

    def destroy(self) -> None:
        """Stop the engine: its hooks and layer forwards leave the module (which may outlive it), the host
        worker stops, pinned host memory is unregistered. The host buffers are freed once nothing views them:
        the parameters' ``ds_tensor`` views keep them while the model is alive."""
        for handle in self._refresh_hooks:  # the module outlives the engine; its hooks must not
            handle.remove()
        self._refresh_hooks = []
        for layer in self.executor.layers:  # the per-instance forward that routes into the executor
            if getattr(layer.__dict__.get("forward"), "_megatrain_executor", False):
                del layer.__dict__["forward"]
        for p in self.module.parameters():  # GatheredParameters' way back to this engine
            if getattr(p, "_megatrain_home", None) is not None and p._megatrain_home.engine is self:
                del p._megatrain_home
        self.synchronize()
        self.executor.inference.release()  # its device buffers (inference.py)
        self.worker.shutdown(wait=True)
        self.opt_worker.shutdown(wait=True)
        self.store.close()
