"""The training engine: DeepSpeed's calls on top of the streaming core.

    loss = engine(input_ids=x, labels=y).loss   # embeddings -> streamed layers -> chunked LM-head loss
    engine.backward(loss)                        # per-layer recompute + grad, D2H into host memory
    engine.step()                                # enqueue clip + AdamW on the host; returns at once

Reading order: ``__init__`` (how the model is split, what is decided, and where each tensor lives), ``forward``,
``backward``, ``step``. ``__init__`` decides nothing itself: decisions.py resolves every setting once into
``engine.decisions``, engine_build.py builds the parts from it, engine_auto.py places what "auto" leaves to the
first step. The executor (executor.py), the host state (host_state.py) and the optimizer (optimizer.py) hold the
mechanics.
"""
from __future__ import annotations

import logging
import os
import warnings
import weakref

import torch
from torch import nn

from .checkpoints.adapters import save_adapter
from .checkpoints.checkpoint import load_checkpoint, save_checkpoint
from .checkpoints.step_counters import StepCounters, counter_view
from .host.layer_state import LayerStates
from .planning.config import TrainConfig
from .parallel.dp import DataParallel
from .training.engine_auto import AutoPlacer
from .training.engine_build import (apply_liger_kernels, buffers_to_device, build_executor, place_initial,
                                    build_optimizer, build_store, build_workers, check_capacity_for, count, decide,
                                    host_share, host_view, log_tier, param_groups, step_counters,
                                    sync_initial_weights)
from .training.engine_forward import LogitsNotComputed, forward_fused_loss, fused_loss_call, to_device  # noqa: F401
from .checkpoints.export import consolidated_state_dict, save_16bit_model
from .training.lifecycle import close_tiers_at_exit, deferred_interrupt, refuse_a_model_in_use, refuse_empty_sequences
from .log import ALL_RANKS, log, logger
from .model.loss import fused_loss_parts
from .optim.loss_scale import cast_inputs_half
from .model.model_map import build_layout, find_block_list, shared_parameter_ids
from .api.monitor import Monitor
from .optim.optimizer import ResidentParams
from .model.recompute_check import RecomputeMismatch, nonfinite_gradients_message
from .streaming.streams import make_streams
from .api.surface import EngineSurface, adopt_zero3_model
from .streaming.timing import StepTimer, traced
from .api.zero import ParamHome, mark_partitioned
from .api.zero_offload import ParameterOffload


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
        # rank, world, which ranks share a host, who holds which state (dp.py)
        self.dp = DataParallel(device, config.megatrain.collective_timeout, config.megatrain.host_sharding)
        model.train()
        groups, defaults = param_groups(model, model_parameters, config.optimizer)
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
            sync_initial_weights(model, layers, self.dp, shared_ids)
        # 2. Decide, once (decisions.py): dtypes, every "auto" decidable now, which layers are GPU-held / on NVMe.
        # Every rank on this host must fit its budget (NVMe split, gradient_hold); the capacity check counts the same.
        owned = self.dp.owned_mask(len(layers))
        resident_numels, _, freed = host_view(model, layers, shared_ids, group_of, self.dp)
        resident_owned = self.dp.set_resident(resident_numels)  # whose host holds each one's state (dp.py)
        share = host_share(config, len(layers), resident_numels, freed, self.dp)  # every rank on this host
        self.decisions = dec = decide(config, layouts, device.type, share, self.dp)
        # before the layer templates are made from the layers
        # None: the model's own kernels
        self.liger_model_type = apply_liger_kernels(model, device, dec.liger_kernels, dec.compute_dtype)
        self.compute_dtype, self.wire_dtype, self.host_kernel = dec.compute_dtype, dec.wire_dtype, dec.host_kernel
        self.streams = make_streams(device)
        pin = device.type == "cuda"
        self.capacity = check_capacity_for(config, dec, layouts, share, freed, model, device) \
            if config.optimizer is not None else None  # refused here, before any buffer, when the state cannot fit
        # 3. Build what was decided (engine_build.py): host store, host threads, executor, resident, optimizer.
        self.store = build_store(config, dec, layouts, owned, self.dp.rank, pin, device)
        self.precision_mode = "bf16 masters" if config.bf16_masters else "fp32 masters"  # named in the step line
        if self.store.tier is not None:  # its writes must land, and its file go, even without destroy()
            close_tiers_at_exit(self)
            log_tier(self.store, config, dec)
        self.placement, self.worker, self.opt_worker = build_workers(config, device, self.local_rank, self.dp)
        # the breakdown costs one device sync per step (see timing.py): only when the config asks for it
        self.timer = StepTimer(self.streams, enabled=config.wall_clock_breakdown)
        self.layer_states = LayerStates(self.store, device)  # where each layer's state lives: the one owner
        self.executor, self.tiled_modules = build_executor(layers, layouts, self.layer_states, device, self.streams,
                                                           self.worker, config, dec, self.dp, type(model).__name__,
                                                           self.timer, self._open_implicit_backward)
        for i, layer in enumerate(layers):
            self.store.load_layer(i, layer)  # copies weights to the host master, frees the module's storage
        self.store.finish_loading()  # page-locks the wire copy now that it is written (host_state.py)
        # "auto" placements are decided after the second step, from its measured peak (engine_auto.py)
        self.auto_placer = AutoPlacer(dec.auto_device_state, dec.auto_keep, config.megatrain.gpu_memory_reserve)
        place_initial(self.layer_states, dec.n_device_layers)
        if not dec.auto_keep:
            self.executor.set_keep(dec.keep)
        layer_ids = {id(p) for layer in layers for p in layer.parameters()} - shared_ids
        resident = [p for p in model.parameters() if id(p) not in layer_ids]
        self.resident = ResidentParams(resident, group_of, device, dec.compute_dtype, self.streams, pin,
                                       state_on_device=dec.resident_on_device, dp=self.dp, owned=resident_owned)
        # the resident parameters' refresh hooks (a module called without the engine), DeepSpeed's parameter offload
        self._offload = ParameterOffload(self, model, resident)  # face to trl's generation (zero_offload.py)
        buffers_to_device(model, layers, device)
        self.module = model
        self._fused = fused_loss_parts(model)
        self._fused_refusals: set[str] = set()  # why labels= calls ran the model's own forward (each logged once)
        self._mark_params(layers)
        if self.auto_placer.pending and device.type == "cuda":
            torch.cuda.empty_cache()  # the model's GPU copy, if it was built there, is gone: so is its peak
            torch.cuda.reset_peak_memory_stats(device)
        self.optimizer = None if config.optimizer is None else build_optimizer(
            groups, defaults, config, dec, self.executor, self.streams, self.timer, self.resident, self.worker,
            self.opt_worker, self.dp)
        self.lr_scheduler = None
        if self.optimizer is not None:
            self.optimizer.parameter_offload = self._offload  # where trl's remove_hooks/add_hooks look
            self.timer.counters = step_counters(self.optimizer, self.store)
        self._implicit_final: bool | None = None  # a loss.backward() is open: its ``final`` ([Note: loss.backward()])
        self.counters = StepCounters()  # global_steps, micro_steps, ...: one value (checkpoints/step_counters.py)
        self._boundary_override: bool | None = None
        self._last_norm = None
        # DeepSpeed's monitors (tensorboard / wandb / csv_monitor / comet blocks), when one is enabled
        self.monitor = Monitor(config.monitor) if config.monitor is not None else None
        self._log_frozen_base()

    def _log_frozen_base(self) -> None:
        """LoRA-style (more frozen than trained parameters): one line with the host bytes per base parameter."""
        mem = self.host_memory()
        if self.optimizer is not None and mem["base"] > mem["trainable"]:
            logger.info(f"frozen base: {count(mem['base'])} parameters kept in {self.compute_dtype} only; "
                        f"{count(mem['trainable'])} trainable with fp32 master + AdamW; host state "
                        f"{mem['total_bytes'] / 2**30:.2f} GiB = {mem['bytes_per_base_param']:.3f} bytes per base "
                        "parameter" + (" (this rank's layers)" if self.dp.active else ""))

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        self._close_implicit_backward()
        self.__dict__.pop("_manual_scaled", None)  # engine.scale(loss) is for the loss of this forward (surface.py)
        self.dp.mark("forward", self.micro_steps, self.global_steps, arrive=True)  # dp.py: collective timeouts
        refuse_empty_sequences(args, kwargs)
        self._check_trained()
        self._settle_speculation()  # a forward between backward() and step() sees the pre-step weights
        self.resident.upload()  # waits for the last step's resident update, then H2D (see the Note)
        if self.config_settings.fp16_auto_cast:  # DeepSpeed's fp16.auto_cast: floating positional inputs to half
            args = cast_inputs_half(args)
        args, kwargs = to_device(args, self.device), to_device(kwargs, self.device)
        self.timer.begin_forward()
        self.tput_timer.start()  # DeepSpeed's throughput timer, as its forward starts it (surface.py)
        try:
            call = self._fused_loss_call(args, kwargs) if torch.is_grad_enabled() else None
            if call is not None:  # exactly the model's own loss ([Note: fused loss only where exact])
                return self._forward_fused_loss((), call)
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
        hint = self.auto_placer.oom_hint()
        if hint:
            exc.args = (f"{exc.args[0] if exc.args else exc}\n[megatrain_ds] {hint}", *exc.args[1:])

    def _fused_loss_call(self, args, kwargs) -> dict | None:
        return fused_loss_call(self, args, kwargs)  # engine_forward.py: the call as keywords, or None

    def _forward_fused_loss(self, args, kwargs):
        return forward_fused_loss(self, args, kwargs)  # the decoder, then the chunked head + cross-entropy

    # ------------------------------------------------------------------ backward
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.config_settings.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary_override = bool(is_boundary)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backward through the head, the streamed layers (recompute + grad) and the embeddings."""
        self._close_implicit_backward()
        self.__dict__.pop("_manual_scaled", None)  # engine.scale(loss) is for a script's own backward only
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

    # [Note: loss.backward()] DeepSpeed >= 0.17 lets a script call loss.backward() itself, then engine.step() (its
    # bf16_master_weight example does). The first streamed layer the backward reaches finds no engine.backward open
    # and calls ``_open_implicit_backward`` (on autograd's thread, while the script's thread waits in it): it does what
    # engine.backward does before autograd. What engine.backward does after autograd (the resident gradients out, the
    # event the GPU-held updates wait for) runs at the engine's next call on the script's thread: step(), forward()
    # or backward() (``_close_implicit_backward``). Only where engine.backward would not change the loss: GA 1, fp16
    # only after engine.scale(loss) (as DeepSpeed asks), one process (the ranks' collectives are ordered by
    # engine.backward);
    # elsewhere the backward raises and names engine.backward(loss). No speculative step in such a backward. A
    # backward that raised part way (the script caught it) is found at the close (a layer ran forward but no
    # backward) and discarded with a warning, as engine.backward discards its own.
    def _open_implicit_backward(self) -> None:
        scaled = self.__dict__.pop("_manual_scaled", False)  # engine.scale(loss) ran (surface.py)
        why = "gradient_accumulation_steps > 1 (engine.backward divides the loss by it)" \
            if self.config_settings.gradient_accumulation_steps > 1 else \
            "fp16 loss scaling without engine.scale(loss) (engine.scale(loss).backward() applies it)" \
            if self.config_settings.loss_scaler is not None and not scaled \
            else "data parallel (engine.backward orders the ranks' collectives)" if self.dp.active else None
        if why is not None:
            raise RuntimeError(f"loss.backward() outside engine.backward(loss) is supported with GA 1 on one process "
                               f"(fp16: engine.scale(loss).backward()); here {why}. Call engine.backward(loss) "
                               "(accelerate: accelerator.backward(loss)); the gradients of this backward were not kept")
        final = self.is_gradient_accumulation_boundary()
        if final and self.optimizer is not None:
            self.optimizer.begin_speculation(allowed=False)
        self.executor.begin_backward(final)
        self._implicit_final = final

    def _close_implicit_backward(self) -> None:
        """The script's thread, at the engine's next call after a loss.backward(): engine.backward's epilogue."""
        if self._implicit_final is None:
            return
        final, self._implicit_final = self._implicit_final, None
        missed = self.executor.schedule.backward_missed()  # it raised part way (the script caught it)
        self.executor.end_backward()
        if missed:  # as engine.backward does when its backward raises: nothing of it reaches a step
            self._discard_gradients(f"the loss.backward() before this call stopped before layers {missed[:8]} (it "
                                    "raised): the gradients accumulated since the last step were discarded")
            return
        self.resident.evacuate(self.worker, final)
        self.executor.mark_backward_done()

    # ------------------------------------------------------------------ step
    # DeepSpeed's counter names, as scripts read (and set) them: views of ``self.counters``
    micro_steps = counter_view("micro_steps")
    window_micro_steps = counter_view("window_micro_steps")
    global_steps = counter_view("global_steps")
    global_samples = counter_view("global_samples")
    skipped_steps = counter_view("skipped_steps")

    def step(self, lr_kwargs=None) -> None:
        """At an accumulation boundary: queue clip + AdamW (host) and advance counters and scheduler.

        Once the update is queued it will be applied, so a Ctrl-C (KeyboardInterrupt) that arrives after that is
        held until the counters, scheduler and monitors agree with the weights, then raised: a checkpoint the
        script saves in its ``except KeyboardInterrupt:`` has step N+1's weights with ``global_steps`` N+1
        (it had N, and a resume repeated a batch)."""
        self._close_implicit_backward()
        self.dp.mark("step", self.micro_steps, self.global_steps)
        with deferred_interrupt() as deferred:
            self._step(lr_kwargs, deferred)
        self.dp.mark("step_done", self.micro_steps, self.global_steps)

    def _step(self, lr_kwargs, deferred) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        self.counters.after_micro_step(boundary)
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
                with traced("megatrain.wait_norm"):
                    self._last_norm.result()
                if self.optimizer.step_error is not None:  # fp16: overflow at the minimum loss scale
                    raise self.optimizer.step_error
                skipped = self.optimizer.last_step_skipped
                if skipped:  # masters, moments and Adam's step count are untouched (optimizer._norm_task)
                    log(self.optimizer.skip_message, ranks=ALL_RANKS)
                    if self.config_settings.loss_scaler is None:  # not fp16's routine overflow: say whose
                        self._log_nonfinite_gradients()
            else:
                self.executor.reset_window()
            previous_samples = self.counters.optimizer_step(self.config_settings.train_batch_size, skipped)
            if self.lr_scheduler is not None and not skipped:  # DeepSpeed does not advance it on overflow
                self.lr_scheduler.step(**(lr_kwargs or {}))
            self.timer.end_step()
            if self.auto_placer.pending:  # "auto" placements after the second step (training/engine_auto.py)
                self.auto_placer.after_step(self)
            if self.monitor is not None:
                self.monitor.write_step(self, previous_samples)
            spp = self.config_settings.steps_per_print
            if spp != float("inf") and self.global_steps % spp == 0:  # DeepSpeed's progress line
                log(f"step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}, "
                    f"mom={self.get_mom()}, {self.precision_mode}", ranks=ALL_RANKS)
                if self.config_settings.wall_clock_breakdown:
                    log(f"step {self.global_steps}: {self.timer.format(self.timer.last)}", ranks=ALL_RANKS)
        self._end_step_surface(self.is_gradient_accumulation_boundary())  # tput_timer.stop, was_step_applied
        self.counters.micro_steps += 1  # a set_gradient_accumulation_boundary() override stays until set again (as DS)

    def _log_nonfinite_gradients(self) -> None:
        layers, resident = self.optimizer.nonfinite_gradients
        names = {id(p): n for n, p in self.module.named_parameters()}
        log(nonfinite_gradients_message(self.global_steps + 1, layers, len(self.store.layouts),
                                        [names.get(id(self.resident.params[k]), f"resident {k}") for k in resident]),
            level=logging.WARNING)

    def move_layer_state_to_device(self, n: int) -> None:
        """Keep the fp32 master, Adam moments and gradient of the leading ``n`` layers on the device from now on
        (between steps; the state so far comes along)."""
        gpu_layers = self.layer_states.gpu_layers()
        if gpu_layers is not None:
            raise RuntimeError(f"layer optimizer state is already on the device (layers [0, {gpu_layers.stop}))")
        self.synchronize()  # every queued update has been applied to the host buffers
        if n > self.store.disk_from:
            raise ValueError(f"move_layer_state_to_device({n}): layers from {self.store.disk_from} on keep their "
                             "moments on the NVMe tier")
        self.layer_states.place_on_device(min(n, len(self.store.layouts)), moments_from_host=True)

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
        ``.grad`` a backward outside the engine left on the resident parameters (a script's own loss.backward() is
        the engine's: closed first, its gradients kept)."""
        self._close_implicit_backward()
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
            report = self.executor.check.read(self.dp, step=self.global_steps + 1)
        except RecomputeMismatch:
            for fut in self.executor.sq_norm:
                if fut is not None:
                    fut.exception()  # the landings queued by the backward have run
            self._drop_window()  # rolls back speculated layers first
            raise
        if report is not None:  # NaN/inf in the forward: not a mismatch ([Note: non-finite values are not drift])
            log(report, level=logging.WARNING)

    def _discard_gradients(self, why: str = "engine.backward() raised: the gradients accumulated since the last step "
                           "were discarded") -> None:
        """A backward raised: whatever part of it ran must not reach a step. Waits for the landings it queued,
        then drops the accumulation window (earlier micro-batches of the window included: their sums share the
        buffers) and the resident parameters' partial ``.grad``; saved activations of the failed graph go too."""
        for fut in self.executor.sq_norm:
            if fut is not None:
                fut.exception()  # waits; an error of the landing itself is not this error
        self._drop_window()
        if self.executor.activations is not None:
            self.executor.activations.clear()
        warnings.warn(f"{why} (the step that follows applies only later backwards)", stacklevel=3)

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
        self._close_implicit_backward()
        self._settle_speculation()
        for i, fut in enumerate(self.executor.wire_ready):
            if fut is not None:
                fut.result()
        if self.resident.update is not None:
            self.resident.update.result()
        if self.optimizer is not None and self.optimizer._closing is not None:
            self.optimizer._closing.result()
        for fut in self.executor.schedule.pending_moments():  # the deferred moments passes (host_update.py)
            fut.result()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def sync_masters_to_host(self) -> None:
        """Wait for queued updates and copy GPU-held layer masters and moments into the host buffers."""
        self.synchronize()
        self.layer_states.sync_to_host()

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
                flat = self.layer_states.full_master(i) if self.layer_states.holds(i) else torch.empty(layout.numel)
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
        names, res = {id(p): n for n, p in self.module.named_parameters()}, self.resident
        for k, (p, master) in enumerate(zip(res.params, res.master)):  # data parallel: from each one's owner
            out[names[id(p)]] = res.master_copy(k).view(p.shape) if self.dp.active and res.trained[k] else \
                master.view(p.shape).cpu()
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
        held = [(p.numel(), t) for p, t, mine in zip(res.params, res.trained, res.owned) if mine]  # (this rank's)
        trainable = self.store.n_train + sum(n for n, t in held if t)
        params = self.store.n_full + sum(n for n, _ in held)
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
        shapes.update({key: tuple(self.resident.params[k].shape) for key, k in resident_keys.items()})
        wrong = [f"{key}: {tuple(state[key].shape)} given, {shape} in the model" for key, shape in shapes.items()
                 if key in state and tuple(state[key].shape) != shape]
        missing, unexpected = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
        if wrong or (strict and (missing or unexpected)):
            raise RuntimeError(f"state does not match the model: wrong shapes {wrong[:5]}, missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]} (strict=False loads what matches; nothing was loaded)")
        # streamed layers: written where each lives (layer_state.py), NVMe masters staged until the resident ones
        staged = self.layer_states.load_masters([(*layer_keys[key], state[key]) for key in layer_keys if key in state])
        for key, k in resident_keys.items():
            if key in state:
                p, master = self.resident.params[k], self.resident.master[k]
                if master is None:  # data parallel: another rank holds its state; the device copy is this rank's
                    p.data.copy_(state[key].reshape(p.shape))
                    continue
                master.copy_(state[key].reshape(master.shape))
                if self.resident.wire[k] is not None:
                    self.resident.wire[k].copy_(master)
                if p.data is not master:  # a frozen one's master is p.data
                    p.data.copy_(master)
        self.layer_states.finish_loading_masters(staged)  # NVMe masters, every wire copy, the GPU-held masters
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
        """A streamed parameter's ``ds_tensor`` (``LayerStates.ds_tensor``)."""
        return self.layer_states.ds_tensor(i, slot)

    def _settle_reads(self, homes: list[ParamHome]) -> None:
        """Before reading many masters (a gather): wait once, and copy each GPU-held layer among them to the host
        once; ``_read_master(home, settled=True)`` then reads the host copies."""
        self.synchronize()
        states = self.layer_states
        states.refresh_host_masters(sorted({h.layer for h in homes if h.layer is not None and states.holds(h.layer)}))

    def _read_master(self, home: ParamHome, settled: bool = False) -> torch.Tensor:
        if not settled:  # the optimizer may be writing these bytes; a GPU-held layer's master from the device first
            self._settle_reads([home])
        states = self.layer_states
        if home.layer is None:  # data parallel: a collective from its owner; on the engine's device, where HF's
            k = home.resident_index  # ``model.device`` (the embedding) sends generate's inputs
            return self.resident.master_copy(k).view(self.resident.params[k].shape).to(self.device, torch.float32)
        if self.dp.active:  # a collective, as DeepSpeed's GatheredParameters: the owner's master to every rank
            import torch.distributed as dist
            slot = self.store.slot_of(home.layer, home.name)
            value = (states.param_master(home.layer, home.name).to(torch.float32, copy=True)
                     if states.holds(home.layer) else torch.empty(slot.shape, dtype=torch.float32))
            dist.broadcast(value, src=self.dp.owner(home.layer), group=self.dp.cpu_group)
            return value
        return states.param_master(home.layer, home.name).to(torch.float32, copy=True)

    def _write_master(self, home: ParamHome, value: torch.Tensor) -> None:
        self.synchronize()
        if self.dp.active:  # GatheredParameters(modifier_rank=0): rank 0's value, on every rank / the owner
            import torch.distributed as dist
            value = value.detach().to("cpu", torch.float32, copy=True).contiguous()
            dist.broadcast(value, src=0, group=self.dp.cpu_group)
            if home.layer is not None and not self.layer_states.holds(home.layer):
                self.executor.schedule.invalidate(home.layer)  # every rank: the slots' versions stay in step
                return
        if home.layer is None:  # resident: fp32 master (its owner's) and the device copy the forward uses
            k, res = home.resident_index, self.resident
            if res.master[k] is not None:
                res.master[k].copy_(value.reshape(res.master[k].shape))
                if res.wire[k] is not None:
                    res.wire[k].copy_(res.master[k])
            res.params[k].ds_tensor.copy_(value.reshape(res.params[k].shape))
            return
        self.layer_states.set_param_master(home.layer, home.name, value)  # and its wire (and device) copies
        self.executor.schedule.invalidate(home.layer)  # slots holding the old weights are stale

    def last_step_breakdown(self) -> dict:
        return self.timer.last

    def destroy(self) -> None:
        """Stop the engine: its hooks and layer forwards leave the module (which may outlive it), the host
        worker stops, pinned host memory is unregistered. The host buffers are freed once nothing views them:
        the parameters' ``ds_tensor`` views keep them while the model is alive."""
        self._offload.destroy()  # the module outlives the engine; its hooks must not
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
