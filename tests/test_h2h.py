"""CPU smoke test of the head-to-head harness: it runs each system in its own process and writes
results.json (with the fields users compare), results.md and a PNG plot."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_h2h_cpu_smoke(tmp_path):
    out = tmp_path / "h2h"
    cmd = [sys.executable, "-m", "benchmarks.h2h", "--model", "tiny", "--device", "cpu", "--systems",
           "megatrain,resident", "--seq", "64", "--tokens-per-step", "256", "--steps", "2", "--warmup", "1",
           "--megatrain-options", '{"num_slots": 3}', "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert data["hardware"]["cpu_cores"] >= 1
    by_system = {r["system"]: r for r in data["results"]}
    assert set(by_system) == {"megatrain", "resident"}
    for r in by_system.values():
        assert r["status"] == "ok"
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0
        assert r["peak_gpu_bytes"] == 0 and r["peak_host_rss_bytes"] > 0 and r["host_bytes_per_param"] > 0
    assert "breakdown" in by_system["megatrain"]
    assert by_system["megatrain"]["ds_config"]["megatrain"]["num_slots"] == 3  # --megatrain-options reached it
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "megatrain" in (out / "results.md").read_text()
    # fair peers: the same AdamW hyperparameters, clip and steps recorded by every system, and by ZeRO-3's config
    from benchmarks.shapes import make_config
    from benchmarks.systems import zero3_ds_config, zero3_settings

    zero3 = zero3_settings(zero3_ds_config(make_config("tiny"), 4, "cpu"), seq=64, steps=2, warmup=1)
    same = ("lr", "weight_decay", "betas", "eps", "clip", "steps", "warmup", "seq", "micro_batch")
    expected = {"lr": 1e-5, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "clip": 1.0, "steps": 2,
                "warmup": 1, "seq": 64, "micro_batch": 4}
    for settings in [r["settings"] for r in by_system.values()] + [zero3]:
        assert {k: settings[k] for k in same} == expected
        assert settings["liger"] is False and settings["kernels"] == []  # --liger auto on CPU: off for all
    assert by_system["megatrain"]["settings"]["megatrain_options"] == {"num_slots": 3}
    assert by_system["megatrain"]["settings"]["gpu_optimizer_layers"] == "engine default"  # not set unless asked
    assert "gpu_optimizer_layers" not in by_system["megatrain"]["ds_config"]["megatrain"]
    md = (out / "results.md").read_text()
    assert "lr 1e-05 wd 0.01 betas (0.9, 0.999) eps 1e-08" in md and "resident_Ldefault_256 (resident)" in md
    # a progress bar per system, over its steps (warm-up + measured; megatrain runs one more to close its breakdown)
    assert "megatrain L=2 T=256: 4/4 steps" in proc.stderr, proc.stderr[-3000:]
    assert "resident L=2 T=256: 3/3 steps" in proc.stderr, proc.stderr[-3000:]


def test_host_adam_probe_prints_a_row_per_thread_count(capsys):
    from benchmarks import host_adam

    assert host_adam.main(["--gparams", "0.002", "--threads", "1,2", "--repeats", "1", "--no-deepspeed"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1]) > 0 and float(cells[2]) > 0 and cells[3] == "–" and float(cells[4]) > 0


def test_h2h_best_batch_records_every_probe_and_marks_the_fastest(tmp_path):
    out = tmp_path / "best"
    cmd = [sys.executable, "-m", "benchmarks.h2h", "--model", "tiny", "--device", "cpu", "--systems",
           "megatrain", "--seq", "64", "--best-batch", "--min-tokens", "64", "--max-tokens", "128",
           "--steps", "1", "--warmup", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads((out / "results.json").read_text())["results"]
    for system in ("megatrain",):  # one system keeps the file fast; the search is the same for each
        probes = [r for r in runs if r["system"] == system]
        assert [r["tokens_per_step"] for r in probes] == [64, 128]
        best = [r for r in probes if r.get("best_batch")]
        assert len(best) == 1 and best[0]["tokens_per_s"] == max(r["tokens_per_s"] for r in probes)
    assert "best tokens/step" in (out / "results.md").read_text()


def test_report_compares_rows_of_the_same_depth_and_names_duplicate_runs_by_file(tmp_path):
    """A depth sweep puts several depths at one tokens/step: each megatrain row is compared with the ZeRO-3 row
    of its own depth, and one run name coming from two files is told apart by the file."""
    from benchmarks import report

    def run(system, layers, tok_s):
        return {"system": system, "layers": layers, "tokens_per_step": 16384, "status": "ok",
                "name": f"{system}_L{layers}_16384", "median_step_s": 16384 / tok_s, "tokens_per_s": tok_s,
                "tflops": 1.0, "peak_gpu_bytes": 0, "peak_host_rss_bytes": 0, "host_bytes_per_param": 0.0}

    files = {"sweep_megatrain": [run("megatrain", 24, 300.0), run("megatrain", 48, 150.0)],
             "sweep_zero3": [run("zero3", 24, 200.0), run("zero3", 48, 50.0)],
             "knob_megatrain": [run("megatrain", 48, 120.0)]}
    for stem, rows in files.items():
        (tmp_path / f"{stem}.json").write_text(json.dumps({"hardware": {}, "results": rows}))
    table = report.throughput_table(report.load(str(tmp_path)))
    lines = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[2:]}
    assert "1.50×" in lines["megatrain_L24_16384"]          # 300 / 200, not 300 / 50
    assert "3.00×" in lines["sweep_megatrain: megatrain_L48_16384"]   # 150 / 50
    assert "2.40×" in lines["knob_megatrain: megatrain_L48_16384"]    # 120 / 50


def test_h2h_depth_sweep_runs_each_depth_and_plots_tflops_against_layers(tmp_path):
    out = tmp_path / "depth"
    cmd = [sys.executable, "-m", "benchmarks.h2h", "--model", "tiny", "--device", "cpu", "--systems", "megatrain",
           "--seq", "64", "--tokens-per-step", "128", "--depth-sweep", "1,3", "--steps", "1", "--warmup", "1",
           "--liger", "off", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads((out / "results.json").read_text())["results"]
    assert [(r["system"], r["layers"], r["status"]) for r in runs] == [("megatrain", 1, "ok"), ("megatrain", 3, "ok")]
    assert runs[1]["n_params"] > runs[0]["n_params"]  # same width, more layers
    for r in runs:  # --liger off: no liger kernel, and megatrain_ds told so (its own default would use liger)
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
        assert ds_config["optimizer"]["params"] == {"lr": 1e-5, "weight_decay": 0.01, "betas": [0.9, 0.999],
                                                    "eps": 1e-8}
    assert mega["megatrain"]["gpu_optimizer_layers"] == -1  # the engine reads the ratio, whatever its default
    assert zero3["zero_optimization"]["sub_group_size"] < 1e8  # DeepSpeed places whole sub-groups: one per layer
    assert zero3_settings(zero3, 1024, 4, 2)["ds_config"]["zero_optimization"]["offload_optimizer"]["ratio"] == 0.5
    recorded = megatrain_settings(mega, 1024, 4, 2, "cuda")
    assert recorded["offload_optimizer_ratio"] == 0.5 and recorded["ds_config"] is mega
    # default: nothing about optimizer placement (the engine decides); --host-only: explicitly all on the host
    assert "ratio" not in zero3_ds_config(config, 16, "cuda")["zero_optimization"]["offload_optimizer"]
    assert "gpu_optimizer_layers" not in megatrain_ds_config(16, "cuda")["megatrain"]
    assert megatrain_ds_config(16, "cuda", host_only=True)["megatrain"]["gpu_optimizer_layers"] == 0
    monkeypatch.setenv("MEGATRAIN_OPTIONS", '{"gpu_optimizer_layers": "auto"}')  # --megatrain-options wins
    assert megatrain_settings(megatrain_ds_config(16, "cuda"), 1024, 4, 2, "cuda")["gpu_optimizer_layers"] == "auto"


def test_h2h_rejects_host_only_with_a_gpu_optimizer_fraction(tmp_path):
    import pytest

    from benchmarks import h2h

    with pytest.raises(SystemExit):
        h2h.main(["--model", "tiny", "--device", "cpu", "--host-only", "--gpu-optimizer-fraction", "0.5",
                  "--out", str(tmp_path)])
