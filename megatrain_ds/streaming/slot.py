"""A device buffer that holds one layer's weights while it computes: the streaming slots, the kept
layers' own buffers, the inference cache's (executor.py, inference.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, eq=False)  # identity, not tensor comparison
class Slot:
    """A device buffer holding one layer's wire weights, with the events that guard it."""

    buf: torch.Tensor  # compute dtype; the templates' parameters are views of it
    # wire dtype, when it differs (fp32 master streamed, cast on GPU)
    stage: torch.Tensor | None = None
    layer: int = -1
    version: int = -1
    ready: object = None  # recorded on h2d after the copy into buf
    free: object = None  # recorded on compute after the last kernel reading buf
    last_use: int = 0
    # (layer, {name: view of buf}): _bind's views, built once per layer held
    views: tuple | None = None
