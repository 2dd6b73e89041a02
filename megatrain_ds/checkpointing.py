"""``deepspeed.checkpointing``: activation checkpointing. The engine already recomputes every streamed
layer from its saved input, so ``configure`` only records the request and ``checkpoint`` is torch's."""
from __future__ import annotations

import torch.utils.checkpoint

_configured = False


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    global _configured
    _configured = True


def is_configured() -> bool:
    return _configured


def checkpoint(function, *args):
    """Recompute ``function(*args)`` in backward (non-reentrant torch checkpoint)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
