"""100B+ on paper: megatrain_ds's planner for a 100B and a 120B Qwen-like model on the paper's
machine and on each GPU box the project can borrow; predictions, nothing is built or run.

    python -m benchmarks.plan_100b --out benchmarks/results/2026-11-29_cpu_plan_100b

Shapes: the Qwen2.5-72B width (hidden 8192, intermediate 29568, 64 heads, 8 KV heads, vocab 152064,
untied) made deeper: 111 layers = 100 B parameters ("qwen-100b"), 134 layers = 120 B
("qwen-120b"). Machines: the paper's (one H200, 1.5 TB host) and the lent kinds (1/2/4/8 H200 with
128/256/512/560 GiB host, 64/128/235/235 GB disk).

For each (model, machine) the planner (``megatrain_ds.planning.plan.plan_model``, what
``megatrain-ds plan`` and ``initialize`` run) is asked, in order, until one fits (MODES): (1)
"ram": fp32 masters, gradients and Adam moments in RAM; (2) "nvme": the same with the NVMe tier
(``offload_optimizer.device: nvme``, ``nvme_layers: "auto"``: the moments of the fewest trailing
layers on disk); (3) and (4): (1) and (2) with bf16 master weights
(``bf16_master_weights_and_grads``, 4 host bytes less per parameter: not the exact fp32 recipe,
labelled so). The host budget is 90% of the machine's RAM; the disk's free bytes are the kind's
disk size (the planner would read this machine's disk: it is replaced by the target's). 16 x 1024
tokens per GPU per step, bf16 compute, data parallel over the box's GPUs (one host copy of the
state).

The step time is not the planner's (it predicts memory only): it is this script's bound model, the
largest of

    GPU     model FLOPs of the step (ANCHORS formula, per GPU) / 350 TFLOPS (the 14B run's rate)
    PCIe    weights streamed in twice (bf16) per GPU at 50 GB/s
    host    the host update of every parameter at the box's measured rate (5.4 Gparam/s on 16
            cores, 7.2 on 64)
    disk    each disk layer's moments read (2.20 GB/s) and written (2.52 GB/s) once per step

i.e. perfect overlap, a lower bound; the measured 14B step was 1.05x its bound. Labelled "estimate"
everywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import tempfile

GiB = 2**30
SHAPES = {  # name -> (hidden, layers, intermediate, heads, kv heads, vocab, tied)
    "qwen-100b": (8192, 111, 29568, 64, 8, 152064, False),
    "qwen-120b": (8192, 134, 29568, 64, 8, 152064, False),
}
# name -> (GPUs, GPU memory GiB, host RAM GiB, disk GB, CPU cores, host update Gparam/s (measured or
# assumed))
MACHINES = {
    "paper: 1x H200, 1.5 TB": (1, 140.4, 1.5e12 / GiB, 0, None, 5.4),
    "nvidia-h200 (1x, 128 GiB)": (1, 140.4, 128, 64, 16, 5.4),
    "nvidia-h200-x2 (2x, 256 GiB)": (2, 140.4, 256, 128, 32, 6.3),
    "nvidia-h200-x4 (4x, 512 GiB)": (4, 140.4, 512, 235, 64, 7.2),
    "nvidia-h200-x8 (8x, 560 GiB)": (8, 140.4, 560, 235, 128, 7.2),
}
HOST_RATE_SOURCE = {
    5.4: "measured, 16 cores (2026-11-27)",
    6.3: "assumed (between 16 and 64 cores)",
    7.2: "measured, 64 cores (2026-11-28); assumed for 128",
}
GPU_TFLOPS, PCIE_BPS, DISK_READ_BPS, DISK_WRITE_BPS = 350e12, 50e9, 2.20e9, 2.52e9
TOKENS_PER_GPU, SEQ = 16384, 1024
BUDGET_SHARE = 0.90
NVME_PATH = os.path.join(
    tempfile.gettempdir(), "megatrain-nvme-plan"
)  # planned only: nothing is written
MODES = (
    "ram",
    "nvme",
    "ram+bf16 masters",
    "nvme+bf16 masters",
)  # tried in this order until one fits


def make_config(name: str, layers: int | None = None):
    from transformers import Qwen2Config

    hidden, depth, inter, heads, kv, vocab, tied = SHAPES[name]
    return Qwen2Config(
        hidden_size=hidden,
        num_hidden_layers=layers or depth,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        max_position_embeddings=32768,
        name_or_path=name,
    )


def ds_config(mode: str, micro_batch: int = TOKENS_PER_GPU // SEQ) -> dict:
    from benchmarks.megatrain_system import megatrain_ds_config

    cfg = megatrain_ds_config(micro_batch, "cuda", liger=True, host_only=True)
    if mode.startswith("nvme"):
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": NVME_PATH}
        cfg["megatrain"]["nvme_layers"] = "auto"
    if mode.endswith("bf16 masters"):
        cfg["bf16"]["bf16_master_weights_and_grads"] = True
    return cfg


@contextlib.contextmanager
def disk_of(size_bytes: int):
    """The planner reads the NVMe path's free bytes on this machine: the target machine's disk
    instead."""
    from megatrain_ds.planning import capacity_count

    original = capacity_count.disk_free_bytes
    capacity_count.disk_free_bytes = lambda path: int(size_bytes)
    try:
        yield
    finally:
        capacity_count.disk_free_bytes = original


def plan(
    model,
    mode: str,
    gpus: int,
    gpu_gib: float,
    host_gib: float,
    disk_gb: float,
    seq: int | None = SEQ,
    micro_batch: int = TOKENS_PER_GPU // SEQ,
):
    """The planner's prediction for one machine and recipe (``seq`` None: host and disk only, no GPU
    working set)."""
    from megatrain_ds.planning.config import parse_config
    from megatrain_ds.planning.plan import plan_model

    config = parse_config(copy.deepcopy(ds_config(mode, micro_batch)), world_size=gpus, warn=False)
    with disk_of(disk_gb * 1e9):
        return plan_model(
            model,
            config,
            seq=seq,
            device="cuda",
            world=gpus,
            host_budget=BUDGET_SHARE * host_gib,
            gpu_memory=int(gpu_gib * GiB),
            nvme_path=NVME_PATH if mode.startswith("nvme") else None,
        )


def plan_fitting(model, mode: str, gpus: int, gpu_gib: float, host_gib: float, disk_gb: float):
    """(prediction, micro-batch): at 16 sequences per GPU, or at the largest micro-batch the GPU
    holds when only the
    GPU stops 16."""
    micro = TOKENS_PER_GPU // SEQ
    pred = plan(model, mode, gpus, gpu_gib, host_gib, disk_gb)
    gpu_only = pred.problems and all(p.startswith("GPU") for p in pred.problems)
    if not pred.fits and gpu_only and pred.max_micro_batch:
        micro = int(pred.max_micro_batch)
        pred = plan(model, mode, gpus, gpu_gib, host_gib, disk_gb, micro_batch=micro)
    return pred, micro


def step_estimate(
    config, pred, gpus: int, host_rate: float, tokens_per_gpu: int = TOKENS_PER_GPU
) -> dict:
    """The bound model of the module docstring (seconds), and tokens/s and TFLOPS per GPU at its
    largest term."""
    from benchmarks.shapes import model_flops_per_token, n_params

    n = n_params(config)
    flops = model_flops_per_token(config, SEQ)
    t = {
        "gpu_s": flops * tokens_per_gpu / GPU_TFLOPS,
        "pcie_s": 2 * 2 * n / PCIE_BPS,
        "host_s": n
        / (host_rate * 1e9),  # disk_bytes: the disk layers' state, read and written once a step
        "disk_s": pred.disk_bytes / DISK_READ_BPS + pred.disk_bytes / DISK_WRITE_BPS,
    }
    step = max(t.values())
    tokens = tokens_per_gpu * gpus
    return {
        **{k: round(v, 2) for k, v in t.items()},
        "step_s": round(step, 2),
        "bound": max(t, key=t.get).removesuffix("_s"),
        "tokens_per_s": round(tokens / step),
        "tflops_per_gpu": round(flops * tokens / step / gpus / 1e12, 1),
    }


def rows() -> list[dict]:
    from benchmarks.shapes import n_params
    from megatrain_ds.planning.plan import meta_model

    out = []
    for shape in SHAPES:
        config = make_config(shape)
        model = meta_model(config)
        for machine, (gpus, gpu_gib, host_gib, disk_gb, cores, rate) in MACHINES.items():
            tried = []
            for mode in MODES:
                if mode.startswith("nvme") and not disk_gb:
                    continue
                pred, micro = plan_fitting(model, mode, gpus, gpu_gib, host_gib, disk_gb)
                tried.append(
                    {
                        "mode": mode,
                        "micro_batch": micro,
                        "fits": pred.fits,
                        "host_need_gib": round(pred.host_need_bytes / GiB, 1),
                        "disk_gb": round(pred.disk_bytes / 1e9, 1),
                        "disk_layers": pred.disk_layers,
                        "gpu_need_gib": round((pred.gpu_need_bytes or 0) / GiB, 1),
                        "binding": pred.binding,
                        "problems": pred.problems,
                    }
                )
                if pred.fits:
                    break
            row = {
                "model": shape,
                "params_b": round(n_params(config) / 1e9, 1),
                "layers": config.num_hidden_layers,
                "machine": machine,
                "gpus": gpus,
                "host_gib": round(host_gib),
                "disk_gb": disk_gb,
                "host_budget_gib": round(BUDGET_SHARE * host_gib, 1),
                "host_rate_gparam_s": rate,
                "host_rate_source": HOST_RATE_SOURCE[rate],
                "tried": tried,
                "fits": tried[-1]["fits"],
                "mode": tried[-1]["mode"] if tried[-1]["fits"] else None,
            }
            if row["fits"]:
                row["estimate"] = step_estimate(
                    config, pred, gpus, rate, tried[-1]["micro_batch"] * SEQ
                )
            out.append(row)
            print(json.dumps({k: row[k] for k in ("model", "machine", "fits", "mode")}), flush=True)
    return out


def deepest(machine: str, mode: str, lo: int = 8, hi: int = 134) -> dict:
    """The most layers of this width that the planner fits on ``machine`` in ``mode`` (host, disk
    and GPU, as
    :func:`plan_fitting`)."""
    from benchmarks.shapes import n_params
    from megatrain_ds.planning.plan import meta_model

    gpus, gpu_gib, host_gib, disk_gb, _, _ = MACHINES[machine]
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if plan_fitting(
            meta_model(make_config("qwen-100b", mid)), mode, gpus, gpu_gib, host_gib, disk_gb
        )[0].fits:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return {
        "machine": machine,
        "mode": mode,
        "layers": best,
        "params_b": round(n_params(make_config("qwen-100b", best)) / 1e9, 1) if best else None,
    }


def markdown(table: list[dict], deep: list[dict]) -> str:
    lines = [
        "| model | machine | fits? | how | host need (budget) GiB | disk GB (layers on disk) | GPU "
        "GiB | "
        "estimated step s (bound) | est. tokens/s | est. TFLOPS/GPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        last = r["tried"][-1]
        est = r.get("estimate") or {}
        how = (
            f"{r['mode']}, micro-batch {last['micro_batch']}"
            if r["fits"]
            else "no: " + "; ".join(p.split(":")[0] for p in last["problems"][:2])
        )
        lines.append(
            f"| {r['model']} ({r['params_b']} B, {r['layers']} L) | {r['machine']} | "
            f"{'yes' if r['fits'] else '**no**'} | {how} | {last['host_need_gib']} "
            f"({r['host_budget_gib']}) | "
            f"{last['disk_gb']} ({last['disk_layers']}) | {last['gpu_need_gib']} | "
            f"{est.get('step_s', '–')} ({est.get('bound', '–')}) | {est.get('tokens_per_s', '–')} "
            "| "
            f"{est.get('tflops_per_gpu', '–')} |"
        )
    lines += [
        "",
        "Deepest model of this width (hidden 8192, inter 29568) the planner fits:",
        "",
        "| machine | recipe | layers | parameters |",
        "|---|---|---|---|",
    ]
    lines += [f"| {d['machine']} | {d['mode']} | {d['layers']} | {d['params_b']} B |" for d in deep]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    table = rows()
    deep = [
        deepest(m, mode)
        for m in MACHINES
        for mode in MODES
        if MACHINES[m][3] or not mode.startswith("nvme")
    ]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "plan_100b.json"), "w") as f:
        json.dump(
            {
                "kind": "predictions (megatrain_ds planner + this script's step bound), nothing "
                "run",
                "tokens_per_gpu": TOKENS_PER_GPU,
                "seq": SEQ,
                "budget_share": BUDGET_SHARE,
                "rates": {
                    "gpu_tflops": GPU_TFLOPS / 1e12,
                    "pcie_GBps": PCIE_BPS / 1e9,
                    "disk_read_GBps": DISK_READ_BPS / 1e9,
                    "disk_write_GBps": DISK_WRITE_BPS / 1e9,
                },
                "rows": table,
                "deepest": deep,
            },
            f,
            indent=2,
        )
    with open(os.path.join(a.out, "plan_100b.md"), "w") as f:
        f.write(markdown(table, deep) + "\n")
    print(markdown(table, deep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
