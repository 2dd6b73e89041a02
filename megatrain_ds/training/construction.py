"""The engine's one construction path: ``build_engine`` splits the model, decides once and builds
every part in order, and returns them as one value (``EngineParts``); ``MegaTrainEngine.__init__``
calls it and keeps what it returns.

The order is the design's: (1) split the model into streamed layers (host flat buffers) and resident
parameters (device copies); (2) decide every setting once (planning/decisions.py), refusing a run
whose state cannot fit before any buffer is made; (3) build what was decided: the host store, the
host threads, the executor, the resident parameters, the model state that owns them all, the
DeepSpeed faces the model keeps, and the optimizer over the engine's own parts. The few things that
belong to the running engine (its implicit backward, its ``synchronize``, its step counters, the
loss scale) are given as ``EngineHooks``: the builders call them later, never during construction.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..api import ParameterOffload, adopt_zero3_model, mark_partitioned
from ..host import LayerStates, ModelState
from ..model import build_layout, find_block_list, fused_loss_parts, shared_parameter_ids
from ..optim import ResidentParams
from ..parallel import DataParallel
from ..planning import TrainConfig
from ..streaming import StepTimer, make_streams
from .engine_auto import AutoPlacer
from .engine_build import (
    apply_liger_kernels,
    buffers_to_device,
    build_executor,
    build_optimizer,
    build_store,
    build_workers,
    check_capacity_for,
    decide,
    host_share,
    host_view,
    log_tier,
    param_groups,
    place_initial,
    step_counters,
    sync_initial_weights,
)
from .lifecycle import refuse_a_model_in_use


@dataclass(frozen=True)
class EngineHooks:
    """What the parts call back into the running engine (bound methods and closures of it)."""

    open_implicit_backward: Callable[[], None]  # a loss.backward() outside engine.backward()
    synchronize: Callable[[], None]  # wait for every queued host task and device work
    step_counts: Callable[[], tuple[int, int]]  # (micro_steps, global_steps)
    loss_scale: Callable[[], float | None]  # fp16's current loss scale
    close_tiers_at_exit: Callable[[object], None]  # an NVMe tier's flush at interpreter exit


@dataclass(frozen=True)
class EngineParts:
    """Every part ``build_engine`` made, as the engine keeps them."""

    local_rank: int
    device: torch.device
    dp: DataParallel
    trained: list  # (name, parameter) initialize decided to train
    block_name: str
    decisions: Any  # planning.Decisions
    liger_model_type: str | None
    streams: Any
    capacity: Any  # planning.Prediction, or None without an optimizer
    store: Any  # host.HostLayerStore
    placement: Any
    worker: Any
    opt_worker: Any
    timer: StepTimer
    layer_states: LayerStates
    executor: Any  # streaming.StreamedLayers
    tiled_modules: Any
    auto_placer: AutoPlacer
    resident: ResidentParams
    model_state: ModelState
    offload: ParameterOffload
    fused: Any  # the fused LM-head loss parts (model/loss.py), or None
    optimizer: Any  # optim.HostAdamW, or None


def build_engine(
    model: nn.Module, config: TrainConfig, model_parameters, device, loss_scaler, hooks: EngineHooks
) -> EngineParts:
    """Split ``model``, decide once, build every part (module docstring)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device is None:
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # rank, world, which ranks share a host, who holds which state (dp.py)
    mt = config.megatrain
    dp = DataParallel(device, mt.collective_timeout, mt.host_sharding)
    model.train()
    groups, defaults = param_groups(model, model_parameters, config.optimizer)
    group_of = {id(p): g for g, group in enumerate(groups) for p in group["params"]}
    # what initialize decided to train (its layout and optimizer state follow): a later
    # requires_grad_(False) on one of them is refused at the next forward, not silently ignored
    trained = [(n, p) for n, p in model.named_parameters() if id(p) in group_of]
    refuse_a_model_in_use(model)
    # built under real DeepSpeed's zero.Init (HfDeepSpeedConfig): made whole
    adopt_zero3_model(model)
    # 1. Split: streamed layers (host flat buffers) vs resident params (device copies).
    block_name, layers = find_block_list(model)
    # used by two layers (or a layer and the rest): resident
    shared_ids = shared_parameter_ids(model, layers)
    layouts = [build_layout(i, layer, group_of, shared_ids) for i, layer in enumerate(layers)]
    if dp.active:  # every rank starts from rank 0's weights, as DeepSpeed's ZeRO-3 does
        sync_initial_weights(model, layers, dp, shared_ids)
    # 2. Decide, once (decisions.py): dtypes, every "auto" decidable now, which layers are
    #    GPU-held / on NVMe. Every rank on this host must fit its budget (NVMe split,
    #    gradient_hold); the capacity check counts the same.
    owned = dp.owned_mask(len(layers))
    resident_numels, _, freed = host_view(model, layers, shared_ids, group_of, dp)
    resident_owned = dp.set_resident(resident_numels)  # whose host holds each one's state
    share = host_share(config, len(layers), resident_numels, freed, dp)  # every rank on this host
    dec = decide(config, layouts, device.type, share, dp)
    # before the layer templates are made from the layers; None: the model's own kernels
    liger_model_type = apply_liger_kernels(model, device, dec.liger_kernels, dec.compute_dtype)
    streams = make_streams(device)
    pin = device.type == "cuda"
    # refused here, before any buffer, when the state cannot fit
    capacity = None
    if config.optimizer is not None:
        capacity = check_capacity_for(config, dec, layouts, share, freed, model, device)
    # 3. Build what was decided: host store, host threads, executor, resident, optimizer.
    store = build_store(config, dec, layouts, owned, dp.rank, pin, device)
    if store.tier is not None:  # its writes must land, and its file go, even without destroy()
        hooks.close_tiers_at_exit(store.tier)
        log_tier(store, config, dec)
    placement, worker, opt_worker = build_workers(config, device, local_rank, dp)
    # the breakdown costs one device sync per step (timing.py): only when the config asks for it
    timer = StepTimer(streams, enabled=config.wall_clock_breakdown)
    layer_states = LayerStates(store, device)  # where each layer's state lives
    executor, tiled_modules = build_executor(
        layers,
        layouts,
        layer_states,
        device,
        streams,
        worker,
        config,
        dec,
        dp,
        type(model).__name__,
        timer,
        hooks.open_implicit_backward,
    )
    for i, layer in enumerate(layers):
        store.load_layer(i, layer)  # copies weights to the host master, frees the module's storage
    store.finish_loading()  # page-locks the wire copy now that it is written (host_state.py)
    # "auto" placements are decided after the second step, from its measured peak
    auto_placer = AutoPlacer(
        dec.auto_device_state, dec.auto_keep, mt.gpu_memory_reserve, dec.auto_weight_cache
    )
    place_initial(layer_states, dec.n_device_layers)
    if not dec.auto_keep:
        executor.set_keep(dec.keep)
    if not dec.auto_weight_cache:
        executor.set_weight_cache(dec.weight_cache)  # after the kept layers and GPU-held state
    layer_ids = {id(p) for layer in layers for p in layer.parameters()} - shared_ids
    resident_params = [p for p in model.parameters() if id(p) not in layer_ids]
    resident = ResidentParams(
        resident_params,
        group_of,
        device,
        dec.compute_dtype,
        streams,
        pin,
        state_on_device=dec.resident_on_device,
        dp=dp,
        owned=resident_owned,
    )
    # every persistent tensor (layers and resident parameters) and each parameter's home
    model_state = ModelState(
        layer_states,
        resident.state,
        dp,
        device,
        block_name,
        module=model,
        synchronize=hooks.synchronize,
        on_layer_written=executor.schedule.invalidate,
        layer_landings=executor,
        resident_landings=resident,
        refresh_device_copies=resident.upload,
        step_counts=hooks.step_counts,
        pending_device_bytes=executor.inference.pending_bytes,
        trains=config.optimizer is not None,
        loss_scale=hooks.loss_scale,
    )
    # the resident parameters' refresh hooks (a module called without the engine), DeepSpeed's
    # parameter offload face to trl's generation (zero_offload.py)
    offload = ParameterOffload(resident.upload, model, resident_params)
    buffers_to_device(model, layers, device)
    fused = fused_loss_parts(model)
    # ZeRO-3-style attributes and a home (where the fp32 master is) on every parameter (zero.py)
    model_state.mark_params(layers, mark_partitioned)
    if auto_placer.pending and device.type == "cuda":
        # the model's GPU copy, if it was built there, is gone: so is its peak
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    optimizer = None
    if config.optimizer is not None:
        optimizer = build_optimizer(
            groups,
            defaults,
            config,
            dec,
            executor,
            layer_states,
            streams,
            timer,
            resident,
            worker,
            opt_worker,
            dp,
            loss_scaler,
        )
        optimizer.parameter_offload = offload  # where trl's remove_hooks/add_hooks look
        timer.counters = step_counters(optimizer, store)
    return EngineParts(
        local_rank=local_rank,
        device=device,
        dp=dp,
        trained=trained,
        block_name=block_name,
        decisions=dec,
        liger_model_type=liger_model_type,
        streams=streams,
        capacity=capacity,
        store=store,
        placement=placement,
        worker=worker,
        opt_worker=opt_worker,
        timer=timer,
        layer_states=layer_states,
        executor=executor,
        tiled_modules=tiled_modules,
        auto_placer=auto_placer,
        resident=resident,
        model_state=model_state,
        offload=offload,
        fused=fused,
        optimizer=optimizer,
    )
