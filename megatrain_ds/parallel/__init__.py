"""Data parallelism: ``dp`` (who owns which layer, the process groups, the gradient exchange) and ``comm``
(``deepspeed.comm`` as scripts use it). Below the streaming core, which reduces each layer's gradient through it.
"""
