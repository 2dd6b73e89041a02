"""``deepspeed.ops.adam.DeepSpeedCPUAdam`` / ``FusedAdam`` as seen through ``import megatrain_ds as
deepspeed``.

Scripts build one and pass it to ``initialize(optimizer=...)``; megatrain_ds runs every update
itself (fused AdamW over the host fp32 masters), so these hold only the hyperparameters and param
groups the engine maps (``megatrain_ds.optimizer_from_client``). No op is compiled. Real DeepSpeed
instances are mapped the same way.
"""

from __future__ import annotations

import torch


class _AdamDescription(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        amsgrad=False,
        adam_w_mode=True,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            amsgrad=amsgrad,
        )
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode

    def step(self, closure=None):
        raise RuntimeError(
            f"{type(self).__name__} from megatrain_ds describes the optimizer for "
            "initialize(optimizer=...); the engine runs the updates (call engine.step())"
        )


class DeepSpeedCPUAdam(_AdamDescription):
    def __init__(
        self,
        model_params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        amsgrad=False,
        adamw_mode=True,
        fp32_optimizer_states=True,
    ) -> None:
        super().__init__(
            model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode
        )


class FusedAdam(_AdamDescription):
    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        set_grad_none=True,
    ) -> None:
        super().__init__(
            params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode
        )
