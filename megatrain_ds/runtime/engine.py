"""``deepspeed.runtime.engine.DeepSpeedEngine``: scripts check ``isinstance(model,
DeepSpeedEngine)`` (OpenRLHF's checkpoint calls, trl's type hints); with megatrain_ds the engine
class is ``MegaTrainEngine``."""

from ..engine import MegaTrainEngine

DeepSpeedEngine = MegaTrainEngine

__all__ = ["DeepSpeedEngine"]
