"""ColossalAI Gemini as a peer of the benchmark harness (``run_system --system gemini``), the
paper's other peer.

    python -m benchmarks.run_system --system gemini --model qwen2.5-1.5b --layers 56 \
        --tokens-per-step 16384 --steps 3 --warmup 2 --json gemini.json

What it runs when ColossalAI imports (recorded under "settings"):

- ``GeminiPlugin(placement_policy="static", shard_param_frac=1.0, offload_optim_frac=1.0,
  offload_param_frac=1.0, pin_memory=True, precision="bf16", max_norm=H2H_CLIP)``: the plugin
  docstring's "old cpu placement", every parameter shard and all optimizer state in (pinned) host
  memory, the placement its docs give for the largest model a GPU can train;
  ``GEMINI_PLACEMENT=auto`` runs ``placement_policy="auto"`` (Gemini's runtime memory tracer moves
  chunks between the GPU and the host) instead; ``GEMINI_OFFLOAD_PARAM=0`` keeps the static
  placement's bf16 parameters on the GPU (optimizer state still on the host);
  ``GEMINI_MAX_PREFETCH=N`` fetches N chunks ahead (the plugin's default: 0);
  ``GEMINI_PRECISION=fp16`` runs the plugin (and builds the model) in fp16 with its dynamic loss
  scale instead of bf16: HybridAdam's compiled host kernel takes fp16 gradients but not bf16 ones
  (``PRECISIONS``), so it is Gemini's fastest host update, in another dtype than the other
  systems'; ``optimizer_steps_taken`` records whether the loss scale skipped a step. Clipping is
  the plugin's ``max_norm``. ``python -m benchmarks.gemini_system --adam-probe [N]`` times
  HybridAdam's host step for fp32, fp16 and bf16 gradients beside torch's fused AdamW.
- ``HybridAdam`` (AdamW mode, benchmarks.common.OPTIMIZER) through ``Booster(plugin=...)``; HF
  activation checkpointing; liger-kernel as HF Trainer applies it (``liger=True``), before
  boosting; ``GEMINI_LIGER=0`` leaves liger off and records why (``LIGER_OFF_WHY``);
  ``GEMINI_LIGER=activations`` applies the liger kernels that touch only activations: SwiGLU,
  RoPE and liger's cross-entropy on the logits, recorded under ``kernels``, ``loss_kernel`` and
  ``liger_off``. The two left out each use a parameter Gemini manages outside its module's forward:
  RMSNorm's backward reads the norm weight after Gemini has moved it back to the host
  (``LIGER_OFF_WHY``), and the fused linear cross-entropy multiplies by ``lm_head.weight`` without
  calling ``lm_head`` (``FUSED_LOSS_OFF_WHY``).

Gemini has no step breakdown of its own: its warm-up steps run forward, backward and the optimizer
step as separately synchronised calls (``phase_timed``), recorded under ``warmup_phases_s`` and
printed by h2h; the measured steps are not interrupted. ``torch_threads`` records the OpenMP team
HybridAdam's CPU kernel gets.

ColossalAI's newest release (0.5.0) pins ``torch>=2.2.0,<=2.5.1`` and ``transformers==4.51.3``;
the lent GPU box has torch 2.11 and transformers 5.x, and it is installed there without its pins.
Under ``--gpu-memory-limit`` (``common.GPU_LIMIT_BYTES``) Gemini is told the limit the way its own
examples cap a GPU, ``colo_set_process_memory_fraction(limit / total)`` (``cap_gemini_capacity``,
recorded as ``gemini_capacity``): its ``auto`` placement plans from ``colo_device_memory_capacity``,
the device's *total* memory times that fraction, not from what is free, so without it the placement
planned for the whole H200 while another process held all but 24 GiB (2026-11-30: out of memory on
the first step, both allocator settings).

When the import (or the plugin's setup) fails, the run is not attempted: the result has status
"did not run" with the exact error and the installed release's pins (``requirements``), so the
depth figure and the tables show why the peer is missing rather than leaving it out.
"""

from __future__ import annotations

import os
import time
import traceback

import torch

from benchmarks import build, common
from benchmarks.common import (
    HF_CHECKPOINTING,
    LIGER_KERNELS,
    OPTIMIZER,
    Run,
    after_result,
    apply_hf_liger,
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
    sync,
)

DID_NOT_RUN = "did not run"
HF_LOSS = "HF ForCausalLMLoss (full logits, torch cross-entropy)"
# GEMINI_LIGER=0 runs Gemini without liger, and the result says why (liger_off)
LIGER_OFF_WHY = (
    "liger's RMSNorm backward launches its Triton kernel on the norm's weight, which Gemini "
    "(offload_param_frac=1.0) has already moved back to host memory: ValueError: Pointer argument "
    "(at 7) cannot be accessed from Triton (cpu tensor?)"
)
LIGER_LOSS = "liger fused linear cross-entropy (no logits)"
LIGER_CE_LOSS = "liger cross-entropy (full logits through HF's lm_head)"
# GEMINI_LIGER=activations leaves the fused loss off too: seen on an H200, Qwen2.5-7B, 2026-11-29
FUSED_LOSS_OFF_WHY = (
    "liger's fused linear cross-entropy reads lm_head.weight without calling lm_head, so Gemini "
    "never gathers its gradient: RuntimeError: Parameter `lm_head.weight` failed at the gradient "
    "reduction. Some unsupported torch function is operated upon this parameter."
)
# GEMINI_LIGER=activations: what the Trainer's liger_kernel_config gets
ACTIVATION_KERNELS = {"rms_norm": False, "fused_linear_cross_entropy": False, "cross_entropy": True}


# GEMINI_PRECISION: the plugin's precision, the model's dtype, and what the settings say of it.
# HybridAdam's CPU kernel takes fp32 and fp16 gradients only: with bf16 ones (Gemini's bf16) it runs
# ``CPUAdam.torch_adam_update``, unfused torch ops ("cpu adam kernel does not support bf16 now",
# colossalai/nn/optimizer/hybrid_adam.py, 0.5.0); fp16 (with the plugin's dynamic loss scale) is
# how a Gemini user gets that kernel on the host.
PRECISIONS = {
    "bf16": (torch.bfloat16, "bf16 params and compute, fp32 master (Gemini bf16)"),
    "fp16": (
        torch.float16,
        "fp16 params and compute, fp32 master, dynamic loss scale (Gemini fp16)",
    ),
}


def colossalai_pins() -> dict:
    """The installed ColossalAI's version and its declared torch/transformers requirements ({} if
    not installed)."""
    from importlib import metadata

    try:
        version = metadata.version("colossalai")
    except metadata.PackageNotFoundError:
        return {}
    reqs = [
        r
        for r in (metadata.requires("colossalai") or [])
        if r.split("[")[0].split(";")[0].strip().lower().startswith(("torch", "transformers"))
    ]
    return {"colossalai": version, "requires": reqs, "torch_here": torch.__version__}


def import_gemini():
    """(Booster, GeminiPlugin, HybridAdam, None) or (None, None, None, the import's traceback)."""
    try:
        from colossalai.booster import Booster
        from colossalai.booster.plugin import GeminiPlugin
        from colossalai.nn.optimizer import HybridAdam
    except Exception:  # noqa: BLE001 - any import failure is the finding recorded
        return None, None, None, traceback.format_exc()
    return Booster, GeminiPlugin, HybridAdam, None


def cap_gemini_capacity(limit_bytes: int | None, total_bytes: int, set_fraction) -> str | None:
    """Tell Gemini a ``limit_bytes`` GPU of ``total_bytes`` (module docstring): ``set_fraction`` is
    ColossalAI's ``colo_set_process_memory_fraction``, called with ``limit / total`` (at most 1). It
    sets the capacity Gemini's ``auto`` placement plans from, and torch's per-process fraction to
    the same bytes. Returns what the settings record, or None (no limit: nothing is called)."""
    if limit_bytes is None:
        return None
    if total_bytes <= 0:
        raise ValueError(f"the device's total memory must be positive, got {total_bytes}")
    fraction = min(1.0, limit_bytes / total_bytes)
    set_fraction(fraction)
    return (
        f"colo_set_process_memory_fraction({fraction:.4f}): {limit_bytes / 2**30:.1f} GiB of "
        f"{total_bytes / 2**30:.1f}"
    )


def plugin_kwargs(placement: str | None = None) -> dict:
    """GeminiPlugin's arguments (module docstring); ``placement`` (default GEMINI_PLACEMENT, else
    "static")."""
    placement = placement or os.environ.get("GEMINI_PLACEMENT", "static")
    if placement not in ("static", "auto"):
        raise ValueError(f"GEMINI_PLACEMENT must be static or auto, got {placement!r}")
    precision = os.environ.get("GEMINI_PRECISION", "bf16")
    if precision not in PRECISIONS:
        raise ValueError(f"GEMINI_PRECISION must be bf16 or fp16, got {precision!r}")
    kwargs = {
        "placement_policy": placement,
        "precision": precision,
        # GEMINI_PIN=0: pageable host chunks (the plugin's own default), recorded in the settings
        "pin_memory": os.environ.get("GEMINI_PIN", "1") != "0",
        "max_norm": h2h_clip(),
        # GEMINI_MAX_PREFETCH: chunks fetched ahead of their use (the plugin's default, 0: none)
        "max_prefetch": int(os.environ.get("GEMINI_MAX_PREFETCH", "0")),
    }
    if placement == "static":
        # GEMINI_OFFLOAD_PARAM: the share of the bf16 parameters kept on the host (default 1.0; 0.0:
        # all on the GPU, the optimizer state still offloaded: the plugin docstring's advice is to
        # tune shard_param_frac, then offload_optim_frac, and offload parameters only past both)
        offload_param = float(os.environ.get("GEMINI_OFFLOAD_PARAM", "1.0"))
        if not 0.0 <= offload_param <= 1.0:
            raise ValueError(f"GEMINI_OFFLOAD_PARAM must be in [0, 1], got {offload_param}")
        kwargs.update(
            shard_param_frac=1.0, offload_optim_frac=1.0, offload_param_frac=offload_param
        )
    return kwargs


def gemini_settings(
    micro_batch: int,
    seq: int,
    steps: int,
    warmup: int,
    liger: bool,
    kwargs: dict,
    kernels: tuple = LIGER_KERNELS,
) -> dict:
    return settings_dict(
        precision=PRECISIONS[kwargs["precision"]][1],
        optimizer="colossalai HybridAdam (AdamW mode)",
        opt_params=OPTIMIZER,
        clip=kwargs["max_norm"],
        warmup=warmup,
        steps=steps,
        seq=seq,
        micro_batch=micro_batch,
        kernels=list(kernels) if liger else [],
        loss_kernel=LIGER_LOSS if liger else HF_LOSS,
        gradient_checkpointing=HF_CHECKPOINTING,
        recomputes_every_layer=True,
        offload_optimizer_ratio=kwargs.get("offload_optim_frac")
        if kwargs["placement_policy"] == "static"
        else None,
        gemini_plugin=kwargs,
    )


def profiled_boost(booster, model, optimizer):
    """``booster.boost(model, optimizer)``; with ``GEMINI_PROFILE=N`` set, under cProfile, printing
    the N functions of most cumulative time (where a slow boost spends its time) to stderr, or
    appending them to the file ``GEMINI_PROFILE_OUT`` names (the harness keeps only a run's last
    lines of output)."""
    top = int(os.environ.get("GEMINI_PROFILE") or 0)
    if top <= 0:
        return booster.boost(model, optimizer)
    import cProfile
    import io
    import pstats
    import sys

    profile = cProfile.Profile()
    boosted = profile.runcall(booster.boost, model, optimizer)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(top)
    where = os.environ.get("GEMINI_PROFILE_OUT")
    if where:
        with open(where, "a") as f:
            f.write(text.getvalue())
    else:
        print(text.getvalue(), file=sys.stderr, flush=True)
    return boosted


def phase_timed(phases, warmup: int, device: str, settings: dict):
    """The training step made of ``phases`` (``(name, fn(input_ids, box)), ...``, run in order on
    one dict ``box`` per step; ``box["loss"]`` is the step's loss). Its first ``warmup`` calls time
    each phase between device synchronisations, appended to ``settings["warmup_phases_s"]`` (one
    dict per warm-up step): where Gemini's step goes (it has no breakdown of its own). The measured
    steps run the same phases with no synchronisation between them."""
    calls = [0]
    record = settings.setdefault("warmup_phases_s", [])

    def step(input_ids: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        timed, box, seconds = calls[0] <= warmup, {}, {}
        for name, fn in phases:
            if timed:
                sync(device)
                t0 = time.perf_counter()
            fn(input_ids, box)
            if timed:
                sync(device)
                seconds[name] = round(time.perf_counter() - t0, 4)
        if timed:
            record.append(seconds)
        return box["loss"]

    return step


def run_gemini(
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
    """ColossalAI Gemini (module docstring); status "did not run" with the reason when ColossalAI
    cannot run here."""
    micro_batch = micro_batch_for(tokens_per_step, seq)
    layers = config.num_hidden_layers
    run = Run("gemini", config, layers, micro_batch, seq, device)  # each result names it
    kwargs = plugin_kwargs()
    mode = os.environ.get("GEMINI_LIGER", "1")
    if mode not in ("0", "1", "activations"):
        raise ValueError(f"GEMINI_LIGER must be 0, 1 or activations, got {mode!r}")
    liger_off = liger and mode != "1"
    liger = liger and mode != "0"
    liger_config = ACTIVATION_KERNELS if mode == "activations" else None
    kernels = LIGER_KERNELS
    if liger_config is not None:
        kernels = ("swiglu", "rope", "cross_entropy")
    settings = gemini_settings(micro_batch, seq, steps, warmup, liger, kwargs, kernels)
    if liger_config is not None:
        settings["loss_kernel"] = LIGER_CE_LOSS
    if liger_off:
        why = LIGER_OFF_WHY
        if liger:
            why = f"RMSNorm: {LIGER_OFF_WHY}; fused linear cross-entropy: {FUSED_LOSS_OFF_WHY}"
        settings["liger_off"] = why
    settings["colossalai"] = colossalai_pins()
    Booster, GeminiPlugin, HybridAdam, error = import_gemini()
    if error is None and not device.startswith("cuda"):
        error = "Gemini needs CUDA (its chunks and HybridAdam's GPU path); this run's device is cpu"
    if error is not None:
        return result_dict(run, status=DID_NOT_RUN, error=error, settings=settings)
    set_single_process_env()
    reset_memory_stats(device)
    n_params = 0
    try:
        import colossalai

        if not torch.distributed.is_initialized():
            colossalai.launch_from_torch(seed=seed, verbose=False)
        if common.GPU_LIMIT_BYTES is not None:
            from colossalai.legacy.utils.memory import colo_set_process_memory_fraction

            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            settings["gemini_capacity"] = cap_gemini_capacity(
                common.GPU_LIMIT_BYTES, total, colo_set_process_memory_fraction
            )
        build_start = time.perf_counter()
        # drawn on the GPU when it fits (as FSDP2's), then handed to the plugin from host memory
        init_device = build.draw_device(config, device, init)
        settings.update(init=build.init_description(build.resolve_init(init, config)))
        settings["init_device"] = init_device
        dtype = PRECISIONS[kwargs["precision"]][0]
        model = build.build_model(config, dtype, init, seed, device=init_device)
        if init_device != "cpu":
            model.to("cpu")
            torch.cuda.empty_cache()
        report_phase("model built on the host")
        if liger:
            apply_hf_liger(model, liger_config)
        enable_hf_checkpointing(model)
        n_params = sum(p.numel() for p in model.parameters())
        optimizer = HybridAdam(
            model.parameters(),
            lr=OPTIMIZER["lr"],
            weight_decay=OPTIMIZER["weight_decay"],
            betas=OPTIMIZER["betas"],
            eps=OPTIMIZER["eps"],
            adamw_mode=True,
        )
        report_phase("HybridAdam made")
        booster = Booster(plugin=GeminiPlugin(**kwargs))
        model, optimizer, *_ = profiled_boost(booster, model, optimizer)
        settings["boost_s"] = report_phase("model built and boosted")["phase_s"]
        # the model's build, the optimizer and the boost
        settings["build_s"] = round(time.perf_counter() - build_start, 3)
        reset_memory_stats(device)

        def forward(input_ids, box):
            box["loss"] = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss

        def optimize(_, box):
            optimizer.step()  # the plugin clips to max_norm first
            optimizer.zero_grad()

        phases = (
            ("forward", forward),
            ("backward", lambda _, box: booster.backward(box["loss"], optimizer)),
            ("optimizer", optimize),
        )
        step = phase_timed(phases, warmup, device, settings)
        settings["torch_threads"] = torch.get_num_threads()  # HybridAdam's CPU kernel's OpenMP team

        batches = make_batches(
            config.vocab_size, micro_batch, seq, warmup + steps, seed, rank=data_rank()
        )
        warm, times, losses = measure(step, batches, warmup, device)
        report_phase("steps done")
        # HybridAdam counts the steps it took: fewer than were run means the loss scale skipped
        # some (fp16), and a skipped step is a faster one
        settings["optimizer_steps_taken"] = optimizer_steps_taken(optimizer)
        settings["steps_run"] = warmup + steps
        after_result([model, optimizer, booster].clear)  # Gemini's chunks freed after the result
    # an OOM is a result; a setup failure is the finding recorded
    except Exception as exc:  # noqa: BLE001
        if is_oom(exc):
            return oom_result(run, n_params, exc, settings=settings)
        return result_dict(
            run,
            n_params,
            status=DID_NOT_RUN,
            error=traceback.format_exc()[-4000:],
            settings=settings,
        )
    return result_dict(
        run, n_params, warm, times, losses, precision=settings["precision"], settings=settings
    )


def optimizer_steps_taken(optimizer) -> int | None:
    """The largest per-parameter step count in the (boosted) optimizer's state, None if it keeps
    none: a skipped step (fp16 overflow) does not count."""
    inner = getattr(optimizer, "optim", optimizer)
    inner = getattr(inner, "optim", inner)
    steps = [int(st["step"]) for st in inner.state.values() if "step" in st]
    return max(steps) if steps else None


def adam_probe(n: int, grad_dtypes=("fp32", "fp16", "bf16"), repeats: int = 3, make=None) -> dict:
    """HybridAdam's host step, Gparam/s, for fp32 parameters with gradients of each dtype: the
    mechanism behind Gemini's host update (``PRECISIONS``). ``make(params)`` builds the optimizer
    (default: ColossalAI's HybridAdam in AdamW mode with the harness's settings); torch's fused
    AdamW on fp32 gradients is timed beside it as the yardstick (what megatrain_ds runs)."""
    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if make is None:
        from colossalai.nn.optimizer import HybridAdam

        def make(params):
            return HybridAdam(params, adamw_mode=True, **OPTIMIZER)

    def rate(opt, params) -> float:
        opt.step()  # state allocated, kernels loaded
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            opt.step()
            best = min(best, time.perf_counter() - start)
        return n / best / 1e9

    out = {"params": n, "threads": torch.get_num_threads()}
    for name in grad_dtypes:
        p = torch.nn.Parameter(torch.randn(n) * 0.02)
        if hasattr(p, "grad_dtype"):  # newer torch refuses a gradient of another dtype unless told
            p.grad_dtype = None
        p.grad = (torch.randn(n) * 1e-3).to(dtypes[name])  # as Gemini hands its chunks' gradients
        out[f"grad {name}"] = round(rate(make([p]), p), 3)
    p = torch.nn.Parameter(torch.randn(n) * 0.02)
    p.grad = torch.randn(n) * 1e-3
    fused = torch.optim.AdamW([p], fused=True, **OPTIMIZER)
    out["torch fused AdamW, grad fp32"] = round(rate(fused, p), 3)
    return out


def prebuild_kernels() -> int:
    """Compile ColossalAI's JIT kernels that ``HybridAdam`` loads (its CPU Adam and its fused CUDA
    optimizers) into ColossalAI's cache, so a timed run does not build them inside its window: on a
    fresh box the fused CUDA build alone outlasted a 370 s run cap at 7B. Exit status 0 when both
    load."""
    from colossalai.kernel.kernel_loader import CPUAdamLoader, FusedOptimizerLoader

    for loader in (CPUAdamLoader, FusedOptimizerLoader):
        start = time.perf_counter()
        loader().load()
        print(
            f"[gemini] {loader.__name__}: loaded in {time.perf_counter() - start:.1f} s", flush=True
        )
    return 0


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    if args == ["--prebuild"]:
        sys.exit(prebuild_kernels())
    if len(args) in (1, 2) and args[0] == "--adam-probe":
        probe = adam_probe(int(float(args[1])) if len(args) == 2 else 100_000_000)
        print(
            "[gemini] HybridAdam host step, Gparam/s: "
            + ", ".join(f"{k} {v}" for k, v in probe.items()),
            flush=True,
        )
        sys.exit(0)
    sys.exit("usage: python -m benchmarks.gemini_system --prebuild | --adam-probe [N]")
