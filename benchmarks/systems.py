"""Baseline training systems measured against megatrain_ds.

Each ``run_<system>(config, tokens_per_step, seq, steps, warmup, device, seed, ...) -> dict`` builds
a random-init model from ``config`` (a transformers config of benchmarks.shapes: dense Qwen2 or
MoE), trains it on seeded random token ids (labels = input_ids) for ``warmup + steps`` optimizer
steps of one micro-batch each, and returns :func:`benchmarks.common.result_dict` (times in s, memory
in bytes) with the run's settings under "settings". A CUDA out-of-memory error is caught and
reported as status "oom" rather than raised.

- ``resident``: whole model on the device, fp32 params, bf16 autocast, fused torch AdamW, HF
  checkpointing.
- ``zero3``: DeepSpeed ZeRO-3 with parameter and optimizer offload to pinned CPU memory (the
  ANCHORS.md config).

Both train with AdamW lr 1e-5, weight decay 0.01, betas (0.9, 0.999), eps 1e-8
(benchmarks.common.OPTIMIZER) and clip H2H_CLIP; with ``liger=True`` both get liger-kernel as HF
Trainer's ``use_liger_kernel=True`` applies it (RMSNorm, SwiGLU, RoPE, fused linear cross-entropy),
as megatrain_ds gets the same kernels and loss.
"""

from __future__ import annotations

import json
import logging
import os

import torch
from transformers import AutoModelForCausalLM

from benchmarks import build
from benchmarks.common import (
    HF_CHECKPOINTING,
    LIGER_KERNELS,
    OPTIMIZER,
    Run,
    after_result,
    apply_hf_liger,
    count_params,
    data_rank,
    enable_hf_checkpointing,
    h2h_clip,
    is_oom,
    make_batches,
    measure,
    micro_batch_for,
    oom_result,
    report_phase,
    reset_memory_stats,
    result_dict,
    set_single_process_env,
    settings_dict,
)
from benchmarks.megatrain_system import _merge
from benchmarks.shapes import layer_params

HF_LOSS = "HF ForCausalLMLoss (full logits, torch cross-entropy)"
LIGER_LOSS = "liger fused linear cross-entropy (no logits)"


def _build_resident(config, device: str, seed: int, liger: bool = False):
    """Random-init fp32 model built directly on ``device`` (``build.build_model``'s hf init, the
    other systems' own: the same values for one seed), liger-kernel patched in when ``liger``, as HF
    Trainer does, with HF checkpointing, plus its fused AdamW (benchmarks.common.OPTIMIZER)."""
    model = build.build_model(config, torch.float32, "hf", seed, device=device)
    if liger:
        apply_hf_liger(model)
    enable_hf_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIMIZER, fused=True)
    return model, optimizer


def resident_settings(
    micro_batch: int, seq: int, steps: int, warmup: int, device: str, liger: bool = False
) -> dict:
    """The recorded settings of a ``resident`` run (everything on the device: no offload ratio)."""
    use_amp = device.startswith("cuda")
    return settings_dict(
        precision="fp32 params, bf16 autocast" if use_amp else "fp32 (cpu, no autocast)",
        optimizer="torch.optim.AdamW (fused)",
        opt_params=OPTIMIZER,
        clip=h2h_clip(),
        warmup=warmup,
        steps=steps,
        seq=seq,
        micro_batch=micro_batch,
        kernels=list(LIGER_KERNELS) if liger else [],
        loss_kernel=LIGER_LOSS if liger else HF_LOSS,
        gradient_checkpointing=HF_CHECKPOINTING,
        recomputes_every_layer=True,
        offload_optimizer_ratio=None,
    )


def run_resident(
    config,
    tokens_per_step: int,
    seq: int = 1024,
    steps: int = 8,
    warmup: int = 2,
    device: str = "cuda",
    seed: int = 0,
    liger: bool = False,
) -> dict:
    """Whole model resident on ``device``: fp32 params, bf16 autocast, fused AdamW, clip H2H_CLIP.

    ``tokens_per_step`` (tokens) is rounded down to a multiple of ``seq`` (tokens per sequence); one
    micro-batch per step. On device "cpu" autocast is off (plain fp32): CPU bf16 autocast is slow
    and is not what the GPU baseline measures; the CPU path exists only as a smoke test. Under a
    launcher with WORLD_SIZE > 1 (h2h --gpus N) the model is wrapped in torch DDP (gradients
    averaged over the ranks, ``gradient_as_bucket_view`` so the buckets are the gradients: no second
    copy), each rank on its own micro-batch: plain data parallel, the whole-on-GPU bound for N GPUs.
    """
    micro_batch = micro_batch_for(tokens_per_step, seq)
    layers = config.num_hidden_layers
    run = Run("resident", config, layers, micro_batch, seq, device)  # each result names it
    use_amp = device.startswith("cuda")
    device_type = "cuda" if use_amp else "cpu"
    settings = resident_settings(micro_batch, seq, steps, warmup, device, liger)
    if getattr(config, "output_router_logits", False):
        settings["loss_kernel"] += " + router aux loss"
    clip = settings["clip"]
    reset_memory_stats(device)
    n_params = 0
    try:
        model, optimizer = _build_resident(config, device, seed, liger)
        settings["build_s"] = report_phase("model built")["phase_s"]
        n_params = count_params(model)
        train_model = _data_parallel(model, device)
        params = [p for p in model.parameters() if p.requires_grad]
        group = optimizer.param_groups[0]  # what the optimizer really got
        settings.update(
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            betas=list(group["betas"]),
            eps=group["eps"],
        )

        def step(input_ids: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=use_amp):
                loss = train_model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        batches = make_batches(
            config.vocab_size, micro_batch, seq, warmup + steps, seed, rank=data_rank()
        )
        warm, times, losses = measure(step, batches, warmup, device)
    except Exception as exc:  # noqa: BLE001 - only OOM is swallowed, everything else re-raised
        if not is_oom(exc):
            raise
        return oom_result(run, n_params, exc, settings=settings)
    return result_dict(
        run, n_params, warm, times, losses, precision=settings["precision"], settings=settings
    )


def _data_parallel(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """``model`` itself in one process; under a launcher (WORLD_SIZE > 1) wrapped in DDP over the
    launcher's process group (NCCL on CUDA, gloo on CPU), created here if the launcher left none."""
    import os

    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return model
    cuda = device.startswith("cuda")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model,
        device_ids=[torch.cuda.current_device()] if cuda else None,
        gradient_as_bucket_view=True,
    )


def zero3_ds_config(
    config, micro_batch: int, device: str = "cuda", gpu_optimizer_fraction: float = 0.0
) -> dict:
    """The DeepSpeed config of ANCHORS.md for hidden size h = ``config.hidden_size``.

    Stage 3, param + optimizer offload to pinned CPU memory, AdamW (DeepSpeedCPUAdam) with
    benchmarks.common.OPTIMIZER (lr 1e-5, weight decay 0.01, betas (0.9, 0.999), eps 1e-8), bf16,
    clip H2H_CLIP, overlap_comm, contiguous_gradients, reduce bucket h^2 elements, prefetch bucket
    0.9 h^2 elements, persistence threshold 10 h elements, max live params 1e9, sub-group 1e9
    elements. ``gpu_optimizer_fraction`` F > 0: ZeRO-Offload++'s ``offload_optimizer.ratio = 1 - F``
    (fraction of optimizer state on the CPU; the leading sub-groups stay on the GPU), as
    megatrain_ds's run with the same F. DeepSpeed places whole sub-groups, so then
    ``sub_group_size`` is one decoder layer's parameters (about L + 1 sub-groups, the granularity
    megatrain_ds places at) instead of 1e9, which would give a 3B model only 4 sub-groups. On device
    "cpu" bf16 is turned off (fp32 training): the smoke test runs DeepSpeed's CPU accelerator with
    gloo, where bf16 mixed precision with DeepSpeedCPUAdam is not a supported combination.
    """
    if not 0.0 <= gpu_optimizer_fraction <= 1.0:
        raise ValueError(f"gpu_optimizer_fraction must be in [0, 1], got {gpu_optimizer_fraction}")
    h = config.hidden_size
    offload_optimizer = {"device": "cpu", "pin_memory": True}
    sub_group_size = int(1e9)
    if gpu_optimizer_fraction > 0:
        offload_optimizer["ratio"] = round(1.0 - gpu_optimizer_fraction, 6)
        sub_group_size = (
            _layer_params(config) if config.model_type == "qwen2" else layer_params(config)
        )
    params = dict(OPTIMIZER, betas=list(OPTIMIZER["betas"]))
    return {
        "train_micro_batch_size_per_gpu": int(micro_batch),
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": device.startswith("cuda")},
        "gradient_clipping": h2h_clip(),
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": offload_optimizer,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": h * h,
            "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
            "stage3_max_live_parameters": int(1e9),
            "sub_group_size": sub_group_size,
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _layer_params(config) -> int:
    """Parameters (count) of one Qwen2 decoder layer: q/k/v (with biases), o, the MLP and two
    RMSNorms."""
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    return (h + 1) * q + 2 * (h + 1) * kv + q * h + 3 * h * inter + 2 * h


def zero3_settings(
    ds_config: dict,
    seq: int,
    steps: int,
    warmup: int,
    liger: bool = False,
    lora: int = 0,
    model_config=None,
) -> dict:
    """The recorded settings of a ``zero3`` run, read from its DeepSpeed config (which is recorded
    whole). ``lora`` > 0: the precision line says the base is frozen; ``model_config`` with
    ``output_router_logits``: the loss includes the router aux loss."""
    zero = ds_config["zero_optimization"]
    ratio = float(zero["offload_optimizer"].get("ratio", 1.0))
    bf16 = ds_config["bf16"]["enabled"]
    precision = "bf16 params and compute, fp32 master (DeepSpeed bf16)" if bf16 else "fp32 (cpu)"
    # DeepSpeed's low-precision state
    if bf16 and ds_config["bf16"].get("bf16_master_weights_and_grads"):
        precision = (
            "bf16 params, compute and master, "
            + ("bf16" if ds_config["bf16"].get("bf16_optimizer_states") else "fp32")
            + " Adam moments (DeepSpeed bf16)"
        )
    if lora:
        precision = (
            "frozen base bf16 (zero.Init, partitioned in pinned host memory); adapters bf16 with "
            "fp32 "
            "masters (DeepSpeed bf16)"
            if bf16
            else "frozen base fp32; adapters fp32 (cpu)"
        )
    loss = LIGER_LOSS if liger else HF_LOSS
    if getattr(model_config, "output_router_logits", False):
        loss += " + router aux loss"
    return settings_dict(
        precision=precision,
        optimizer="DeepSpeedCPUAdam (AdamW)"
        + (" + torch AdamW for the GPU sub-groups" if ratio < 1 else ""),
        opt_params=ds_config["optimizer"]["params"],
        clip=ds_config["gradient_clipping"],
        warmup=warmup,
        steps=steps,
        seq=seq,
        micro_batch=ds_config["train_micro_batch_size_per_gpu"],
        kernels=list(LIGER_KERNELS) if liger else [],
        loss_kernel=loss,
        gradient_checkpointing=HF_CHECKPOINTING,
        recomputes_every_layer=True,
        offload_optimizer_ratio=ratio,
        ds_config=ds_config,
    )


def _gpu_optimizer_share(engine) -> float | None:
    """Fraction of the parameters whose optimizer state DeepSpeed placed on the GPU (None if not
    readable)."""
    opt = getattr(engine, "optimizer", None)
    placement = getattr(opt, "subgroup_to_device", None)
    sizes = getattr(opt, "fp16_partitioned_groups_flat_numel", None)
    if not placement or not sizes:
        return None
    total = sum(int(n) for n in sizes)
    return (
        sum(int(n) for i, n in enumerate(sizes) if placement.get(i) != "cpu") / total
        if total
        else None
    )


ZERO3_INIT = (
    "hf under deepspeed.zero.Init (each module gathered to the GPU, initialized there, partitioned "
    "again)"
)


def _build_zero3(
    config,
    ds_config: dict,
    seed: int,
    liger: bool = False,
    lora: int = 0,
    lora_targets: str = "default",
):
    """ZeRO-3 engine around a model constructed under deepspeed.zero.Init (never whole on the GPU or
    the host).

    HfDeepSpeedConfig makes transformers' from_config build inside zero.Init (in the config's dtype:
    bf16 when ``bf16.enabled``; each parameter is partitioned into pinned host memory as its module
    is constructed) and run its weight init on gathered parameters; the returned holder must stay
    referenced while the model is built. ``liger``: liger-kernel is patched into the built
    (partitioned) model before deepspeed.initialize, as HF Trainer does. Its instance patching only
    rebinds forwards (RMSNorm, MLP, the causal LM's) and never touches parameter data; the
    fused-loss forward reads ``lm_head.weight`` outside the head's own forward, which ZeRO-3 gathers
    as an external parameter (DeepSpeed marks every module as in-forward during the engine's
    forward). ``lora`` R > 0: peft LoRA (benchmarks.build.apply_lora) on the zero.Init-built model,
    as HF does for ZeRO-3 LoRA: the adapters are made unpartitioned, and deepspeed.initialize
    converts them to ZeRO-3 parameters; only they go to the optimizer. Liger and checkpointing are
    applied to the base model before the wrap (HF Trainer patches the base model of a PeftModel).
    """
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    holder = HfDeepSpeedConfig(ds_config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.train()
    if liger:
        apply_hf_liger(model)
    enable_hf_checkpointing(model)
    params = model.parameters()
    if lora:
        model = build.apply_lora(model, lora, lora_targets)
        params = [p for p in model.parameters() if p.requires_grad]
    counts = build.param_counts(model)
    timings = {"build_s": report_phase("model built")["phase_s"]}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config)
    timings["initialize_s"] = report_phase("engine initialized")["phase_s"]
    return engine, holder, counts, timings


def _partition_bytes(module: torch.nn.Module) -> int:
    """Bytes of this rank's ZeRO-3 parameter partitions (``ds_tensor``; host memory with
    offload_param cpu)."""
    return sum(
        p.ds_tensor.numel() * p.ds_tensor.element_size()
        for p in module.parameters()
        if getattr(p, "ds_tensor", None) is not None
    )


def run_zero3(
    config,
    tokens_per_step: int,
    seq: int = 1024,
    steps: int = 8,
    warmup: int = 2,
    device: str = "cuda",
    seed: int = 0,
    liger: bool = False,
    gpu_optimizer_fraction: float = 0.0,
    lora: int = 0,
    lora_targets: str = "default",
    init: str = "auto",
) -> dict:
    """DeepSpeed ZeRO-3 with CPU offload of params and optimizer, one process, one device.

    ``tokens_per_step`` (tokens) is rounded down to a multiple of ``seq``; one micro-batch per step,
    gradient accumulation 1. The DeepSpeed config used is returned under "ds_config" (and in
    "settings"). ``gpu_optimizer_fraction``: see :func:`zero3_ds_config`; the share DeepSpeed really
    placed on the GPU is recorded as settings["gpu_optimizer_share"]. ``lora`` R > 0: see
    :func:`_build_zero3`; FLOPs by the LoRA formula. ``init`` is not used: the model is always
    initialized by transformers under zero.Init (recorded as settings["init"]; the run's build time
    is settings["build_s"]).
    """
    micro_batch = micro_batch_for(tokens_per_step, seq)
    layers = config.num_hidden_layers
    run = Run("zero3", config, layers, micro_batch, seq, device)  # each result names it
    ds_config = zero3_ds_config(config, micro_batch, device, gpu_optimizer_fraction)
    _merge(ds_config, json.loads(os.environ.get("ZERO3_DS_CONFIG", "{}")))  # h2h --zero3-ds-config
    settings = zero3_settings(ds_config, seq, steps, warmup, liger, lora, config)
    settings["init"] = ZERO3_INIT
    set_single_process_env()
    reset_memory_stats(device)
    n_params, counts = 0, {}
    try:
        engine, holder, counts, timings = _build_zero3(
            config, ds_config, seed, liger, lora, lora_targets
        )
        settings.update(timings)
        if lora:
            settings["lora"] = build.lora_settings(lora, lora_targets, engine.module)
        n_params = count_params(engine.module)
        settings["gpu_optimizer_share"] = (
            _gpu_optimizer_share(engine) if gpu_optimizer_fraction > 0 else 0.0
        )
        # ranks DeepSpeed partitions over
        settings["dp_world_size"] = int(getattr(engine, "dp_world_size", 1))
        partition_bytes = _partition_bytes(engine.module)
        run_device = str(engine.device) if device.startswith("cuda") else "cpu"

        def step(input_ids: torch.Tensor) -> torch.Tensor:
            loss = engine(input_ids=input_ids, labels=input_ids).loss
            engine.backward(loss)
            engine.step()
            return loss

        batches = make_batches(
            config.vocab_size, micro_batch, seq, warmup + steps, seed, rank=data_rank()
        )
        warm, times, losses = measure(step, batches, warmup, run_device)
        report_phase("steps done")
        # ZeRO-3's teardown (191 GB of host at 7B: 8-19 s) after the result is written
        after_result([engine, holder].clear)
    except Exception as exc:  # noqa: BLE001 - only OOM is swallowed, everything else re-raised
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
    res = result_dict(
        run,
        n_params,
        warm,
        times,
        losses,
        ds_config=ds_config,
        precision=settings["precision"],
        settings=settings,
        zero3_param_partition_bytes=partition_bytes,
        lora_params=counts["adapter_params"] if lora else None,
        **counts,
    )
    base = res.get("base_params") or 0
    if base:
        res["host_bytes_per_base_param"] = res["peak_host_rss_bytes"] / base
    return res
