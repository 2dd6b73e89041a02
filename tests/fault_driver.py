"""Fault injection on a tiny Llama: does the engine lose work, or train on silently wrong state,
when things go wrong?

    # or: python tests/fault_driver.py --cases 200 --seed 1
    python -m tests.fault_driver --cases 200 --seed 1
    python -m tests.fault_driver --cases 8 --seed 0 --kinds signal,disk --verbose

Each case injects one fault into a short training script (4 optimizer steps of a 3-layer Llama,
fp32, AdamW, WarmupLR, gradient clipping that fires, so speculative steps roll back; GA 1 or 2) and
classifies what happened:

- ``ok``: what the contract says happened (below);
- ``lost``: work the script saved, or tried to save, is gone: a checkpoint that does not load, a
  save that fails where it must succeed, a process that hangs (a hung script saves nothing);
- ``silent``: the run goes on, or loads, with state that disagrees with itself: weights that are not
  those of the global step the counters say, a resumed run that does not end where the uninterrupted
  one ends, an engine changed by a load that refused, a survivor that trains on alone;
- ``unclear``: nothing lost or silent, but the fault was not reported as it should be: an error that
  does not name the file or the rank, an error later than the bound, a Ctrl-C that never reached the
  script.

Kinds (``--kinds``; cases cycle through ``PATTERN``, so the first four cases are one of each):

- ``signal``: SIGINT (what Ctrl-C sends: KeyboardInterrupt) at a random point of ``forward()``,
  ``backward()``, ``step()`` or ``save_checkpoint()`` -- sent by a hook on one of the engine's own
  functions at its n-th call during that call (the functions and their call counts are found by
  profiling a calibration run), or by a timer at a random fraction of the call's measured duration.
  The script then does what a user's ``except KeyboardInterrupt:`` does (``save_checkpoint``); a
  fresh engine loads it and must hold the reference run's weights at its global step, then train on
  to the reference run's final weights; the interrupted engine, trained on in place from its own
  counters, must end there too.
- ``disk``: the disk fills up during a save (every file write of the save goes through a file object
  that raises ``OSError(ENOSPC)`` once a random byte budget is spent): the save must fail with an
  error naming the file, the previous checkpoint (same tag or not) must load with its weights, and
  the engine must train on and save as if the failed save had never happened.
- ``corrupt``: one byte of a random file of a checkpoint (its rank files, checksum manifest,
  ``latest``) is flipped: a load must refuse naming the file and leave the engine exactly as it was
  (or, where the byte changes nothing that is loaded, load the right weights).
- ``rank``: two gloo processes (tests/scripts/dp_fault.py); one of them stalls (longer than the
  collective timeout) or dies (``os._exit``) at a random point (before forward, inside forward /
  backward / step / save_checkpoint, between backward and step): the other must raise
  ``CollectiveError`` naming the rank within the timeout plus a bound, and both processes must exit.

Isolation: the cases run in a child process that reports one line per case; a case that makes no
progress within its bound is killed with the child (and counted ``lost``), and a new child goes on
with the next case. Every subprocess has a timeout: the driver (and
tests/integration/test_fault_driver.py) cannot hang.
"""

from __future__ import annotations

import argparse
import builtins
import collections
import errno
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from dataclasses import asdict, dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:  # python tests/fault_driver.py
    sys.path.insert(0, REPO)
from tests.scripts.dp_fault import PROCESS_TIMEOUT_S as RANK_PROCESS_TIMEOUT_S  # noqa: E402
from tests.scripts.dp_fault import launch_pair  # noqa: E402
from tests.fault_script import (  # noqa: E402,F401
    ATOL,
    SAVE_AT,
    STEPS,
    Reference,
    Windows,
    _batches,
    _config,
    _engine,
    check_at,
    finish_and_check,
    max_diff,
    script,
    weights,
)

OK, LOST, SILENT, UNCLEAR = "ok", "lost", "silent", "unclear"
RESULTS = (OK, LOST, SILENT, UNCLEAR)
KINDS = ("signal", "disk", "corrupt", "rank")
PATTERN = ("signal", "disk", "corrupt", "rank", "signal", "signal", "disk", "corrupt")
# no progress for this long: the case hangs (the child is killed; the case is lost)
CASE_TIMEOUT_S = 150.0
RANK_TIMEOUT_S = 3.0  # megatrain.collective_timeout of the rank cases
# the survivor's error may come this long after timeout + fault (a loaded 2-core box)
RANK_BOUND_S = 20.0
PREFIX = "@@fault-driver "


@dataclass
class Outcome:
    case: int
    kind: str
    params: dict
    result: str = UNCLEAR
    why: str = ""
    seconds: float = 0.0
    notes: list = field(default_factory=list)


def plan(seed: int, index: int, kinds=KINDS) -> tuple[str, dict]:
    """Case ``index`` of ``seed``: its kind and parameters (deterministic; the hook's function is
    drawn at run time from the calibration, with the same generator)."""
    pattern = [k for k in PATTERN if k in kinds]
    kind = pattern[index % len(pattern)]
    rng = random.Random(f"{seed}/{index}")
    params = {"ga": rng.choice((1, 2)), "draw": rng.random()}
    if kind == "signal":
        params["phase"] = rng.choice(("forward", "backward", "step", "save"))
        # which micro-step's call (forward/backward/step)
        params["micro"] = rng.randrange(STEPS * params["ga"])
        params["how"] = rng.choice(("hook", "hook", "timer"))
    elif kind == "disk":
        params["before"] = rng.choice((1, 2))  # steps before the previous checkpoint
        params["between"] = rng.choice((1, 2))  # steps between it and the failing save
        params["same_tag"] = rng.random() < 0.3
    elif kind == "corrupt":
        params["steps"] = rng.randint(1, STEPS)
    elif kind == "rank":
        params["fault"] = rng.choice(("stall", "exit"))
        params["at"] = rng.choice(
            ("before_forward", "forward", "backward", "between", "step", "save")
        )
        params["victim"] = rng.choice((0, 1))
        del params["ga"]  # (tests/scripts/dp_fault.py: GA 1)
    return kind, params


# ====================================================================================== calibration
class Calibration:
    """For one GA: the engine functions called during each call of the script (how often), and each
    call's duration. Found by profiling one run (``sys.setprofile`` / ``threading.setprofile``: the
    engine's worker threads too)."""

    def __init__(self, ga: int, workdir: str) -> None:
        import megatrain_ds

        package = os.path.dirname(megatrain_ds.__file__) + os.sep
        windows = Windows()
        calls: dict = collections.defaultdict(collections.Counter)
        durations: dict = {}
        started = {}

        def profile(frame, event, arg):
            if (
                event == "call"
                and windows.current is not None
                and frame.f_code.co_filename.startswith(package)
            ):
                calls[windows.current][frame.f_code] += 1

        def enter(window):
            started[window] = time.perf_counter()

        def leave(window):
            durations[window] = time.perf_counter() - started[window]

        windows.enter, windows.leave = enter, leave
        threading.setprofile(profile)  # before the engine exists: its worker threads start with it
        sys.setprofile(profile)
        try:
            engine = _engine(ga)
            script(engine, ga, tempfile.mkdtemp(dir=workdir), windows)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
        engine.destroy()
        # without the profiler's overhead (the timer draws from these)
        windows.enter, windows.leave = enter, leave
        engine = _engine(ga)
        script(engine, ga, tempfile.mkdtemp(dir=workdir), windows)
        engine.destroy()
        self.calls, self.durations = calls, durations
        self.bindings = _bindings()

    def hook_points(self, window) -> list[tuple[types.CodeType, int]]:
        """(code, calls during ``window``) of the engine functions that can be hooked (found by name
        in a module or class of megatrain_ds)."""
        return sorted(
            ((code, n) for code, n in self.calls.get(window, {}).items() if code in self.bindings),
            key=lambda item: (item[0].co_filename, item[0].co_firstlineno),
        )


def _bindings() -> dict:
    """code object -> every (owner, name) holding a plain function with it: module functions (and
    their imports under other names: ``from .checksums import save_file as _save``) and class
    methods of megatrain_ds."""
    out = collections.defaultdict(list)
    seen, modules_seen = set(), set()
    for name, module in list(sys.modules.items()):
        if not (name == "megatrain_ds" or name.startswith("megatrain_ds.")) or module is None:
            continue
        # a module under its flat-layout name too (megatrain_ds/_moved.py)
        if id(module) in modules_seen:
            continue
        modules_seen.add(id(module))
        for attr, obj in list(vars(module).items()):
            if isinstance(obj, types.FunctionType):
                out[obj.__code__].append((module, attr))
            elif (
                isinstance(obj, type)
                and obj.__module__.startswith("megatrain_ds")
                and id(obj) not in seen
            ):
                seen.add(id(obj))
                for key, member in list(vars(obj).items()):
                    if isinstance(member, types.FunctionType):
                        out[member.__code__].append((obj, key))
    return dict(out)


class Hook:
    """SIGINT at the ``n``-th call of ``code``'s function during ``window`` (at the end of the
    window if the function was called fewer times this run: timing moves the AdamW thread's
    calls)."""

    def __init__(self, calibration: Calibration, code, n: int, window, windows: Windows) -> None:
        self.code, self.n, self.window, self.windows = code, n, window, windows
        self.count, self.fired, self.armed = 0, None, False
        self.saved = []
        for owner, name in calibration.bindings[code]:
            original = vars(owner)[name]
            self.saved.append((owner, name, original))
            setattr(owner, name, self._wrap(original))

    def _wrap(self, original):
        hook = self

        def hooked(*args, **kwargs):
            if hook.armed and hook.fired is None:
                hook.count += 1
                if hook.count == hook.n:
                    hook.fired = "hook"
                    os.kill(os.getpid(), signal.SIGINT)
            return original(*args, **kwargs)

        hooked.__wrapped__ = original
        return hooked

    def enter(self, window):
        self.armed = window == self.window

    def leave(self, window):
        if window == self.window and self.fired is None:
            self.fired = "end of the call"
            os.kill(os.getpid(), signal.SIGINT)
        self.armed = False

    def remove(self):
        for owner, name, original in self.saved:
            setattr(owner, name, original)


class Timer:
    """SIGINT ``delay`` seconds after ``window`` starts."""

    def __init__(self, delay: float, window) -> None:
        self.delay, self.window, self.timer, self.fired = delay, window, None, None

    def enter(self, window):
        if window == self.window and self.timer is None:
            self.timer = threading.Timer(self.delay, self._fire)
            self.timer.daemon = True
            self.timer.start()

    def _fire(self):
        self.fired = "timer"
        os.kill(os.getpid(), signal.SIGINT)

    def leave(self, window):
        pass

    def wait(self):
        """The script ended before the delay did (a window's calibrated duration includes warm-up):
        fire now."""
        if self.timer is not None:
            self.timer.join()

    def remove(self):
        if self.timer is not None:
            self.timer.cancel()


# ======================================================================================== the cases
class Runner:
    """Runs cases in this process (the child): calibrations and references are made once per GA."""

    def __init__(self, seed: int, workdir: str, kinds=KINDS) -> None:
        self.seed, self.workdir, self.kinds = seed, workdir, kinds
        self.references, self.calibrations = {}, {}

    def reference(self, ga: int) -> Reference:
        if ga not in self.references:
            self.references[ga] = Reference(ga, self.workdir)
        return self.references[ga]

    def calibration(self, ga: int) -> Calibration:
        if ga not in self.calibrations:
            self.calibrations[ga] = Calibration(ga, self.workdir)
        return self.calibrations[ga]

    def run(self, index: int) -> Outcome:
        kind, params = plan(self.seed, index, self.kinds)
        outcome = Outcome(index, kind, params)
        folder = tempfile.mkdtemp(prefix=f"case{index}-", dir=self.workdir)
        start = time.monotonic()
        try:
            getattr(self, f"case_{kind}")(outcome, params, folder)
        # the driver's own failure, or an unexpected one: said
        except Exception as exc:  # noqa: BLE001
            import traceback

            outcome.result, outcome.why = (
                UNCLEAR,
                f"the case itself failed: {type(exc).__name__}: {exc}",
            )
            outcome.notes.append(traceback.format_exc()[-2000:])
        outcome.seconds = round(time.monotonic() - start, 2)
        shutil.rmtree(folder, ignore_errors=True)
        return outcome

    # --------------------------------------------------------------------------------------- signal
    def case_signal(self, out: Outcome, p: dict, folder: str) -> None:
        ga = p["ga"]
        ref, cal = self.reference(ga), self.calibration(ga)
        window = ("save", 0) if p["phase"] == "save" else (p["phase"], p["micro"])
        rng = random.Random(p["draw"])
        windows = Windows()
        if p["how"] == "hook" and cal.hook_points(window):
            code, calls = rng.choice(cal.hook_points(window))
            n = rng.randint(1, calls)
            injector = Hook(cal, code, n, window, windows)
            out.params["at"] = (
                f"{code.co_qualname} ({os.path.basename(code.co_filename)}), call {n} of {calls}"
            )
        else:
            delay = rng.random() * cal.durations.get(window, 0.01)
            injector = Timer(delay, window)
            out.params["at"] = f"timer, {delay * 1000:.1f} ms into the call"
        out.params["window"] = list(window)
        windows.enter, windows.leave = injector.enter, injector.leave
        ckdir = os.path.join(folder, "ckpt")
        engine = _engine(ga)
        caught = None
        import warnings

        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                try:
                    script(engine, ga, ckdir, windows)
                    if isinstance(injector, Timer):
                        injector.wait()
                    # a signal sent at the very end lands here, still inside the try
                    time.sleep(0.3)
                finally:
                    injector.remove()
            except KeyboardInterrupt:
                caught = windows.interrupted_in or "the script's own code, between calls"
        discarded = any("discarded" in str(w.message) for w in said)
        out.params["fired"] = injector.fired
        if caught is None:
            out.result, out.why = (
                UNCLEAR,
                f"SIGINT sent ({injector.fired}) but no KeyboardInterrupt reached the script",
            )
            engine.destroy()
            return
        out.notes.append(
            f"KeyboardInterrupt in {caught}; engine at global step {engine.global_steps}"
        )
        try:  # what the script's except KeyboardInterrupt: does
            engine.save_checkpoint(ckdir)
        except Exception as exc:  # noqa: BLE001
            out.result, out.why = (
                LOST,
                f"the save after the KeyboardInterrupt failed: {type(exc).__name__}: {exc}",
            )
            return
        problems = []
        resumed = _engine(ga, seed=1)
        try:
            resumed.load_checkpoint(ckdir)
        except Exception as exc:  # noqa: BLE001
            out.result, out.why = (
                LOST,
                f"the checkpoint saved after the interrupt does not load: {exc}",
            )
            return
        problems.append(check_at(ref, resumed, "the resumed engine"))
        problems.append(
            finish_and_check(
                ref, resumed, ga, os.path.join(folder, "after"), "the resumed run's end"
            )
        )
        # In place, the engine's counters tell the script where to go on, except after a
        # KeyboardInterrupt that came between a backward() and the step() counting it (in
        # backward(), or in step() before it counted): whether that micro-step's gradient is in the
        # window is not visible to the script (as with DeepSpeed, or with loss.backward() before
        # optimizer.step() in PyTorch). The resume from the checkpoint is checked either way.
        uncounted = (
            caught[0] in ("backward", "step") and engine.micro_steps <= caught[1]
            if isinstance(caught, tuple)
            else False
        )
        if uncounted or (discarded and engine.window_micro_steps):
            out.notes.append(
                f"in-place run not checked: interrupted in {caught[0]}() of micro-step {caught[1]} "
                "before "
                "step() counted it"
            )
        else:
            problems.append(
                finish_and_check(
                    ref,
                    engine,
                    ga,
                    os.path.join(folder, "in-place"),
                    "the interrupted engine, trained on in place",
                )
            )
        resumed.destroy(), engine.destroy()
        problems = [x for x in problems if x]
        out.result, out.why = (SILENT, "; ".join(problems)) if problems else (OK, "")

    # ----------------------------------------------------------------------------------------- disk
    def case_disk(self, out: Outcome, p: dict, folder: str) -> None:
        ga = p["ga"]
        ref = self.reference(ga)
        rng = random.Random(p["draw"])
        ckdir = os.path.join(folder, "ckpt")
        tag = (lambda g: "same") if p["same_tag"] else (lambda g: None)
        engine = _engine(ga)
        batches = _batches(ga)

        def train(n):
            for _ in range(n):
                g = engine.global_steps
                for k in range(ga):
                    ids = batches[g * ga + k]
                    engine.backward(engine(input_ids=ids, labels=ids).loss)
                    engine.step()

        train(p["before"])
        engine.save_checkpoint(ckdir, tag=tag(engine.global_steps))
        previous = engine.global_steps
        train(p["between"])
        total = _bytes_of_a_save(
            engine, ckdir, os.path.join(folder, "measure"), tag(engine.global_steps)
        )
        budget = rng.randrange(total)
        out.params["budget"] = f"{budget} of {total} bytes"
        disk = FullDisk(budget)
        try:
            with disk:
                engine.save_checkpoint(ckdir, tag=tag(engine.global_steps))
            error = None
        except Exception as exc:  # noqa: BLE001
            error = exc
        out.params["failed_writing"] = disk.failed_path and os.path.relpath(
            disk.failed_path, folder
        )
        problems, unclear = [], []
        if error is None:
            unclear.append(f"the save succeeded although the write of {disk.failed_path} failed")
        elif not isinstance(error, OSError):
            unclear.append(f"{type(error).__name__}, not an OSError: {error}")
        elif disk.failed_path and os.path.basename(disk.failed_path) not in str(error):
            unclear.append(
                f"the error does not name the file ({os.path.basename(disk.failed_path)}): {error}"
            )
        loaded = _engine(ga, seed=1)
        try:
            loaded.load_checkpoint(ckdir, tag=tag(previous) if p["same_tag"] else None)
        except Exception as exc:  # noqa: BLE001
            out.result, out.why = (
                LOST,
                f"after the failed save, the previous checkpoint does not load: {exc}",
            )
            return
        if loaded.global_steps not in (previous, engine.global_steps):
            problems.append(
                f"after the failed save, the checkpoint loads global step {loaded.global_steps}"
            )
        problems.append(check_at(ref, loaded, "the checkpoint loaded after the failed save"))
        problems.append(
            finish_and_check(
                ref,
                engine,
                ga,
                os.path.join(folder, "after"),
                "the engine whose save failed, trained on",
            )
        )
        engine.save_checkpoint(ckdir)  # the disk has room again
        again = _engine(ga, seed=2)
        try:
            again.load_checkpoint(ckdir)
        except Exception as exc:  # noqa: BLE001
            out.result, out.why = LOST, f"a save after the failed one does not load: {exc}"
            return
        problems.append(check_at(ref, again, "the save after the failed one"))
        loaded.destroy(), engine.destroy(), again.destroy()
        problems = [x for x in problems if x]
        if problems:
            out.result, out.why = SILENT, "; ".join(problems)
        elif unclear:
            out.result, out.why = UNCLEAR, "; ".join(unclear)
        else:
            out.result, out.why = OK, ""

    # -------------------------------------------------------------------------------------- corrupt
    def case_corrupt(self, out: Outcome, p: dict, folder: str) -> None:
        ga = p["ga"]
        ref = self.reference(ga)
        rng = random.Random(p["draw"])
        ckdir = os.path.join(folder, "ckpt")
        engine = _engine(ga)
        batches = _batches(ga)
        for _ in range(p["steps"]):
            g = engine.global_steps
            for k in range(ga):
                ids = batches[g * ga + k]
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                engine.step()
        engine.save_checkpoint(ckdir)
        engine.destroy()
        tag_dir = os.path.join(ckdir, open(os.path.join(ckdir, "latest")).read())
        files = sorted(os.path.join(tag_dir, n) for n in os.listdir(tag_dir)) + [
            os.path.join(ckdir, "latest")
        ]
        path = rng.choice(files)
        data = bytearray(open(path, "rb").read())
        offset, mask = rng.randrange(len(data)), rng.randrange(1, 256)
        data[offset] ^= mask
        with open(path, "wb") as f:
            f.write(bytes(data))
        out.params["flipped"] = (
            f"{os.path.relpath(path, ckdir)} byte {offset} of {len(data)} ^ {mask:#04x}"
        )
        target = _engine(ga, seed=2)
        ids = batches[0]
        target.backward(target(input_ids=ids, labels=ids).loss)
        target.step()
        before = snapshot(target)
        try:
            target.load_checkpoint(ckdir)
        except Exception as exc:  # noqa: BLE001
            changed = compare_snapshots(before, snapshot(target))
            if changed:
                out.result = SILENT
                out.why = (
                    f"the load refused ({type(exc).__name__}) but changed the engine: {changed}"
                )
            elif os.path.basename(path) not in str(exc):
                out.result, out.why = (
                    UNCLEAR,
                    f"refused without naming {os.path.basename(path)}: {type(exc).__name__}: {exc}",
                )
            else:
                out.result, out.why = OK, f"refused: {type(exc).__name__}"
            target.destroy()
            return
        problem = check_at(ref, target, "a load of the corrupted checkpoint")
        if problem is None and target.global_steps != p["steps"]:
            problem = (
                f"a load of the corrupted checkpoint gave global step {target.global_steps}, saved "
                f"{p['steps']}"
            )
        out.result, out.why = (
            (SILENT, problem)
            if problem
            else (OK, "loaded: the flipped byte changes nothing loaded")
        )
        target.destroy()

    # ----------------------------------------------------------------------------------------- rank
    def case_rank(self, out: Outcome, p: dict, folder: str) -> None:
        victim, survivor = p["victim"], 1 - p["victim"]
        procs, logs = launch_pair(
            folder,
            [
                "--timeout",
                str(RANK_TIMEOUT_S),
                "--fault",
                p["fault"],
                "--at",
                p["at"],
                "--victim",
                str(victim),
                "--fault-step",
                "1",
            ],
        )
        records = {}
        for r in (0, 1):
            try:
                with open(os.path.join(folder, f"rank{r}.json")) as f:
                    records[r] = json.load(f)
            except (OSError, ValueError):
                records[r] = None
        codes = {r: proc.returncode for r, proc in procs.items()}
        out.notes.append(f"exit codes {codes}")
        hung = [
            r
            for r, proc in procs.items()
            if proc.returncode is None or proc.returncode in (-9, 124)
        ]
        if hung:
            out.result, out.why = (
                LOST,
                f"rank(s) {hung} did not exit within {RANK_PROCESS_TIMEOUT_S:.0f} s (killed)",
            )
            out.notes.append(_tail(logs[hung[0]]))
            return
        rec = records[survivor]
        fault_at = (records[victim] or {}).get("events", {}).get("fault")
        if rec is None or fault_at is None:
            out.result, out.why = (
                UNCLEAR,
                f"no record of the fault (survivor {rec is not None}, fault {fault_at})",
            )
            out.notes.append(_tail(logs[survivor]))
            return
        error = rec["error"]
        if error is None or codes[survivor] == 0:
            out.result, out.why = (
                SILENT,
                f"rank {survivor} went on without rank {victim} (finished: {rec['finished']})",
            )
            return
        latency = error["time"] - fault_at
        out.params["latency_s"] = round(latency, 2)
        first = error["message"].splitlines()[0] if error["message"] else ""
        bound = RANK_TIMEOUT_S + RANK_BOUND_S
        if error["type"] != "CollectiveError":
            out.result, out.why = (
                UNCLEAR,
                f"rank {survivor} raised {error['type']}, not CollectiveError: {first}",
            )
        elif victim not in (error.get("missing") or []) or f"rank {victim}" not in error["message"]:
            out.result, out.why = (
                UNCLEAR,
                f"rank {survivor}'s error does not name rank {victim}: {first}",
            )
        elif latency > bound:
            out.result, out.why = (
                UNCLEAR,
                f"rank {survivor} raised {latency:.1f} s after the fault (bound {bound:g} s)",
            )
        elif p["fault"] == "stall" and codes[victim] == 0:
            out.result, out.why = (
                SILENT,
                f"the stalled rank {victim} went on and finished without its peer",
            )
        else:
            out.result, out.why = OK, first[:200]


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


# ====================================================================================== a full disk
class _FullFile:
    """A file object whose writes spend the disk's budget; past it, ``OSError(ENOSPC)`` (as write(2)
    gives it: no file name in the error)."""

    def __init__(self, f, disk: "FullDisk", path: str) -> None:
        self._f, self._disk, self._path = f, disk, path

    def write(self, data):
        size = len(data) if not isinstance(data, memoryview) else data.nbytes
        if self._disk.left < size:
            self._disk.failed_path = self._disk.failed_path or self._path
            self._disk.left = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._disk.left -= size
        self._disk.written += size
        return self._f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()
        return False

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)


class FullDisk:
    """While active, every file opened for writing (``open``; ``shutil``'s copies go through it, not
    sendfile) has ``budget`` bytes in all; ``os.posix_fallocate`` beyond it fails too."""

    def __init__(self, budget: float) -> None:
        self.left, self.written, self.failed_path = budget, 0, None

    def __enter__(self):
        self._open, self._fallocate = builtins.open, getattr(os, "posix_fallocate", None)
        self._sendfile = shutil._USE_CP_SENDFILE
        disk = self

        def open_(file, mode="r", *args, **kwargs):
            f = disk._open(file, mode, *args, **kwargs)
            if any(c in mode for c in "wax+") and not isinstance(file, int):
                return _FullFile(f, disk, os.fspath(file))
            return f

        def fallocate(fd, offset, length):
            if disk.left < length:
                # the file behind the descriptor (Linux), so the check can ask the error to name it
                try:
                    where = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    where = f"fd {fd}"
                disk.failed_path = disk.failed_path or where
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            disk.left -= length
            return disk._fallocate(fd, offset, length)

        builtins.open = open_
        if self._fallocate is not None:
            os.posix_fallocate = fallocate
        shutil._USE_CP_SENDFILE = False
        return self

    def __exit__(self, *exc):
        builtins.open = self._open
        if self._fallocate is not None:
            os.posix_fallocate = self._fallocate
        shutil._USE_CP_SENDFILE = self._sendfile
        return False


def _bytes_of_a_save(engine, ckdir: str, folder: str, tag) -> int:
    """What a save of ``engine`` into ``ckdir`` writes (through ``open``), measured on a copy of
    ``ckdir``."""
    shutil.copytree(ckdir, folder)
    disk = FullDisk(float("inf"))
    with disk:
        engine.save_checkpoint(folder, tag=tag)
    shutil.rmtree(folder, ignore_errors=True)
    return disk.written


# ======================================================================================== snapshots
def snapshot(engine) -> dict:
    """Everything a load may write, copied."""
    engine.sync_masters_to_host()
    res = engine.resident
    return {
        "masters": weights(engine),
        "exp_avg": engine.store.exp_avg.clone(),
        "exp_avg_sq": engine.store.exp_avg_sq.clone(),
        "resident": [None if t is None else t.clone() for t in res.exp_avg + res.exp_avg_sq],
        "counters": (
            engine.global_steps,
            engine.global_samples,
            engine.micro_steps,
            engine.skipped_steps,
            engine.optimizer.step_count,
        ),
        "lr": engine.get_lr(),
        "scheduler": engine.lr_scheduler.state_dict(),
    }


def compare_snapshots(a: dict, b: dict) -> str:
    import torch

    changed = [k for k in a["masters"] if not torch.equal(a["masters"][k], b["masters"][k])]
    if not (
        torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    ):
        changed.append("Adam moments")
    if any(
        (x is None) != (y is None) or (x is not None and not torch.equal(x, y))
        for x, y in zip(a["resident"], b["resident"])
    ):
        changed.append("resident moments")
    for key in ("counters", "lr", "scheduler"):
        if a[key] != b[key]:
            changed.append(f"{key} {a[key]} -> {b[key]}")
    return ", ".join(changed)


# ========================================================================================== driving
def child_main(seed: int, first: int, last: int, workdir: str, kinds) -> None:
    """Run cases [first, last) here, one line per case on stdout (``PREFIX`` + JSON)."""
    import warnings

    warnings.simplefilter("ignore")
    runner = Runner(seed, workdir, kinds)
    for index in range(first, last):
        print(PREFIX + json.dumps({"start": index}), flush=True)
        outcome = runner.run(index)
        print(PREFIX + json.dumps(asdict(outcome)), flush=True)


def run(
    cases: int,
    seed: int,
    kinds=KINDS,
    workdir: str | None = None,
    verbose: bool = False,
    log=None,
    start: int = 0,
) -> list[Outcome]:
    """Cases ``start`` .. ``start + cases - 1`` of ``seed``, in child processes (see the module
    note); their outcomes."""
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="fault-driver-")
    outcomes: list[Outcome] = []
    index = start
    try:
        while index < start + cases:
            outcomes += _run_child(index, start + cases, seed, kinds, workdir, verbose, log)
            index = start + len(outcomes)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    return outcomes


def _run_child(first, last, seed, kinds, workdir, verbose, log) -> list[Outcome]:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(x for x in (REPO, os.environ.get("PYTHONPATH", "")) if x),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
        CUDA_VISIBLE_DEVICES="",
    )
    stderr_path = os.path.join(workdir, f"child-{first}.log")
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.fault_driver",
                "--child",
                "--seed",
                str(seed),
                "--first",
                str(first),
                "--cases",
                str(last),
                "--workdir",
                workdir,
                "--kinds",
                ",".join(kinds),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
    outcomes, current = [], first
    deadline = time.monotonic() + CASE_TIMEOUT_S
    try:
        while True:
            ready, _, _ = select.select(
                [proc.stdout], [], [], max(0.0, deadline - time.monotonic())
            )
            if not ready:  # no progress: the case hangs
                kind, params = plan(seed, current, kinds)
                outcome = Outcome(
                    current,
                    kind,
                    params,
                    LOST,
                    f"no progress within {CASE_TIMEOUT_S:.0f} s: the case hung (killed)",
                    CASE_TIMEOUT_S,
                    [_tail(stderr_path)],
                )
                _report(outcome, verbose, log)
                return outcomes + [outcome]
            line = proc.stdout.readline()
            if not line:  # the child ended
                if len(outcomes) < last - first:
                    kind, params = plan(seed, current, kinds)
                    outcome = Outcome(
                        current,
                        kind,
                        params,
                        LOST,
                        f"the case's process died (exit {proc.wait()}): a crash loses the run",
                        0.0,
                        [_tail(stderr_path)],
                    )
                    _report(outcome, verbose, log)
                    outcomes.append(outcome)
                return outcomes
            if not line.startswith(PREFIX):
                continue
            message = json.loads(line[len(PREFIX) :])
            if "start" in message:
                current, deadline = message["start"], time.monotonic() + CASE_TIMEOUT_S
                continue
            outcome = Outcome(**message)
            _report(outcome, verbose, log)
            outcomes.append(outcome)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _report(outcome: Outcome, verbose: bool, log) -> None:
    if log is not None:
        log.write(json.dumps(asdict(outcome)) + "\n")
        log.flush()
    if verbose or outcome.result != OK:
        params = {k: v for k, v in outcome.params.items() if k != "draw"}
        print(
            f"case {outcome.case:4d} {outcome.kind:7s} {outcome.result:7s} {outcome.seconds:6.1f}s "
            f"{params}" + (f"\n    {outcome.why}" if outcome.why else ""),
            flush=True,
        )
        if outcome.result != OK:
            for note in outcome.notes:
                print("    | " + str(note).replace("\n", "\n    | "), flush=True)


def summary(outcomes: list[Outcome]) -> dict:
    counts = {"cases": len(outcomes), **{r: 0 for r in RESULTS}}
    by_kind = {}
    for o in outcomes:
        counts[o.result] += 1
        by_kind.setdefault(o.kind, {r: 0 for r in RESULTS})[o.result] += 1
    counts["by_kind"] = by_kind
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help="comma-separated subset of " + ",".join(KINDS)
    )
    parser.add_argument(
        "--verbose", action="store_true", help="a line for every case, not only the others"
    )
    parser.add_argument("--log", default=None, help="write every outcome here (JSON lines)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--first", type=int, default=0, help="the first case's index (to run one case again)"
    )
    args = parser.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)} (known: {', '.join(KINDS)})")
    if args.child:
        # (--cases: the end, here)
        child_main(args.seed, args.first, args.cases, args.workdir, kinds)
        return 0
    start = time.monotonic()
    log = open(args.log, "w") if args.log else None
    try:
        outcomes = run(args.cases, args.seed, kinds, args.workdir, args.verbose, log, args.first)
    finally:
        if log is not None:
            log.close()
    counts = summary(outcomes)
    print(
        f"fault driver: seed {args.seed}, {counts['cases']} cases in {time.monotonic() - start:.0f}"
        " s: " + ", ".join(f"{r} {counts[r]}" for r in RESULTS)
    )
    for kind, c in sorted(counts["by_kind"].items()):
        print(f"  {kind:8s} " + ", ".join(f"{r} {c[r]}" for r in RESULTS))
    return 0 if counts[LOST] == counts[SILENT] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
