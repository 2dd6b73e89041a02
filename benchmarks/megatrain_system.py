"""The megatrain system for the benchmark harness: megatrain_ds driven exactly like a DeepSpeed
script.

Same model, data, optimizer hyperparameters and clipping as ``resident`` and ``zero3`` (AdamW lr
1e-5, weight decay 0.01, betas (0.9, 0.999), eps 1e-8: benchmarks.common.OPTIMIZER; clip H2H_CLIP;
bf16 compute), one micro-batch per step. With ``init_device="cuda"`` the random init is drawn on the
GPU with the same seed as ``resident`` so the two runs start from identical weights (then the engine
moves everything to host memory and frees the GPU copy); peak GPU memory is measured from after
``initialize``.

The engine's own defaults decide every knob the harness is not asked about (speculation, slots,
where the optimizer state lives, ...): the "megatrain" block carries only the liger switches (the
same kernels and loss as the peers get), ``gpu_optimizer_layers`` when asked (``--host-only``: 0;
``--gpu-optimizer-fraction``: from ``offload_optimizer.ratio``), and MEGATRAIN_OPTIONS (h2h
--megatrain-options) merged on top.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics

import torch

import megatrain_ds
from benchmarks import build
from benchmarks.common import (
    LIGER_KERNELS,
    OPTIMIZER,
    Run,
    after_result,
    allocator_record,
    cleanup,
    count_params,
    data_rank,
    h2h_clip,
    is_oom,
    liger_importable,
    make_batches,
    measure,
    micro_batch_for,
    oom_result,
    peak_gpu_bytes,
    report_phase,
    reset_memory_stats,
    result_dict,
    settings_dict,
)

ENGINE_RECOMPUTE = (
    "megatrain_ds recompute of each streamed layer in its backward, except the kept layers "
    "(keep_activations; count in kept_layers)"
)


def megatrain_options() -> dict:
    """Extra engine knobs from MEGATRAIN_OPTIONS (h2h --megatrain-options), e.g.
    '{"fp32_grad_landing": true}'."""
    return json.loads(os.environ.get("MEGATRAIN_OPTIONS", "{}"))


def megatrain_ds_config(
    micro_batch: int,
    device: str,
    liger: bool = False,
    gpu_optimizer_fraction: float = 0.0,
    host_only: bool = False,
) -> dict:
    """megatrain_ds's DeepSpeed config: the peers' optimizer hyperparameters, clip and precision.

    ``liger``: liger-kernel's RMSNorm, SwiGLU and RoPE (``liger_kernels``) and its fused linear
    cross-entropy (``use_liger``), the kernels and loss HF Trainer's use_liger_kernel gives the
    peers; off: neither. ``gpu_optimizer_fraction`` F > 0: ``offload_optimizer.ratio = 1 - F`` (the
    leading layers' optimizer state on the GPU, as ZeRO-3's run with the same F) and
    ``gpu_optimizer_layers: -1`` (read the ratio) unless MEGATRAIN_OPTIONS names a count.
    ``host_only``: ``gpu_optimizer_layers: 0``. Neither: the engine decides.
    """
    if not 0.0 <= gpu_optimizer_fraction <= 1.0:
        raise ValueError(f"gpu_optimizer_fraction must be in [0, 1], got {gpu_optimizer_fraction}")
    if host_only and gpu_optimizer_fraction > 0:
        raise ValueError("host_only and gpu_optimizer_fraction > 0 contradict each other")
    options = megatrain_options()
    block: dict = {"liger_kernels": bool(liger), "use_liger": bool(liger)}
    offload_optimizer = {"device": "cpu", "pin_memory": True}
    if gpu_optimizer_fraction > 0:
        offload_optimizer["ratio"] = round(1.0 - gpu_optimizer_fraction, 6)
        # from offload_optimizer.ratio, whatever the engine's default
        block["gpu_optimizer_layers"] = -1
    if host_only:
        block["gpu_optimizer_layers"] = 0
    block.update(options)
    return _merge(
        {
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": 1,
            "optimizer": {
                "type": "AdamW",
                "params": dict(OPTIMIZER, betas=list(OPTIMIZER["betas"])),
            },
            "gradient_clipping": h2h_clip(),
            "bf16": {"enabled": device.startswith("cuda")},
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "cpu", "pin_memory": True},
                "offload_optimizer": offload_optimizer,
            },
            "wall_clock_breakdown": True,
            "megatrain": block,
        },
        json.loads(os.environ.get("MEGATRAIN_DS_CONFIG", "{}")),
    )


def _merge(base: dict, extra: dict) -> dict:
    """``base`` with MEGATRAIN_DS_CONFIG (h2h --ds-config JSON) merged in, nested blocks key by key
    (e.g. the NVMe tier: '{"zero_optimization": {"offload_optimizer": {"device": "nvme",
    "nvme_path": "/x"}}, "aio": {...}}')."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def megatrain_settings(
    ds_config: dict,
    seq: int,
    steps: int,
    warmup: int,
    device: str,
    model_config=None,
    lora: int = 0,
) -> dict:
    """The recorded settings of a ``megatrain`` run, read from its config (recorded whole, with the
    options). ``model_config``: a config with ``output_router_logits`` (MoE) runs the model's own
    loss (the engine's fused loss does not apply); ``lora`` > 0: the precision line says the base is
    frozen."""
    block = ds_config.get("megatrain", {})
    cuda = device.startswith("cuda")
    kernels = [k for k in LIGER_KERNELS[:3] if cuda and block.get("liger_kernels")]
    if getattr(model_config, "output_router_logits", False):
        loss = "the model's own loss (full logits) + router aux loss"
    elif not block.get("fused_loss", True):
        loss = "the model's own loss (full logits)"
    elif block.get("use_liger", True) and cuda and liger_importable():
        loss = "liger fused linear cross-entropy (no logits)"
        kernels.append("fused_linear_cross_entropy")
    else:
        loss = "megatrain_ds chunked linear cross-entropy (torch, no whole logits)"
    recompute = ENGINE_RECOMPUTE + (
        "; saved inputs in pinned host memory" if block.get("offload_activations") else ""
    )
    bf16 = ds_config["bf16"]["enabled"]
    precision = "fp32 master, bf16 compute" if bf16 else "fp32"
    # the layers' masters (and moments) in bf16
    if bf16 and ds_config["bf16"].get("bf16_master_weights_and_grads"):
        precision = (
            "bf16 master"
            + (
                ", bf16 Adam moments"
                if ds_config["bf16"].get("bf16_optimizer_states")
                else ", fp32 Adam moments"
            )
            + ", bf16 compute"
        )
    if lora:
        precision = (
            "frozen base built in bf16; adapters bf16 with fp32 masters, bf16 compute"
            if bf16
            else "frozen base fp32; adapters fp32 (cpu)"
        )
    return settings_dict(
        precision=precision,
        optimizer="megatrain_ds host AdamW",
        opt_params=ds_config["optimizer"]["params"],
        clip=ds_config["gradient_clipping"],
        warmup=warmup,
        steps=steps,
        seq=seq,
        micro_batch=ds_config["train_micro_batch_size_per_gpu"],
        kernels=kernels,
        loss_kernel=loss,
        gradient_checkpointing=recompute,
        offload_optimizer_ratio=float(
            ds_config["zero_optimization"]["offload_optimizer"].get("ratio", 1.0)
        ),
        gpu_optimizer_layers=block.get("gpu_optimizer_layers", "engine default"),
        megatrain_options=megatrain_options(),
        ds_config=ds_config,
    )


def _median_breakdown(breakdowns: list[dict]) -> dict:
    keys = [k for k in breakdowns[0] if isinstance(breakdowns[0][k], (int, float))]
    return {k: statistics.median(b[k] for b in breakdowns) for k in keys}


def _engine_facts(engine) -> dict:
    """What the engine really ran with: its parsed megatrain knobs (defaults included) and how many
    leading layers' optimizer state ended on the GPU (read defensively: only for the record)."""
    facts: dict = {}
    mt = getattr(getattr(engine, "config_settings", None), "megatrain", None)
    if mt is not None and dataclasses.is_dataclass(mt):
        facts["engine_megatrain"] = dataclasses.asdict(mt)
    state = getattr(getattr(engine, "executor", None), "device_state", None)
    lo, hi = getattr(state, "lo", 0), getattr(state, "hi", 0)
    facts["gpu_optimizer_layers_used"] = int(hi - lo) if state is not None else 0
    # no recompute for these
    facts["kept_layers"] = len(getattr(getattr(engine, "executor", None), "keep", ()))
    facts["resident_state_on_gpu"] = bool(
        getattr(getattr(engine, "resident", None), "on_device", False)
    )
    # megatrain.tiled_mlp (tiling.py)
    facts["tiled_modules"] = list(getattr(engine, "tiled_modules", []))
    # recompute_check.py: what it compared
    check = getattr(getattr(engine, "executor", None), "check", None)
    if check is not None:
        facts["recompute_check"] = {
            "steps_checked": check.steps_checked,
            "outputs_compared": check.compared,
            "worst_relative_error": check.worst,
            "tolerance": check.tolerance,
        }
    store = getattr(engine, "store", None)
    # the NVMe tier (nvme.py): which layers, how, how many bytes moved
    tier = getattr(store, "tier", None)
    if tier is not None:
        facts["nvme"] = {
            "disk_from_layer": store.disk_from,
            "disk_layers": len(tier.n_train),
            "file_bytes": tier.file_bytes,
            "backend": tier.backend,
            "staging_buffers": len(tier.buffers),
            "staging_bytes": tier.staging_bytes(),
            "read_bytes_total": tier.read_bytes,
            "written_bytes_total": tier.written_bytes,
        }
    # plan.py's prediction at initialize (host / disk / GPU)
    plan = getattr(engine, "capacity", None)
    if plan is not None and hasattr(plan, "to_dict"):
        facts["plan_at_initialize"] = plan.to_dict()
    # the host optimizer's threads and cores (per rank under DP)
    placement = getattr(engine, "placement", None)
    if placement is not None and hasattr(placement, "describe"):
        facts["host_placement"] = placement.describe()
    # what "auto" placed after the second step (training/engine_auto.py)
    if engine.auto_placer.placed:
        facts["auto_placed"] = engine.auto_placer.placed
    # the templates whose recompute skips the MLP's output projection (recompute_skip.py)
    facts["recompute_skips"] = list(getattr(engine.executor, "recompute_skips", []))
    # data parallel: the layers this rank holds
    owned = getattr(getattr(engine, "store", None), "owned", None)
    if owned is not None:
        facts["owned_layers"] = f"{sum(bool(o) for o in owned)}/{len(owned)}"
    # share of the parameters whose optimizer state is on the GPU: those layers + the resident ones
    # with them
    try:
        on_gpu = (
            0
            if state is None
            else int(state.full1 - state.full0)
            + sum(
                t.numel()
                for t in engine.resident.master
                if t is not None and t.device.type != "cpu"
            )
        )
        total = int(engine.store.n_full) + sum(
            t.numel() for t in engine.resident.master if t is not None
        )
        facts["gpu_optimizer_share"] = on_gpu / total if total else None
    except Exception:  # noqa: BLE001 - engine internals; the record just lacks the number
        pass
    return facts


def _init_device(config, device: str, lora: int) -> str:
    """Where the model is built: on the GPU (the init drawn there, fast) unless its fp32 weights
    (the compute dtype's under LoRA) would take more than 90% of the GPU's free memory (a small GPU,
    or --gpu-memory-limit): then on the CPU, from where initialize streams it into host memory as it
    does a model the GPU could never hold."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return device
    from benchmarks.shapes import n_params

    need = n_params(config) * (2 if lora else 4)
    return device if need <= 0.9 * torch.cuda.mem_get_info()[0] else "cpu"


def _stream_names(engine) -> dict:
    """The engine's CUDA streams by handle (for ``allocator_record``): the compute stream (the
    current one), weight prefetch (h2d), gradient evacuation (d2h) and the GPU-held optimizer
    (opt); {} off CUDA."""
    streams = getattr(getattr(engine, "executor", None), "streams", None)
    if getattr(streams, "kind", "") != "cuda":
        return {}
    names = {streams.compute().cuda_stream: "compute"}
    for name in ("h2d", "d2h", "opt"):
        names[getattr(streams, name).cuda_stream] = name
    return names


def engine_host_state_bytes(engine) -> int:
    """The engine's host state (bytes): its layer store (``store.nbytes()``) + the resident
    parameters' host tensors (masters, moments, gradients, wire copies). A tensor on the device is
    not host memory (a frozen resident parameter's master is its device copy; state placed on the
    GPU), nor is one tensor counted twice."""
    seen: dict[int, torch.Tensor] = {}
    resident = engine.resident
    for ts in (
        resident.master,
        resident.exp_avg,
        resident.exp_avg_sq,
        resident.grad,
        resident.wire,
    ):
        for t in ts:
            if t is not None and t.device.type == "cpu":
                seen[id(t)] = t
    return engine.store.nbytes() + sum(t.numel() * t.element_size() for t in seen.values())


def run_megatrain(
    config,
    tokens_per_step: int,
    seq: int = 1024,
    steps: int = 8,
    warmup: int = 2,
    device: str = "cuda",
    seed: int = 0,
    init_device: str | None = None,
    liger: bool = False,
    gpu_optimizer_fraction: float = 0.0,
    host_only: bool = False,
    lora: int = 0,
    lora_targets: str = "default",
    init: str = "auto",
    closing_step: str = "full",
) -> dict:
    """Train ``warmup + steps`` steps on megatrain_ds; result dict as the baselines, plus the
    breakdown. ``liger``, ``gpu_optimizer_fraction``, ``host_only``: see
    :func:`megatrain_ds_config`.

    ``init``: benchmarks.build (``hf``: the model's own init on ``init_device``, as before;
    ``fast``: layer 0's values repeated, the layers built on the CPU and the rest on
    ``init_device``; ``auto``: fast from 14 B parameters). Full fine-tuning trains an fp32 model
    (``.float()``, unchanged). ``lora`` R > 0: peft LoRA rank R on ``lora_targets``
    (benchmarks.build.apply_lora), the base frozen and built in the compute dtype (bf16 on CUDA;
    fp32 on the CPU, where the engine computes in fp32), never upcast; FLOPs by the LoRA formula
    (benchmarks.shapes).

    ``closing_step``: the engine's breakdown of a step is read at the start of the next forward, so
    the last measured step needs one more. "full" (default, as every earlier result): one more
    training step, not timed; "tiny": a no-grad forward of 8 tokens of one sequence (long context: a
    second 512K step would double the run), with the peak GPU memory read before it."""
    if closing_step not in ("full", "tiny"):
        raise ValueError(f"closing_step must be 'full' or 'tiny', got {closing_step!r}")
    micro_batch = micro_batch_for(tokens_per_step, seq)
    layers = config.num_hidden_layers
    run = Run("megatrain", config, layers, micro_batch, seq, device)  # each result names it
    init_device = init_device or _init_device(config, device, lora)
    ds_config = megatrain_ds_config(micro_batch, device, liger, gpu_optimizer_fraction, host_only)
    settings = megatrain_settings(ds_config, seq, steps, warmup, device, config, lora)
    n_params, counts = 0, {}
    try:
        init = build.resolve_init(init, config)
        dtype = torch.bfloat16 if lora and ds_config["bf16"]["enabled"] else torch.float32
        model = build.build_model(config, dtype, init, seed, device=init_device)
        settings.update(
            init=build.init_description(init),
            model_dtype=str(dtype).replace("torch.", ""),
            init_device=init_device,
        )
        if lora:
            model = build.apply_lora(model, lora, lora_targets)
            settings["lora"] = build.lora_settings(lora, lora_targets, model)
        n_params, counts = count_params(model), build.param_counts(model)
        settings["build_s"] = report_phase("model built")["phase_s"]
        engine, _, _, _ = megatrain_ds.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config
        )
        settings["initialize_s"] = report_phase("engine initialized")["phase_s"]
        cleanup()
        reset_memory_stats(device)
        breakdowns = []

        def step(input_ids: torch.Tensor) -> torch.Tensor:
            loss = engine(input_ids=input_ids, labels=input_ids).loss
            engine.backward(loss)
            engine.step()
            if engine.last_step_breakdown():
                breakdowns.append(dict(engine.last_step_breakdown()))
            return loss

        extra_batch = 1 if closing_step == "full" else 0
        batches = make_batches(
            config.vocab_size,
            micro_batch,
            seq,
            warmup + steps + extra_batch,
            seed,
            rank=data_rank(),
        )
        warm, times, losses = measure(step, batches, warmup, device)
        peak_gpu = peak_gpu_bytes(device)  # the training steps' peak (before any closing forward)
        # + cache
        peak_reserved = int(torch.cuda.max_memory_reserved()) if device.startswith("cuda") else 0
        # opens the next step's window: closes the last measured step's breakdown
        if closing_step == "tiny":
            with torch.no_grad():
                engine(input_ids=batches[-1][:1, :8].to(device))
            if engine.last_step_breakdown():
                breakdowns.append(dict(engine.last_step_breakdown()))
            # (sliced off below, as the full closing step's)
            times, losses = times + [None], losses + [None]
        report_phase("steps done")
        # measure() times each step; the breakdown of step k is read at the start of step k+1
        breakdown = _median_breakdown(breakdowns[warmup:]) if len(breakdowns) > warmup else {}
        host_state = engine_host_state_bytes(engine)
        settings.update(_engine_facts(engine))
        settings["allocator"] = allocator_record(device, _stream_names(engine))
        after_result(engine.destroy)  # its host memory is freed after the result is written
    except Exception as exc:  # noqa: BLE001 - only OOM is swallowed
        if not is_oom(exc):
            raise
        return oom_result(
            run,
            n_params,
            exc,
            ds_config=ds_config,
            settings=settings,
            lora_params=counts.get("adapter_params") if lora else None,
            **counts,
        )
    # the last batch only served to close the last measured step's breakdown
    res = result_dict(
        run,
        n_params,
        warm,
        times[:-1],
        losses[:-1],
        breakdown=breakdown,
        engine_host_state_bytes=host_state,
        engine_host_bytes_per_param=host_state / n_params,
        ds_config=ds_config,
        peak_gpu_bytes=peak_gpu,
        peak_gpu_reserved_bytes=peak_reserved,
        precision=settings["precision"],
        settings=settings,
        lora_params=counts["adapter_params"] if lora else None,
        **counts,
    )
    return with_base_param_ratios(res)


def with_base_param_ratios(res: dict) -> dict:
    """Adds host_bytes_per_base_param (peak RSS / base parameters) and, where the engine's host
    state is known, engine_host_bytes_per_base_param: per parameter of the base model (adapters left
    out), the LoRA figure."""
    base = res.get("base_params") or 0
    if base:
        res["host_bytes_per_base_param"] = res["peak_host_rss_bytes"] / base
        if res.get("engine_host_state_bytes") is not None:
            res["engine_host_bytes_per_base_param"] = res["engine_host_state_bytes"] / base
    return res
