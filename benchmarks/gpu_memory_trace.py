"""Where a step's GPU peak comes from: one optimizer step of a Qwen2-shaped model under
megatrain_ds, with torch's allocation history recorded, and the live allocations at the peak grouped
by the megatrain_ds / model frame that made them; next to it, what ``megatrain-ds plan`` predicts
for the same model and config.

    python -m benchmarks.gpu_memory_trace --ga 2 --megatrain '{"stream_fp32_master": false}'
        --out DIR

Prints the predicted and measured peaks and the live bytes at the peak by origin (largest first);
writes the snapshot (``torch.cuda.memory._snapshot()``, loadable at pytorch.org/memory_viz) and the
table as JSON to DIR. Defaults: the model of tests/unit/test_plan.py's GPU cases (hidden 2048, 6
layers, micro-batch 8 x 2048 tokens).

Where the caching allocator's *reserved* peak runs over its allocated one (the memory "auto"'s
placement budgets around: 2.2-3.7 GiB at 7B on 24 GiB even with expandable segments, 2026-11-30),
``reserved_at_peak`` replays the segments: the reserved peak, what was allocated then, the bytes
free inside each stream's segments, and the allocation whose new segment set the peak (its size,
stream and origin). A harness model under the harness's limit, the trace of the step after "auto"
placed:

    python -m benchmarks.gpu_memory_trace --model qwen2.5-7b --micro 8 --seq 1024 --steps 3 \
        --gpu-memory-limit 24 --megatrain '{"gpu_optimizer_layers": "auto",
        "keep_activations": "auto"}' --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
from collections import defaultdict


def live_at_peak(snapshot: dict, device: int = 0) -> tuple[int, list[dict]]:
    """Replay the device's allocation trace: the largest total of live blocks, and those blocks
    (size, frames)."""
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for ev in snapshot["device_traces"][device]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
    return peak, at_peak


SEGMENT_UP = ("segment_alloc", "segment_map")
SEGMENT_DOWN = ("segment_free", "segment_unmap")


def reserved_at_peak(snapshot: dict, device: int = 0) -> dict:
    """Replay the device's trace for the caching allocator's reserved bytes (segments allocated or,
    with expandable segments, mapped) beside its allocated ones. The totals before the trace are
    the end state (``snapshot["segments"]``) less what the trace added. Returns the reserved peak,
    the bytes allocated at that moment, the bytes free inside each stream's segments then
    (``free_by_stream``), and the segment event that set the peak (``set_by``: size, stream and
    origin)."""
    trace = snapshot["device_traces"][device]
    segments = [seg for seg in snapshot.get("segments", []) if seg.get("device", device) == device]
    reserved_s: dict[int, int] = defaultdict(int)
    allocated_s: dict[int, int] = defaultdict(int)
    for seg in segments:  # the end state, per stream
        stream = seg.get("stream", 0)
        reserved_s[stream] += seg["total_size"]
        allocated_s[stream] += sum(
            b["size"]
            for b in seg.get("blocks", [])
            if b.get("state") in ("active_allocated", "active_pending_free")
        )
    deltas = {"alloc": 1, "free_completed": -1}

    def apply(ev: dict, sign: int) -> None:
        stream, size = ev.get("stream", 0), sign * ev.get("size", 0)  # "snapshot", "oom": none
        if ev["action"] in SEGMENT_UP:
            reserved_s[stream] += size
        elif ev["action"] in SEGMENT_DOWN:
            reserved_s[stream] -= size
        elif ev["action"] in deltas:
            allocated_s[stream] += deltas[ev["action"]] * size

    def moment(set_by: dict | None) -> dict:
        return {
            "reserved_bytes": sum(reserved_s.values()),
            "allocated_bytes": sum(allocated_s.values()),
            "free_by_stream": {k: reserved_s[k] - allocated_s[k] for k in sorted(reserved_s)},
            "set_by": set_by,
        }

    for ev in trace:  # back out what the trace added: the state before it
        apply(ev, -1)
    best = moment(None)
    for ev in trace:
        apply(ev, 1)
        if ev["action"] in SEGMENT_UP and sum(reserved_s.values()) > best["reserved_bytes"]:
            best = moment(
                {
                    "action": ev["action"],
                    "bytes": ev["size"],
                    "stream": ev.get("stream", 0),
                    "origin": origin(ev.get("frames", [])),
                }
            )
    return best


def origin(frames: list[dict]) -> str:
    """The innermost frame in megatrain_ds, transformers, liger or torch.nn (else the innermost
    Python frame)."""
    for key in ("megatrain_ds/", "liger_kernel/", "transformers/", "torch/nn/", "torch/autograd/"):
        for f in frames:
            name = f.get("filename", "")
            if key in name and not name.endswith(".cpp") and "<" not in name:
                return f"{name[name.index(key) :]}:{f.get('line')} {f.get('name')}"
    py = [f for f in frames if f.get("filename", "").endswith(".py")]
    return f"{py[0]['filename']}:{py[0]['line']} {py[0]['name']}" if py else "(no Python frame)"


def plan_check_config(layers: int):
    """The default model's config, and tests/unit/test_plan.py's GPU cases': a Qwen2 of hidden 2048
    whose step's working set, not fixed allocations, is most of the peak at 8 x 2048 tokens."""
    import transformers as tf

    return tf.Qwen2Config(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=32000,
        tie_word_embeddings=False,
        use_cache=False,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ga", type=int, default=1)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument(
        "--model",
        default=None,
        help="a harness shape (benchmarks/shapes.py) instead of the default",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=1,
        help='optimizer steps; the last is traced ("auto" places after the second)',
    )
    p.add_argument(
        "--gpu-memory-limit", type=float, default=None, help="GiB left free, as the harness's"
    )
    p.add_argument("--megatrain", default="{}", help="megatrain_ds's own config block (JSON)")
    p.add_argument("--out", required=True)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    import torch
    import transformers as tf

    import megatrain_ds
    from megatrain_ds.planning import plan

    os.makedirs(args.out, exist_ok=True)
    if args.model is not None:
        from benchmarks import build, common
        from benchmarks.shapes import make_config

        cfg = make_config(args.model)
        model = build.build_model(cfg, torch.float32, "auto", 0, device="cpu")
        if args.gpu_memory_limit is not None:
            common.hold_gpu_memory(args.gpu_memory_limit)
    else:
        cfg = plan_check_config(args.layers)
        torch.manual_seed(0)
        model = tf.Qwen2ForCausalLM(cfg)
    ds = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.ga,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
        "megatrain": {
            "gpu_optimizer_layers": 0,
            "keep_activations": 0,
            **json.loads(args.megatrain),
        },
    }
    pred = plan.plan_model(model, plan.load_train_config(ds), seq=args.seq, device="cuda")
    engine, *_ = megatrain_ds.initialize(model=model, config=ds)
    ids = torch.randint(0, cfg.vocab_size, (args.micro, args.seq))

    def step() -> None:
        for _ in range(args.ga):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        engine.synchronize()

    for _ in range(args.steps - 1):  # the steps before the traced one ("auto" places after 2)
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    step()
    measured = torch.cuda.max_memory_allocated()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(os.path.join(args.out, "snapshot.pickle"), "wb") as f:
        pickle.dump(snap, f)
    traced_peak, blocks = live_at_peak(snap)
    by_origin: dict[str, int] = defaultdict(int)
    count: dict[str, int] = defaultdict(int)
    for b in blocks:
        key = origin(b.get("frames", []))
        by_origin[key] += b["size"]
        count[key] += 1
    rows = sorted(by_origin.items(), key=lambda kv: -kv[1])
    mib = 2**20
    print(
        f"ga {args.ga}, megatrain {args.megatrain}: predicted {pred.gpu_allocated_bytes / mib:,.1f}"
        " MiB "
        f"(peak in {pred.gpu_phase}), measured {measured / mib:,.1f} MiB; allocated before the "
        "step "
        f"{base / mib:,.1f} MiB; traced peak (allocations made during the step) "
        f"{traced_peak / mib:,.1f} MiB"
    )
    reserved = reserved_at_peak(snap)
    set_by = reserved["set_by"] or {}
    print(
        f"reserved peak (traced) {reserved['reserved_bytes'] / mib:,.1f} MiB with "
        f"{reserved['allocated_bytes'] / mib:,.1f} MiB allocated; free inside the segments by "
        "stream: "
        + ", ".join(f"{k}: {v / mib:,.1f} MiB" for k, v in reserved["free_by_stream"].items())
        + (
            f"; set by a {set_by['bytes'] / mib:,.1f} MiB {set_by['action']} on stream "
            f"{set_by['stream']} for {set_by['origin']}"
            if set_by
            else "; no segment was added during the traced step"
        )
    )
    print(pred.table())
    print(f"{'MiB':>10}  {'blocks':>6}  origin (live at the traced peak)")
    for key, size in rows[: args.top]:
        print(f"{size / mib:10.1f}  {count[key]:6d}  {key}")
    with open(os.path.join(args.out, "peak.json"), "w") as f:
        json.dump(
            {
                "ga": args.ga,
                "model": args.model,
                "steps": args.steps,
                "gpu_memory_limit_gib": args.gpu_memory_limit,
                "megatrain": json.loads(args.megatrain),
                "predicted_bytes": pred.gpu_allocated_bytes,
                "predicted_parts": pred.gpu_parts,
                "measured_bytes": measured,
                "before_step_bytes": base,
                "traced_peak_bytes": traced_peak,
                "reserved_at_peak": reserved,
                "live_at_peak": [{"origin": k, "bytes": v, "blocks": count[k]} for k, v in rows],
            },
            f,
            indent=1,
        )
    engine.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
