"""What a layer's recompute in the backward replays of its forward (as torch.utils.checkpoint does):
the RNG state (dropout, a MoE router's jitter) and the script's torch.autocast around the forward
(the backward runs on another thread, without it: bf16_master_weight-style scripts wrap their
forward in autocast)."""

from __future__ import annotations

import torch


def autocast_state(device: torch.device) -> tuple | None:
    """The autocast the forward runs under on ``device``'s type: (dtype, cache enabled), or None
    when off."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type), torch.is_autocast_cache_enabled()


def autocast_as(state: tuple | None, device: torch.device) -> torch.autocast:
    """The recompute under the forward's autocast (``autocast_state``), or with autocast off where
    the forward had none, whatever the backward's thread has: as torch.utils.checkpoint replays
    it."""
    if state is None:
        return torch.autocast(device_type=device.type, enabled=False)
    return torch.autocast(device_type=device.type, dtype=state[0], cache_enabled=state[1])


def get_rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


class replay_rng:
    """Context manager: run with the RNG state captured at forward time, then restore the current
    one."""

    def __init__(self, state: tuple | None, device: torch.device) -> None:
        self.state, self.device = state, device

    def __enter__(self):
        if self.state is None:
            return
        self.saved = get_rng_state(self.device)
        torch.set_rng_state(self.state[0])
        if self.state[1] is not None:
            torch.cuda.set_rng_state(self.state[1], self.device)

    def __exit__(self, *exc):
        if self.state is None:
            return
        torch.set_rng_state(self.saved[0])
        if self.saved[1] is not None:
            torch.cuda.set_rng_state(self.saved[1], self.device)
