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
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from .activations import HostActivations
from .checkpoint import consolidated_state_dict, load_checkpoint, save_16bit_model, save_checkpoint
from .config import ConfigError, TrainConfig
from .executor import StreamedLayers
from .device_state import DeviceOptimizerState
from .host_state import HostLayerStore
from .loss import linear_cross_entropy
from .model_map import build_layout, find_block_list
from .monitor import Monitor
from .optimizer import HostAdamW, ResidentParams
from .streams import make_streams
from .timing import StepTimer
from .zero import ParamHome, mark_partitioned


def _apply_liger_kernels(model: nn.Module, device: torch.device) -> None:
    """``megatrain.liger_kernels``: liger-kernel's RMSNorm, SwiGLU MLP and RoPE in place of the model's (CUDA
    only; the loss is megatrain_ds's own chunked / fused linear cross-entropy either way)."""
    if device.type != "cuda":
        warnings.warn("megatrain.liger_kernels: liger-kernel runs on CUDA only; the model's own kernels are used",
                      stacklevel=3)
        return
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as exc:
        raise ConfigError("megatrain.liger_kernels needs liger-kernel (pip install 'megatrain-ds[gpu]'): "
                          f"{exc}") from exc
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)


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


def _fused_loss_head(model: nn.Module) -> nn.Linear | None:
    """The LM head if ``model`` is a Hugging Face causal LM whose head is a plain linear layer."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    name = type(model).__name__
    if not isinstance(head, nn.Linear) or not (name.endswith("ForCausalLM") or name.endswith("LMHeadModel")):
        return None
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, attr, None) not in (None, 1.0):
            return None  # head does more than a matmul: use the model's own forward
    return head


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


class MegaTrainEngine(nn.Module):
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
        compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.compute_dtype, torch.float32)
        mt = config.megatrain
        # what crosses PCIe: the compute dtype, or the fp32 master itself (cast on the GPU) when asked
        wire_dtype = torch.float32 if mt.stream_fp32_master else compute_dtype
        self.compute_dtype, self.wire_dtype = compute_dtype, wire_dtype
        model.train()
        if mt.liger_kernels:
            _apply_liger_kernels(model, device)  # before the layer templates are made from the layers
        settings = config.optimizer
        defaults = settings and dict(lr=settings.lr, betas=settings.betas, eps=settings.eps,
                                     weight_decay=settings.weight_decay)
        groups = _param_groups(model, model_parameters, defaults) if settings else []
        group_of = {id(p): g for g, group in enumerate(groups) for p in group["params"]}

        # 1. Split: streamed layers (host flat buffers) vs resident params (device copies).
        self.block_name, layers = find_block_list(model)
        layouts = [build_layout(i, layer, group_of) for i, layer in enumerate(layers)]
        ga = config.gradient_accumulation_steps
        self.streams = make_streams(device)
        pin = device.type == "cuda"
        grad_dtype = torch.float32 if (mt.fp32_grad_landing or mt.stream_fp32_master) else None
        self.store = HostLayerStore(layouts, wire_dtype, grad_accum_fp32=ga > 1, pin=pin, grad_dtype=grad_dtype)
        # 2. One host worker thread: gradient landings and optimizer tasks, FIFO. See streams.py's Note.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-host")
        self.executor = StreamedLayers(layers, layouts, self.store, device, self.streams, self.worker,
                                       num_slots=mt.num_slots, compute_dtype=compute_dtype)
        if mt.trace:
            self.executor.trace = []
        if mt.offload_activations:
            self.executor.activations = HostActivations(self.streams, device)
        for i, layer in enumerate(layers):
            self.store.load_layer(i, layer)  # copies weights to the host master, frees the module's storage
        n_device = mt.gpu_optimizer_layers
        self._auto_device_state = n_device == "auto"  # decided after the first step (see _place_state_auto)
        if n_device == "auto":
            n_device = 0
        elif n_device < 0:  # from DeepSpeed's offload_optimizer.ratio: the fraction of optimizer state on the CPU
            n_device = round((1.0 - config.offload_optimizer_ratio) * len(layers))
        if n_device > 0:
            self.executor.device_state = DeviceOptimizerState(self.store, 0, min(n_device, len(layers)), device)
        layer_ids = {id(p) for layer in layers for p in layer.parameters()}
        resident = [p for p in model.parameters() if id(p) not in layer_ids]
        self.resident = ResidentParams(resident, group_of, device, compute_dtype, self.streams, pin,
                                       state_on_device=n_device > 0)
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
        self._head = _fused_loss_head(model)
        self._mark_params(layers)
        if self._auto_device_state and device.type == "cuda":
            torch.cuda.empty_cache()  # the model's GPU copy, if it was built there, is gone: so is its peak
            torch.cuda.reset_peak_memory_stats(device)

        # 3. Host optimizer over the fp32 masters.
        self.optimizer = None
        if settings is not None:
            self.optimizer = HostAdamW(groups, defaults, adam_w_mode=settings.adam_w_mode)
            self.optimizer.bind(self.executor, self.resident, self.worker, config.gradient_clipping,
                                config.loss_scaler)
        self.lr_scheduler = None
        # the breakdown costs one device sync per step (see timing.py): only when the config asks for it
        self.timer = StepTimer(self.streams, enabled=config.wall_clock_breakdown)
        self.executor.timer = self.timer
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0  # fp16 steps skipped on overflow
        self._boundary_override: bool | None = None
        self._last_norm = None
        # DeepSpeed's monitors (tensorboard / wandb / csv_monitor / comet blocks), when one is enabled
        self.monitor = Monitor(config.monitor) if config.monitor is not None else None

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        self.resident.upload()  # waits for the last step's resident update, then H2D (see the Note)
        args, kwargs = _to_device(args, self.device), _to_device(kwargs, self.device)
        self.timer.begin_forward()
        if self._head is not None and torch.is_grad_enabled() and kwargs.get("labels") is not None:
            return self._forward_fused_loss(args, kwargs)
        return self.module(*args, **kwargs)

    def _forward_fused_loss(self, args, kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast
        labels = kwargs.pop("labels")
        num_items = kwargs.pop("num_items_in_batch", None)
        kwargs["use_cache"] = False
        out = self.module.base_model(*args, **kwargs)
        hidden = out[0]  # (B, S, h)
        mt = self.config_settings.megatrain
        with self.timer.span("compute", self.streams.compute()):
            loss = linear_cross_entropy(hidden, self._head.weight, self._head.bias, labels, num_items,
                                        chunk_rows=mt.loss_chunk_rows, use_liger=mt.use_liger)
        return CausalLMOutputWithPast(loss=loss, logits=None)

    # ------------------------------------------------------------------ backward
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.config_settings.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary_override = bool(is_boundary)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backward through the head, the streamed layers (recompute + grad) and the embeddings."""
        final = self.is_gradient_accumulation_boundary()
        self.executor.final_micro = final
        ga = self.config_settings.gradient_accumulation_steps
        if scale_wrt_gas and ga > 1:
            loss = loss / ga
        if self.config_settings.loss_scaler is not None:  # fp16: the optimizer divides it back out
            loss = loss * self.config_settings.loss_scaler.scale
        loss.backward(retain_graph=retain_graph)
        self.resident.evacuate(self.worker, final)
        self.executor.backward_done = self.streams.record(self.streams.compute())  # after the folds above
        return loss

    # ------------------------------------------------------------------ step
    def step(self, lr_kwargs=None) -> None:
        """At an accumulation boundary: queue clip + AdamW (host) and advance counters and scheduler."""
        if self.is_gradient_accumulation_boundary():
            if self.optimizer is not None:
                self._last_norm = self.optimizer.step()
            else:
                self.executor.reset_window()
            self.global_steps += 1
            previous_samples = self.global_samples
            self.global_samples += self.config_settings.train_batch_size
            skipped = False
            if self.optimizer is not None and self.config_settings.loss_scaler is not None:
                self._last_norm.result()  # fp16: waits for the overflow check (a CPU-GPU sync per step)
                skipped = self.optimizer.last_step_skipped
                self.skipped_steps += int(skipped)
            if self.lr_scheduler is not None and not skipped:  # DeepSpeed does not advance it on overflow
                self.lr_scheduler.step(**(lr_kwargs or {}))
            self.timer.end_step()
            if self._auto_device_state:
                self._auto_device_state = False
                self._place_state_auto()
            if self.monitor is not None:
                self.monitor.write_step(self, previous_samples)
            spp = self.config_settings.steps_per_print
            if spp != float("inf") and self.global_steps % spp == 0:  # DeepSpeed's progress line
                print(f"[megatrain_ds] step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}, "
                      f"mom={self.get_mom()}", flush=True)
                if self.config_settings.wall_clock_breakdown:
                    print(f"[megatrain_ds] step {self.global_steps}: {self.timer.format(self.timer.last)}", flush=True)
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

    def _place_state_auto(self) -> None:
        """``gpu_optimizer_layers: "auto"``: once the first step has shown the working set, move the optimizer
        state of as many leading layers as fit onto the GPU (their updates then run there, beside the CPU's).
        Later batches are assumed to be no larger than the first (a longer one may then run out of memory)."""
        budget = self._auto_budget_bytes()
        if budget is None or self.optimizer is None:
            return
        n_layers = len(self.store.layouts)
        n = 0
        while n < n_layers and DeviceOptimizerState.nbytes(self.store, n + 1) <= budget:
            n += 1
        if n > 0:
            self.move_layer_state_to_device(n)
        print(f"[megatrain_ds] gpu_optimizer_layers auto: {n} of {n_layers} layers' optimizer state on the GPU "
              f"({DeviceOptimizerState.nbytes(self.store, n) / 2**30:.1f} GiB of {max(budget, 0) / 2**30:.1f} GiB "
              "left free by the first step)", flush=True)

    def move_layer_state_to_device(self, n: int) -> None:
        """Keep the fp32 master, Adam moments and gradient of the leading ``n`` layers on the device from now on
        (between steps; the state so far comes along)."""
        if self.executor.device_state is not None:
            raise RuntimeError("layer optimizer state is already on the device "
                               f"(layers [0, {self.executor.device_state.hi}))")
        self.synchronize()  # every queued update has been applied to the host buffers
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
        """Drop the gradients accumulated since the last step (DeepSpeed's engine.zero_grad)."""
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        else:
            self.executor.reset_window()

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer else []

    def get_mom(self) -> list:
        """Each group's Adam betas, as DeepSpeed's ``get_mom``."""
        return [g["betas"] for g in self.optimizer.param_groups] if self.optimizer else []

    def synchronize(self) -> None:
        """Wait for every queued host task (landings, optimizer) and device work."""
        for i, fut in enumerate(self.executor.wire_ready):
            if fut is not None:
                fut.result()
        if self.resident.update is not None:
            self.resident.update.result()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def sync_masters_to_host(self) -> None:
        """Wait for queued updates and copy GPU-held layer masters and moments into the host buffers."""
        self.synchronize()
        if self.executor.device_state is not None:
            self.executor.device_state.sync_to_host()

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights keyed like ``module.state_dict()`` (views of host memory, no copy)."""
        self.sync_masters_to_host()
        out = {}
        prefix = self.block_name + "."
        for i, layout in enumerate(self.store.layouts):
            for slot in layout.slots:
                out[f"{prefix}{i}.{slot.name}"] = self.store.param_master(i, slot.name)
        names = {id(p): n for n, p in self.module.named_parameters()}
        for p, master in zip(self.resident.params, self.resident.master):
            out[names[id(p)]] = master.view(p.shape).cpu()
        return out

    # ------------------------------------------------------------------ checkpoints (checkpoint.py)
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 (DS's API)
                        exclude_frozen_parameters=False) -> bool:
        return save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False):
        return load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only)

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False) -> bool:
        return save_16bit_model(self, save_dir, save_filename)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's flag (``zero_optimization.stage3_gather_16bit_weights_on_model_save``): accelerate's
        ``get_state_dict`` and the HF Trainer's ``save_model`` export full weights only when it is set."""
        block = self.config.get("zero_optimization") or {}
        return bool(block.get("stage3_gather_16bit_weights_on_model_save",
                              block.get("gather_16bit_weights_on_model_save", False)))

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False) -> dict:
        """What accelerate's ``get_state_dict`` calls under ZeRO-3: the full model in the compute dtype."""
        return consolidated_state_dict(self)

    def load_master_state_dict(self, state: dict, strict: bool = True) -> None:
        """Write fp32 weights keyed like ``master_state_dict()`` into the host masters (and every copy
        derived from them: wire copy, GPU-held masters, resident device copies, slots)."""
        self.synchronize()
        store, expected = self.store, set()
        for i, layout in enumerate(store.layouts):
            for slot in layout.slots:
                key = f"{self.block_name}.{i}.{slot.name}"
                expected.add(key)
                if key in state:
                    store.param_master(i, slot.name).copy_(state[key].reshape(slot.shape))
        names = {id(p): n for n, p in self.module.named_parameters()}
        for k, p in enumerate(self.resident.params):
            key = names[id(p)]
            expected.add(key)
            if key in state:
                self.resident.master[k].copy_(state[key].reshape(self.resident.master[k].shape))
                if self.resident.wire[k] is not None:
                    self.resident.wire[k].copy_(self.resident.master[k])
                p.data.copy_(self.resident.master[k])
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if strict and (missing or unexpected):
            raise RuntimeError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected "
                               f"{unexpected[:5]} (load_module_strict=False to load what matches)")
        if not store.wire_is_master:
            store.wire.copy_(store.master)
        ds = self.executor.device_state
        if ds is not None:
            ds.master.copy_(store.master[ds.full0:ds.full1])
        self.executor.version = [v + 1 for v in self.executor.version]  # every slot is stale

    # ------------------------------------------------------------------ zero.GatheredParameters
    def _mark_params(self, layers) -> None:
        """ZeRO-3-style attributes and a home (where the fp32 master is) on every parameter; see zero.py."""
        for i, layer in enumerate(layers):
            by_name = dict(layer.named_parameters(remove_duplicate=False))
            for slot in self.store.layouts[i].slots:
                mark_partitioned(by_name[slot.name], ParamHome(self, i, slot.name, None), slot.shape)
                by_name[slot.name].ds_tensor = self.store.param_master(i, slot.name)
        for k, p in enumerate(self.resident.params):
            mark_partitioned(p, ParamHome(self, None, None, k), tuple(p.shape))
            p.ds_tensor = p.data

    def _read_master(self, home: ParamHome) -> torch.Tensor:
        self.synchronize()  # the optimizer may be writing these bytes
        ds = self.executor.device_state
        if home.layer is None:
            return self.resident.master[home.resident_index].detach().to("cpu", copy=True)
        if ds is not None and ds.owns(home.layer):
            self.store.master_of(home.layer).copy_(ds.master_of(home.layer))  # this layer only
        return self.store.param_master(home.layer, home.name).clone()

    def _write_master(self, home: ParamHome, value: torch.Tensor) -> None:
        self.synchronize()
        if home.layer is None:  # resident: fp32 master and the device copy the forward uses
            k = home.resident_index
            self.resident.master[k].copy_(value.reshape(self.resident.master[k].shape))
            if self.resident.wire[k] is not None:
                self.resident.wire[k].copy_(self.resident.master[k])
            self.resident.params[k].ds_tensor.copy_(self.resident.master[k])
            return
        i, store = home.layer, self.store
        master = store.param_master(i, home.name)
        master.copy_(value.reshape(master.shape))
        if not store.wire_is_master:
            store.wire_of(i).copy_(store.master_of(i))
        ds = self.executor.device_state
        if ds is not None and ds.owns(i):
            ds.master_of(i).copy_(store.master_of(i))
        self.executor.version[i] += 1  # slots holding the old weights are stale

    def last_step_breakdown(self) -> dict:
        return self.timer.last

    def destroy(self) -> None:
        for handle in self._refresh_hooks:  # the module outlives the engine; its hooks must not
            handle.remove()
        self._refresh_hooks = []
        self.synchronize()
        self.worker.shutdown(wait=True)
        self.store.close()
