"""Data parallel on CPU (gloo, 2 processes; dp.py): the same global batch gives the same training.

- 2 ranks x micro-batch M == 1 process with GA 2 (and 2 ranks x GA 2 == GA 4, with tied embeddings,
  a kept layer and GPU-held optimizer state on the CPU device): per-micro-batch losses, global grad
  norms and final fp32 weights within 1e-5, every rank ending with the same weights;
- == real DeepSpeed ZeRO-3 (CPU offload) with 2 ranks on the same script and config;
- host state is held once: each rank holds only the layers and resident parameters it owns, and the
  planner's host bytes for 2 ranks are theirs to the byte (several nodes:
  tests/integration/test_dp_nodes.py).
Script: tests/scripts/dp_train.py (a DeepSpeed-style script; ``--engine deepspeed`` runs real
DeepSpeed).
"""

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from tests.fork_launch import warm_run
from tests.launch import run_again_after_exit_abort

HERE = Path(__file__).resolve().parents[1]  # tests/
SCRIPT = HERE / "scripts" / "dp_train.py"
REPO = HERE.parent
TOL = 1e-5


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(gpu: bool = False) -> dict:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        NCCL_NVLS_ENABLE="0",
        **({} if gpu else {"CUDA_VISIBLE_DEVICES": ""}),
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    )
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _check(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode != 0:  # plain text, whole: pytest cuts a tuple's repr short
        pytest.fail(
            f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n"
            f"{proc.stderr[-8000:]}",
            pytrace=False,
        )


def run(out: Path, *args: str, ranks: int = 1, gpu: bool = False) -> dict:
    """The script with ``ranks`` processes or one plain process; its record and final weights. The
    launch and its ranks are forked from a process that imported the libraries once, with torchrun's
    environment (tests/fork_launch.py's warm_run: a launch costs no imports); the real launchers are
    tested in test_dp_launchers.py."""

    def launch():
        return warm_run(ranks, str(SCRIPT), ["--out", str(out), *args], _env(gpu), timeout=900)

    _check(run_again_after_exit_abort(launch))
    record = json.loads(out.read_text())
    record["weights"] = torch.load(str(out) + ".pt")
    return record


def assert_same_training(got: dict, want: dict) -> None:
    assert sorted(got["loss"], key=int) == sorted(want["loss"], key=int)
    for k, loss in want["loss"].items():
        assert abs(got["loss"][k] - loss) <= TOL * max(1.0, abs(loss)), (
            f"micro-batch {k}: {got['loss'][k]} vs {loss}"
        )
    for step, (g, w) in enumerate(zip(got["grad_norm"], want["grad_norm"], strict=True)):
        assert abs(g - w) <= TOL * max(1.0, abs(w)), f"grad norm at step {step}: {g} vs {w}"
    assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)
    assert set(got["weights"]) == set(want["weights"])
    for name, w in want["weights"].items():
        diff = (got["weights"][name] - w).abs().max().item()
        assert diff <= TOL, f"{name}: max |diff| {diff}"
    assert len(set(got["digests"])) == 1, "ranks ended with different weights"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp")
    return {
        "dp2": run(tmp / "dp2.json", ranks=2),
        "ga2": run(tmp / "ga2.json", "--ga", "2"),
        "tmp": tmp,
    }


def test_every_rank_destroys_its_process_groups_at_exit(runs):
    """A script that never calls destroy_process_group() (dp_train.py does not) exits cleanly: the
    engine's exit handler destroys the groups (gloo's worker threads can abort a process at
    interpreter exit)."""
    for rank in range(2):
        assert (runs["tmp"] / f"dp2.json.exit{rank}").read_text() == "destroyed"
    assert (runs["tmp"] / "ga2.json.exit0").read_text() == "destroyed"


def test_two_ranks_equal_one_process_with_ga2(runs):
    dp2, ga2 = runs["dp2"], runs["ga2"]
    assert dp2["world"] == 2 and ga2["world"] == 1
    assert_same_training(dp2, ga2)
    # the run moved: clipping at 1.0 fired (norms > 1) and the weights changed from step to step
    assert min(dp2["grad_norm"]) > 1.0


def test_each_rank_holds_only_its_layers(runs):
    held = runs["dp2"]["host_elements"]
    total = held[0][1]
    assert sum(n for n, _ in held) == total  # once over the run, not once per rank
    assert all(0 < n < total for n, _ in held)
    assert runs["ga2"]["host_elements"][0][0] == total


def test_each_resident_parameter_is_held_by_one_rank_and_the_plan_counts_the_host(runs):
    """The resident parameters' state (untied embedding, final norm, head) is held once over the
    ranks: the embedding and the head on different ranks (dp.resident_positions);
    engine.host_memory() summed over the ranks equals the planner's host state for 2 ranks to the
    byte (and one process's, with GA 2, its own)."""
    ranks, one = runs["dp2"]["ranks"], runs["ga2"]["ranks"][0]
    held = [set(r["resident"]) for r in ranks]
    assert not held[0] & held[1] and held[0] | held[1] == set(one["resident"])
    assert len(one["resident"]) == 3 and all(held)
    assert {"model.embed_tokens.weight", "lm_head.weight"} - held[0] and {
        "model.embed_tokens.weight",
        "lm_head.weight",
    } - held[1]
    total = sum(r["host_bytes"] for r in ranks)
    assert (
        total == runs["dp2"]["planned_host_bytes"]
        and one["host_bytes"] == runs["ga2"]["planned_host_bytes"]
    )
    assert [r["local_world"] for r in ranks] == [2, 2]


def test_two_ranks_with_ga_tied_kept_layer_and_device_state_equal_ga4(tmp_path):
    """GA 2 on 2 ranks (landing ring), tied embeddings (a replicated resident parameter), the last
    layer kept (no recompute) and the leading 2 layers' optimizer state on the compute device: == 1
    process with GA 4."""
    mt = json.dumps({"keep_activations": 1, "gpu_optimizer_layers": 2})
    got = run(tmp_path / "a.json", "--ga", "2", "--tied", "--mt", mt, ranks=2)
    want = run(tmp_path / "b.json", "--ga", "4", "--tied")
    assert_same_training(got, want)


def test_two_ranks_with_weight_cache_equal_one_process_without(tmp_path):
    """The weight cache under data parallel (executor.py's [Note: weight cache]): each load is a
    broadcast, so every rank must cache the same layers, whatever layers of the GPU-held range it
    owns. 6 layers, the last kept, the leading 2 GPU-held: the cache takes layer 2 on both ranks;
    2 ranks with GA 2 train as 1 process with GA 4 and no cache."""
    mt = {"keep_activations": 1, "gpu_optimizer_layers": 2}
    cached = json.dumps({**mt, "weight_cache_layers": 3})
    got = run(tmp_path / "a.json", "--ga", "2", "--layers", "6", "--mt", cached, ranks=2)
    want = run(tmp_path / "b.json", "--ga", "4", "--layers", "6", "--mt", json.dumps(mt))
    assert_same_training(got, want)


def test_nvme_tier_two_ranks_equal_one_process_with_ga2(runs, tmp_path):
    """The NVMe tier under data parallel: each rank keeps the Adam moments of the layers it owns in
    its own swap file (every layer on disk), and 2 ranks train as 1 host-only process with GA 2; a
    checkpoint (each owner reads its layers' moments from disk to scatter them) resumes into a
    host-only process exactly as the uninterrupted run."""
    mt = json.dumps({"nvme_layers": 3, "nvme_backend": "threads"})
    got = run(
        tmp_path / "a.json",
        "--nvme",
        str(tmp_path),
        "--mt",
        mt,
        "--save",
        str(tmp_path / "ckpt"),
        ranks=2,
    )
    assert_same_training(got, runs["ga2"])
    # each rank's swap folder goes with its engine (and the empty root)
    swap = tmp_path / "megatrain_ds_swap"
    assert not swap.exists() or not os.listdir(swap)
    resumed = run(tmp_path / "b.json", "--ga", "2", "--load", str(tmp_path / "ckpt"))
    for k, loss in resumed["loss"].items():
        assert abs(loss - runs["ga2"]["loss"][k]) <= TOL * max(1.0, abs(loss)), f"micro-batch {k}"


def test_nvme_masters_two_ranks_equal_host_only(tmp_path):
    """Masters on NVMe too (offload_param nvme): 2 ranks, each owner's swap file holding its layers'
    fp32 masters and moments, train bit for bit as 2 host-only ranks with the same bf16 wire; the
    checkpoint (each owner reads its disk masters to scatter them) loads into one host-only process
    with exactly the saved weights."""
    # no speculative steps: with clipping firing, which layers were stepped before the norm was
    # known depends on timing, and their rollback is exact to a few ulps only (speculation.py);
    # bit-for-bit needs the same path twice
    mt = {"stream_fp32_master": False, "speculative_step": False}
    args = ("--bf16", "--steps", "3", "--save-at", "3")
    got = run(
        tmp_path / "a.json",
        *args,
        "--nvme",
        str(tmp_path),
        "--nvme-masters",
        "--save",
        str(tmp_path / "ckpt"),
        "--mt",
        json.dumps({**mt, "nvme_layers": 2, "nvme_backend": "threads"}),
        ranks=2,
    )
    want = run(tmp_path / "b.json", *args, "--mt", json.dumps(mt), ranks=2)
    assert_same_training(got, want)
    for name, w in want["weights"].items():
        assert torch.equal(got["weights"][name], w), name
    loaded = run(
        tmp_path / "c.json",
        "--bf16",
        "--ga",
        "2",
        "--steps",
        "0",
        "--load",
        str(tmp_path / "ckpt"),
        "--mt",
        json.dumps(mt),
    )
    for name, w in want["weights"].items():
        assert torch.equal(loaded["weights"][name], w), name


def test_bf16_masters_two_ranks(tmp_path):
    """bf16-master mode (the streamed layers' master is the bf16 wire) on 2 ranks: each owner
    updates its layers' bf16 masters; trains as 1 process with GA 2 to bf16 rounding (the ranks'
    gradients are reduced in bf16), every rank ends with the same weights, and the NVMe tier under
    it changes no bit."""
    args = (
        "--bf16",
        "--bf16-masters",
        "--steps",
        "3",
        "--mt",
        json.dumps({"nvme_backend": "threads"}),
    )
    got = run(tmp_path / "a.json", *args, ranks=2)
    want = run(tmp_path / "b.json", *args, "--ga", "2")
    for k, loss in want["loss"].items():
        assert abs(got["loss"][k] - loss) <= 2e-2 * abs(loss), f"micro-batch {k}"
    assert len(set(got["digests"])) == 1
    for name, w in want["weights"].items():
        # the streamed layers' masters: bf16, within bf16 rounding of one process's
        if "layers" in name:
            assert got["weights"][name].dtype == torch.bfloat16, name
            assert (got["weights"][name].float() - w.float()).abs().max().item() <= 2e-2, name
    tier = run(tmp_path / "c.json", *args, "--nvme", str(tmp_path), ranks=2)
    assert tier["loss"] == got["loss"]
    for name, w in got["weights"].items():
        assert torch.equal(tier["weights"][name], w), name


def test_compact_moments_two_ranks(tmp_path):
    """bf16 masters and bf16 moments (bf16_optimizer_states) on 2 ranks: each owner holds its
    layers' bf16 moments; trains as 1 process with GA 2 does to bf16 rounding, and every rank ends
    with the same weights."""
    args = ("--bf16", "--bf16-masters", "--bf16-moments", "--steps", "3")
    got = run(tmp_path / "a.json", *args, ranks=2)
    want = run(tmp_path / "b.json", *args, "--ga", "2")
    assert got["moments_dtype"] == want["moments_dtype"] == "torch.bfloat16"
    for k, loss in want["loss"].items():
        assert abs(got["loss"][k] - loss) <= 2e-2 * abs(loss), f"micro-batch {k}"
    assert len(set(got["digests"])) == 1
    for name, w in want["weights"].items():
        if "layers" in name:
            assert (got["weights"][name].float() - w.float()).abs().max().item() <= 2e-2, name


def test_lora_bf16_two_ranks(tmp_path):
    """PEFT LoRA in bf16 on 2 ranks (each layer's frozen base held by its owner in bf16 only,
    host_state.py): trains as 1 process with GA 2 (to bf16 rounding: the ranks' gradients are
    reduced in bf16), and the checkpoint holds every rank's bf16 frozen fragments and the adapter as
    peft saves it."""
    peft = pytest.importorskip("peft")
    ckpt = tmp_path / "ckpt"
    args = ("--lora", "4", "--bf16", "--steps", "3")
    got = run(tmp_path / "a.json", *args, "--save", str(ckpt), ranks=2)
    want = run(tmp_path / "b.json", *args, "--ga", "2")
    for k, loss in want["loss"].items():
        assert abs(got["loss"][k] - loss) <= 2e-2 * abs(loss), f"micro-batch {k}"
    lora = [n for n in want["weights"] if "lora_" in n]
    assert lora and len(set(got["digests"])) == 1
    for name in lora:
        assert (got["weights"][name] - want["weights"][name]).abs().max().item() <= 2e-3, name
    for name, w in want["weights"].items():  # the base never moves and is kept in bf16
        if "lora_" not in name and w.dim() == 2 and "embed" not in name:
            assert w.dtype == torch.bfloat16 and torch.equal(got["weights"][name], w), name
    folder = ckpt / "global_step2"
    for rank in range(2):
        states = torch.load(
            folder / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", weights_only=False
        )
        assert all(t.dtype == torch.bfloat16 for t in states["frozen_param_fragments"].values())
    assert (folder / "adapter_model.safetensors").exists()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    base = Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        )
    )
    assert peft.get_peft_model_state_dict(peft.PeftModel.from_pretrained(base, str(folder)))


def test_two_ranks_equal_real_deepspeed_zero3(runs):
    """The same script and config under real DeepSpeed ZeRO-3 (CPU offload, gloo) with 2 ranks."""
    real = run(runs["tmp"] / "ds2.json", "--engine", "deepspeed", ranks=2)
    assert_same_training(runs["dp2"], real)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (the nvidia-h200-x2 box)")
@pytest.mark.parametrize("megatrain", ["{}", '{"speculative_step": false, "keep_activations": 0}'])
def test_two_gpus_equal_one_gpu_with_ga(tmp_path, megatrain):
    """NCCL, the real streams: 2 GPUs x GA 2 == 1 GPU with GA 4 (fp32, tied embeddings; the engine's
    defaults place kept layers and GPU-held optimizer state after the first step, speculation on;
    then without them). This caught a stream race: the owner's accumulate of a reduced gradient on
    d2h without handing it over."""
    got = run(tmp_path / "g2.json", "--ga", "2", "--tied", "--mt", megatrain, ranks=2, gpu=True)
    want = run(tmp_path / "g1.json", "--ga", "4", "--tied", "--mt", megatrain, gpu=True)
    assert_same_training(got, want)
