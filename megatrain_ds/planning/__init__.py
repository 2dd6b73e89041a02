"""Decisions made before the first step: the config parse (``config``, ``config_values``), the one resolver
(``decisions``), the byte models of host, disk and GPU (``host_bytes``, ``plan_gpu``), the capacity check
(``capacity``), ``megatrain-ds plan`` (``plan``, ``plan_cli``) and the named shapes (``shapes``). Reads the
packages below for their constants and byte counts; builds nothing.
"""
