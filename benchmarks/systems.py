"""Baseline training systems measured against megatrain_ds.

Each ``run_<system>(config, tokens_per_step, seq, steps, warmup, device, seed) -> dict`` builds a
random-init model from ``config`` (a transformers.Qwen2Config, see benchmarks.shapes), trains it on
seeded random token ids (labels = input_ids) for ``warmup + steps`` optimizer steps of one micro-batch
each, and returns :func:`benchmarks.common.result_dict` (times in s, memory in bytes). A CUDA
out-of-memory error is caught and reported as status "oom" rather than raised.

- ``resident``: whole model on the device, fp32 params, bf16 autocast, fused torch AdamW, HF checkpointing.
- ``zero3``: DeepSpeed ZeRO-3 with parameter and optimizer offload to pinned CPU memory (the ANCHORS.md config).
"""
from __future__ import annotations

import logging

import os

import torch
from transformers import AutoModelForCausalLM

from benchmarks.common import (cleanup, count_params, enable_hf_checkpointing, is_oom, make_batches,
                               measure, micro_batch_for, reset_memory_stats, result_dict,
                               set_single_process_env)

LR = 1e-5
CLIP = float(os.environ.get("H2H_CLIP", "1.0"))  # h2h --clip; ANCHORS: 1.0


def _build_resident(config, device: str, seed: int):
    """Random-init fp32 model built directly on ``device`` with HF checkpointing, plus its fused AdamW."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    model = model.float().train()
    enable_hf_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    return model, optimizer


def run_resident(config, tokens_per_step: int, seq: int = 1024, steps: int = 8, warmup: int = 2,
                 device: str = "cuda", seed: int = 0) -> dict:
    """Whole model resident on ``device``: fp32 params, bf16 autocast, fused AdamW (lr 1e-5), clip 1.0.

    ``tokens_per_step`` (tokens) is rounded down to a multiple of ``seq`` (tokens per sequence); one
    micro-batch per step. On device "cpu" autocast is off (plain fp32): CPU bf16 autocast is slow and
    is not what the GPU baseline measures; the CPU path exists only as a smoke test.
    """
    micro_batch = micro_batch_for(tokens_per_step, seq)
    layers = config.num_hidden_layers
    use_amp = device.startswith("cuda")
    device_type = "cuda" if use_amp else "cpu"
    reset_memory_stats(device)
    n_params = 0
    try:
        model, optimizer = _build_resident(config, device, seed)
        n_params = count_params(model)
        params = [p for p in model.parameters() if p.requires_grad]

        def step(input_ids: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=use_amp):
                loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        batches = make_batches(config.vocab_size, micro_batch, seq, warmup + steps, seed)
        warm, times, losses = measure(step, batches, warmup, device)
    except Exception as exc:  # noqa: BLE001 - only OOM is swallowed, everything else re-raised
        if not is_oom(exc):
            raise
        cleanup()
        return result_dict("resident", config, layers, micro_batch, seq, device, n_params,
                           status="oom", error=str(exc)[:4000])
    return result_dict("resident", config, layers, micro_batch, seq, device, n_params, warm, times, losses,
                       precision="fp32 params, bf16 autocast" if use_amp else "fp32 (cpu, no autocast)")


def zero3_ds_config(config, micro_batch: int, device: str = "cuda") -> dict:
    """The DeepSpeed config of ANCHORS.md for hidden size h = ``config.hidden_size``.

    Stage 3, param + optimizer offload to pinned CPU memory, AdamW lr 1e-5 (DeepSpeedCPUAdam), bf16,
    clip 1.0, overlap_comm, contiguous_gradients, reduce bucket h^2 elements, prefetch bucket 0.9 h^2
    elements, persistence threshold 10 h elements, max live params 1e9, sub-group 1e9 elements.
    On device "cpu" bf16 is turned off (fp32 training): the smoke test runs DeepSpeed's CPU accelerator
    with gloo, where bf16 mixed precision with DeepSpeedCPUAdam is not a supported combination.
    """
    h = config.hidden_size
    return {
        "train_micro_batch_size_per_gpu": int(micro_batch),
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": device.startswith("cuda")},
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": h * h,
            "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
            "stage3_max_live_parameters": int(1e9),
            "sub_group_size": int(1e9),
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _build_zero3(config, ds_config: dict, seed: int):
    """ZeRO-3 engine around a model constructed under deepspeed.zero.Init (never whole on the GPU).

    HfDeepSpeedConfig makes transformers' from_config build inside zero.Init and run its weight init
    on gathered parameters; the returned holder must stay referenced while the model is built.
    """
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    holder = HfDeepSpeedConfig(ds_config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.train()
    enable_hf_checkpointing(model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    return engine, holder


def run_zero3(config, tokens_per_step: int, seq: int = 1024, steps: int = 8, warmup: int = 2,
              device: str = "cuda", seed: int = 0) -> dict:
    """DeepSpeed ZeRO-3 with CPU offload of params and optimizer, one process, one device.

    ``tokens_per_step`` (tokens) is rounded down to a multiple of ``seq``; one micro-batch per step,
    gradient accumulation 1. The DeepSpeed config used is returned under "ds_config".
    """
    micro_batch = micro_batch_for(tokens_per_step, seq)
    layers = config.num_hidden_layers
    ds_config = zero3_ds_config(config, micro_batch, device)
    set_single_process_env()
    reset_memory_stats(device)
    n_params = 0
    try:
        engine, holder = _build_zero3(config, ds_config, seed)
        n_params = count_params(engine.module)
        run_device = str(engine.device) if device.startswith("cuda") else "cpu"

        def step(input_ids: torch.Tensor) -> torch.Tensor:
            loss = engine(input_ids=input_ids, labels=input_ids).loss
            engine.backward(loss)
            engine.step()
            return loss

        batches = make_batches(config.vocab_size, micro_batch, seq, warmup + steps, seed)
        warm, times, losses = measure(step, batches, warmup, run_device)
        del holder
    except Exception as exc:  # noqa: BLE001 - only OOM is swallowed, everything else re-raised
        if not is_oom(exc):
            raise
        cleanup()
        return result_dict("zero3", config, layers, micro_batch, seq, device, n_params,
                           status="oom", error=str(exc)[:4000], ds_config=ds_config)
    return result_dict("zero3", config, layers, micro_batch, seq, device, n_params, warm, times, losses,
                       ds_config=ds_config,
                       precision="bf16 (DeepSpeed)" if device.startswith("cuda") else "fp32 (cpu)")
