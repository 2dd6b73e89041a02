"""The harness's FSDP2 and Gemini peers and the depth driver (benchmarks/fsdp_system.py,
gemini_system.py, depth.py),
on the CPU: FSDP2 (gloo, one rank, CPU offload, fp32) trains a tiny model with the same losses as
plain PyTorch
AdamW; Gemini records why it did not run; the depth driver's order, records and figure."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from benchmarks.shapes import make_config

DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


@pytest.fixture
def one_process_world(monkeypatch):
    """The systems fill in a one-process torch.distributed env; undo it and the process group
    afterwards."""
    for key in DIST_ENV:
        monkeypatch.delenv(key, raising=False)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def test_fsdp_losses_match_plain_adamw(one_process_world, monkeypatch):
    from benchmarks.fsdp_system import run_fsdp
    from benchmarks.systems import run_resident

    monkeypatch.setenv("H2H_CLIP", "1.0")
    config = make_config("tiny")
    fsdp = run_fsdp(config, 256, seq=64, steps=3, warmup=1, device="cpu", seed=3)
    assert fsdp["status"] == "ok", fsdp.get("error")
    plain = run_resident(config, 256, seq=64, steps=3, warmup=1, device="cpu", seed=3)
    assert len(fsdp["losses"]) == 4
    # the same init, data, AdamW and clip: steps 2-4 see the updates, so equal losses mean equal
    # updates (one update moves this loss by about 4e-5: lr 1e-5 against lr 0)
    assert fsdp["losses"] == pytest.approx(plain["losses"], rel=0, abs=1e-6)
    assert fsdp["n_params"] == plain["n_params"]
    s = fsdp["settings"]
    assert s["mesh_size"] == 1 and s["fused"] is True and s["clip"] == 1.0
    assert s["lr"] == 1e-5 and s["weight_decay"] == 0.01 and s["offload_optimizer_ratio"] == 1.0
    assert fsdp["tflops"] > 0 and fsdp["peak_host_rss_bytes"] > 0


def test_fsdp_keeps_its_model_until_the_result_is_written(one_process_world, monkeypatch):
    """Under run_system (common.DEFER_TEARDOWN) FSDP2's model and optimizer, whose offloaded state
    took 178 GB of host at 7B, live until the release after the result is written."""
    import gc
    import weakref

    from benchmarks import common, fsdp_system

    built = []
    build = fsdp_system.build_fsdp

    def recording_build(*args, **kwargs):
        model, optimizer, facts = build(*args, **kwargs)
        built.append(weakref.ref(model))
        return model, optimizer, facts

    monkeypatch.setattr(fsdp_system, "build_fsdp", recording_build)
    monkeypatch.setattr(common, "DEFER_TEARDOWN", True)
    res = fsdp_system.run_fsdp(make_config("tiny"), 256, seq=64, steps=1, warmup=1, device="cpu")
    assert res["status"] == "ok", res.get("error")
    gc.collect()
    assert built[0]() is not None  # held for the teardown after the result
    assert common.release_after_result() == 1
    assert built[0]() is None


def test_fsdp_wraps_each_layer_with_checkpointing_and_offload(one_process_world):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from benchmarks.fsdp_system import build_fsdp

    model, optimizer, facts = build_fsdp(make_config("tiny"), "cpu", seed=0, init="hf")
    layers = list(model.model.layers)
    assert layers and all(
        isinstance(layer, CheckpointWrapper) and isinstance(layer, FSDPModule) for layer in layers
    )
    assert isinstance(model, FSDPModule)
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied stays tied
    assert facts["mixed_precision"] == "none (fp32)"


def test_gemini_records_why_it_did_not_run(monkeypatch):
    from benchmarks import gemini_system

    monkeypatch.setenv("H2H_CLIP", "1.0")
    res = gemini_system.run_gemini(
        make_config("tiny"), 128, seq=64, steps=1, warmup=1, device="cpu"
    )
    assert res["status"] == gemini_system.DID_NOT_RUN
    assert res["error"]  # the import error, or that it needs CUDA
    plugin = res["settings"]["gemini_plugin"]
    assert (
        plugin["placement_policy"] == "static"
        and plugin["precision"] == "bf16"
        and plugin["max_norm"] == 1.0
    )
    assert plugin["offload_optim_frac"] == 1.0 and plugin["offload_param_frac"] == 1.0
    monkeypatch.setenv("GEMINI_PLACEMENT", "auto")
    assert gemini_system.plugin_kwargs() == {
        "placement_policy": "auto",
        "precision": "bf16",
        "pin_memory": True,
        "max_norm": 1.0,
        "max_prefetch": 0,
    }
    monkeypatch.setenv("GEMINI_MAX_PREFETCH", "4")
    assert gemini_system.plugin_kwargs()["max_prefetch"] == 4
    # pageable host chunks, recorded with the plugin's settings
    monkeypatch.setenv("GEMINI_PIN", "0")
    assert gemini_system.plugin_kwargs()["pin_memory"] is False
    # the static placement with the bf16 parameters on the GPU; a share outside [0, 1] is refused
    monkeypatch.setenv("GEMINI_OFFLOAD_PARAM", "0")
    kw = gemini_system.plugin_kwargs("static")
    assert kw["offload_param_frac"] == 0.0 and kw["offload_optim_frac"] == 1.0
    monkeypatch.setenv("GEMINI_OFFLOAD_PARAM", "1.5")
    with pytest.raises(ValueError, match="GEMINI_OFFLOAD_PARAM"):
        gemini_system.plugin_kwargs("static")


def test_run_system_knows_the_new_systems():
    from benchmarks import host_check, run_system

    assert {"fsdp", "gemini"} <= set(run_system.SYSTEMS) and {"fsdp", "gemini"} <= set(
        host_check.HOST_BYTES_PER_PARAM
    )
    args = run_system.parse_args(
        [
            "--system",
            "fsdp",
            "--model",
            "tiny",
            "--tokens-per-step",
            "64",
            "--device",
            "cpu",
            "--json",
            "x.json",
            "--init",
            "fast",
        ]
    )
    assert run_system.system_kwargs(args) == {"liger": False, "init": "fast"}
    with pytest.raises(ValueError, match="no LoRA path"):
        run_system.system_kwargs(
            run_system.parse_args(
                [
                    "--system",
                    "fsdp",
                    "--model",
                    "tiny",
                    "--tokens-per-step",
                    "64",
                    "--device",
                    "cpu",
                    "--json",
                    "x",
                    "--lora",
                    "4",
                ]
            )
        )


def test_a_run_past_its_time_is_stopped_and_recorded():
    from benchmarks import h2h

    watch = {"timeout_s": 1.0}
    h2h._run_with_progress(
        [sys.executable, "-c", "import time; time.sleep(60)"], "sleeper", watch=watch
    )
    assert watch["timed_out"] and watch["returncode"] != 0
    rec = h2h.failed_run("fsdp", "tiny", 2, 64, [], watch, 0)
    assert rec["status"].startswith("timed out")


def test_depth_order_stops_a_system_after_its_first_failure(tmp_path, monkeypatch):
    from benchmarks import depth, h2h

    assert depth.plan_runs(["a", "b"], [1, 2], "depth") == [("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert depth.plan_runs(["a", "b"], [1, 2], "system") == [("a", 1), ("a", 2), ("b", 1), ("b", 2)]
    calls = []

    def fake_run_one(system, args, layers, tokens, path):
        calls.append((system, args.host_only, layers, args.run_timeout_s > 0))
        oom = system == "zero3" and layers >= 56
        return {
            "system": system,
            "layers": layers,
            "tokens_per_step": tokens,
            "status": "oom" if oom else "ok",
            "n_params": layers * 1e8,
            "median_step_s": 1.0,
            "tokens_per_s": 16384.0,
            "tflops": 100.0 + layers,
            "peak_gpu_bytes": 1e9,
            "peak_host_rss_bytes": 2e9,
            "error": "CUDA out of memory" if oom else "",
        }

    monkeypatch.setattr(h2h, "run_one", fake_run_one)
    monkeypatch.setattr(h2h, "hardware", lambda: {"gpu": None})
    out = tmp_path / "a"
    assert (
        depth.main(["--systems", "megatrain-host,zero3", "--depths", "28,56,84", "--out", str(out)])
        == 0
    )
    assert calls == [
        ("megatrain", True, 28, True),
        ("zero3", False, 28, True),
        ("megatrain", True, 56, True),
        ("zero3", False, 56, True),
        ("megatrain", True, 84, True),
    ]
    data = json.loads((out / "depth.json").read_text())
    assert data["not_run"] == [{"system": "zero3", "layers": 84, "why": "L=56: oom"}]
    assert depth.main(["--plot", str(out), "--out", str(tmp_path / "fig")]) == 0
    assert os.path.getsize(tmp_path / "fig" / "depth.png") > 1000
    md = (tmp_path / "fig" / "depth.md").read_text()
    assert "**oom**" in md and "not run: L=56: oom" in md


def test_a_depth_run_predicted_past_the_calls_time_is_left_for_the_next_system(
    tmp_path, monkeypatch
):
    """depth.sweep: a system's deeper run that its last finished run (scaled by depth) says would
    not finish in the call's time is recorded as not run, with the prediction, and the time goes
    to the next system; a system with no finished run yet is always tried."""
    from benchmarks import depth, h2h

    assert depth.predicted_wall(None, 56) is None
    assert depth.predicted_wall((28, 30.0), 56) == 60.0
    clock = [0.0]
    monkeypatch.setattr(depth.time, "monotonic", lambda: clock[0])
    ran = []

    def fake_run_one(system, args, layers, tokens, path):
        ran.append((system, layers))
        if layers > 28 and h2h.host_precheck(system):  # as run_one: skipped, in no time
            return {"system": system, "layers": layers, "status": "skipped", "error": "host"}
        clock[0] += {"zero3": 100.0, "fsdp": 10.0}[system] * layers / 28
        return {
            "system": system,
            "layers": layers,
            "tokens_per_step": tokens,
            "status": "ok",
            "tokens_per_s": 1.0,
            "tflops": 1.0,
            "peak_gpu_bytes": 1e9,
            "peak_host_rss_bytes": 1e9,
        }

    monkeypatch.setattr(h2h, "run_one", fake_run_one)
    monkeypatch.setattr(h2h, "hardware", lambda: {"gpu": None})
    monkeypatch.setattr(h2h, "host_precheck", lambda *args: None)
    argv = ["--systems", "zero3,fsdp", "--depths", "28,56", "--deadline-s", "300"]
    assert depth.main([*argv, "--out", str(tmp_path / "d")]) == 0
    # after 110 s: 300 - 110 - 25 = 165 s left; zero3 at 56 wants 200 s, fsdp at 56 wants 20 s
    assert ran == [("zero3", 28), ("fsdp", 28), ("fsdp", 56)]
    data = json.loads((tmp_path / "d" / "depth.json").read_text())
    assert data["not_run"] == [
        {"system": "zero3", "layers": 56, "why": "the call's time: predicted 200 s, 165 s left"}
    ]
    assert [r["run_wall_s"] for r in data["results"]] == [100.0, 10.0, 20.0]
    # a run the host pre-check refuses goes to run_one (its quick "skipped" record says why), not
    # to "the call's time"
    monkeypatch.setattr(h2h, "host_precheck", lambda system, *args: system == "zero3" or None)
    clock[0], ran[:] = 0.0, []
    assert depth.main([*argv, "--out", str(tmp_path / "e")]) == 0
    assert ran == [("zero3", 28), ("fsdp", 28), ("zero3", 56), ("fsdp", 56)]


def test_a_depth_figure_merged_from_two_leases_names_each_points_machine(tmp_path):
    """depth --plot over several folders: a later folder's point replaces an earlier one's, and
    depth.md lists each folder's machine and gives each row its folder ("from")."""
    from benchmarks import depth

    def run(system, layers, tflops):
        return {
            "system": system,
            "depth_system": system,
            "layers": layers,
            "status": "ok",
            "n_params": layers * 1e8,
            "median_step_s": 1.0,
            "tokens_per_s": 16384.0,
            "tflops": tflops,
            "peak_gpu_bytes": 1e9,
            "peak_host_rss_bytes": 2e9,
        }

    boxes = {
        "a": {"gpu": "NVIDIA H200, 143771 MiB, 5, 16", "cpu_cores": 16, "host_mem_bytes": 2**37},
        "b": {"gpu": "NVIDIA H200\nNVIDIA H200", "cpu_cores": 32, "host_mem_bytes": 251 * 2**30},
    }
    runs = {"a": [run("zero3", 28, 95.0), run("gemini", 28, 0.0)], "b": [run("gemini", 28, 47.6)]}
    for name in "ab":
        (tmp_path / name).mkdir()
        (tmp_path / name / "depth.json").write_text(
            json.dumps({"hardware": boxes[name], "results": runs[name], "not_run": []})
        )
    folders = [str(tmp_path / "a"), str(tmp_path / "b")]
    results, _, sources = depth.load(folders)
    assert {(r["depth_system"], r["tflops"], r["source"]) for r in results} == {
        ("zero3", 95.0, 1),
        ("gemini", 47.6, 2),
    }
    assert depth.main(["--plot", *folders, "--out", str(tmp_path / "fig")]) == 0
    md = (tmp_path / "fig" / "depth.md").read_text()
    assert "1. `" in md and "16 CPU cores, 128 GiB host" in md
    assert "2 × NVIDIA H200, 32 CPU cores, 251 GiB host" in md
    assert "| 47.6 |  | 1.0 | 2.0 |  |  | 2 |" in md and "| 95.0 |  | 1.0 | 2.0 |  |  | 1 |" in md
    one = depth.sources_md(sources[:1])
    assert (
        one == "Hardware: 1 × NVIDIA H200 (143771 MiB, PCIe gen5 x16), 16 CPU cores, 128 GiB host"
    )


def test_a_timed_out_depth_point_names_its_last_phase_not_the_teardown_warning():
    """A point stopped by the call's time: the table names the phase it was in, not stderr's last
    line (there, the interrupt's teardown warning); a failed point still shows its error."""
    from benchmarks import depth

    base = {"system": "gemini", "depth_system": "gemini", "layers": 120}
    timed_out = {
        **base,
        "status": "timed out (stopped after 57 s)",
        "last_phase": "HybridAdam made",
        "error": "KeyboardInterrupt\nWarning: destroy_process_group() was not called",
    }
    md = depth.table([timed_out], [])
    assert "stopped in the phase after: HybridAdam made" in md
    assert "destroy_process_group" not in md
    failed = {**base, "status": "failed", "error": "Traceback\nRuntimeError: bad shape"}
    assert "RuntimeError: bad shape" in depth.table([failed], [])
    # a run with a step breakdown shows its stall: the GPU's idle share and the host update's rate
    ok = {
        **base,
        "depth_system": "megatrain",
        "status": "ok",
        "n_params": 1e9,
        "median_step_s": 1.0,
        "tokens_per_s": 16384.0,
        "tflops": 300.0,
        "peak_gpu_bytes": 1e9,
        "peak_host_rss_bytes": 2e9,
        "breakdown": {"step_s": 1.2, "gpu_idle_s": 0.3, "cpu_optimizer_gparam_s": 5.5},
    }
    assert "| 300.0 |  | 1.0 | 2.0 | 25% | 5.50 |" in depth.table([ok], [])  # no settings: blank


def test_the_depth_figure_marks_where_each_system_stopped_and_why():
    """benchmarks.depth.stops: each system's shallowest depth without TFLOPS, labelled from a device
    OOM, the host pre-check's refusal, a timeout or a point the call's time did not reach; a system
    that ran every depth has no mark, and a point run again after a timeout is not a stop."""
    from benchmarks import depth

    def r(system, layers, status, error=""):
        return {"depth_system": system, "layers": layers, "status": status, "error": error}

    results = [
        r("fsdp", 84, "ok"),
        r("fsdp", 120, "oom"),
        r("zero3", 84, "ok"),
        r("zero3", 120, "skipped", "needs ~147 GiB host memory (27 B/param), 124 GiB free"),
        r("zero3", 180, "skipped", "needs ~218 GiB host memory (27 B/param), 124 GiB free"),
        r("gemini", 120, "timed out (stopped after 57 s)"),
        r("megatrain", 180, "ok"),
    ]
    not_run = [
        {"system": "gemini", "layers": 180, "why": "L=120: timed out"},
        {"system": "megatrain-host", "layers": 180, "why": "the call's time ran out"},
        {"system": "megatrain", "layers": 180, "why": "the call's time ran out"},  # ran later
    ]
    results.append(r("megatrain-host", 120, "ok"))
    assert depth.stops(results, not_run) == {
        "fsdp": (120, "OOM"),
        "zero3": (120, "host"),
        "gemini": (120, "timed out"),
        "megatrain-host": (180, "not run"),
    }


def test_an_out_of_memory_run_is_a_result_of_its_own():
    """benchmarks.common.oom_result, the record every system returns for an OOM: status "oom", no
    tokens/s, the error cut to 4000 characters, the system's own keys kept."""
    from benchmarks.common import Run, oom_result

    exc = torch.OutOfMemoryError("CUDA out of memory. " + "x" * 5000)
    run = Run("fsdp", make_config("tiny"), 2, 2, 64, "cpu")
    rec = oom_result(run, 1234, exc, settings={"a": 1})
    assert (rec["system"], rec["status"], rec["tokens_per_s"]) == ("fsdp", "oom", 0.0)
    assert rec["error"].startswith("CUDA out of memory.") and len(rec["error"]) == 4000
    assert rec["settings"] == {"a": 1} and rec["n_params"] == 1234 and rec["layers"] == 2


def test_gemini_boost_profile_names_where_the_time_went(monkeypatch, capsys, tmp_path):
    from benchmarks import gemini_system

    class Booster:
        def boost(self, model, optimizer):
            return sorted([model, optimizer]), "dataloader"

    monkeypatch.delenv("GEMINI_PROFILE", raising=False)
    assert gemini_system.profiled_boost(Booster(), 2, 1) == ([1, 2], "dataloader")
    assert "cumulative" not in capsys.readouterr().err
    monkeypatch.setenv("GEMINI_PROFILE", "5")
    assert gemini_system.profiled_boost(Booster(), 2, 1) == ([1, 2], "dataloader")
    err = capsys.readouterr().err
    assert "cumulative" in err and "boost" in err
    monkeypatch.setenv("GEMINI_PROFILE_OUT", str(tmp_path / "boost.prof.txt"))
    gemini_system.profiled_boost(Booster(), 2, 1)
    assert "boost" in (tmp_path / "boost.prof.txt").read_text() and not capsys.readouterr().err


def test_the_host_peers_draw_their_init_on_the_gpu_when_it_fits(monkeypatch):
    """FSDP2 and Gemini build their model where ``build.draw_device`` says: drawn on the CPU, HF's
    init of a 7B took Gemini's whole device call."""
    from benchmarks import build

    cfg = make_config("qwen2.5-3b")  # 3.1 B params: 12.4 GB in fp32
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (20 * 2**30, 80 * 2**30))
    assert build.draw_device(cfg, "cuda", "auto") == "cpu"  # 12.4 GB > half of 20 GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (70 * 2**30, 80 * 2**30))
    assert build.draw_device(cfg, "cuda", "auto") == "cuda"
    assert build.draw_device(cfg, "cuda", "fast") == "cpu"  # fast builds its layers on the host
    assert build.draw_device(cfg, "cpu", "hf") == "cpu"
    assert build.draw_device(make_config("qwen2.5-14b"), "cuda", "auto") == "cpu"  # auto: fast


def test_gemini_liger_on_activations_only_is_recorded(monkeypatch):
    """GEMINI_LIGER=activations: SwiGLU, RoPE and liger's cross-entropy on the logits, passed to
    liger as the Trainer's liger_kernel_config (RMSNorm and the fused loss off: each uses a
    parameter Gemini manages outside its module's forward) and recorded with why; an unknown value
    is refused."""
    import transformers.integrations.liger as hf_liger

    from benchmarks import common, gemini_system

    monkeypatch.setenv("GEMINI_LIGER", "activations")
    res = gemini_system.run_gemini(
        make_config("tiny"), 128, seq=64, steps=1, warmup=1, device="cpu", liger=True
    )
    settings = res["settings"]
    assert settings["kernels"] == ["swiglu", "rope", "cross_entropy"]
    assert settings["loss_kernel"] == gemini_system.LIGER_CE_LOSS
    assert settings["liger_off"].startswith("RMSNorm: ")
    assert "lm_head.weight" in settings["liger_off"]
    assert gemini_system.ACTIVATION_KERNELS == {
        "rms_norm": False,
        "fused_linear_cross_entropy": False,
        "cross_entropy": True,
    }
    monkeypatch.setenv("GEMINI_LIGER", "0")
    res = gemini_system.run_gemini(
        make_config("tiny"), 128, seq=64, steps=1, warmup=1, device="cpu", liger=True
    )
    assert res["settings"]["kernels"] == [] and res["settings"]["loss_kernel"].startswith("HF")
    assert res["settings"]["liger_off"] == gemini_system.LIGER_OFF_WHY
    seen = []
    monkeypatch.setattr(hf_liger, "apply_liger_kernel", lambda model, cfg: seen.append(cfg))
    common.apply_hf_liger(object(), gemini_system.ACTIVATION_KERNELS)
    common.apply_hf_liger(object())
    assert seen == [gemini_system.ACTIVATION_KERNELS, None]
    monkeypatch.setenv("GEMINI_LIGER", "yes")
    with pytest.raises(ValueError, match="GEMINI_LIGER"):
        gemini_system.run_gemini(make_config("tiny"), 128, seq=64, steps=1, warmup=1, device="cpu")


def test_gemini_steps_run_its_phases_and_only_warmup_steps_are_timed():
    """gemini_system.phase_timed: every step runs forward, backward and optimizer in order on its
    own box; only the warm-up steps are timed by phase (settings["warmup_phases_s"], printed by
    h2h's breakdown line)."""
    from benchmarks import gemini_system
    from benchmarks.h2h import breakdown_line

    calls = []

    def forward(x, box):
        assert box == {}  # a fresh box each step
        calls.append(("forward", x))
        box["loss"] = torch.tensor(10.0 * x)

    phases = (
        ("forward", forward),
        ("backward", lambda x, box: calls.append(("backward", float(box["loss"])))),
        ("optimizer", lambda x, box: calls.append(("optimizer", x))),
    )
    settings = {}
    step = gemini_system.phase_timed(phases, 2, "cpu", settings)
    losses = [float(step(x)) for x in (1, 2, 3, 4)]
    assert losses == [10.0, 20.0, 30.0, 40.0]
    assert calls[:3] == [("forward", 1), ("backward", 10.0), ("optimizer", 1)]
    assert [c[0] for c in calls] == ["forward", "backward", "optimizer"] * 4
    phases = settings["warmup_phases_s"]
    assert len(phases) == 2 and list(phases[0]) == ["forward", "backward", "optimizer"]
    assert all(v >= 0 for p in phases for v in p.values())
    line = breakdown_line({"system": "gemini", "status": "ok", "settings": settings})
    assert line.startswith("    [gemini] last warm-up step by phase") and "optimizer" in line
    assert breakdown_line({"system": "gemini", "status": "oom", "settings": settings}) == ""


def test_host_snapshot_reads_memory_load_and_the_huge_page_mode(monkeypatch, tmp_path):
    """benchmarks.host_check.host_snapshot: /proc/meminfo's free, cached and huge-page bytes, the
    load average and the bracketed THP mode; what cannot be read is left out."""
    import builtins

    from benchmarks import host_check

    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    (tmp_path / "thp").write_text("always [madvise] never\n")
    real_open = builtins.open

    def fake_open(path, *a, **k):
        return real_open(tmp_path / "thp" if path == thp else path, *a, **k)

    sizes = {"MemFree": 3 * 2**30, "Cached": 2**30, "AnonHugePages": 2**21}
    monkeypatch.setattr(host_check, "meminfo", lambda key: sizes[key])
    monkeypatch.setattr(host_check.os, "getloadavg", lambda: (3.25, 2.0, 1.0))
    monkeypatch.setattr(builtins, "open", fake_open)
    assert host_check.host_snapshot() == {
        "mem_free_bytes": 3 * 2**30,
        "cached_bytes": 2**30,
        "anon_huge_bytes": 2**21,
        "loadavg_1m": 3.25,
        "thp": "madvise",
    }

    def unreadable(*_):
        raise OSError("unreadable")

    def no_sys(path, *a, **k):
        return unreadable() if str(path).startswith("/sys/") else real_open(path, *a, **k)

    monkeypatch.setattr(host_check.os, "getloadavg", unreadable)
    monkeypatch.setattr(builtins, "open", no_sys)
    assert set(host_check.host_snapshot()) == {"mem_free_bytes", "cached_bytes", "anon_huge_bytes"}


def test_the_depth_tables_gpu_tflops_count_each_systems_recompute():
    """depth.gpu_tflops: the model TFLOPS plus the forwards each run recomputes: every decoder layer
    for a peer (HF / checkpoint_wrapper per layer), all but the kept layers for megatrain_ds, less
    the MLP's output projection where its recompute skips it; blank where the settings do not
    say. The numbers by hand from the Qwen2.5-1.5B shape at 4 layers."""
    from benchmarks import depth
    from benchmarks.shapes import make_config, model_flops_per_token, recompute_flops_per_token

    cfg = make_config("qwen2.5-1.5b", layers=4)
    h, inter, seq = cfg.hidden_size, cfg.intermediate_size, 1024
    head_dim = h // cfg.num_attention_heads
    attn = 2 * h * h + 2 * h * cfg.num_key_value_heads * head_dim  # q, o; k, v
    forward = 2 * (attn + 3 * h * inter) + 2 * h * seq
    assert recompute_flops_per_token(cfg, seq, 3, False) == 3 * forward
    assert recompute_flops_per_token(cfg, seq, 3, True) == 3 * (forward - 2 * h * inter)
    flops = model_flops_per_token(cfg, seq)

    def run(settings):
        return {
            "model": "qwen2.5-1.5b",
            "layers": 4,
            "seq": seq,
            "tokens_per_s": 1e6,
            "flops_per_token": flops,
            "settings": settings,
        }

    peer = run({"recomputes_every_layer": True})
    assert depth.recomputed(peer) == (4, False)
    # a run recorded before the field: its gradient_checkpointing text says so
    older = run({"gradient_checkpointing": "HF per decoder layer (non-reentrant)"})
    assert depth.recomputed(older) == (4, False)
    assert depth.gpu_tflops(peer) == (flops + 4 * forward) * 1e6 / 1e12
    ours = run({"kept_layers": 1, "recompute_skips": ["0:mlp.down_proj"]})
    assert depth.recomputed(ours) == (3, True)
    assert depth.gpu_tflops(ours) == (flops + 3 * (forward - 2 * h * inter)) * 1e6 / 1e12
    all_kept = run({"kept_layers": 4, "recompute_skips": ["0:mlp.down_proj"]})
    assert depth.gpu_tflops(all_kept) == flops * 1e6 / 1e12  # nothing recomputed
    assert depth.gpu_tflops(run({})) is None  # the settings do not say: left blank


def test_every_peer_records_that_it_recomputes_every_layer(monkeypatch):
    """ZeRO-3, FSDP2, Gemini and the whole-on-GPU run checkpoint every decoder layer, and their
    settings say so as a field (not only as text), which depth.recomputed reads."""
    import inspect

    from benchmarks import common, depth, fsdp_system, gemini_system, systems

    monkeypatch.setenv("H2H_CLIP", "1.0")
    res = gemini_system.run_gemini(
        make_config("tiny"), 128, seq=64, steps=1, warmup=1, device="cpu"
    )
    assert res["settings"]["recomputes_every_layer"] is True
    for module in (fsdp_system, systems):
        source = inspect.getsource(module)
        assert source.count("gradient_checkpointing=") == source.count(
            "recomputes_every_layer=True"
        ), module.__name__
    kw = dict(
        precision="p",
        optimizer="o",
        opt_params=common.OPTIMIZER,
        clip=1.0,
        warmup=1,
        steps=1,
        seq=8,
        micro_batch=1,
        kernels=[],
        loss_kernel="l",
        gradient_checkpointing="g",
        offload_optimizer_ratio=None,
    )
    assert "recomputes_every_layer" not in common.settings_dict(**kw)
    rec = {"layers": 3, "settings": common.settings_dict(**kw, recomputes_every_layer=True)}
    assert depth.recomputed(rec) == (3, False)


def test_the_depth_figure_draws_megatrains_recompute_counted_line(tmp_path, monkeypatch):
    """depth.plot: a megatrain_ds system whose runs say what they recomputed gets a dashed line of
    its GPU's rate beside its model TFLOPS (labelled in the legend); a peer does not."""
    import matplotlib.axes

    from benchmarks import depth
    from benchmarks.shapes import make_config, model_flops_per_token

    def run(system, layers, kept):
        flops = model_flops_per_token(make_config("qwen2.5-1.5b", layers=layers), 1024)
        settings = (
            {"kept_layers": kept, "recompute_skips": ["0:mlp.down_proj"]}
            if system == "megatrain"
            else {"gradient_checkpointing": "HF per decoder layer"}
        )
        return {
            "depth_system": system,
            "system": system,
            "model": "qwen2.5-1.5b",
            "layers": layers,
            "seq": 1024,
            "status": "ok",
            "tokens_per_s": 1e4,
            "flops_per_token": flops,
            "tflops": flops * 1e4 / 1e12,
            "settings": settings,
        }

    labels = []
    real_plot = matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):
        labels.append((kwargs.get("label"), kwargs.get("linestyle")))
        return real_plot(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    results = [run("megatrain", 4, 4), run("megatrain", 8, 2), run("zero3", 4, 0)]
    depth.plot(results, str(tmp_path / "d.png"))
    assert os.path.getsize(tmp_path / "d.png") > 1000
    assert ("megatrain_ds defaults, recompute counted", "--") in labels
    assert not any(label and "recompute" in label and "ZeRO" in label for label, _ in labels)


def test_the_breakdown_line_names_the_recompute_after_compute():
    """report.breakdown_line: a megatrain_ds step's ``recompute_s`` (part of compute) printed right
    after compute; absent (a run with every layer kept) it is not printed."""
    from benchmarks.report import breakdown_line

    b = {"step_s": 2.4, "compute_s": 2.2, "recompute_s": 0.46, "h2d_s": 0.3, "gpu_idle_s": 0.2}
    line = breakdown_line({"system": "megatrain", "status": "ok", "breakdown": b})
    assert "compute 2.200, recompute 0.460, h2d 0.300" in line
    kept = breakdown_line(
        {"system": "megatrain", "status": "ok", "breakdown": {**b, "recompute_s": 0.0}}
    )
    assert "recompute" not in kept and "compute 2.200, h2d 0.300" in kept


def test_gemini_precision_is_a_setting_of_the_plugin_and_the_record(monkeypatch):
    """GEMINI_PRECISION=fp16 gives HybridAdam fp16 gradients (its compiled host kernel; bf16 ones
    take its unfused torch path): the plugin, the model's dtype and the recorded precision follow
    it; anything else is refused by name."""
    from benchmarks import gemini_system

    monkeypatch.setenv("H2H_CLIP", "1.0")
    monkeypatch.delenv("GEMINI_PRECISION", raising=False)
    assert gemini_system.plugin_kwargs("auto")["precision"] == "bf16"
    monkeypatch.setenv("GEMINI_PRECISION", "fp16")
    assert gemini_system.plugin_kwargs("auto")["precision"] == "fp16"
    res = gemini_system.run_gemini(
        make_config("tiny"), 128, seq=64, steps=1, warmup=1, device="cpu"
    )
    assert res["settings"]["gemini_plugin"]["precision"] == "fp16"
    assert res["settings"]["precision"].startswith("fp16 params and compute")
    assert "loss scale" in res["settings"]["precision"]
    assert gemini_system.PRECISIONS["fp16"][0] is torch.float16
    monkeypatch.setenv("GEMINI_PRECISION", "fp8")
    with pytest.raises(ValueError, match="GEMINI_PRECISION"):
        gemini_system.plugin_kwargs("auto")


def test_gemini_counts_the_optimizer_steps_it_took():
    """A step the fp16 loss scale skips is a faster one: the record says how many steps the
    optimizer took, through the booster's wrappers, so a skipped one cannot pass as measured."""
    from benchmarks import gemini_system

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    inner = torch.optim.AdamW(params, lr=0.1)
    wrapped = type("Wrapper", (), {"optim": type("Mixin", (), {"optim": inner})()})()
    assert gemini_system.optimizer_steps_taken(wrapped) is None  # no state yet
    for p in params:
        p.grad = torch.ones_like(p)
    for _ in range(3):
        inner.step()
    assert gemini_system.optimizer_steps_taken(wrapped) == 3
    assert gemini_system.optimizer_steps_taken(inner) == 3


def test_gemini_adam_probe_times_each_gradient_dtype():
    """The probe hands the optimizer fp32 parameters with fp32, fp16 and bf16 gradients (as Gemini
    does), steps it, and times torch's fused AdamW beside it; each optimizer really steps."""
    from benchmarks import gemini_system

    made, start = [], []

    def make(params):
        made.append(params[0])
        start.append(params[0].detach().clone())
        return torch.optim.SGD(params, lr=1.0)

    out = gemini_system.adam_probe(4096, repeats=2, make=make)
    assert [p.grad.dtype for p in made] == [torch.float32, torch.float16, torch.bfloat16]
    assert all(p.dtype == torch.float32 for p in made)
    # SGD took 1 + 2 steps of lr 1.0: each parameter moved by 3 of its gradients
    for p, p0 in zip(made, start):
        torch.testing.assert_close(p.detach(), p0 - 3 * p.grad.float())
    keys = ["grad fp32", "grad fp16", "grad bf16", "torch fused AdamW, grad fp32"]
    assert all(out[k] > 0 for k in keys) and out["params"] == 4096
    assert out["threads"] == torch.get_num_threads()


def test_the_depth_figures_gemini_fp16_runs_with_its_precision_and_its_label(tmp_path, monkeypatch):
    """``gemini-fp16`` is Gemini's run with GEMINI_PRECISION=fp16 in its child's environment (and
    only its: the bf16 Gemini beside it runs without), drawn and tabled under a label that says its
    dtype is not the others'."""
    from benchmarks import depth, h2h

    seen = []

    def fake_run_one(system, args, layers, tokens, path):
        seen.append((system, layers, os.environ.get("GEMINI_PRECISION")))
        return {
            "system": system,
            "layers": layers,
            "tokens_per_step": tokens,
            "status": "ok",
            "n_params": layers * 1e8,
            "median_step_s": 1.0,
            "tokens_per_s": 16384.0,
            "tflops": 40.0 + layers + (100 if os.environ.get("GEMINI_PRECISION") else 0),
            "peak_gpu_bytes": 1e9,
            "peak_host_rss_bytes": 2e9,
            "error": "",
        }

    monkeypatch.setattr(h2h, "run_one", fake_run_one)
    monkeypatch.setattr(h2h, "hardware", lambda: {"gpu": None})
    monkeypatch.setenv("GEMINI_PRECISION", "bf16")  # the caller's own is restored after
    out = tmp_path / "g"
    argv = ["--systems", "gemini,gemini-fp16", "--depths", "28", "--out", str(out)]
    assert depth.main(argv) == 0
    assert seen == [("gemini", 28, "bf16"), ("gemini", 28, "fp16")]
    assert os.environ["GEMINI_PRECISION"] == "bf16"
    monkeypatch.delenv("GEMINI_PRECISION")
    with depth.run_env({"GEMINI_PRECISION": "fp16"}):
        assert os.environ["GEMINI_PRECISION"] == "fp16"
    assert "GEMINI_PRECISION" not in os.environ
    assert depth.main(["--plot", str(out), "--out", str(tmp_path / "fig")]) == 0
    md = (tmp_path / "fig" / "depth.md").read_text()
    assert "| ColossalAI Gemini fp16 (not the others' dtype) | 28 |" in md
    assert "| ColossalAI Gemini | 28 |" in md
