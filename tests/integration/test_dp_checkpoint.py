"""Checkpoints under data parallel (CPU, gloo, 2 processes; checkpoint.py, dp.py).

One module fixture makes every checkpoint and run the tests compare (tests/scripts/dp_ckpt_run.py:
PlainLM with odd parameter sizes, so ZeRO-3's 2-rank partitions are padded, and frozen norms in the
streamed layers; GA-free 2-rank runs against 1-process GA 2 runs on the same global batches):

1. real DeepSpeed ZeRO-3 (CPU offload), 2 ranks: 4 steps, a checkpoint after 2 (``ds``);
2. megatrain_ds, 1 process, GA 2: 4 steps, a checkpoint after 2 (``ck1``; in this process);
3. megatrain_ds, 2 ranks: 4 steps, a checkpoint after 2 (``ck2``), ``save_16bit_model`` at the end,
   then fresh engines (another init) resume ``ck2``, ``ck1`` (with GPU-held optimizer state, saving
   again at its end) and ``ds`` on 2 ranks, and a load of ``ck2`` that fails its check on rank 1
   only;
4. megatrain_ds, 1 process, GA 2, resumes ``ck2`` and ``ds`` (in this process).

Every resume continues the run that saved the checkpoint: the same losses and learning rates, and
the same final fp32 weights, within 1e-6 (megatrain_ds's own checkpoints) and as DeepSpeed's own
continuation within 1e-6.
"""

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.launch import EXIT_ABORT, aborted_at_exit

HERE = Path(__file__).resolve().parents[1]  # tests/
SCRIPT = HERE / "scripts" / "dp_ckpt_run.py"
REPO = HERE.parent
TOL = 1e-6
# the 1 -> 2 resume: the leading 2 layers' optimizer state "on the GPU" (the compute device: here
# the CPU) and the last layer kept without recompute; it saves again at its end (the GPU-held state
# comes back to the host first)
DEVICE_STATE = json.dumps({"gpu_optimizer_layers": 2, "keep_activations": 1})


def _script():
    spec = importlib.util.spec_from_file_location("dp_ckpt_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(*args: str) -> subprocess.Popen:
    """The script on 2 ranks (gloo on the CPU), forked with torchrun's environment
    (tests/fork_launch.py)."""
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    )
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["MASTER_PORT"] = str(_port())
    cmd = [sys.executable, "-m", "tests.fork_launch", "2", str(SCRIPT), *args]
    # a session of its own: a failing test stops the launcher and its ranks together (_stop)
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()


def _finish_all(launches: list[tuple[subprocess.Popen, Path]]) -> list[dict]:
    """Wait for every launch, then read each one's record. A launch whose rank died of the exit-time
    abort (tests/launch.py) is run again, up to three launches in all, after all of them finished
    (no launch reads a folder it rewrites)."""
    done = [(proc, *proc.communicate(timeout=600)) for proc, _ in launches]
    records = []
    for (proc, stdout, stderr), (_, out) in zip(done, launches):
        for _ in range(2):
            if not aborted_at_exit(proc.returncode, stderr):
                break
            print(
                f"[tests/launch.py] a rank died of {EXIT_ABORT!r} after its script; launching "
                "again",
                flush=True,
            )
            proc = _launch(*proc.args[proc.args.index(str(SCRIPT)) + 1 :])
            stdout, stderr = proc.communicate(timeout=600)
        if proc.returncode != 0:  # plain text, whole: pytest cuts a tuple's repr short
            pytest.fail(
                f"exit {proc.returncode}\n--- stdout ---\n{stdout[-3000:]}\n--- stderr ---\n"
                f"{stderr[-8000:]}",
                pytrace=False,
            )
        records.append(_record(out))
    return records


def _record(out: Path) -> dict:
    record = json.loads(out.read_text())
    for name, run in record["runs"].items():
        run["weights"] = torch.load(f"{out}.{name}.pt")
    return record


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp_ckpt")
    script = _script()
    # DeepSpeed's run and ours side by side (most of a launch's time is start-up, not compute): ours
    # resumes the DeepSpeed checkpoint last, once DeepSpeed's run has written its record (its
    # checkpoint is complete then)
    launches = [
        _launch("--engine", "deepspeed", "--out", str(tmp / "ds.json"), "--save", str(tmp / "ds"))
    ]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            script.main(["--ga", "2", "--out", str(tmp / "one.json"), "--save", str(tmp / "ck1")])
        launches.append(
            _launch(
                "--out",
                str(tmp / "two.json"),
                "--save",
                str(tmp / "ck2"),
                "--export",
                str(tmp / "export"),
                "--resume",
                str(tmp / "ck2"),
                "--resume",
                str(tmp / "ck1"),
                "--resume",
                str(tmp / "ds"),
                "--resume-mt",
                "{}",
                "--resume-mt",
                DEVICE_STATE,
                "--wait",
                "",
                "--wait",
                "",
                "--wait",
                str(tmp / "ds.json"),
                "--end-save",
                str(tmp / "end"),
                "--refuse",
                str(tmp / "ck2"),
            )
        )
        ds, two = _finish_all([(launches[0], tmp / "ds.json"), (launches[1], tmp / "two.json")])
    finally:
        _stop(*launches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        script.main(
            [
                "--ga",
                "2",
                "--no-train",
                "--out",
                str(tmp / "back.json"),
                "--resume",
                str(tmp / "ck2"),
                "--resume",
                str(tmp / "ds"),
            ]
        )
    return {
        "ds": ds,
        "one": _record(tmp / "one.json"),
        "two": two,
        "back": _record(tmp / "back.json"),
        "warnings": [str(w.message) for w in caught],
        "tmp": tmp,
    }


def _continues(got: dict, want: dict, tol: float = TOL) -> None:
    """``got`` (a resume from step 2) continues ``want`` (a run that never stopped)."""
    assert got["start"] == 2 and sorted(got["loss"], key=int) == [str(k) for k in range(4, 8)]
    for k, loss in got["loss"].items():
        assert abs(loss - want["loss"][k]) <= tol * max(1.0, abs(want["loss"][k])), (
            f"micro-batch {k}"
        )
    assert got["lr"] == pytest.approx(want["lr"][2:], rel=1e-12)
    assert set(got["weights"]) == set(want["weights"])
    for name, w in want["weights"].items():
        diff = (got["weights"][name] - w).abs().max().item()
        assert diff <= tol, f"{name}: max |diff| {diff}"


def test_two_rank_checkpoint_resumes_on_two_ranks_and_on_one(runs):
    two, back = runs["two"], runs["back"]
    straight = two["runs"]["straight"]
    _continues(two["runs"]["resume0"], straight)  # 2 -> 2
    _continues(back["runs"]["resume0"], straight)  # 2 -> 1 (GA 2: the same global batches)
    # each rank: its own client state
    assert two["runs"]["resume0"]["client"] == {"rank": 0, "step": 2}
    assert back["runs"]["resume0"]["loaded"] == str(runs["tmp"] / "ck2" / "global_step2")
    # the RNG states belong to the 2 saving ranks: one process does not restore them, and says so
    assert any("saved by 2 rank(s) and is loaded by 1" in w for w in runs["warnings"])


def test_one_rank_checkpoint_resumes_on_two_ranks(runs):
    """1 -> 2, into engines holding the leading layers' optimizer state on the compute device; that
    run's own checkpoint at its end (saved from the device-held state) holds its final weights."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    resumed = runs["two"]["runs"]["resume1"]
    assert resumed["mt"] == DEVICE_STATE
    _continues(resumed, runs["one"]["runs"]["straight"])
    saved = get_fp32_state_dict_from_zero_checkpoint(str(runs["tmp"] / "end" / "resume1"))
    assert set(saved) == set(resumed["weights"])
    for name, w in resumed["weights"].items():
        assert torch.equal(torch.as_tensor(saved[name].contiguous()), w), name


def test_a_load_refused_on_one_rank_is_refused_on_every_rank(runs):
    """The check fails on rank 1 only: both ranks raise (rank 0 naming rank 1), neither wrote
    anything."""
    (kind0, message0), untouched0 = runs["two"]["refused"][0]
    (kind1, message1), untouched1 = runs["two"]["refused"][1]
    assert kind0 == kind1 == "CheckpointMismatchError" and untouched0 and untouched1
    assert "refused on this rank only" in message1
    assert (
        message0.startswith("rank 1 failed to load")
        and "nothing was loaded on any rank" in message0
    )


def test_deepspeed_two_rank_zero3_checkpoint_resumes_on_two_ranks_and_on_one(runs):
    """Real DeepSpeed ZeRO-3's 2-rank checkpoint (its frozen fragments and optimizer partitions):
    megatrain_ds on 2 ranks and on 1 continues it as DeepSpeed's own run did."""
    ds = runs["ds"]["runs"]["straight"]
    _continues(runs["two"]["runs"]["resume2"], ds)
    _continues(runs["back"]["runs"]["resume1"], ds)


def test_the_two_rank_layout_is_deepspeeds_and_zero_to_fp32_reads_it(runs):
    """Each rank wrote its ZeRO-3 partitions (ceil(numel / 2) elements per parameter, the last
    rank's padded); DeepSpeed's zero_to_fp32 reconstructs exactly the engine's fp32 masters at the
    save (frozen ones included)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from megatrain_ds.checkpoints.checkpoint import fp32_state_dict

    ckpt, folder = runs["tmp"] / "ck2", runs["tmp"] / "ck2" / "global_step2"
    assert sorted(os.listdir(folder)) == sorted(
        [
            f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt"
            for r in (0, 1)
            for kind in ("model", "optim")
        ]
        + [f"zero_pp_rank_{r}_checksums.sha256" for r in (0, 1)]
    )
    want = torch.load(str(runs["tmp"] / "two.json") + ".at_save.pt")
    for r in (0, 1):
        states = torch.load(
            folder / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", weights_only=False
        )
        optim = torch.load(
            folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", weights_only=False
        )
        zero = optim["optimizer_state_dict"]
        assert (
            states["dp_world_size"] == 2
            and zero["partition_count"] == 2
            and zero["zero_stage"] == 3
        )
        for group, flat in zip(states["param_shapes"], zero["fp32_flat_groups"], strict=True):
            parts = [(want[n].reshape(-1), -(-want[n].numel() // 2)) for n in group]
            assert flat.numel() == sum(p for _, p in parts)
            offset = 0
            for full, p in parts:  # rank r's slice of each parameter, zeros past its end
                piece = torch.zeros(p)
                own = full[r * p : (r + 1) * p]
                piece[: own.numel()] = own
                assert torch.equal(flat[offset : offset + p], piece)
                offset += p
        assert set(states["frozen_param_fragments"]) == {
            f"blocks.{i}.norm.{w}" for i in range(3) for w in ("weight", "bias")
        }
        # 33 = 17 + 16 (+1 pad)
        assert all(t.numel() == 17 for t in states["frozen_param_fragments"].values())
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    ours = fp32_state_dict(str(folder))
    assert set(theirs) == set(want) == set(ours)
    for name, w in want.items():
        assert torch.equal(torch.as_tensor(theirs[name].contiguous()), w), name
        assert torch.equal(ours[name], w), name


def test_sixteen_bit_export_under_two_ranks(runs):
    """save_16bit_model: gathered to rank 0, written by it, in place when any rank returns; the
    consolidated state dict is rank 0's (None on the others, as DeepSpeed's)."""
    two = runs["two"]
    assert two["consolidated_is_none"] == [False, True] and two["export_exists_on_return"]
    exported = torch.load(runs["tmp"] / "export" / "model.bin", weights_only=True)
    final = two["runs"]["straight"]["weights"]
    assert set(exported) == set(final)
    for name, w in final.items():
        # fp32 compute on the CPU: the masters themselves
        assert torch.equal(exported[name], w), name


def test_a_two_rank_checkpoint_that_does_not_fit_changes_nothing(runs, tmp_path):
    """Checked before any write with N-rank files too; a missing rank's file is named."""
    import megatrain_ds
    from megatrain_ds.checkpoints.checkpoint import CheckpointMismatchError
    from tests.models import PlainLM

    model = PlainLM(vocab=63, width=35, depth=3)  # another width: every shape differs
    engine, *_ = megatrain_ds.initialize(
        model=model, config={"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}}
    )
    before = {k: v.clone() for k, v in engine.master_state_dict().items()}
    with pytest.raises(
        CheckpointMismatchError, match=r"blocks\.0\.fc1\.weight: shape \(66, 33\) in the checkpoint"
    ):
        engine.load_checkpoint(str(runs["tmp"] / "ck2"))
    after = engine.master_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()) and engine.global_steps == 0
    engine.destroy()
    broken = tmp_path / "ck"
    shutil.copytree(runs["tmp"] / "ck2", broken)
    os.remove(broken / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(
        FileNotFoundError, match="saved by 2 ranks, but .*zero_pp_rank_1_mp_rank_00_optim_states.pt"
    ):
        _script().main(
            ["--ga", "2", "--no-train", "--out", str(tmp_path / "x.json"), "--resume", str(broken)]
        )


def test_a_corrupted_rank_file_of_a_two_rank_checkpoint_is_refused(runs, tmp_path):
    """Each rank's save records its files' SHA-256; a load verifies every rank's manifest before
    reading (issue 27)."""
    import megatrain_ds
    from megatrain_ds.checkpoints.checksums import ChecksumError

    broken = tmp_path / "ck"
    shutil.copytree(runs["tmp"] / "ck2", broken)
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray((broken / "global_step2" / name).read_bytes())
    data[len(data) // 3] ^= 0x01
    (broken / "global_step2" / name).write_bytes(bytes(data))
    # the saving run's model, another init
    engine, *_ = megatrain_ds.initialize(
        model=_script().model(1),
        config={"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}},
    )
    before = {k: v.clone() for k, v in engine.master_state_dict().items()}
    with pytest.raises(ChecksumError, match=f"{name} is corrupted"):
        engine.load_checkpoint(str(broken))
    after = engine.master_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()) and engine.global_steps == 0
    engine.destroy()
