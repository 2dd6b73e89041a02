"""The DeepSpeed surface beyond ``initialize``: ``deepspeed.zero`` (``zero``, ``zero_offload``),
``deepspeed.utils``, ``deepspeed.checkpointing``, the monitors, the throughput timer and the engine attributes
scripts touch (``surface``). ``megatrain_ds.zero`` and the other ``deepspeed.<name>`` mirrors stay reachable at the
top (``megatrain_ds/__init__.py``).
"""
