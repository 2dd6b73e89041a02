"""CPU smoke test of the head-to-head harness: it runs each system in its own process and writes
results.json (with the fields users compare), results.md and a PNG plot."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.integration.test_h2h_dp import rank_result, run_h2h

REPO = Path(__file__).resolve().parents[2]


def test_h2h_cpu_smoke(tmp_path):
    out = tmp_path / "h2h"
    data, proc = run_h2h(
        out,
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--systems",
        "megatrain,resident",
        "--seq",
        "64",
        "--tokens-per-step",
        "256",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--megatrain-options",
        '{"num_slots": 3}',
    )
    assert data["hardware"]["cpu_cores"] >= 1
    by_system = {r["system"]: r for r in data["results"]}
    assert set(by_system) == {"megatrain", "resident"}
    for r in by_system.values():
        assert r["status"] == "ok"
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0
        assert (
            r["peak_gpu_bytes"] == 0
            and r["peak_host_rss_bytes"] > 0
            and r["host_bytes_per_param"] > 0
        )
        # the host as the run started (host_check.host_snapshot): memory read from /proc/meminfo
        assert r["host_at_start"]["mem_free_bytes"] > 0 and "cached_bytes" in r["host_at_start"]
    assert "breakdown" in by_system["megatrain"]
    # --megatrain-options reached it
    assert by_system["megatrain"]["ds_config"]["megatrain"]["num_slots"] == 3
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "megatrain" in (out / "results.md").read_text()
    # fair peers: the same AdamW hyperparameters, clip and steps recorded by every system, and by
    # ZeRO-3's config
    from benchmarks.shapes import make_config
    from benchmarks.systems import zero3_ds_config, zero3_settings

    zero3 = zero3_settings(
        zero3_ds_config(make_config("tiny"), 4, "cpu"), seq=64, steps=2, warmup=1
    )
    same = ("lr", "weight_decay", "betas", "eps", "clip", "steps", "warmup", "seq", "micro_batch")
    expected = {
        "lr": 1e-5,
        "weight_decay": 0.01,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "clip": 1.0,
        "steps": 2,
        "warmup": 1,
        "seq": 64,
        "micro_batch": 4,
    }
    for settings in [r["settings"] for r in by_system.values()] + [zero3]:
        assert {k: settings[k] for k in same} == expected
        # --liger auto on CPU: off for all
        assert settings["liger"] is False and settings["kernels"] == []
    assert by_system["megatrain"]["settings"]["megatrain_options"] == {"num_slots": 3}
    # not set unless asked
    assert by_system["megatrain"]["settings"]["gpu_optimizer_layers"] == "engine default"
    assert "gpu_optimizer_layers" not in by_system["megatrain"]["ds_config"]["megatrain"]
    md = (out / "results.md").read_text()
    assert (
        "lr 1e-05 wd 0.01 betas (0.9, 0.999) eps 1e-08" in md
        and "resident_Ldefault_256 (resident)" in md
    )
    # a progress bar per system, over its steps (warm-up + measured; megatrain runs one more to
    # close its breakdown)
    assert "megatrain L=2 T=256: 4/4 steps" in proc.stderr, proc.stderr[-3000:]
    assert "resident L=2 T=256: 3/3 steps" in proc.stderr, proc.stderr[-3000:]


def test_host_adam_probe_prints_a_row_per_thread_count(capsys):
    from benchmarks import host_adam

    assert (
        host_adam.main(
            ["--gparams", "0.002", "--threads", "1,2", "--repeats", "1", "--no-deepspeed"]
        )
        == 0
    )
    rows = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| 1 |") or line.startswith("| 2 |")
    ]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert (
            float(cells[1]) > 0 and float(cells[2]) > 0 and cells[3] == "–" and float(cells[4]) > 0
        )


def test_h2h_best_batch_records_every_probe_and_marks_the_fastest(tmp_path):
    out = tmp_path / "best"
    data, _ = run_h2h(
        out,
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--systems",
        "megatrain",
        "--seq",
        "64",
        "--best-batch",
        "--min-tokens",
        "64",
        "--max-tokens",
        "128",
        "--steps",
        "1",
        "--warmup",
        "1",
    )
    runs = data["results"]
    for system in ("megatrain",):  # one system keeps the file fast; the search is the same for each
        probes = [r for r in runs if r["system"] == system]
        assert [r["tokens_per_step"] for r in probes] == [64, 128]
        best = [r for r in probes if r.get("best_batch")]
        assert len(best) == 1 and best[0]["tokens_per_s"] == max(r["tokens_per_s"] for r in probes)
    assert "best tokens/step" in (out / "results.md").read_text()


def test_report_compares_rows_of_the_same_depth_and_names_duplicate_runs_by_file(tmp_path):
    """A depth sweep puts several depths at one tokens/step: each megatrain row is compared with the
    ZeRO-3 row of its own depth, and one run name coming from two files is told apart by the
    file."""
    from benchmarks import report

    def run(system, layers, tok_s):
        return {
            "system": system,
            "layers": layers,
            "tokens_per_step": 16384,
            "status": "ok",
            "name": f"{system}_L{layers}_16384",
            "median_step_s": 16384 / tok_s,
            "tokens_per_s": tok_s,
            "tflops": 1.0,
            "peak_gpu_bytes": 0,
            "peak_host_rss_bytes": 0,
            "host_bytes_per_param": 0.0,
        }

    files = {
        "sweep_megatrain": [run("megatrain", 24, 300.0), run("megatrain", 48, 150.0)],
        "sweep_zero3": [run("zero3", 24, 200.0), run("zero3", 48, 50.0)],
        "knob_megatrain": [run("megatrain", 48, 120.0)],
    }
    for stem, rows in files.items():
        (tmp_path / f"{stem}.json").write_text(json.dumps({"hardware": {}, "results": rows}))
    table = report.throughput_table(report.load(str(tmp_path)))
    lines = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[2:]}
    assert "1.50×" in lines["megatrain_L24_16384"]  # 300 / 200, not 300 / 50
    assert "3.00×" in lines["sweep_megatrain: megatrain_L48_16384"]  # 150 / 50
    assert "2.40×" in lines["knob_megatrain: megatrain_L48_16384"]  # 120 / 50


def test_h2h_depth_sweep_runs_each_depth_and_plots_tflops_against_layers(tmp_path):
    out = tmp_path / "depth"
    data, _ = run_h2h(
        out,
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--systems",
        "megatrain",
        "--seq",
        "64",
        "--tokens-per-step",
        "128",
        "--depth-sweep",
        "1,3",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--liger",
        "off",
    )
    runs = data["results"]
    assert [(r["system"], r["layers"], r["status"]) for r in runs] == [
        ("megatrain", 1, "ok"),
        ("megatrain", 3, "ok"),
    ]
    assert runs[1]["n_params"] > runs[0]["n_params"]  # same width, more layers
    # --liger off: no liger kernel, and megatrain_ds told so (its own default would use liger)
    for r in runs:
        assert r["settings"]["liger"] is False and r["settings"]["kernels"] == []
        block = r["ds_config"]["megatrain"]
        assert block["liger_kernels"] is False and block["use_liger"] is False
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpu_optimizer_fraction_sets_the_same_offload_ratio_for_megatrain_and_zero3(monkeypatch):
    from benchmarks.megatrain_system import megatrain_ds_config, megatrain_settings
    from benchmarks.shapes import make_config
    from benchmarks.systems import zero3_ds_config, zero3_settings

    monkeypatch.delenv("MEGATRAIN_OPTIONS", raising=False)
    config = make_config("qwen2.5-3b")
    zero3 = zero3_ds_config(config, 16, "cuda", gpu_optimizer_fraction=0.5)
    mega = megatrain_ds_config(16, "cuda", gpu_optimizer_fraction=0.5)
    for ds_config in (zero3, mega):
        assert ds_config["zero_optimization"]["offload_optimizer"]["ratio"] == 0.5
        assert ds_config["optimizer"]["params"] == {
            "lr": 1e-5,
            "weight_decay": 0.01,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
        }
    # the engine reads the ratio, whatever its default
    assert mega["megatrain"]["gpu_optimizer_layers"] == -1
    # DeepSpeed places whole sub-groups: one per layer
    assert zero3["zero_optimization"]["sub_group_size"] < 1e8
    assert (
        zero3_settings(zero3, 1024, 4, 2)["ds_config"]["zero_optimization"]["offload_optimizer"][
            "ratio"
        ]
        == 0.5
    )
    recorded = megatrain_settings(mega, 1024, 4, 2, "cuda")
    assert recorded["offload_optimizer_ratio"] == 0.5 and recorded["ds_config"] is mega
    # default: nothing about optimizer placement (the engine decides); --host-only: explicitly all
    # on the host
    assert (
        "ratio" not in zero3_ds_config(config, 16, "cuda")["zero_optimization"]["offload_optimizer"]
    )
    assert "gpu_optimizer_layers" not in megatrain_ds_config(16, "cuda")["megatrain"]
    assert megatrain_ds_config(16, "cuda", host_only=True)["megatrain"]["gpu_optimizer_layers"] == 0
    # --megatrain-options wins
    monkeypatch.setenv("MEGATRAIN_OPTIONS", '{"gpu_optimizer_layers": "auto"}')
    assert (
        megatrain_settings(megatrain_ds_config(16, "cuda"), 1024, 4, 2, "cuda")[
            "gpu_optimizer_layers"
        ]
        == "auto"
    )


def test_h2h_rejects_host_only_with_a_gpu_optimizer_fraction(tmp_path):
    import pytest

    from benchmarks import h2h

    with pytest.raises(SystemExit):
        h2h.main(
            [
                "--model",
                "tiny",
                "--device",
                "cpu",
                "--host-only",
                "--gpu-optimizer-fraction",
                "0.5",
                "--out",
                str(tmp_path),
            ]
        )


# --- LoRA, fast init, mixture of experts, killed processes (issue 15) -----------------------------


def _h2h(tmp_path, name, *args):
    out = tmp_path / name
    data, proc = run_h2h(
        out,
        "--device",
        "cpu",
        "--seq",
        "64",
        "--tokens-per-step",
        "128",
        "--steps",
        "1",
        "--warmup",
        "1",
        *args,
    )
    return {r["system"]: r for r in data["results"]}, out, proc


def test_h2h_lora_megatrain_and_zero3(tmp_path):
    """--lora 4 on the tiny shape: both systems train only the adapters of the same peft model;
    FLOPs by the LoRA formula (hand-counted below); per base parameter host numbers, phases and
    build times recorded. megatrain with --init fast (layer 0's values repeated, the layers sharing
    its storage until the engine copies them)."""
    runs, out, proc = _h2h(
        tmp_path,
        "lora",
        "--model",
        "tiny",
        "--lora",
        "4",
        "--init",
        "fast",
        "--systems",
        "megatrain,zero3",
    )
    assert set(runs) == {"megatrain", "zero3"}
    # tiny: h 64, 2 layers, inter 128, 4 heads, 2 KV heads (head_dim 16), vocab 256 (tied)
    n_matmul = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128) + 256 * 64  # 90,112
    # 8,192
    n_lora = 2 * 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 128))
    n_base = (
        2 * (64 * 64 + 64 + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 256 * 64 + 64
    )
    for system, r in runs.items():
        assert r["status"] == "ok", r.get("error")
        assert r["trainable_params"] == r["adapter_params"] == n_lora == 8192
        assert r["base_params"] == r["frozen_params"] == n_base
        assert r["flops_per_token"] == 4 * n_matmul + 6 * n_lora + 6 * 2 * 64 * 64 == 458_752
        assert r["host_bytes_per_base_param"] == r["peak_host_rss_bytes"] / n_base > 0
        s = r["settings"]
        assert s["lora"]["r"] == 4 and s["lora"]["alpha"] == 8 and s["lora"]["dropout"] == 0.0
        assert s["lora"]["targets"] == [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
        assert s["build_s"] > 0 and s["initialize_s"] > 0
        assert [p["phase"] for p in r["phases"]] == [
            "model built",
            "engine initialized",
            "steps done",
        ]
        assert all(p["peak_rss_bytes"] > 0 for p in r["phases"])
        assert all(0 <= p["anon_huge_bytes"] <= p["rss_bytes"] for p in r["phases"])
    mega = runs["megatrain"]
    assert mega["engine_host_bytes_per_base_param"] == mega["engine_host_state_bytes"] / n_base > 0
    assert mega["settings"]["init"].startswith("layer 0 values repeated")
    assert (
        "zero.Init" in runs["zero3"]["settings"]["init"]
        and runs["zero3"]["zero3_param_partition_bytes"] > 0
    )
    md = (out / "results.md").read_text()
    assert "host B/base param" in md and "LoRA r 4 alpha 8" in md
    assert "LoRA r4: trainable 8,192" in proc.stdout and "breakdown (s, median step)" in proc.stdout


def test_moe_megatrain_router_aux_loss_and_active_flops(monkeypatch):
    """tiny-moe through run_megatrain (in this process: the subprocess path is the LoRA test's):
    FLOPs count the active matmul weights; the loss is the model's own, router aux loss included."""
    from benchmarks.megatrain_system import run_megatrain
    from benchmarks.shapes import make_config

    monkeypatch.delenv("MEGATRAIN_OPTIONS", raising=False)
    r = run_megatrain(make_config("tiny-moe"), 128, seq=64, steps=1, warmup=1, device="cpu")
    assert r["status"] == "ok", r.get("error")
    # tiny-moe (Qwen2-MoE): h 64, 2 layers, 4 experts top-2 of inter 32, shared expert 64, vocab 256
    # (untied)
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64
    # router, top-2 experts, shared expert, its gate
    active = 4 * 64 + 2 * 3 * 64 * 32 + 3 * 64 * 64 + 64
    assert (
        r["flops_per_token"]
        == 6 * (2 * (attention + active) + 256 * 64) + 6 * 2 * 64 * 64
        == 593_664
    )
    assert r["settings"]["loss_kernel"] == "the model's own loss (full logits) + router aux loss"
    assert r["trainable_params"] == r["base_params"] == r["n_params"]
    assert r["host_bytes_per_base_param"] > 0 and r["engine_host_bytes_per_base_param"] > 0


def test_shapes_flops_formulas_and_moe_configs():
    import transformers

    from benchmarks import shapes

    # analytic == counted from a meta model, all and active
    shapes.self_check(("tiny", "tiny-moe", "tiny-olmoe"))
    dense = shapes.make_config("qwen2.5-3b")
    assert (
        shapes.model_flops_per_token(dense, 1024)
        == 6 * shapes.matmul_params(dense) + 6 * 36 * 2048 * 1024
    )
    # the anchors' number, unchanged
    assert abs(shapes.model_flops_per_token(dense, 1024) / 1e9 - 18.9672) < 1e-4
    big = shapes.make_config("qwen2.5-72b")
    n_lora = shapes.lora_params(big, 16)
    assert (
        n_lora
        == 80 * 16 * ((8192 + 8192) * 2 + (8192 + 1024) * 2 + (8192 + 29568) * 3)
        == 210_534_400
    )
    assert (
        shapes.model_flops_per_token(big, 1024, n_lora)
        == 4 * shapes.matmul_params(big) + 6 * n_lora + 6 * 80 * 8192 * 1024
    )
    olmoe = shapes.make_config("olmoe-1b-7b")
    assert isinstance(olmoe, transformers.OlmoeConfig) and olmoe.output_router_logits
    assert olmoe.router_aux_loss_coef == 0.01
    per_layer = 4 * 2048 * 2048 + 64 * 2048 + 8 * 3 * 2048 * 1024
    assert shapes.active_matmul_params(olmoe) == 16 * per_layer + 50304 * 2048
    qmoe = shapes.make_config("qwen1.5-moe-a2.7b", layers=4)
    assert isinstance(qmoe, transformers.Qwen2MoeConfig) and qmoe.num_hidden_layers == 4
    assert qmoe.router_aux_loss_coef == 0.001 and qmoe.output_router_logits


def test_hf_init_on_cpu_draws_every_weight_with_the_models_init():
    """On the CPU, hf init skips torch's own Linear/Embedding init (the model's init redraws them):
    every such weight must hold the model's normal(0, 0.02), not torch's kaiming uniform (std
    0.072 at fan-in 64), the build is reproducible, and a weight the model's init did not draw is
    refused by name."""
    import pytest
    import torch
    from torch import nn

    from benchmarks.build import _check_drawn, build_model
    from benchmarks.shapes import make_config

    config = make_config("tiny", layers=2)
    originals = (nn.Linear.reset_parameters, nn.Embedding.reset_parameters)
    model = build_model(config, torch.float32, "hf", seed=0)
    again = build_model(config, torch.float32, "hf", seed=0)
    for (name, module), other in zip(model.named_modules(), again.modules()):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            assert 0.015 < module.weight.std() < 0.025, name
            assert torch.equal(module.weight, other.weight), name
    # torch's own init is back after the build
    assert (nn.Linear.reset_parameters, nn.Embedding.reset_parameters) == originals
    with pytest.raises(RuntimeError, match="lm_head|embed_tokens"):
        _check_drawn(model, {p.data_ptr() for p in model.model.layers.parameters()})


def test_fast_init_shares_layer_0_and_keeps_buffers_and_ties():
    import torch

    from benchmarks.build import apply_lora, build_model, param_counts, resolve_init
    from benchmarks.shapes import make_config

    assert resolve_init("auto", make_config("tiny")) == "hf"
    assert resolve_init("auto", make_config("qwen2.5-14b")) == "fast"
    for name in ("tiny", "tiny-olmoe"):
        fast = build_model(make_config(name, layers=3), torch.bfloat16, "fast", seed=0)
        hf = build_model(make_config(name, layers=3), torch.bfloat16, "hf", seed=0)
        first, third = (
            dict(fast.model.layers[0].named_parameters()),
            dict(fast.model.layers[2].named_parameters()),
        )
        for key, p in first.items():
            # own parameter, shared storage
            assert third[key] is not p and third[key].data_ptr() == p.data_ptr()
            assert p.dtype == torch.bfloat16 and p.device.type == "cpu"
        # the model's normal(0, 0.02)
        assert 0.015 < first["self_attn.q_proj.weight"].float().std() < 0.025
        assert torch.equal(first["input_layernorm.weight"], torch.ones(64, dtype=torch.bfloat16))
        # rotary inv_freq computed for real, not left uninitialized
        for key, buf in hf.named_buffers():
            assert torch.equal(dict(fast.named_buffers())[key], buf), key
        assert [(n, p.shape) for n, p in fast.named_parameters()] == [
            (n, p.shape) for n, p in hf.named_parameters()
        ]
    tied = build_model(make_config("tiny"), torch.float32, "fast", seed=0)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    lora = apply_lora(tied, 4)
    counts = param_counts(lora)
    assert counts["trainable_params"] == counts["adapter_params"] == 8192
    assert counts["base_params"] == counts["frozen_params"]


def test_a_killed_system_is_recorded_with_its_peak_rss_and_phases(tmp_path):
    """A process the kernel kills leaves no result file: the driver records what it saw (its VmHWM,
    sampled; the phases it printed) as "killed (host OOM)" when the OOM killer did it, and goes on
    with the next system."""
    from benchmarks import h2h

    child = (
        "import json, os, signal, time; b = bytearray(64 << 20); b[::4096] = b'x' * "
        "len(b[::4096]); "
        "print('@@h2h-phase ' + json.dumps({'phase': 'model built', 't_s': 1.0, 'phase_s': 1.0, "
        "'rss_bytes': 1, 'peak_rss_bytes': 1}), flush=True); time.sleep(1.2); os.kill(os.getpid(), "
        "signal.SIGKILL)"
    )
    watch: dict = {}
    tail = h2h._run_with_progress([sys.executable, "-c", child], "killed", watch=watch)
    assert watch["returncode"] == -9 and [p["phase"] for p in watch["phases"]] == ["model built"]
    assert watch["peak_rss_bytes"] >= 64 << 20  # sampled while it ran
    rec = h2h.failed_run("zero3", "tiny", 2, 128, tail, watch, host_mem_bytes=1 << 50)
    assert rec["status"] == ("killed (SIGKILL)" if not watch["oom_kills"] else "killed (host OOM)")
    assert (
        rec["last_phase"] == "model built" and rec["peak_host_rss_bytes"] == watch["peak_rss_bytes"]
    )
    oom = h2h.failed_run(
        "zero3", "tiny", 2, 128, [], dict(watch, oom_kills=1), host_mem_bytes=1 << 50
    )
    assert oom["status"] == "killed (host OOM)"
    unreadable = dict(watch, oom_kills=None, peak_rss_bytes=90)
    assert (
        h2h.failed_run("zero3", "tiny", 2, 128, [], unreadable, 100)["status"]
        == "killed (host OOM)"
    )
    assert (
        h2h.failed_run("zero3", "tiny", 2, 128, [], dict(watch, returncode=1), 100)["status"]
        == "error"
    )
    assert "KILLED (HOST OOM) (peak host RSS" in h2h.report_line(oom)


def test_h2h_goes_on_after_a_killed_system(tmp_path, monkeypatch):
    from benchmarks import h2h

    def fake(cmd, desc, env=None, watch=None):
        path = cmd[cmd.index("--json") + 1]
        system = cmd[cmd.index("--system") + 1]
        if system == "zero3":  # killed by the kernel: no result file
            watch.update(
                returncode=-9,
                oom_kills=1,
                peak_rss_bytes=7 * 10**9,
                phases=[
                    {
                        "phase": "model built",
                        "t_s": 5.0,
                        "phase_s": 5.0,
                        "rss_bytes": 6 * 10**9,
                        "peak_rss_bytes": 6 * 10**9,
                    }
                ],
            )
            return ["Killed\n"]
        watch.update(returncode=0, oom_kills=0, peak_rss_bytes=1, phases=[])
        with open(path, "w") as f:
            json.dump(rank_result(0, 0.5, 10**9, world_size=1, system=system, lora_params=None), f)
        return []

    monkeypatch.setattr(h2h, "_run_with_progress", fake)
    assert (
        h2h.main(
            [
                "--model",
                "tiny",
                "--device",
                "cpu",
                "--systems",
                "zero3,megatrain",
                "--lora",
                "4",
                "--host-mem-gib",
                "1000",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    runs = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [(r["system"], r["status"]) for r in runs] == [
        ("zero3", "killed (host OOM)"),
        ("megatrain", "ok"),
    ]
    assert runs[0]["peak_host_rss_bytes"] == 7 * 10**9 and runs[0]["last_phase"] == "model built"
    md = (tmp_path / "results.md").read_text()
    assert "killed (host OOM)" in md and "| model built |" in md


def test_lora_is_refused_for_the_whole_on_gpu_system(tmp_path):
    import pytest

    from benchmarks import h2h

    with pytest.raises(SystemExit):
        h2h.main(
            [
                "--model",
                "tiny",
                "--device",
                "cpu",
                "--systems",
                "resident",
                "--lora",
                "4",
                "--out",
                str(tmp_path),
            ]
        )


def _interrupted_driver(child: str, then: str) -> tuple[dict, subprocess.CompletedProcess]:
    """Runs the driver's ``_run_with_progress`` on the Python program ``child`` in a session of its
    own, with a SIGINT to the whole group 1.5 s in (phase_lib's ``timeout --signal=INT``); ``then``
    is an expression of ``watch`` and ``tail`` whose JSON the script prints last."""
    script = (
        "import json, os, signal, sys, threading\n"
        "from benchmarks import h2h\n"
        f"child = {child!r}\n"
        "threading.Timer(1.5, lambda: os.killpg(0, signal.SIGINT)).start()\n"
        "watch = {}\n"
        "tail = h2h._run_with_progress([sys.executable, '-c', child], 'slow', watch=watch)\n"
        f"print(json.dumps({then}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        start_new_session=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc


def test_a_time_limit_records_the_run_so_far():
    """phase_lib's `timeout --signal=INT` interrupts the driver and the system's process (one
    process group): the driver records the phases and step times the process printed before it
    stopped."""
    phase = {"phase": "model built", "t_s": 1, "phase_s": 1, "rss_bytes": 1, "peak_rss_bytes": 1}
    rec, proc = _interrupted_driver(
        f"import time; print('@@h2h-phase ' + {json.dumps(phase)!r}, flush=True); "
        "print('@@h2h-step 1 4 0.5', flush=True); time.sleep(60)",
        "h2h.failed_run('zero3', 'tiny', 2, 128, tail, watch, 1 << 40)",
    )
    assert rec["status"] == "interrupted (time limit or Ctrl-C)", proc.stderr[-2000:]
    assert rec["step_times_s_seen"] == [0.5] and rec["last_phase"] == "model built"


def test_a_time_limit_in_the_childs_teardown_is_recorded_not_raised():
    """The limit can come after the child's output ended (its teardown, 2026-11-30: ZeRO-3 at 7B):
    the driver records the interruption and the child's exit instead of dying in its wait, so a
    result the child wrote before its teardown is still read."""
    rec, proc = _interrupted_driver(
        "import os, time; print('@@h2h-step 1 1 0.5', flush=True); "
        "os.close(1); os.close(2); time.sleep(60)",
        "{k: watch[k] for k in ('interrupted', 'returncode', 'step_times')}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert rec["interrupted"] is True and rec["step_times"] == [0.5]
    assert rec["returncode"] != 0  # the child was stopped by the interrupt, not left running


def test_host_precheck_asks_megatrains_planner(tmp_path, monkeypatch):
    """The harness's host-memory check for megatrain is the engine's own plan of this run's config
    (issue 26: a fixed 18 B/param skipped 7B with bf16 masters, which the engine then ran in 104
    GB): fp32 masters plan about 15 bytes per parameter (14 for the layers: bf16 gradients land
    beside the streamed fp32 master), bf16 masters 2 less (the layers'), and a run that does not fit
    is skipped with the plan's number."""
    import argparse

    from benchmarks import h2h, host_check
    from benchmarks.shapes import make_config, n_params
    from megatrain_ds.planning.config import parse_config
    from megatrain_ds.planning.plan import meta_model, plan_model
    from benchmarks.megatrain_system import megatrain_ds_config

    args = argparse.Namespace(
        lora=0,
        ds_config=None,
        device="cuda",
        seq=1024,
        liger="off",
        gpu_optimizer_fraction=0.0,
        host_only=True,
        gpus=1,
        model="qwen2.5-7b",
        host_mem_gib=100.0,
    )
    cfg = make_config("qwen2.5-7b")
    fp32 = host_check.planned_megatrain_host_bytes(args, cfg, 16384, 1)
    want = plan_model(
        meta_model(cfg),
        parse_config(megatrain_ds_config(16, "cuda", False, 0.0, True), warn=False),
        device="cuda",
        host_budget=1e9,
    ).host_need_bytes
    assert fp32 == want and 14.5 < fp32 / n_params(cfg) < 15.5
    monkeypatch.setenv(
        "MEGATRAIN_DS_CONFIG",
        json.dumps({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}),
    )
    bf16 = host_check.planned_megatrain_host_bytes(args, cfg, 16384, 1)
    # the layers (not the resident part)
    assert 1.5 < (fp32 - bf16) / n_params(cfg) < 2.5, (fp32, bf16)
    # 100 GiB: bf16 masters fit...
    assert host_check.host_precheck("megatrain", args, cfg, 16384, 1) is None
    args.host_mem_gib = 80.0  # ...80 GiB do not: skipped before any process starts, naming the plan
    res = h2h.run_one("megatrain", args, None, 16384, str(tmp_path / "y.json"))
    assert res["status"] == "skipped" and "megatrain_ds's plan" in res["error"], res
    monkeypatch.delenv("MEGATRAIN_DS_CONFIG")
    # fp32 masters: 106.3 + 3
    assert "needs ~109 GiB" in host_check.host_precheck("megatrain", args, cfg, 16384, 1)


def test_megatrain_builds_on_the_cpu_when_the_gpu_cannot_hold_the_fp32_model(monkeypatch):
    import torch

    from benchmarks import megatrain_system
    from benchmarks.shapes import make_config

    cfg = make_config("qwen2.5-3b")  # 3.1 B params: 12.4 GB in fp32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (10 * 2**30, 80 * 2**30))
    assert megatrain_system._init_device(cfg, "cuda", lora=0) == "cpu"
    assert megatrain_system._init_device(cfg, "cuda", lora=16) == "cuda"  # bf16 base: 6.2 GB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (70 * 2**30, 80 * 2**30))
    assert megatrain_system._init_device(cfg, "cuda", lora=0) == "cuda"
    assert megatrain_system._init_device(cfg, "cpu", lora=0) == "cpu"
