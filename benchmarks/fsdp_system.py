"""PyTorch FSDP2 with CPU offload as a peer of the benchmark harness (``run_system --system fsdp``).

    python -m benchmarks.run_system --system fsdp --model qwen2.5-1.5b --layers 56 \
        --tokens-per-step 16384 --steps 3 --warmup 2 --json fsdp.json
    torchrun --nproc-per-node 2 -m benchmarks.run_system --system fsdp ...   # N GPUs (h2h --gpus N)

What it runs (the settings recorded under "settings"):

- ``torch.distributed.fsdp.fully_shard`` on every decoder layer, then on the root (embeddings,
  final norm and the LM head, tied or not, in the root's group), over a 1-D device mesh of the
  launcher's WORLD_SIZE ranks.
- ``CPUOffloadPolicy(pin_memory=True)``: the sharded fp32 parameters, their gradients and the
  optimizer state live in pinned host memory; each layer's shard is copied to the GPU for its
  all-gather and the reduced gradient back.
- ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` over fp32 parameters on CUDA (the
  compute copies are bf16, gradients are reduced and kept in fp32). On device "cpu" (the unit
  test) no mixed precision: fp32, as the ``resident`` and ``zero3`` systems train on the CPU.
- Per-layer activation checkpointing: every decoder layer wrapped in ``checkpoint_wrapper``
  (non-reentrant torch.utils.checkpoint) before it is sharded, as torchtitan applies AC before
  FSDP.
- ``torch.optim.AdamW(fused=True)`` with benchmarks.common.OPTIMIZER on the offloaded (CPU) DTensor
  parameters: the fused kernel has a CPU implementation, and FSDP2 runs the optimizer step where
  the shards are.
- Clip H2H_CLIP with ``torch.nn.utils.clip_grad_norm_`` on the DTensor parameters (the global norm
  over ranks).
- liger-kernel as HF Trainer applies it (``liger=True``), before wrapping, like the other systems.

The model is built by benchmarks.build (``init``: ``hf`` on the GPU when its fp32 weights fit
there, else on the CPU; ``fast`` for big shapes), then each layer is moved, sharded and offloaded by
``fully_shard`` one at a time, so the host never holds a second whole copy. GPU peak memory is
counted from after the wrap.
"""

from __future__ import annotations

import torch

from benchmarks import build
from benchmarks.common import (
    LIGER_KERNELS,
    OPTIMIZER,
    Run,
    after_result,
    apply_hf_liger,
    data_rank,
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

FSDP_CHECKPOINTING = (
    "checkpoint_wrapper per decoder layer (non-reentrant torch.utils.checkpoint), before "
    "fully_shard"
)
HF_LOSS = "HF ForCausalLMLoss (full logits, torch cross-entropy)"
LIGER_LOSS = "liger fused linear cross-entropy (no logits)"


def _mesh(device: str):
    """The 1-D mesh of the launcher's ranks (a one-process world without a launcher). CUDA: the
    process group has
    NCCL for the GPU collectives and gloo for the CPU ones (the gradient norm of CPU-offloaded
    shards)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    set_single_process_env()
    cuda = device.startswith("cuda")
    if not dist.is_initialized():
        dist.init_process_group(backend="cuda:nccl,cpu:gloo" if cuda else "gloo")
    return init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))


def build_fsdp(
    config,
    device: str,
    seed: int,
    liger: bool = False,
    init: str = "auto",
    mixed_precision: bool | None = None,
):
    """(model, optimizer, facts): the FSDP2-wrapped model and its AdamW. ``mixed_precision`` None:
    bf16 compute on
    CUDA, none on the CPU. ``facts``: what was built (init, init device, mesh size)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = device.startswith("cuda")
    mixed_precision = cuda if mixed_precision is None else mixed_precision
    mesh = _mesh(device)
    init_device = build.draw_device(config, device, init)
    model = build.build_model(config, torch.float32, init, seed, device=init_device)
    if liger:
        apply_hf_liger(model)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer)
    offload = CPUOffloadPolicy(pin_memory=cuda)
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    for layer in layers:
        fully_shard(layer, mesh=mesh, offload_policy=offload, mp_policy=mp)
    fully_shard(model, mesh=mesh, offload_policy=offload, mp_policy=mp)
    if cuda:  # buffers (rotary inv_freq) are not sharded: they stay where they were built
        for module in model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.device.type != "cuda":
                    module._buffers[name] = buf.to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIMIZER, fused=True)
    facts = {
        "init": build.resolve_init(init, config),
        "init_device": init_device,
        "mesh_size": mesh.size(),
        "mixed_precision": "param bf16, reduce fp32" if mixed_precision else "none (fp32)",
    }
    return model, optimizer, facts


def fsdp_settings(
    micro_batch: int, seq: int, steps: int, warmup: int, device: str, liger: bool = False
) -> dict:
    """The recorded settings of an ``fsdp`` run."""
    cuda = device.startswith("cuda")
    return settings_dict(
        precision="fp32 params (sharded, CPU-offloaded), MixedPrecisionPolicy(param bf16, reduce "
        "fp32)"
        if cuda
        else "fp32 (cpu, no mixed precision)",
        optimizer="torch.optim.AdamW (fused, CPU, on the offloaded DTensor shards)",
        opt_params=OPTIMIZER,
        clip=h2h_clip(),
        warmup=warmup,
        steps=steps,
        seq=seq,
        micro_batch=micro_batch,
        kernels=list(LIGER_KERNELS) if liger else [],
        loss_kernel=LIGER_LOSS if liger else HF_LOSS,
        gradient_checkpointing=FSDP_CHECKPOINTING,
        recomputes_every_layer=True,
        offload_optimizer_ratio=1.0,
        fsdp="FSDP2 fully_shard per decoder layer + root, CPUOffloadPolicy(pin_memory=True), "
        "reshard_after_forward=True",
    )


def run_fsdp(
    config,
    tokens_per_step: int,
    seq: int = 1024,
    steps: int = 8,
    warmup: int = 2,
    device: str = "cuda",
    seed: int = 0,
    liger: bool = False,
    init: str = "auto",
) -> dict:
    """FSDP2 with CPU offload (module docstring), one micro-batch of ``tokens_per_step`` tokens
    (rounded down to a
    multiple of ``seq``) per step and rank. A device or pinned-host OOM is reported as status
    "oom"."""
    micro_batch = micro_batch_for(tokens_per_step, seq)
    layers = config.num_hidden_layers
    run = Run("fsdp", config, layers, micro_batch, seq, device)  # each result names it
    settings = fsdp_settings(micro_batch, seq, steps, warmup, device, liger)
    reset_memory_stats(device)
    n_params = 0
    try:
        model, optimizer, facts = build_fsdp(config, device, seed, liger, init)
        settings.update(facts)
        settings["init"] = build.init_description(facts["init"])
        settings["build_s"] = report_phase("model built and sharded")["phase_s"]
        n_params = sum(p.numel() for p in model.parameters())  # DTensor numel: the global count
        params = [p for p in model.parameters() if p.requires_grad]
        group = optimizer.param_groups[0]
        settings.update(
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            betas=list(group["betas"]),
            eps=group["eps"],
            fused=bool(group.get("fused")),
        )
        clip = settings["clip"]
        reset_memory_stats(device)  # the GPU copy of an hf init is gone: count the training only

        def step(input_ids: torch.Tensor) -> torch.Tensor:
            loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        batches = make_batches(
            config.vocab_size, micro_batch, seq, warmup + steps, seed, rank=data_rank()
        )
        warm, times, losses = measure(step, batches, warmup, device)
        report_phase("steps done")
        after_result([model, optimizer].clear)  # the offloaded state is freed after the result
    except Exception as exc:  # noqa: BLE001 - only OOM is swallowed, everything else re-raised
        if not is_oom(exc):
            raise
        return oom_result(run, n_params, exc, settings=settings)
    return result_dict(
        run, n_params, warm, times, losses, precision=settings["precision"], settings=settings
    )
