"""The host optimizer: exact global-norm clipping and fused CPU AdamW per layer, overlapped with the GPU
(``optimizer``, its threads ``host_threads``), the update kernels (``host_update``), speculative stepping
(``speculation``), the resident parameters (``resident``) and fp16 loss scaling (``loss_scale``). Sits above the
streaming core, whose gradient landings it listens to.
"""
