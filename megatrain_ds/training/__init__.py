"""The engine's parts (``megatrain_ds/engine.py`` holds the engine itself): ``engine_build`` builds every
part from the resolver's ``Decisions``, ``engine_forward`` the batch's way in and the exact fused loss,
``engine_auto`` the placements made after the second step, ``lifecycle`` the guards around a run.
"""
