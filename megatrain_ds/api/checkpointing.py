"""``deepspeed.checkpointing``: activation checkpointing. The engine already recomputes every
streamed layer from its saved input, so ``configure`` only records the request (and names, in one
warning, the options it cannot honour) and ``checkpoint`` is torch's."""

from __future__ import annotations

import warnings

import torch.utils.checkpoint

_configured = False

# DeepSpeed's activation-checkpointing options, each with what megatrain_ds does instead
_NOT_ACTED_ON = {
    "partition_activations": "one process: the saved layer inputs are not partitioned",
    "contiguous_checkpointing": "no contiguous checkpoint buffers are kept",
    "num_checkpoints": "the streamed layers are recomputed one by one",
    "checkpoint_in_cpu": "saved layer inputs stay on the GPU unless megatrain.offload_activations "
    "is set",
    "synchronize": "no extra device synchronizations are inserted",
    "profile": "no checkpointing profile is printed",
    "deepspeed_config": "its activation_checkpointing block is not read",
}


def configure(
    mpu_=None,
    deepspeed_config=None,
    partition_activations=None,
    contiguous_checkpointing=None,
    num_checkpoints=None,
    checkpoint_in_cpu=None,
    synchronize=None,
    profile=None,
) -> None:
    """Record that checkpointing was configured. Options given (not None / False) are named in a
    warning: every streamed layer is recomputed in its backward already, so none of them changes
    anything here."""
    global _configured
    _configured = True
    given = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
        "deepspeed_config": deepspeed_config,
    }
    ignored = [k for k, v in given.items() if v is not None and v is not False]
    if mpu_ is not None:
        ignored.append("mpu_")
    if ignored:
        warnings.warn(
            "deepspeed.checkpointing.configure: every streamed layer is recomputed in its backward "
            "already; ignored: "
            + "; ".join(
                f"{k} ({_NOT_ACTED_ON.get(k, 'one process: no model-parallel groups')})"
                for k in ignored
            ),
            stacklevel=2,
        )


def is_configured() -> bool:
    return _configured


def checkpoint(function, *args):
    """Recompute ``function(*args)`` in backward (non-reentrant torch checkpoint)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
