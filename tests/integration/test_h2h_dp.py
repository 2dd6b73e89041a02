"""The head-to-head harness on several ranks (h2h --gpus N, benchmarks/multi_gpu.py): the
arguments it checks, the per-rank results it sums, the scaling and bound rows, the cores each rank
is given, the launches that stand for hosts, each rank's data, and a 2-rank CPU run. Moved out of
test_h2h.py, which imports ``rank_result`` (one rank's record) and ``run_h2h`` (one harness run)
from here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_h2h(out: Path, *args: str) -> tuple[dict, subprocess.CompletedProcess]:
    """``python -m benchmarks.h2h ARGS --out OUT`` in a process of its own, which must exit 0:
    (its results.json, the finished process)."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.h2h", *args, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), proc


# --- data parallel (h2h --gpus N, benchmarks/multi_gpu.py) ----------------------------------------


def rank_result(rank, median, rss, steps=3, warmup=2, tokens=16384, status="ok", **extra):
    out = {
        "system": "megatrain",
        "model": "qwen2.5-3b",
        "layers": 36,
        "seq": 1024,
        "tokens_per_step": tokens,
        "rank": rank,
        "world_size": 2,
        "status": status,
        "error": "" if status == "ok" else "CUDA out of memory",
        "warmup_step_times_s": [9.0] * warmup,
        "step_times_s": [median] * steps,
        "median_step_s": median,
        "tokens_per_s": tokens / median,
        "flops_per_token": 1e10,
        "tflops": 1e10 * tokens / median / 1e12,
        "peak_host_rss_bytes": rss,
        "peak_gpu_bytes": 10**9 * (rank + 1),
        "n_params": 10**9,
        "host_bytes_per_param": rss / 10**9,
        "breakdown": {"step_s": median, "comm_s": 0.1 * (rank + 1)},
    }
    out.update(extra)
    return out


def test_h2h_dp_arguments_are_checked(tmp_path):
    from benchmarks import h2h

    for bad in (
        ["--gpus", "0"],
        ["--scaling"],
        ["--gpus", "1", "--scaling"],
        ["--gpus", "2", "--resident-mode", "x"],
        ["--gpus", "2", "--bind-cores", "maybe"],
        ["--gpus", "3", "--nodes", "2"],
    ):
        with pytest.raises(SystemExit):
            h2h.main(["--model", "tiny", "--device", "cpu", *bad, "--out", str(tmp_path)])


def test_dp_aggregate_sums_tokens_and_host_memory_over_ranks():
    from benchmarks import multi_gpu

    # rank 1's file first: the order of the files does not matter, rank 0's clock does
    res = multi_gpu.aggregate(
        [
            rank_result(1, 0.52, 30 * 10**9, engine_host_state_bytes=8 * 10**9),
            rank_result(0, 0.50, 34 * 10**9, engine_host_state_bytes=8 * 10**9),
        ],
        gpus=2,
    )
    assert res["status"] == "ok" and res["gpus"] == 2
    assert res["tokens_per_s"] == 16384 * 2 / 0.50  # tokens per rank × N / rank 0's median step
    assert (
        res["tokens_per_rank"] == res["tokens_per_step"] == 16384
        and res["global_tokens_per_step"] == 32768
    )
    assert res["tflops_total"] == 1e10 * res["tokens_per_s"] / 1e12
    assert res["tflops"] == res["tflops_per_gpu"] == res["tflops_total"] / 2
    assert res["peak_host_rss_bytes"] == 64 * 10**9 and res["peak_host_rss_bytes_per_rank"] == [
        34 * 10**9,
        30 * 10**9,
    ]
    assert res["host_bytes_per_param"] == 64.0  # summed over the ranks, per parameter of the model
    assert (
        res["engine_host_state_bytes"] == 16 * 10**9 and res["engine_host_bytes_per_param"] == 16.0
    )
    assert res["peak_gpu_bytes"] == 2 * 10**9  # the largest rank's
    assert res["breakdown"] == {"step_s": 0.50, "comm_s": 0.1}  # rank 0's, every key
    assert [r["rank"] for r in res["per_rank"]] == [0, 1] and res["rank_median_step_s"] == [
        0.50,
        0.52,
    ]


def test_dp_aggregate_fails_on_a_missing_rank_a_failed_rank_or_disagreeing_step_counts():
    from benchmarks import multi_gpu

    missing = multi_gpu.aggregate([rank_result(0, 0.5, 1)], gpus=2)
    assert (
        missing["status"] == "error"
        and "rank(s) [1]" in missing["error"]
        and missing["tokens_per_s"] == 0.0
    )
    oom = multi_gpu.aggregate(
        [rank_result(0, 0.5, 1), rank_result(1, 0.5, 1, status="oom")], gpus=2
    )
    assert oom["status"] == "oom" and "rank 1: oom" in oom["error"]
    steps = multi_gpu.aggregate([rank_result(0, 0.5, 1), rank_result(1, 0.5, 1, steps=2)], gpus=2)
    assert steps["status"] == "error" and "step count" in steps["error"]
    tokens = multi_gpu.aggregate(
        [rank_result(0, 0.5, 1), rank_result(1, 0.5, 1, tokens=8192)], gpus=2
    )
    assert tokens["status"] == "error" and "tokens per step" in tokens["error"]


def test_dp_scaling_and_bound_rows():
    from benchmarks import multi_gpu

    one = dict(rank_result(0, 0.5, 1), gpus=1, name="m1", file="f")
    two = dict(
        multi_gpu.aggregate([rank_result(0, 0.52, 1), rank_result(1, 0.52, 1)], 2),
        name="m2",
        file="f",
    )
    zero3 = dict(
        multi_gpu.aggregate(
            [rank_result(0, 2.0, 1, system="zero3"), rank_result(1, 2.0, 1, system="zero3")], 2
        ),
        name="z",
        file="g",
    )
    single = dict(rank_result(0, 0.25, 1, system="resident"), gpus=1)
    bound = multi_gpu.bound_from_single(single, 2, "test")
    assert bound["tokens_per_s"] == 2 * 16384 / 0.25 and bound["tflops"] == single["tflops"]
    assert multi_gpu.label(bound) == "resident ×2 (bound: 1 GPU × 2)"
    rows = [one, two, zero3, dict(bound, name="b", file="h")]
    (s,) = multi_gpu.scaling(rows)
    assert (
        abs(s["ratio"] - 0.5 / 0.52 * 2) < 1e-12
        and s["target"] == 1.9
        and abs(s["vs_zero3"] - 2.0 / 0.52) < 1e-12
    )
    lines = multi_gpu.scaling_lines(rows)
    assert (
        "**1.92×** (target ≥ 0.95·N = 1.90×: met)" in lines
        and "= 3.85× (target ≥ 2.5×: met)" in lines
    )
    table = multi_gpu.throughput_table(rows)
    row = next(line for line in table.splitlines() if line.startswith("| m2 "))
    # vs the whole-on-GPU bound of the same GPU count: 63,015 / 131,072 tokens/s
    assert "| 0.48× |" in row
    assert "| 3.85× |" in row  # vs ZeRO-3 ×2


def test_dp_rank_cpu_sets_keep_physical_cores_whole_and_launch_env():
    from benchmarks import multi_gpu

    # 2 NUMA nodes of 4 physical cores each, SMT siblings c and c + 8
    topo = {
        "cpus": list(range(16)),
        "nodes": {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7, 12, 13, 14, 15]},
        "siblings": {c: (c % 8, c % 8 + 8) for c in range(16)},
    }
    assert multi_gpu.rank_cpu_sets(2, topo) == [
        [0, 1, 2, 3, 8, 9, 10, 11],
        [4, 5, 6, 7, 12, 13, 14, 15],
    ]
    three = multi_gpu.rank_cpu_sets(3, topo)
    assert [len(b) for b in three] == [6, 6, 4] and sorted(sum(three, [])) == list(range(16))
    assert multi_gpu.rank_cpu_sets(9, topo) is None  # fewer physical cores than ranks: no binding
    env = multi_gpu.launch_env(2, env={"PATH": "/bin"}, topology=topo)
    assert env["H2H_RANK_CPUS"] == "0-3,8-11;4-7,12-15" and env["OMP_NUM_THREADS"] == "8"
    assert env["NCCL_NVLS_ENABLE"] == "0"  # NVLink multicast stays off in every rank
    kept = multi_gpu.launch_env(
        2, bind=False, env={"OMP_NUM_THREADS": "3", "H2H_RANK_CPUS": "stale"}, topology=topo
    )
    assert kept["OMP_NUM_THREADS"] == "3" and "H2H_RANK_CPUS" not in kept
    assert multi_gpu.launch_env(2, bind=False, env={}, topology=topo)["OMP_NUM_THREADS"] == "8"
    assert multi_gpu.cpulist([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert multi_gpu.rank_json("out/m_g2.json", 1) == "out/m_g2.rank1.json"
    cmd = multi_gpu.launch_cmd(
        "venv/bin/python", 2, ["--system", "zero3", "--json", "runs/x/z.json"]
    )
    assert multi_gpu.recorded_cmd(cmd, "runs/x/z.json") == (
        "python3 -m torch.distributed.run --standalone "
        "--nproc_per_node 2 -m benchmarks.run_system --system zero3 "
        "--json z.json"
    )


def test_node_launches_stand_for_hosts_on_one_box():
    """h2h --nodes 2: two torchrun launches (--nnodes 2, --node_rank 0/1 over 127.0.0.1), each with
    its GPU block and its own NCCL host identity, the ranks' core blocks kept."""
    from benchmarks import multi_gpu

    env = {
        "CUDA_VISIBLE_DEVICES": "4,5,6,7",
        "H2H_RANK_CPUS": "0-3;4-7;8-11;12-15",
        "OMP_NUM_THREADS": "4",
    }
    (cmd0, env0), (cmd1, env1) = multi_gpu.node_launches(
        "python3", 4, 2, ["--system", "megatrain"], 29511, env
    )
    assert (
        cmd0[cmd0.index("--nnodes") + 1] == "2" and cmd0[cmd0.index("--nproc_per_node") + 1] == "2"
    )
    assert [c[c.index("--node_rank") + 1] for c in (cmd0, cmd1)] == ["0", "1"]
    assert "--master_port" in cmd1 and cmd1[cmd1.index("--master_addr") + 1] == "127.0.0.1"
    assert (env0["CUDA_VISIBLE_DEVICES"], env1["CUDA_VISIBLE_DEVICES"]) == ("4,5", "6,7")
    assert (
        env0["NCCL_HOSTID"] != env1["NCCL_HOSTID"] and env1["H2H_RANK_CPUS"] == env["H2H_RANK_CPUS"]
    )
    # sockets only, as between hosts without InfiniBand: no NVLink/PCIe peer copies, no
    # shared-memory transport
    assert all(e["NCCL_P2P_DISABLE"] == e["NCCL_SHM_DISABLE"] == "1" for e in (env0, env1))
    assert cmd1[-2:] == ["--system", "megatrain"]


def test_make_batches_gives_each_rank_its_own_data_and_rank_0_the_one_process_data():
    import torch

    from benchmarks.common import make_batches

    one = make_batches(256, 2, 8, 3, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(one, make_batches(256, 2, 8, 3, seed=0, rank=0)))
    assert not torch.equal(one[0], make_batches(256, 2, 8, 3, seed=0, rank=1)[0])


def test_h2h_two_ranks_on_cpu_megatrain_scaling(tmp_path):
    """--gpus 2 on CPU (torchrun, gloo): megatrain on 1 and 2 ranks (--scaling); every rank's file,
    the sums and the recorded launch. FSDP2 on 2 ranks (the harness's N-GPU peer) trains each rank
    exactly as torch DDP does (the whole-on-GPU system on 2 ranks: plain PyTorch data parallel),
    rank by rank: the same losses, so the same averaged, clipped updates."""
    out = tmp_path / "dp"
    data, _ = run_h2h(
        out,
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--systems",
        "megatrain,fsdp,resident",
        "--seq",
        "64",
        "--tokens-per-step",
        "128",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--gpus",
        "2",
        "--scaling",
    )
    runs = {(r["system"], r["gpus"]): r for r in data["results"]}
    assert set(runs) == {("megatrain", 1), ("megatrain", 2), ("fsdp", 2), ("resident", 2)}
    for (system, gpus), r in runs.items():
        assert r["status"] == "ok", r.get("error")
        if gpus == 1 or system != "megatrain":
            continue
        ranks = r["per_rank"]
        assert [p["rank"] for p in ranks] == [0, 1] and all(p["status"] == "ok" for p in ranks)
        assert len({len(p["step_times_s"]) for p in ranks}) == 1
        assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank trains on its own micro-batch
        assert r["tokens_per_s"] == 128 * 2 / r["median_step_s"]
        assert r["peak_host_rss_bytes"] == sum(p["peak_host_rss_bytes"] for p in ranks)
        assert r["host_bytes_per_param"] == r["peak_host_rss_bytes"] / r["n_params"]
        assert r["settings"]["ranks"] == 2 and r["settings"]["data_parallel"]
        assert "torch.distributed.run --standalone --nproc_per_node 2" in r["launch"]["command"]
        assert (out / f"{r['name']}.rank1.json").exists()
    assert runs[("megatrain", 2)]["settings"]["owned_layers"] == "1/2"  # layer i on rank i % 2
    fsdp, ddp = (runs[(system, 2)]["per_rank"] for system in ("fsdp", "resident"))
    for f, d in zip(fsdp, ddp):
        # one step's update moves this loss by 3-4e-5 (lr 1e-5 against lr 0): 1e-6 would see a
        # fortieth of it
        assert len(f["losses"]) == 3 and f["losses"] == pytest.approx(d["losses"], rel=0, abs=1e-6)
    assert fsdp[0]["losses"] != fsdp[1]["losses"]
    (s,) = data["scaling"]
    assert (
        s["ratio"]
        == runs[("megatrain", 2)]["tokens_per_s"] / runs[("megatrain", 1)]["tokens_per_s"]
    )
    md = (out / "results.md").read_text()
    assert (
        "scaling megatrain_Ldefault_128_g2" in md
        and "megatrain ×2" in md
        and "Launch commands" in md
    )
