"""The megatrain system for the benchmark harness: megatrain_ds driven exactly like a DeepSpeed script.

Same model, data, optimizer hyperparameters and clipping as ``resident`` (AdamW lr 1e-5, weight decay 0.01
like torch's default, clip 1.0, bf16 compute), one micro-batch per step. With ``init_device="cuda"`` the
random init is drawn on the GPU with the same seed as ``resident`` so the two runs start from identical
weights (then the engine moves everything to host memory and frees the GPU copy); peak GPU memory is
measured from after ``initialize``.
"""
from __future__ import annotations

import json
import os
import statistics

import torch
from transformers import AutoModelForCausalLM

import megatrain_ds
from benchmarks.common import (cleanup, count_params, is_oom, make_batches, measure, micro_batch_for,
                               reset_memory_stats, result_dict)

LR = 1e-5
CLIP = float(os.environ.get("H2H_CLIP", "1.0"))  # h2h --clip; ANCHORS: 1.0


def megatrain_ds_config(micro_batch: int, device: str, num_slots: int = 2) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "gradient_clipping": CLIP,
        "bf16": {"enabled": device.startswith("cuda")},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "wall_clock_breakdown": True,
        # extra engine knobs for experiments, e.g. MEGATRAIN_OPTIONS='{"fp32_grad_landing": true}'
        "megatrain": {"num_slots": num_slots, **json.loads(os.environ.get("MEGATRAIN_OPTIONS", "{}"))},
    }


def _median_breakdown(breakdowns: list[dict]) -> dict:
    keys = [k for k in breakdowns[0] if isinstance(breakdowns[0][k], (int, float))]
    return {k: statistics.median(b[k] for b in breakdowns) for k in keys}


def run_megatrain(config, tokens_per_step: int, seq: int = 1024, steps: int = 8, warmup: int = 2,
                  device: str = "cuda", seed: int = 0, init_device: str | None = None) -> dict:
    """Train ``warmup + steps`` steps on megatrain_ds; result dict as the baselines, plus the breakdown."""
    micro_batch = micro_batch_for(tokens_per_step, seq)
    layers = config.num_hidden_layers
    init_device = init_device or device
    n_params = 0
    try:
        torch.manual_seed(seed)
        with torch.device(init_device):
            model = AutoModelForCausalLM.from_config(config)
        model = model.float()
        n_params = count_params(model)
        ds_config = megatrain_ds_config(micro_batch, device)
        engine, _, _, _ = megatrain_ds.initialize(model=model, model_parameters=model.parameters(),
                                                  config=ds_config)
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

        batches = make_batches(config.vocab_size, micro_batch, seq, warmup + steps + 1, seed)
        warm, times, losses = measure(step, batches, warmup, device)
        # measure() times each step; the breakdown of step k is read at the start of step k+1
        breakdown = _median_breakdown(breakdowns[warmup:]) if len(breakdowns) > warmup else {}
        host_state = engine.store.nbytes() + sum(
            t.numel() * t.element_size() for ts in (engine.resident.master, engine.resident.exp_avg,
                                                    engine.resident.exp_avg_sq, engine.resident.grad,
                                                    engine.resident.wire) for t in ts if t is not None)
        engine.destroy()
    except Exception as exc:  # noqa: BLE001 - only OOM is swallowed
        if not is_oom(exc):
            raise
        cleanup()
        return result_dict("megatrain", config, layers, micro_batch, seq, device, n_params,
                           status="oom", error=str(exc)[:4000])
    # the last batch only served to close the last measured step's breakdown
    return result_dict("megatrain", config, layers, micro_batch, seq, device, n_params, warm, times[:-1],
                       losses[:-1], breakdown=breakdown, engine_host_state_bytes=host_state,
                       engine_host_bytes_per_param=host_state / n_params, ds_config=ds_config,
                       precision="fp32 master, bf16 compute" if device.startswith("cuda") else "fp32")
