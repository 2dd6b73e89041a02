"""``deepspeed.ops`` as scripts reach it through ``import megatrain_ds as deepspeed``.

Only ``adam`` is provided: its optimizer classes describe the host AdamW the engine runs.
DeepSpeed's other ops are kernels or optimizers megatrain_ds does not run; asking for one raises
AttributeError naming it.
"""

from . import adam

_UNSUPPORTED = {
    "adagrad": "DeepSpeedCPUAdagrad",
    "lion": "DeepSpeedCPULion / FusedLion",
    "lamb": "FusedLamb",
    "sparse_attention": "sparse attention kernels",
    "transformer": "DeepSpeed's fused transformer kernels",
    "deepspeed4science": "DS4Sci attention kernels",
}


def __getattr__(name: str):
    what = _UNSUPPORTED.get(name, repr(name))
    raise AttributeError(
        f"deepspeed.ops.{name} (megatrain_ds imported as deepspeed): not provided ({what}). "
        "megatrain_ds runs "
        "AdamW/Adam on the host (deepspeed.ops.adam.DeepSpeedCPUAdam / FusedAdam, "
        "torch.optim.AdamW, or an "
        "optimizer block in the config) and the model's own kernels"
    )


__all__ = ["adam"]
