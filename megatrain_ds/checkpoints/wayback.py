"""The way back to DeepSpeed: what real DeepSpeed ZeRO-3 reads when its ``engine.load_checkpoint``
resumes a megatrain_ds checkpoint (checkpoint.py writes it; docs/wayback.md says how to use it).

DeepSpeed's ZeRO-3 (``runtime/zero/stage3.py``) restores rank r's state from rank r's optimizer file
only, and copies it without any name: ``fp32_flat_groups[k]`` into its k-th fp32 partition, the
torch optimizer state by position. So the files must hold its layout exactly, which this module
computes from the engine:

- its sub-groups (``sub_groups``): per optimizer param group, the trained parameters in the group's
  order (``_get_trainable_parameter_groups``), cut where the running sum of their partition sizes
  reaches ``zero_optimization.sub_group_size`` (``_create_fp16_sub_groups``); each parameter
  contributes its ZeRO-3 partition of ``ceil(numel / N)`` elements for N ranks, zero-padded past its
  end (``ds_tensor``);
- its optimizer state (``optimizer_state``): the torch ``state_dict`` of its CPU Adam over one flat
  fp32 tensor per sub-group, numbered sub-group by sub-group (``_set_fp32_optimizer_param_groups``),
  with the step count and every hyperparameter its Adam reads (``bias_correction`` and ``amsgrad``
  included);
- its loss scaler (``loss_scaler``): the object it keeps (``CreateLossScaler``), not a description
  of it.

megatrain_ds reads that same layout back (checkpoint_files.py reads real DeepSpeed's files): one set
of files serves both. What DeepSpeed cannot resume whatever the files hold is listed by
``resume_problems``.
"""

from __future__ import annotations

import torch

from .checkpoint_files import partition_of

# DeepSpeed's default sub_group_size (0.19.8: zero/config.py), for a config its model refuses
_SUB_GROUP_SIZE = 1_000_000_000


def zero_config(config: dict):
    """DeepSpeed's own reading of ``zero_optimization`` (its defaults, its coercions); None when it
    refuses the block (the caller falls back to DeepSpeed's defaults)."""
    try:
        from deepspeed.runtime.zero.config import get_zero_config

        return get_zero_config(dict(config or {}))
    # a block DeepSpeed refuses: megatrain_ds's own checks named it already
    except Exception:  # noqa: BLE001
        return None


def sub_group_size(zero) -> int:
    """``zero_optimization.sub_group_size`` of a ``zero_config`` (None: DeepSpeed's default)."""
    return int(zero.sub_group_size) if zero is not None else _SUB_GROUP_SIZE


def sub_groups(param_groups: list[list], numel, world: int, size: int) -> list[tuple[int, list]]:
    """DeepSpeed ZeRO-3's sub-groups of ``param_groups`` (lists of trained parameters, in each
    optimizer group's order) for ``world`` ranks: ``[(param group index, parameters)]`` in its
    order. ``numel(p)``: p's elements.

    A group whose partitions sum to at most ``size`` is one sub-group; a larger one is cut after
    each parameter that brings the running sum to ``size`` or more (the last one closes the last
    sub-group). DeepSpeed leaves zero-element parameters out of its groups
    (``is_optimized_parameter``): they never move a cut here, and sit in the sub-group of the
    parameter before them (0 elements: the flat partitions are DeepSpeed's)."""
    out = []
    for g, params in enumerate(param_groups):
        sized = [p for p in params if numel(p) > 0]
        if not sized:
            if params:  # only zero-element parameters (DeepSpeed would have no sub-group for them)
                out.append((g, list(params)))
            continue
        parts = {id(p): partition_of(numel(p), world) for p in sized}
        if size is None or size >= sum(parts.values()):
            out.append((g, list(params)))
            continue
        current, running = [], 0
        for p in params:
            current.append(p)
            if numel(p) == 0:  # moves no cut
                continue
            running += parts[id(p)]
            if running >= size or p is sized[-1]:
                out.append((g, current))
                current, running = [], 0
        if current:  # zero-element parameters after the last cut
            out[-1][1].extend(current)
    return out


def optimizer_state(
    param_groups: list[dict],
    group_of: list[int],
    step: int,
    exp_avg: list[torch.Tensor],
    exp_avg_sq: list[torch.Tensor],
) -> dict:
    """The torch ``state_dict`` DeepSpeed's ZeRO-3 saves of its CPU Adam: sub-group k is parameter
    index k (its groups are filled sub-group by sub-group, so group g lists the indices of its
    sub-groups), its state the step count and the moments (this rank's partitions, flat).
    ``group_of[k]``: sub-group k's param group.

    Every sub-group gets a state, also before the first step (zero moments, step 0): DeepSpeed's
    Adam then counts on from 0, as from an empty state. Hyperparameters are the engine's groups'
    (``lr`` as the schedule set it); DeepSpeed's Adam also reads ``bias_correction`` and ``amsgrad``
    (megatrain_ds supports only True and False), which megatrain_ds's groups do not hold."""
    groups = []
    for g, group in enumerate(param_groups):
        saved = {k: v for k, v in group.items() if k != "params"}
        saved.setdefault("bias_correction", True)
        saved.setdefault("amsgrad", False)
        saved["params"] = [k for k, owner in enumerate(group_of) if owner == g]
        groups.append(saved)
    state = {
        k: {"step": int(step), "exp_avg": m, "exp_avg_sq": v}
        for k, (m, v) in enumerate(zip(exp_avg, exp_avg_sq))
    }
    return {"state": state, "param_groups": groups}


def loss_scaler(scaler, compute_dtype: torch.dtype):
    """DeepSpeed's loss scaler object for the engine's (``loss_scale.LossScaler`` or None), as its
    ``CreateLossScaler`` builds it: a static ``LossScaler`` (scale 1 outside fp16), or fp16's
    ``DynamicLossScaler`` carrying on from ours (scale, iteration, last overflow, hysteresis left).
    ZeRO-3 takes the object itself from the checkpoint (``_rigid_load_state_dict``), so a
    description would not do."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    if scaler is None or not scaler.dynamic:
        fp16 = compute_dtype == torch.float16 and scaler is not None
        return LossScaler(scale=float(scaler.scale) if fp16 else 1.0)
    out = DynamicLossScaler(
        init_scale=float(scaler.scale),
        scale_window=scaler.window,
        min_scale=scaler.min_scale,
        delayed_shift=scaler.hysteresis,
        consecutive_hysteresis=scaler.consecutive_hysteresis,
        raise_error_at_min_scale=scaler.raise_error_at_min_scale,
        dtype=torch.half,
    )
    out.cur_iter, out.last_overflow_iter, out.cur_hysteresis = scaler.progress()
    return out


def resume_problems(config: dict, untrained: list[str], zero=None) -> list[str]:
    """Why real DeepSpeed ZeRO-3 could not resume this engine's checkpoint with the same config
    (empty: it can). ``untrained``: parameters that require grad but are in no optimizer group;
    ``zero``: ``zero_config(config)`` when the caller has it."""
    problems = []
    zero = zero if zero is not None else zero_config(config)
    stage = (
        int(zero.stage)
        if zero is not None
        else int(((config or {}).get("zero_optimization") or {}).get("stage", 0) or 0)
    )
    if stage != 3:
        problems.append(
            f"zero_optimization.stage is {stage}: DeepSpeed would build a ZeRO-{stage} engine, "
            "which "
            "reads another layout (these files are ZeRO-3's)"
        )
    offload = getattr(getattr(zero, "offload_optimizer", None), "device", None)
    if str(getattr(offload, "value", offload)) == "nvme":
        problems.append(
            "zero_optimization.offload_optimizer.device is nvme: DeepSpeed then restores its "
            "optimizer "
            "state from <tag>/offloaded_tensors/, which megatrain_ds does not write (use device "
            "cpu to "
            "go back)"
        )
    if untrained:
        problems.append(
            f"{len(untrained)} parameter(s) require grad but are in no optimizer group "
            f"({untrained[:8]}): "
            "DeepSpeed ZeRO-3 restores only frozen (requires_grad False) parameters from "
            "frozen_param_fragments, so it would keep its own initial values for them"
        )
    return problems
