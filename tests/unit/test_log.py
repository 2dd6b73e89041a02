"""The ``megatrain_ds`` logger (megatrain_ds/log.py): the engine's operational lines keep their text
on stdout, rank 0 says INFO unless a record names its ranks, and a logging configuration of the
user's takes over."""

import logging
import os
import re
import subprocess
import sys

import pytest

from megatrain_ds import log as mlog

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def rank(monkeypatch):
    """Pretend to be rank ``r``: ``rank(r)``."""

    def set_rank(r):
        monkeypatch.setattr(mlog, "_rank", lambda: r)

    return set_rank


def _ours():
    return [h for h in mlog.logger.handlers if isinstance(h, mlog.StdoutHandler)]


def test_default_handler_prints_the_old_text_on_the_current_stdout(capsys):
    """(pytest attaches its own capture handlers to non-propagating loggers: only ours is
    counted.)"""
    assert mlog.logger.name == "megatrain_ds" and not mlog.logger.propagate
    assert mlog.logger.getEffectiveLevel() == logging.INFO and len(_ours()) == 1
    mlog.logger.info("step=1, skipped=0")
    mlog.logger.warning("at exit: something")
    mlog.logger.debug("not shown at INFO")
    out, err = capsys.readouterr()
    assert (
        out == "[megatrain_ds] step=1, skipped=0\n[megatrain_ds] [WARNING] at exit: something\n"
        and err == ""
    )


def test_rank_filter(capsys, rank):
    rank(1)
    mlog.logger.info("rank 0 only")
    mlog.log("every rank", ranks=mlog.ALL_RANKS)
    mlog.log("rank 1 named", ranks=[1])
    mlog.log("rank 0 named", ranks=[0])
    mlog.log("rank 1 as an int", ranks=1)
    mlog.logger.warning("a warning: every rank")
    assert capsys.readouterr().out.splitlines() == [
        "[megatrain_ds] every rank",
        "[megatrain_ds] rank 1 named",
        "[megatrain_ds] rank 1 as an int",
        "[megatrain_ds] [WARNING] a warning: every rank",
    ]
    rank(0)
    mlog.logger.info("rank 0 only")
    mlog.log("rank 1 named", ranks=[1])
    assert capsys.readouterr().out.splitlines() == ["[megatrain_ds] rank 0 only"]


def test_a_handler_of_the_users_in_place_of_ours(capsys, rank):
    """Ours removed, the user's added (as log.py's docstring says): the lines go there only, and the
    rank filter still applies (it is the logger's, not the handler's)."""
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    mine, ours = Collect(), _ours()[0]
    mlog.logger.removeHandler(ours)
    mlog.logger.addHandler(mine)
    try:
        mlog.logger.info("to the user's handler")
        rank(2)
        mlog.logger.info("rank 0 only")
    finally:
        mlog.logger.removeHandler(mine)
        mlog.logger.addHandler(ours)
    assert records == ["to the user's handler"] and capsys.readouterr().out == ""
    rank(0)
    mlog.logger.info("ours again")
    assert capsys.readouterr().out == "[megatrain_ds] ours again\n"


def test_a_users_logging_configuration_is_respected():
    """Configured before the package is imported: no handler added, the user's level and propagate
    kept. Configured after (dictConfig naming the logger): the user's handler replaces ours, the
    rank filter stays."""
    code = (
        "import logging, logging.config, sys\n"
        "h = logging.StreamHandler(sys.stdout); h.setFormatter(logging.Formatter('USER "
        "%(levelname)s %(message)s'))\n"
        "lg = logging.getLogger('megatrain_ds'); lg.addHandler(h); lg.setLevel(logging.WARNING)\n"
        "from megatrain_ds import log\n"
        "assert lg.handlers == [h] and lg.propagate and lg.level == logging.WARNING\n"
        "log.logger.info('hidden'); log.logger.warning('shown')\n"
        "logging.config.dictConfig({'version': 1, 'disable_existing_loggers': False,\n"
        "    'formatters': {'f': {'format': 'DICT %(message)s'}},\n"
        "    'handlers': {'h': {'class': 'logging.StreamHandler', 'stream': 'ext://sys.stdout', "
        "'formatter': 'f'}},\n"
        "    'loggers': {'megatrain_ds': {'handlers': ['h'], 'level': 'INFO'}}})\n"
        "log.logger.info('info now'); log._rank = lambda: 1; log.logger.info('rank 1: hidden')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == "USER WARNING shown\nDICT info now\n"


def test_the_package_prints_no_operational_lines():
    """Every ``[megatrain_ds] ...`` line of the package goes through log.py (print stays for the
    CLI's own output: the plan table, convert's summary, the versions table)."""
    offenders = []
    for folder, _, files in os.walk(os.path.join(ROOT, "megatrain_ds")):
        for f in files:
            if f.endswith(".py") and f != "log.py":
                text = open(os.path.join(folder, f)).read()
                offenders += [
                    f"{f}: {m.group(0)[:60]}"
                    for m in re.finditer(r"print\(\s*f?[\"']\[megatrain_ds\]", text)
                ]
    assert not offenders, offenders
