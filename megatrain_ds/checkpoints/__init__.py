"""Checkpoints in DeepSpeed's ZeRO-3 layout: writing (``checkpoint``, ``checkpoint_partition``,
``checkpoint_stream``), reading (``checkpoint_files``), the folder's life across ranks (``checkpoint_folder``),
checksums, PEFT adapters, 16-bit export, the way back to real DeepSpeed (``wayback``), and the step counters a
checkpoint saves (``step_counters``). Self-contained: they
see the engine's state only through what the engine hands them.
"""
