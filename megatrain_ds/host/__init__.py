"""Where the persistent state lives on the host: ``host_state`` (one flat buffer per kind, one view per layer),
``host_memory`` (the mappings and pinning), ``grad_hold``, ``nvme`` (the NVMe tier), ``device_state`` (optimizer
state held on the GPU), ``layer_state`` (``LayerStates``: the one owner of where layer i's state lives) and
``placement`` (the host threads' cores). The streaming core reads and writes this state; it never imports upward.
"""
