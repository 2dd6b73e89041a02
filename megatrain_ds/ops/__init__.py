"""``deepspeed.ops`` as scripts reach it through ``import megatrain_ds as deepspeed``."""
from . import adam

__all__ = ["adam"]
