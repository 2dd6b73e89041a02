"""The training engine: DeepSpeed's calls on top of the streaming core.

    # embeddings -> streamed layers -> chunked LM-head loss
    loss = engine(input_ids=x, labels=y).loss
    # per-layer recompute + grad, D2H into host memory
    engine.backward(loss)
    # enqueue clip + AdamW on the host; returns at once
    engine.step()

Reading order: ``__init__``, then ``forward``, ``backward``, ``step``. ``__init__`` decides and
builds nothing itself: training/construction.py's ``build_engine`` is the one construction path
(how the model is split, what is decided, where each tensor lives); decisions.py resolves every
setting once into ``engine.decisions``; engine_auto.py places what "auto" leaves to the first
steps. The executor (executor.py), the model state (model_state.py) and the optimizer
(optimizer.py) hold the mechanics.
"""

from __future__ import annotations

import logging
import warnings
import weakref

import torch
from torch import nn

from .checkpoints import (
    save_adapter,
    load_checkpoint,
    save_checkpoint,
    StepCounters,
    counter_view,
    consolidated_state_dict,
    save_16bit_model,
    CheckpointParts,
)
from .planning import TrainConfig
from .training import (
    EngineHooks,
    PlacementParts,
    build_engine,
    close_tiers_at_exit,
    count,
    deferred_interrupt,
    refuse_empty_sequences,
)

# LogitsNotComputed and to_device: importable from the engine's module too
from .training import (  # noqa: F401
    LogitsNotComputed,
    forward_fused_loss,
    fused_loss_call,
    to_device,
)
from .log import ALL_RANKS, log, logger
from .model import RecomputeMismatch, nonfinite_gradients_message
from .optim import cast_inputs_half
from .api import Monitor, EngineSurface
from .streaming import traced


class MegaTrainEngine(EngineSurface, nn.Module):
    """Trains ``model`` with every persistent tensor in host memory and the GPU as a streaming
    engine."""

    def __init__(
        self,
        model: nn.Module,
        config: TrainConfig,
        model_parameters=None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.config_settings = config  # the parsed settings: a value
        # fp16's live loss scaler, built from the parsed settings; the optimizer updates it
        self.loss_scaler = None if config.loss_scaling is None else config.loss_scaling.scaler()
        # every part, built in one pass (training/construction.py): split, decide once, build
        hooks = EngineHooks(
            open_implicit_backward=self._open_implicit_backward,
            synchronize=self.synchronize,
            step_counts=lambda: (self.micro_steps, self.global_steps),
            loss_scale=self._loss_scale,
            close_tiers_at_exit=lambda tier: close_tiers_at_exit(tier, self.synchronize),
        )
        parts = build_engine(model, config, model_parameters, device, self.loss_scaler, hooks)
        self.local_rank, self.device, self.dp = parts.local_rank, parts.device, parts.dp
        self._trained = parts.trained  # refused if untrained later (_check_trained)
        self.block_name, self.decisions = parts.block_name, parts.decisions
        dec = parts.decisions
        self.liger_model_type = parts.liger_model_type
        self.compute_dtype, self.wire_dtype = dec.compute_dtype, dec.wire_dtype
        self.host_kernel = dec.host_kernel
        self.streams, self.capacity, self.store = parts.streams, parts.capacity, parts.store
        # named in the step line
        self.precision_mode = "bf16 masters" if config.bf16_masters else "fp32 masters"
        self.placement, self.worker, self.opt_worker = (
            parts.placement,
            parts.worker,
            parts.opt_worker,
        )
        self.timer, self.layer_states = parts.timer, parts.layer_states
        self.executor, self.tiled_modules = parts.executor, parts.tiled_modules
        self.auto_placer, self.resident = parts.auto_placer, parts.resident
        self.model_state = parts.model_state
        self._offload = parts.offload
        self.module = model
        self._fused = parts.fused
        # why labels= calls ran the model's own forward (each logged once)
        self._fused_refusals: set[str] = set()
        self.optimizer = parts.optimizer
        self.lr_scheduler = None
        # a loss.backward() is open: its ``final`` ([Note: loss.backward()])
        self._implicit_final: bool | None = None
        # global_steps, micro_steps, ...: one value (checkpoints/step_counters.py)
        self.counters = StepCounters()
        self._boundary_override: bool | None = None
        self._last_norm = None
        # DeepSpeed's monitors (tensorboard / wandb / csv_monitor / comet blocks), when one is
        # enabled
        self.monitor = Monitor(config.monitor) if config.monitor is not None else None
        self._log_frozen_base()

    def _log_frozen_base(self) -> None:
        """LoRA-style (more frozen than trained parameters): one line with the host bytes per base
        parameter."""
        mem = self.host_memory()
        if self.optimizer is not None and mem["base"] > mem["trainable"]:
            logger.info(
                f"frozen base: {count(mem['base'])} parameters kept in {self.compute_dtype} only; "
                f"{count(mem['trainable'])} trainable with fp32 master + AdamW; host state "
                f"{mem['total_bytes'] / 2**30:.2f} GiB = {mem['bytes_per_base_param']:.3f} bytes "
                "per base "
                "parameter" + (" (this rank's layers)" if self.dp.active else "")
            )

    def _loss_scale(self) -> float | None:
        """fp16's current loss scale (None without one): divided out of ``full_grad``."""
        scaler = self.loss_scaler
        return None if scaler is None else scaler.scale

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        self._close_implicit_backward()
        # engine.scale(loss) is for the loss of this forward (surface.py)
        self.__dict__.pop("_manual_scaled", None)
        # dp.py: collective timeouts
        self.dp.mark("forward", self.micro_steps, self.global_steps, arrive=True)
        refuse_empty_sequences(args, kwargs)
        self._check_trained()
        # a forward between backward() and step() sees the pre-step weights
        self._settle_speculation()
        self.resident.upload()  # waits for the last step's resident update, then H2D (see the Note)
        # DeepSpeed's fp16.auto_cast: floating positional inputs to half
        if self.config_settings.fp16_auto_cast:
            args = cast_inputs_half(args)
        args, kwargs = to_device(args, self.device), to_device(kwargs, self.device)
        self.timer.begin_forward()
        # DeepSpeed's throughput timer, as its forward starts it (surface.py)
        self.tput_timer.start()
        try:
            call = self._fused_loss_call(args, kwargs) if torch.is_grad_enabled() else None
            # exactly the model's own loss ([Note: fused loss only where exact])
            if call is not None:
                return self._forward_fused_loss((), call)
            return self.module(*args, **kwargs)
        except torch.OutOfMemoryError as exc:
            self._explain_oom(exc)
            raise

    def _check_trained(self) -> None:
        """A parameter initialize set up for training whose requires_grad was turned off since: its
        flat layout, optimizer state and gradient landing are fixed at initialize, so it would go on
        training; refuse by name."""
        frozen = [n for n, p in self._trained if not p.requires_grad]
        if frozen:
            raise RuntimeError(
                f"requires_grad_(False) after initialize on {len(frozen)} parameter(s) "
                "megatrain_ds trains "
                f"({', '.join(frozen[:4])}{', ...' if len(frozen) > 4 else ''}): the set of "
                "trained parameters is "
                "fixed at initialize (their host layout and optimizer state). Freeze them before "
                "initialize (e.g. "
                "build a new engine for the new set), or turn requires_grad back on"
            )

    def _explain_oom(self, exc: BaseException) -> None:
        """A device OOM after "auto" used the memory the first step left free: say which keys give
        it back."""
        hint = self.auto_placer.oom_hint()
        if hint:
            exc.args = (f"{exc.args[0] if exc.args else exc}\n[megatrain_ds] {hint}", *exc.args[1:])

    def _fused_loss_call(self, args, kwargs) -> dict | None:
        """engine_forward.py: the call as keywords, or None (the model's own forward runs)."""
        if self._fused is None:
            return None
        own_hooks = {h.id for h in self._offload.forward_hooks}  # the resident refresh hooks
        return fused_loss_call(
            self.module,
            self._fused,
            args,
            kwargs,
            enabled=self.config_settings.megatrain.fused_loss,
            own_hooks=own_hooks,
            refusals=self._fused_refusals,
        )

    def _forward_fused_loss(self, args, kwargs):
        """The decoder, then the chunked head + cross-entropy (engine_forward.py)."""
        return forward_fused_loss(
            self._fused,
            args,
            kwargs,
            megatrain=self.config_settings.megatrain,
            timer=self.timer,
            streams=self.streams,
        )

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
        # engine.scale(loss) is for a script's own backward only
        self.__dict__.pop("_manual_scaled", None)
        self.dp.mark("backward", self.micro_steps, self.global_steps, arrive=True)
        done = getattr(self, "_backward_done_for", None)
        if done is not None and done[0]() is loss and not done[1]:
            raise RuntimeError(
                "Trying to backward through the graph a second time: engine.backward() already ran "
                "on this loss "
                "without retain_graph=True, and its graph is freed (PyTorch and DeepSpeed refuse "
                "this too). The "
                "first backward's gradient is kept. Pass retain_graph=True to the first backward "
                "to go through "
                "the graph again, or compute the loss again"
            )
        user_loss = loss
        final = self.is_gradient_accumulation_boundary()
        ga = self.config_settings.gradient_accumulation_steps
        if scale_wrt_gas and ga > 1:
            loss = loss / ga
        if self.loss_scaler is not None:  # fp16: the optimizer divides it back out
            loss = loss * self.loss_scaler.scale
        stale = [p for p in self.resident.params if p.grad is not None]
        # evacuate() leaves every .grad None: these came from a backward outside the engine
        if stale:
            for p in stale:
                p.grad = None
            warnings.warn(
                f"{len(stale)} parameter(s) held a .grad from a backward outside "
                "engine.backward(); it "
                "was dropped",
                stacklevel=2,
            )
        # layers step as their gradients land (speculation.py) when each layer's backward loads it
        # exactly once: one forward per layer into this loss, no retained graph
        if final and self.optimizer is not None:
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
        # the owners' accumulations ran on d2h after each reduce (executor._evacuate)
        if self.dp.active:
            self.streams.wait(self.streams.compute(), self.streams.record(self.streams.d2h))
        self.resident.evacuate(self.worker, final)
        self.executor.mark_backward_done()  # after the folds above
        # a second backward of it is refused
        self._backward_done_for = (weakref.ref(user_loss), retain_graph)
        self.dp.mark("backward_done", self.micro_steps, self.global_steps)
        return loss

    # [Note: loss.backward()] DeepSpeed >= 0.17 lets a script call loss.backward() itself, then
    # engine.step() (its bf16_master_weight example does). The first streamed layer the backward
    # reaches finds no engine.backward open and calls ``_open_implicit_backward`` (on autograd's
    # thread, while the script's thread waits in it): it does what engine.backward does before
    # autograd. What engine.backward does after autograd (the resident gradients out, the event the
    # GPU-held updates wait for) runs at the engine's next call on the script's thread: step(),
    # forward() or backward() (``_close_implicit_backward``). Only where engine.backward would not
    # change the loss: GA 1, fp16 only after engine.scale(loss) (as DeepSpeed asks), one process
    # (the ranks' collectives are ordered by engine.backward); elsewhere the backward raises and
    # names engine.backward(loss). No speculative step in such a backward. A backward that raised
    # part way (the script caught it) is found at the close (a layer ran forward but no backward)
    # and discarded with a warning, as engine.backward discards its own.
    def _open_implicit_backward(self) -> None:
        scaled = self.__dict__.pop("_manual_scaled", False)  # engine.scale(loss) ran (surface.py)
        why = (
            "gradient_accumulation_steps > 1 (engine.backward divides the loss by it)"
            if self.config_settings.gradient_accumulation_steps > 1
            else "fp16 loss scaling without engine.scale(loss) (engine.scale(loss).backward() "
            "applies it)"
            if self.loss_scaler is not None and not scaled
            else "data parallel (engine.backward orders the ranks' collectives)"
            if self.dp.active
            else None
        )
        if why is not None:
            raise RuntimeError(
                f"loss.backward() outside engine.backward(loss) is supported with GA 1 on one "
                "process "
                f"(fp16: engine.scale(loss).backward()); here {why}. Call engine.backward(loss) "
                "(accelerate: accelerator.backward(loss)); the gradients of this backward were not "
                "kept"
            )
        final = self.is_gradient_accumulation_boundary()
        if final and self.optimizer is not None:
            self.optimizer.begin_speculation(allowed=False)
        self.executor.begin_backward(final)
        self._implicit_final = final

    def _close_implicit_backward(self) -> None:
        """The script's thread, at the engine's next call after a loss.backward(): engine.backward's
        epilogue."""
        if self._implicit_final is None:
            return
        final, self._implicit_final = self._implicit_final, None
        # it raised part way (the script caught it)
        missed = self.executor.schedule.backward_missed()
        self.executor.end_backward()
        if missed:  # as engine.backward does when its backward raises: nothing of it reaches a step
            self._discard_gradients(
                f"the loss.backward() before this call stopped before layers {missed[:8]} (it "
                "raised): the gradients accumulated since the last step were discarded"
            )
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
        """At an accumulation boundary: queue clip + AdamW (host) and advance counters and
        scheduler.

        Once the update is queued it will be applied, so a Ctrl-C (KeyboardInterrupt) that arrives
        after that is held until the counters, scheduler and monitors agree with the weights, then
        raised: a checkpoint the script saves in its ``except KeyboardInterrupt:`` has step N+1's
        weights with ``global_steps`` N+1 (it had N, and a resume repeated a batch)."""
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
            # the recompute check's errors, before any update is queued
            if self.executor.check.active:
                self._read_recompute_check()
            if self.optimizer is not None:
                self._last_norm = self.optimizer.step()
                # Wait for the norm task (it waits for the last gradient landings: a CPU-GPU sync),
                # in every precision: a step with non-finite gradients is skipped, as DeepSpeed
                # skips it, and that decides the counters and the lr scheduler below. It costs no
                # overlap: the next forward waits for the resident update, which waits for this
                # norm, anyway; only the script's own work between step() and the next forward
                # (fetching a batch) no longer runs beside the last landings.
                with traced("megatrain.wait_norm"):
                    self._last_norm.result()
                # fp16: overflow at the minimum loss scale
                if self.optimizer.step_error is not None:
                    raise self.optimizer.step_error
                skipped = self.optimizer.last_step_skipped
                # masters, moments and Adam's step count are untouched (optimizer._norm_task)
                if skipped:
                    log(self.optimizer.skip_message, ranks=ALL_RANKS)
                    if self.loss_scaler is None:  # not fp16's routine overflow: say whose
                        self._log_nonfinite_gradients()
            else:
                self.executor.reset_window()
            previous_samples = self.counters.optimizer_step(
                self.config_settings.train_batch_size, skipped
            )
            # DeepSpeed does not advance it on overflow
            if self.lr_scheduler is not None and not skipped:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            self.timer.end_step()
            # "auto" placements after the second step (training/engine_auto.py)
            if self.auto_placer.pending:
                self.auto_placer.after_step(self.placement_parts())
            if self.monitor is not None:
                self.monitor.write_step(
                    self.global_samples,
                    previous_samples,
                    self.get_lr(),
                    self.loss_scaler,
                    self.last_step_breakdown(),
                )
            spp = self.config_settings.steps_per_print
            if spp != float("inf") and self.global_steps % spp == 0:  # DeepSpeed's progress line
                log(
                    f"step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}, "
                    f"mom={self.get_mom()}, {self.precision_mode}",
                    ranks=ALL_RANKS,
                )
                if self.config_settings.wall_clock_breakdown:
                    log(
                        f"step {self.global_steps}: {self.timer.format(self.timer.last)}",
                        ranks=ALL_RANKS,
                    )
        # tput_timer.stop, was_step_applied
        self._end_step_surface(self.is_gradient_accumulation_boundary())
        # a set_gradient_accumulation_boundary() override stays until set again (as DS)
        self.counters.micro_steps += 1

    def _log_nonfinite_gradients(self) -> None:
        layers, resident = self.optimizer.nonfinite_gradients
        names = {id(p): n for n, p in self.module.named_parameters()}
        log(
            nonfinite_gradients_message(
                self.global_steps + 1,
                layers,
                len(self.store.layouts),
                [names.get(id(self.resident.params[k]), f"resident {k}") for k in resident],
            ),
            level=logging.WARNING,
        )

    def move_layer_state_to_device(self, n: int) -> None:
        """Keep the fp32 master, Adam moments and gradient of the leading ``n`` layers on the device
        from now on (between steps; the state so far comes along)."""
        gpu_layers = self.layer_states.gpu_layers()
        if gpu_layers is not None:
            raise RuntimeError(
                f"layer optimizer state is already on the device (layers [0, {gpu_layers.stop}))"
            )
        self.synchronize()  # every queued update has been applied to the host buffers
        if n > self.store.disk_from:
            raise ValueError(
                f"move_layer_state_to_device({n}): layers from {self.store.disk_from} on keep "
                "their "
                "moments on the NVMe tier"
            )
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
        """DeepSpeed's engine forwards unknown attributes to the wrapped module (e.g.
        ``engine.config`` is the DeepSpeed dict, but ``engine.generate`` or
        ``engine.gradient_checkpointing_enable`` are the model's)."""
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
        """DeepSpeed's ``engine.zero_grad()``: the gradients of the accumulation window are the
        engine's, and it keeps them until the window's step (DeepSpeed's ZeRO keeps its accumulated
        partitions), so a script that calls it after every micro-step trains with the configured
        accumulation as on DeepSpeed. What it clears: ``.grad`` a backward outside the engine left
        on the resident parameters (a script's own loss.backward() is the engine's: closed first,
        its gradients kept)."""
        self._close_implicit_backward()
        for p in self.resident.params:
            p.grad = None

    def _drop_window(self) -> None:
        """Drop the gradients accumulated since the last step (a failed backward, a refused
        step)."""
        self._settle_speculation()
        # a failed backward may have left autograd's partial sums here
        for p in self.resident.params:
            p.grad = None
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        else:
            self.executor.reset_window()

    def _read_recompute_check(self) -> None:
        """Read the window's recompute comparisons ([Note: recompute check]); on a mismatch nothing
        of this step is applied: speculated layers are rolled back and the window's gradients
        dropped, then it raises."""
        # a CPU-GPU sync, where step() waits for the last landing anyway (the norm below): it
        # costs no overlap
        if self.executor.backward_done is not None:
            self.executor.backward_done.synchronize()
        try:
            report = self.executor.check.read(self.dp, step=self.global_steps + 1)
        except RecomputeMismatch:
            for fut in self.executor.sq_norm:
                if fut is not None:
                    fut.exception()  # the landings queued by the backward have run
            self._drop_window()  # rolls back speculated layers first
            raise
        # NaN/inf in the forward: not a mismatch ([Note: non-finite values are not drift])
        if report is not None:
            log(report, level=logging.WARNING)

    def _discard_gradients(
        self,
        why: str = "engine.backward() raised: the gradients accumulated since the last step "
        "were discarded",
    ) -> None:
        """A backward raised: whatever part of it ran must not reach a step. Waits for the landings
        it queued, then drops the accumulation window (earlier micro-batches of the window included:
        their sums share the buffers) and the resident parameters' partial ``.grad``; saved
        activations of the failed graph go too."""
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
        """Between backward() and step(), anything that reads or changes the weights first rolls
        back the layers stepped speculatively (step() then runs the plain update)."""
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
        if self.optimizer is not None:
            self.optimizer.wait_for_close()
        # the deferred moments passes (host_update.py)
        for fut in self.executor.schedule.pending_moments():
            fut.result()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def sync_masters_to_host(self) -> None:
        """Wait for queued updates and copy GPU-held layer masters and moments into the host
        buffers."""
        self.synchronize()
        self.layer_states.sync_to_host()

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights keyed like ``module.state_dict()``
        (``ModelState.master_state_dict``). Data parallel: a collective (every rank calls it)."""
        return self.model_state.master_state_dict()

    # ------------------------------------------------------------------ checkpoints (checkpoint.py)
    def save_adapter(self, folder: str) -> None:
        """A peft model's adapter, written by peft's ``save_pretrained`` from the engine's weights
        (adapters.py); ``save_checkpoint`` also writes it into the tag folder. Data parallel: every
        rank calls it."""
        save_adapter(self.checkpoint_parts(), folder)

    def host_memory(self) -> dict:
        """Host bytes of the engine's persistent state, and per parameter
        (``ModelState.host_memory``)."""
        return self.model_state.host_memory()

    # what the last save_checkpoint's phases took (checkpoint_stream.py's SaveTimes); None before
    last_save_times = None
    # whether a save warned that real DeepSpeed could not resume its checkpoint (once per engine)
    deepspeed_resume_said = False

    def checkpoint_parts(self) -> CheckpointParts:
        """What save, load, the 16-bit export and the adapter use (checkpoints/parts.py), as the
        engine holds it now: built at each call, so the scheduler ``initialize`` attached (or a
        script replaced) is the one saved."""
        return CheckpointParts(
            module=self.module,
            block_name=self.block_name,
            layer_states=self.layer_states,
            store=self.store,
            resident=self.resident,
            layer_buffers=self.executor.buffers,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            counters=self.counters,
            settings=self.config_settings,
            loss_scaler=self.loss_scaler,
            ds_config=self.config,
            compute_dtype=self.compute_dtype,
            dp=self.dp,
            synchronize=self.synchronize,
            sync_masters_to_host=self.sync_masters_to_host,
            load_master_state_dict=self.load_master_state_dict,
            deepspeed_resume_said=self.deepspeed_resume_said,
            model_state=self.model_state,
        )

    def placement_parts(self) -> PlacementParts:
        """What the "auto" placement after the first steps reads and moves
        (training/engine_auto.py), as the engine holds it now (the measured layer graph
        included)."""
        ex = self.executor
        return PlacementParts(
            timer=self.timer,
            device=self.device,
            dp=self.dp,
            has_optimizer=self.optimizer is not None,
            resident=self.resident,
            layer_states=self.layer_states,
            store=self.store,
            graph_bytes=ex.graph_bytes,
            weight_itemsize=ex.slots[0].buf.element_size(),
            set_keep=ex.set_keep,
            set_weight_cache=ex.set_weight_cache,
            move_layer_state_to_device=self.move_layer_state_to_device,
            synchronize=self.synchronize,
        )

    def save_checkpoint(
        self,
        save_dir,
        tag=None,
        client_state={},  # noqa: B006 (DS's API)
        save_latest=True,
        exclude_frozen_parameters=False,
    ) -> bool:
        # data parallel: its exchanges, bounded (dp.py)
        self.dp.mark("save", self.micro_steps, self.global_steps)
        with self.dp.watch("save_checkpoint()'s exchange between the ranks"):
            saved = save_checkpoint(
                self.checkpoint_parts(),
                save_dir,
                tag,
                client_state,
                save_latest,
                exclude_frozen_parameters,
            )
        self.last_save_times = saved.times
        self.deepspeed_resume_said = saved.deepspeed_resume_said
        return True

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict=True,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_only=False,
    ):
        self.dp.mark("load", self.micro_steps, self.global_steps)
        with self.dp.watch("load_checkpoint()'s exchange between the ranks"):
            return load_checkpoint(
                self.checkpoint_parts(),
                load_dir,
                tag,
                load_module_strict,
                load_optimizer_states,
                load_lr_scheduler_states,
                load_module_only,
            )

    def save_16bit_model(
        self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False
    ) -> bool:
        return save_16bit_model(
            self.checkpoint_parts(), save_dir, save_filename, exclude_frozen_parameters
        )

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's flag (``zero_optimization.stage3_gather_16bit_weights_on_model_save``):
        accelerate's ``get_state_dict`` and the HF Trainer's ``save_model`` export full weights only
        when it is set."""
        block = self.config.get("zero_optimization") or {}
        return bool(
            block.get(
                "stage3_gather_16bit_weights_on_model_save",
                block.get("gather_16bit_weights_on_model_save", False),
            )
        )

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False) -> dict:
        """What accelerate's ``get_state_dict`` calls under ZeRO-3: the full model in the compute
        dtype."""
        return consolidated_state_dict(
            self.checkpoint_parts(), exclude_frozen_parameters=exclude_frozen_parameters
        )

    def load_master_state_dict(self, state: dict, strict: bool = True) -> None:
        """Write fp32 weights keyed like ``master_state_dict()`` into the masters and every copy
        made from them (``ModelState.load_master_state_dict``: all checked before the first
        write)."""
        self.model_state.load_master_state_dict(state, strict)

    def last_step_breakdown(self) -> dict:
        return self.timer.last

    def destroy(self) -> None:
        """Stop the engine: its hooks and layer forwards leave the module (which may outlive it),
        the host worker stops, pinned host memory is unregistered. The host buffers are freed once
        nothing views them: the parameters' ``ds_tensor`` views keep them while the model is
        alive."""
        self._offload.destroy()  # the module outlives the engine; its hooks must not
        for layer in self.executor.layers:  # the per-instance forward that routes into the executor
            if getattr(layer.__dict__.get("forward"), "_megatrain_executor", False):
                del layer.__dict__["forward"]
        # GatheredParameters' way back to this engine
        self.model_state.unmark(self.module.parameters())
        self.synchronize()
        self.executor.inference.release()  # its device buffers (inference.py)
        self.worker.shutdown(wait=True)
        self.opt_worker.shutdown(wait=True)
        self.store.close()
