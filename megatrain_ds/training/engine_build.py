"""The engine's parts, built at initialize from the resolver's ``Decisions``.

This module owns the init-time construction ``MegaTrainEngine.__init__`` composes, in its order: the
optimizer groups (``param_groups``), rank 0's weights on every rank (``sync_initial_weights``), what
the host budget holds (``host_view``: the resident parameters, the ranks sharing the host, the
model's own bytes that loading frees), the capacity check with the engine's own decisions
(``check_capacity_for``), liger-kernel's kernels patched in (``apply_liger_kernels``), the host
layer store with its NVMe tier (``build_store``), the host worker threads (``build_workers``), the
streamed-layer executor with its tiling, inference cache and activation offload
(``build_executor``), the resident parameters' device buffers, and the host optimizer
(``build_optimizer``). It decides nothing: every choice is read from ``Decisions`` (decisions.py) or
the config.
"""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch
from torch import nn

from ..streaming import HostActivations, StreamedLayers, StepTimer
from ..planning import (
    Prediction,
    check_capacity,
    TrainConfig,
    Decisions,
    HostShare,
    resolve,
    host_budget_bytes,
)
from ..errors import ConfigError
from ..host import (
    fmt_bytes,
    HostLayerStore,
    LayerStates,
    check_path,
    apply_placement,
    resolve_placement,
)
from ..log import logger
from ..optim import HostAdamW, HostAdamWParts, SpeculationPolicy
from ..model import RecomputeCheck, apply_tiling


def param_groups(model: nn.Module, model_parameters, settings) -> tuple[list[dict], dict | None]:
    """(torch-style groups of trainable params, the optimizer's defaults) from the user's
    ``model_parameters`` (None, params, or dicts) and the config's optimizer settings; no groups
    without an optimizer."""
    defaults = settings and dict(
        lr=settings.lr, betas=settings.betas, eps=settings.eps, weight_decay=settings.weight_decay
    )
    if not settings:
        return [], defaults
    if model_parameters is None:
        model_parameters = model.parameters()
    items = list(model_parameters)
    if not items or not isinstance(items[0], dict):
        items = [{"params": items}]
    groups = []
    for item in items:
        params = [p for p in item["params"] if p.requires_grad]
        groups.append(
            {**defaults, **{k: v for k, v in item.items() if k != "params"}, "params": params}
        )
    return groups, defaults


def sync_initial_weights(model: nn.Module, layers: nn.ModuleList, dp, shared_ids: set) -> None:
    """Data parallel: every rank trains from rank 0's weights (DeepSpeed broadcasts them from rank 0
    too). A streamed layer's weights go to its owner only (the other ranks never hold them);
    resident parameters and buffers to every rank. Over the gloo group, one tensor at a time (host
    memory: one tensor above the model)."""
    import torch.distributed as dist

    def exchange(t: torch.Tensor, dst: int | None) -> None:
        host = (
            t.detach().to("cpu", copy=True).contiguous() if t.device.type != "cpu" else t.detach()
        )
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
            # resident (used by two layers, or a layer and the rest): every rank
            if id(p) in shared_ids:
                continue
            in_layers.add(id(p))
            for owner in dp.owners(i):  # one per shard (dp.py)
                if owner != 0 and dp.rank in (0, owner):
                    exchange(p.data, owner)
    for p in model.parameters():
        if id(p) not in in_layers:
            exchange(p.data, None)
    for buf in model.buffers():
        if buf.is_floating_point() or buf.dtype in (torch.int64, torch.int32):
            exchange(buf, None)


def host_view(
    model: nn.Module, layers: nn.ModuleList, shared_ids: set, group_of: dict, dp
) -> tuple[list[tuple[int, bool]], int, int]:
    """(per resident parameter (elements, trainable), the ranks sharing this host's memory, the host
    bytes of the model's own weights): what the host budget is measured against. The model's weights
    count as free (the engine's copies replace them as the layers load); data parallel: the ranks of
    this host (dp.py's topology, as the launcher's node and LOCAL_WORLD_SIZE say; not the world)
    share its budget, each freeing its own model copy."""
    layer_ids = {id(p) for layer in layers for p in layer.parameters()} - shared_ids
    resident = [
        (p.numel(), id(p) in group_of) for p in model.parameters() if id(p) not in layer_ids
    ]
    local = dp.local_world if dp.active else 1
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
        for p in model.parameters()
        if p.device.type == "cpu"
    }
    return resident, local, local * sum(storages.values())


def host_share(
    config: TrainConfig, n_layers: int, resident: list[tuple[int, bool]], freed_bytes: int, dp
) -> HostShare:
    """What this host's budget must hold (decisions.HostShare): the layers and resident parameters
    each rank on this host holds (dp.py's ``Topology``), and the host's budget, the smallest any
    rank measured (``dp.min_int``): the ranks of a host, and the replicas on other hosts, then
    decide alike."""
    budget = dp.min_int(host_budget_bytes(config.megatrain.host_memory_budget, freed_bytes))
    if not dp.active:
        return HostShare(
            tuple(resident),
            ((True,) * n_layers,),
            budget,
            resident_owned=((True,) * len(resident),),
        )
    topo = dp.topology
    return HostShare(
        tuple(resident),
        tuple(tuple(topo.owned_mask(r, n_layers)) for r in dp.host_ranks),
        budget,
        resident_owned=tuple(tuple(topo.resident_mask(r, dp.resident_pos)) for r in dp.host_ranks),
    )


def decide(config: TrainConfig, layouts, device_type: str, share: HostShare, dp) -> Decisions:
    """decisions.resolve for this rank's host share. Data parallel: ``gradient_hold`` "auto" holds
    on every rank when one rank's host needs it (a hold turns the speculative step off, and every
    rank must make the same collectives: dp.py's Note)."""
    dec = resolve(config, layouts, device_type, share)
    # (every rank calls min_int)
    if dp.active and dp.min_int(int(not dec.grad_hold)) == 0 and not dec.grad_hold:
        dec = resolve(config, layouts, device_type, replace(share, hold=True))
    return dec


def check_capacity_for(
    config: TrainConfig,
    dec: Decisions,
    layouts,
    share: HostShare,
    freed_bytes: int,
    model: nn.Module,
    device: torch.device,
) -> Prediction:
    """capacity.py's check of what ``initialize`` is about to allocate on this host under the
    engine's own decisions (host RAM of every rank on it, the NVMe tier's disk, the GPU's persistent
    buffers): ``CapacityError`` with the numbers, before any buffer exists, instead of an allocation
    failure (or the memory cgroup's OOM kill) mid-build or mid-step. Logs the host RAM needed
    against the budget and the limit that sets it."""
    pred = check_capacity(
        layouts,
        share.resident,
        config,
        device,
        world=len(share.owned),
        freed_bytes=freed_bytes,
        model_name=getattr(getattr(model, "config", None), "name_or_path", "")
        or type(model).__name__,
        decisions=dec,
        owned=share.owned,
        resident_owned=share.resident_masks(),
    )
    logger.info(
        f"host RAM: {fmt_bytes(pred.host_need_bytes)} of a {fmt_bytes(pred.host_budget_bytes)} "
        "budget "
        f"({pred.host_budget_source})"
    )
    return pred


def apply_liger_kernels(
    model: nn.Module, device: torch.device, setting, dtype: torch.dtype = torch.bfloat16
) -> str | None:
    """``megatrain.liger_kernels`` (as decisions.liger_setting resolves it): liger-kernel's RMSNorm,
    SwiGLU MLP and RoPE in place of the model's (CUDA only; the loss is megatrain_ds's own chunked /
    fused linear cross-entropy either way). ``setting`` "auto" applies them when liger-kernel is
    installed, knows the model type and its kernels run on this GPU for this model's sizes in
    ``dtype`` (probe_liger_kernels; a failure is logged in one line and the model's own kernels are
    used); True requires them (a failing kernel is a ConfigError naming it). Returns the model type
    patched, or None."""
    if setting is False:
        return None
    if device.type != "cuda":
        if setting is True:
            warnings.warn(
                "megatrain.liger_kernels: liger-kernel runs on CUDA only; the model's own kernels "
                "are "
                "used",
                stacklevel=3,
            )
        return None
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        if setting == "auto":
            return None
        raise ConfigError(
            f"megatrain.liger_kernels needs liger-kernel (pip install 'megatrain-ds[gpu]'): {exc}"
        ) from exc
    # PEFT: as HF Trainer does
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        if setting is True:
            warnings.warn(
                "megatrain.liger_kernels: liger-kernel has no kernels for model type "
                f"{model_type!r}; "
                "the model's own kernels are used",
                stacklevel=3,
            )
        return None
    failure = probe_liger_kernels(base.config, device, dtype)
    # before patching: liger's RoPE replaces the modeling module's function process-wide
    if failure is not None:
        if setting is True:
            raise ConfigError(
                f"megatrain.liger_kernels is true but liger-kernel fails on this GPU: {failure}. "
                "Set it to \"auto\" or false to train with the model's own kernels."
            )
        logger.warning(
            f"liger-kernel fails on this GPU ({failure}); the model's own RMSNorm, MLP and RoPE "
            "are used "
            "(megatrain.liger_kernels false skips this check)"
        )
        return None
    _apply_liger_kernel_to_instance(
        model=base,
        rope=True,
        rms_norm=True,
        swiglu=True,
        cross_entropy=False,
        fused_linear_cross_entropy=False,
    )
    return model_type


def probe_liger_kernels(
    config, device: torch.device, dtype: torch.dtype, tokens: int = 4
) -> str | None:
    """Run liger-kernel's RoPE, RMSNorm (hidden and head width) and SwiGLU once, forward and
    backward, on ``tokens`` tokens of this model's head count, head width, hidden and intermediate
    sizes in ``dtype`` on ``device``: a Triton kernel that does not build here fails at initialize,
    not in the first training step (seen 2026-11-29 on an H200: in a process that had built a CUDA
    extension first, every liger kernel failed with "PassManager::run failed"). The inputs come from
    a generator of its own: the global RNG state, which dropout draws from, is not moved. Returns
    None when all ran, else "<kernel> (<sizes>): <error's first line>". Sizes the config does not
    name are not probed."""
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden and heads else None)
    inter = getattr(config, "intermediate_size", None)

    gen = torch.Generator(device=device).manual_seed(0)

    # a non-leaf input that needs grad (liger's kernels may write their input in place)
    def leaf(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen).requires_grad_() * 1

    def rope():
        q, k = leaf(1, heads, tokens, head_dim), leaf(1, kv, tokens, head_dim)
        cos, sin = (
            torch.randn(1, tokens, head_dim, device=device, dtype=dtype, generator=gen)
            for _ in range(2)
        )
        qo, ko = liger_rotary_pos_emb(q, k, cos, sin)
        (qo.float().sum() + ko.float().sum()).backward()

    def rms(width):
        norm = LigerRMSNorm(width).to(device=device, dtype=dtype)
        norm(leaf(tokens, width)).float().sum().backward()

    def swiglu():
        LigerSiLUMulFunction.apply(
            leaf(tokens, inter), leaf(tokens, inter)
        ).float().sum().backward()

    checks = []
    if heads and head_dim:
        checks.append(
            (f"RoPE ({heads} heads, {kv} kv heads, head width {head_dim}, {dtype})", rope)
        )
    for width in sorted({w for w in (hidden, head_dim) if w}):
        checks.append((f"RMSNorm (width {width}, {dtype})", lambda w=width: rms(w)))
    if inter:
        checks.append((f"SwiGLU (width {inter}, {dtype})", swiglu))
    for name, run in checks:
        try:
            run()
            torch.cuda.synchronize(device)
        # a Triton compile error is a RuntimeError or a triton.CompilationError
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            return f"{name}: {type(exc).__name__}: {first}"
    return None


def build_store(
    config: TrainConfig,
    dec: Decisions,
    layouts,
    owned: list[bool],
    rank: int,
    pin: bool,
    device: torch.device | None = None,
) -> HostLayerStore:
    """The streamed layers' host buffers (host_state.py) as decided: wire, master and landing
    dtypes, the layers this rank holds, the NVMe tier's trailing layers (its path checked up front
    even when none is on disk now)."""
    if config.nvme is not None and dec.disk_layers == 0:
        check_path(config.nvme.nvme_path, 0)
    store = HostLayerStore(
        layouts,
        dec.wire_dtype,
        grad_accum_fp32=dec.ga > 1,
        pin=pin,
        grad_dtype=dec.landing_dtype,
        owned=owned,
        disk_from=dec.disk_from,
        nvme=config.nvme,
        rank=rank,
        nvme_backend=config.megatrain.nvme_backend,
        master_dtype=dec.master_dtype,
        moments_dtype=dec.moments_dtype,
        hold_device=device if dec.grad_hold else None,
    )
    if dec.grad_hold:
        logger.info(
            "gradient_hold \"gpu\": the streamed layers' gradients wait for the norm on the device "
            "(2 bytes "
            "per parameter of GPU memory, none on the host); no speculative step, one-pass updates "
            "([Note: gradients held on the device])"
        )
    if config.bf16_masters:
        logger.info(
            "bf16 master weights (bf16.bf16_master_weights_and_grads): the streamed layers' "
            "masters are bf16 (12 host bytes per parameter instead of 16); updates below bf16's "
            "resolution "
            "round away. Speculative steps and GPU-held layer optimizer state are off in this mode "
            "(the "
            "resident parameters keep fp32 state, which \"auto\" may still hold on the GPU)."
        )
    if config.bf16_moments:
        logger.info(
            "bf16 Adam moments (bf16.bf16_optimizer_states): the streamed layers' moments are bf16 "
            "too (8 host "
            "bytes per parameter): each step's moments are rounded to bf16 ([Note: compact "
            "moments])"
        )
    return store


def place_initial(states: LayerStates, n_device_layers: int) -> None:
    """The GPU-held layers decided at init (the store must hold the loaded weights: the device
    copies them)."""
    if n_device_layers > 0:  # GPU-held layers lead; NVMe layers trail
        states.place_on_device(n_device_layers)


def log_tier(store: HostLayerStore, config: TrainConfig, dec: Decisions) -> None:
    """One line naming what the NVMe tier holds, where, and how it is staged."""
    tier = store.tier
    what = "fp32 masters and Adam moments" if store.masters_on_disk else "Adam moments"
    logger.info(
        f"NVMe tier: the {what} of layers {store.disk_from}..{dec.n_layers - 1} "
        f"({dec.disk_layers} of {dec.n_layers}) live in {tier.path} ({tier.file_bytes / 2**30:.2f} "
        "GiB, "
        f"{tier.backend}, {len(tier.buffers)} staging buffers of {tier.region_bytes / 2**20:.0f} "
        "MiB, "
        f"pipeline_read={config.nvme.pipeline_read}, pipeline_write={config.nvme.pipeline_write})"
    )


def build_workers(config: TrainConfig, device: torch.device, local_rank: int, dp):
    """(thread placement, the host worker, the AdamW worker). One host worker thread runs gradient
    landings and optimizer tasks, FIFO (streams.py's Note); the AdamW thread the speculative and
    post-norm updates ([Note: host threads] in optimizer.py). Their threads are placed
    (placement.py) on CUDA only: on the CPU the main thread computes the model itself (data
    parallel: each local rank within its own share of the host's cores)."""
    local_world = dp.local_world if dp.active else 1  # the ranks of this host (dp.py's topology)
    placement = (
        resolve_placement(
            config.megatrain.host_threads,
            device.index,
            local_rank=local_rank,
            local_world=local_world,
        )
        if device.type == "cuda"
        else None
    )
    worker = ThreadPoolExecutor(
        max_workers=1,
        thread_name_prefix="megatrain-host",
        initializer=apply_placement,
        initargs=(placement,),
    )
    opt_worker = ThreadPoolExecutor(
        max_workers=1,
        thread_name_prefix="megatrain-adamw",
        initializer=apply_placement,
        initargs=(placement,),
    )
    return placement, worker, opt_worker


def build_executor(
    layers: nn.ModuleList,
    layouts,
    states: LayerStates,
    device: torch.device,
    streams,
    worker,
    config: TrainConfig,
    dec: Decisions,
    dp,
    model_name: str,
    timer: StepTimer,
    open_implicit_backward=None,
) -> tuple[StreamedLayers, list[str]]:
    """(the streamed-layer executor, the "template:path" of each tiled module): the executor with
    its recompute check, long-context tiling of the templates' MLPs (and non-liger RMSNorms), trace,
    no-grad inference cache and activation offload as the config asks; ``open_implicit_backward``:
    the engine's, for a script's loss.backward()."""
    mt = config.megatrain
    # True: every step
    steps = True if dec.check_recompute_steps is None else dec.check_recompute_steps
    check = RecomputeCheck(
        steps,
        dec.check_recompute_tolerance,
        dec.compute_dtype,
        model_name,
        input_from_next=mt.offload_activations,
    )
    executor = StreamedLayers(
        layers,
        layouts,
        states,
        device,
        streams,
        worker,
        num_slots=mt.num_slots,
        compute_dtype=dec.compute_dtype,
        dp=dp,
        check=check,
        timer=timer,
        trace=mt.trace,
        inference_cache=mt.inference_cache,
        inference_cache_memory=mt.inference_cache_memory,
        activations=HostActivations(streams, device) if mt.offload_activations else None,
        open_implicit_backward=open_implicit_backward,
        recompute_skip=mt.skip_recompute_down_proj,
    )
    tiled_modules = apply_tiling(executor.templates, mt.tiled_mlp)
    return executor, tiled_modules


def buffers_to_device(model: nn.Module, layers: nn.ModuleList, device: torch.device) -> None:
    """Buffers outside the layers (e.g. rotary tables) live on the device; the layers' own are the
    executor's per-layer device copies."""
    in_layers = {id(m) for m in layers.modules()}
    for module in model.modules():
        if id(module) in in_layers:
            continue
        for name, buf in module.named_buffers(recurse=False):
            module._buffers[name] = buf.to(device)


def build_optimizer(
    groups: list[dict],
    defaults: dict,
    config: TrainConfig,
    dec: Decisions,
    executor: StreamedLayers,
    states: LayerStates,
    streams,
    timer: StepTimer,
    resident,
    worker,
    opt_worker,
    dp,
    scaler,
) -> HostAdamW:
    """The host AdamW over the fp32 masters, given its collaborators ([Note: host threads] in
    optimizer.py). A speculative step is undone exactly only on fp32 masters (bf16 rounding would
    not come back)."""
    parts = HostAdamWParts(
        executor=executor,
        states=states,
        store=states.store,
        schedule=executor.schedule,
        streams=streams,
        timer=timer,
        resident=resident,
        worker=worker,
        opt_worker=opt_worker,
        clip=config.gradient_clipping,
        scaler=scaler,
        dp=dp,
        kernel=dec.host_kernel,
        defer_moments=dec.deferred_moments,
        defer_when_speculating=config.megatrain.deferred_moments is True,
    )
    mt = config.megatrain
    policy = SpeculationPolicy(
        mt.speculative_step and not config.bf16_masters and not dec.grad_hold,
        mt.speculation_backoff,
    )
    return HostAdamW(
        groups, defaults, parts, adam_w_mode=config.optimizer.adam_w_mode, policy=policy
    )


def step_counters(optimizer: HostAdamW, store: HostLayerStore):
    """The step breakdown's counters (timing.py): speculation, and the NVMe tier's traffic when
    there is one."""
    policy, tier = optimizer.policy, store.tier
    return lambda: {
        "speculated_steps": policy.speculated,
        "rolled_back_steps": policy.rolled_back,
        **(
            {"nvme_read_bytes": tier.read_bytes, "nvme_written_bytes": tier.written_bytes}
            if tier
            else {}
        ),
    }


def count(n: int) -> str:
    """A parameter count for people: 72.7 B, 210 M, 12.3 K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)
