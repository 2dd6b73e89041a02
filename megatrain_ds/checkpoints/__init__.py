"""Checkpoints in DeepSpeed's ZeRO-3 layout: writing (``checkpoint``, ``checkpoint_partition``,
``checkpoint_stream``), reading (``checkpoint_files``), the folder's life across ranks
(``checkpoint_folder``), checksums, PEFT adapters, 16-bit export, the way back to real DeepSpeed
(``wayback``), and the step counters a checkpoint saves (``step_counters``). Self-contained: they
see the engine's state only through what the engine hands them.
"""

from .adapters import save_adapter
from .checkpoint import load_checkpoint, save_checkpoint
from .checkpoint_files import MODEL_FILE, fp32_state_dict
from .export import consolidated_state_dict, save_16bit_model
from .parts import CheckpointParts
from .step_counters import StepCounters, counter_view

# the names the other packages (and the top-level modules) use: test_structure.py's face rule
__all__ = [
    "save_adapter",
    "load_checkpoint",
    "save_checkpoint",
    "MODEL_FILE",
    "fp32_state_dict",
    "consolidated_state_dict",
    "save_16bit_model",
    "StepCounters",
    "counter_view",
    "CheckpointParts",
]
