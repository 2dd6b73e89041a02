"""What ``MEGATRAIN_DS=1`` changes in DeepSpeed's multi-node runner, and why: the switch crosses
hosts.

``deepspeed --hostfile hosts train.py`` (pdsh by default; also openmpi, mpich, impi, mvapich, slurm,
and accelerate's
``deepspeed_multinode_launcher: pdsh``) starts every host's ranks, its own included, through the
remote shell with
only the variables it exports: names starting with one of ``deepspeed.launcher.runner.EXPORT_ENVS``
(MLFLOW, PYTHON,
MV2, UCX), the accelerator's (NCCL on CUDA) and the lines of ``.deepspeed_env``. ``MEGATRAIN_DS`` is
none of these,
so every rank would run real DeepSpeed while the launch was asked for megatrain_ds.

Under the switch, once ``deepspeed.launcher.runner`` is imported, ``MEGATRAIN_DS`` joins
``EXPORT_ENVS`` (a prefix, as
the others are: ``MEGATRAIN_DS_*`` variables travel too). ``main()`` builds the exports from that
list when it runs
(``exports = EXPORT_ENVS + get_accelerator().export_envs()``, DeepSpeed 0.19), so every launcher's
command carries
``export MEGATRAIN_DS=1``. Without the switch in the runner's environment nothing here is imported.

If a DeepSpeed release no longer builds its exports that way, the runner's ``main`` is replaced by
one that stops with
what to do instead (importing the runner still works: accelerate reads a constant from it).
tests/drift.py runs
tests/system/test_pdsh_exports.py, which checks the exported command against each DeepSpeed the
canary installs.
"""

from __future__ import annotations

from .env import ENV

RUNNER = "deepspeed.launcher.runner"


def drift(runner) -> str | None:
    """What in ``runner`` no longer matches what the export relies on; None when it matches."""
    exports = getattr(runner, "EXPORT_ENVS", None)
    if not (isinstance(exports, list) and all(isinstance(name, str) for name in exports)):
        return f"has EXPORT_ENVS as a list of variable-name prefixes (found {exports!r})"
    code = getattr(getattr(runner, "main", None), "__code__", None)
    if code is None or "EXPORT_ENVS" not in code.co_names:
        return "reads EXPORT_ENVS in main() when it builds the variables it exports to the hosts"
    return None


def _refusing_main(problem: str):
    def main(*args, **kwargs):
        import deepspeed

        raise RuntimeError(
            f"{ENV}=1: DeepSpeed {deepspeed.__version__}'s launcher ({RUNNER}) no longer {problem}"
            f", so {ENV} "
            f"cannot be added to what it exports to the hosts (compat/launcher_env.py), and their "
            "ranks would run "
            f"real DeepSpeed. Instead: unset {ENV} for the launcher and put the line {ENV}=1 in "
            ".deepspeed_env "
            f"(its working directory or ~), which it exports to every host."
        )

    main.__megatrain_ds__ = True
    return main


def export_switch(runner) -> None:
    """Add ``MEGATRAIN_DS`` to the runner's exported prefixes (idempotent); a drifted runner refuses
    to launch."""
    problem = drift(runner)
    if problem is not None:
        runner.main = _refusing_main(problem)
    elif ENV not in runner.EXPORT_ENVS:
        runner.EXPORT_ENVS.append(ENV)


HOOKS = {
    RUNNER: export_switch
}  # module name -> what runs once it is imported (compat/import_hook.py)
