"""TRL's own scripts on the GPU box, real DeepSpeed ZeRO-3 offload against ``MEGATRAIN_DS=1`` (issue
38, item 5).

Nothing is downloaded (the box reaches no network): ``prepare`` writes a random-init model of a
named shape (benchmarks/shapes.py) with a word-level tokenizer whose vocabulary covers every id of
the model (so any generated id decodes), a chat template, and two local datasets:

- ``sft/``: ``text`` rows of random words, each longer than ``--seq`` tokens as the saved tokenizer
  counts them, so that SFT with ``--max_length SEQ`` (no packing) trains exactly ``batch × SEQ``
  tokens per step;
- ``grpo/``: ``prompt`` rows of a few words, for GRPO with the reward
  ``benchmarks.trl_bench.length_reward``.

``timed`` runs one command, stamps every output line with the seconds since start, and writes a JSON
summary: the Trainer's own per-step log records (loss, grad_norm, ...) with the time each was
printed, the median interval between consecutive step records after the first ``--skip`` (the step
time as the Trainer logs it, one record per step with ``--logging_steps 1``), the Trainer's final
``train_runtime``, the wall time of the whole command and of the final save (from the "Training
completed" line to exit), the process tree's peak host RSS, and the peak GPU memory used on the
visible GPUs (nvidia-smi, every 0.5 s; none on a box without it).

    python -m benchmarks.trl_bench prepare --shape qwen2.5-3b --out DIR
    python -m benchmarks.trl_bench timed --json OUT.json
        -- accelerate launch ... trl/scripts/sft.py ...

benchmarks/run_trl.sh puts them together for the lent box.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time

import psutil


def length_reward(completions, **kwargs):
    """A GRPO reward that needs no model: longer completions score higher, capped at 64 words."""
    out = []
    for c in completions:
        text = c if isinstance(c, str) else " ".join(m.get("content", "") for m in c)
        out.append(min(len(text.split()), 64) / 64.0)
    return out


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer maps each byte
    to)."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _tokenizer(vocab_size: int):
    """Byte-level BPE without merges: every byte one token (ids 0-255), then ChatML's special
    tokens, then filler entries up to the model's vocabulary so that every id a random-init model
    generates decodes. transformers 5 loads a qwen2 folder's tokenizer as Qwen2Tokenizer, which
    keeps its own byte-level pre-tokenizer: a word-level vocabulary there encodes to nothing (seen
    2026-11-28: 16 tokens per 16-row step), bytes survive it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {c: i for i, c in enumerate(_byte_chars())}
    for tok in specials:
        vocab[tok] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[f"<f{i}>"] = i
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.add_special_tokens({"additional_special_tokens": specials[1:2]})
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% "
        "endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return fast


def prepare(shape: str, out: str, rows: int, seq: int, seed: int = 0) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.shapes import make_config

    config = make_config(shape)
    config.torch_dtype = "bfloat16"
    rng = random.Random(seed)
    tok = _tokenizer(config.vocab_size)
    model_dir = os.path.join(out, "model")
    torch.manual_seed(seed)
    t = time.perf_counter()
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(model_dir, safe_serialization=True)
    tok.save_pretrained(model_dir)
    n = sum(p.numel() for p in model.parameters())
    del model
    from transformers import AutoTokenizer

    # as TRL loads it: the row lengths are counted in its tokens
    loaded = AutoTokenizer.from_pretrained(model_dir)
    letters = "abcdefghijklmnopqrstuvwxyz"
    word = lambda: "".join(rng.choices(letters, k=rng.randint(2, 8)))  # noqa: E731
    text = lambda n: " ".join(word() for _ in range(n))  # noqa: E731
    probe = len(loaded(text(200))["input_ids"])
    if probe < 400:
        raise RuntimeError(
            f"the saved tokenizer gives {probe} tokens for 200 words ({type(loaded).__name__}): "
            "the SFT rows would not fill max_length"
        )
    words_per_row = int((seq + 64) * 200 / probe) + 1
    for name, make in (
        ("sft", lambda: {"text": text(words_per_row)}),
        ("grpo", lambda: {"prompt": text(8)}),
    ):
        os.makedirs(os.path.join(out, name), exist_ok=True)
        with open(os.path.join(out, name, "train.jsonl"), "w") as f:
            for _ in range(rows):
                f.write(json.dumps(make()) + "\n")
    print(
        f"prepared {shape}: {n / 1e9:.2f} B parameters in {model_dir} "
        f"({time.perf_counter() - t:.0f} s), "
        f"{rows} rows each of sft/ and grpo/"
    )


_RECORD = re.compile(r"^\{.*'(loss|train_runtime)'.*\}$")


def timed(cmd: list[str], json_out: str, skip: int) -> int:
    start = time.perf_counter()
    # each record printed when its step ends, not when a buffer fills
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env
    )
    peak, gpu_peak = [0], [None]

    # the process tree's RSS, and the GPUs' used memory (nvidia-smi, where there is one), every 0.5
    # s
    def watch():
        p = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                rss = sum(c.memory_info().rss for c in [p, *p.children(recursive=True)])
                peak[0] = max(peak[0], rss)
            except psutil.Error:
                pass
            used = _gpu_used_bytes()
            if used is not None:
                gpu_peak[0] = max(gpu_peak[0] or 0, used)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()
    records, final, done_at = [], {}, None
    for line in proc.stdout:
        now = time.perf_counter() - start
        line = line.rstrip("\n")
        print(f"[{now:8.2f}] {line}", flush=True)
        text = line.strip()
        if "Training completed" in text:
            done_at = now
        if _RECORD.match(text):
            try:
                rec = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                continue
            if "train_runtime" in rec:
                final = rec
            else:
                records.append({"t": now, **rec})
    rc = proc.wait()
    wall = time.perf_counter() - start
    gaps = [b["t"] - a["t"] for a, b in zip(records, records[1:])][skip:]
    summary = {
        "argv": cmd,
        "rc": rc,
        "wall_s": wall,
        "peak_host_rss_gb": peak[0] / 1e9,
        "peak_gpu_used_gb": None if gpu_peak[0] is None else gpu_peak[0] / 1e9,
        "steps_logged": len(records),
        "median_step_s": statistics.median(gaps) if gaps else None,
        "step_gaps_s": gaps,
        "train_runtime": final.get("train_runtime"),
        "final": final,
        "save_s": (wall - done_at) if done_at is not None else None,
        "records": records,
    }
    with open(json_out, "w") as f:
        json.dump(summary, f, indent=1)
    print(
        f"== rc {rc}, {len(records)} step records, median step {summary['median_step_s']}, "
        f"train_runtime {summary['train_runtime']}, save {summary['save_s']}, wall {wall:.1f} s, "
        f"peak host RSS {summary['peak_host_rss_gb']:.1f} GB, peak GPU memory used "
        f"{'-' if gpu_peak[0] is None else f'{gpu_peak[0] / 1e9:.1f} GB'}",
        flush=True,
    )
    return rc


def _gpu_used_bytes() -> int | None:
    """Memory used on the visible GPUs (CUDA_VISIBLE_DEVICES respected), as nvidia-smi reports it
    (every process's, the CUDA context included: what a user sees); None without nvidia-smi."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    cmd = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [line.split(",") for line in out.strip().splitlines() if "," in line]
    keep = None if not visible else {v.strip() for v in visible.split(",")}
    used = [int(mib) for index, mib in rows if keep is None or index.strip() in keep]
    return sum(used) * 2**20 if used else None


def table(outdir: str, phase: str, tokens_per_step: int | None = None) -> str:
    """The phase's systems side by side: median step (the Trainer's records), tokens/s where the
    step's tokens are fixed (SFT: batch × max_length), train_runtime, the final save, peak host RSS
    and GPU memory used (nvidia-smi; "–" where there was none); megatrain_ds / DeepSpeed."""
    rows, med = [], {}
    for system in ("deepspeed", "megatrain"):
        path = os.path.join(outdir, f"{phase}_{system}.json")
        if not os.path.exists(path):
            rows.append(f"| {system} | did not run |" + " |" * 8)
            continue
        d = json.load(open(path))
        m = d["median_step_s"]
        med[system] = m
        tps = f"{tokens_per_step / m:,.0f}" if (m and tokens_per_step) else "–"
        last = d["records"][-1] if d["records"] else {}
        # the Trainer logs strings
        fmt = lambda v, f="{:.2f}": "–" if v is None else f.format(float(v))  # noqa: E731
        rows.append(
            f"| {system} | {d['rc']} | {d['steps_logged']} | {fmt(m, '{:.3f}')} | {tps} | "
            f"{fmt(d['train_runtime'])} | {fmt(d['save_s'], '{:.1f}')} | "
            f"{d['peak_host_rss_gb']:.1f} | "
            f"{fmt(d.get('peak_gpu_used_gb'), '{:.1f}')} | {last.get('loss', '–')} |"
        )
    head = (
        "| system | rc | step records | median step s | tokens/s | train_runtime s | final save s "
        "| "
        "peak host RSS GB | peak GPU used GB | last loss "
        "|\n|---|---|---|---|---|---|---|---|---|---|"
    )
    ratio = ""
    if med.get("deepspeed") and med.get("megatrain"):
        ratio = (
            "\n\nmegatrain_ds / DeepSpeed by median step: "
            f"**{med['deepspeed'] / med['megatrain']:.2f}×**"
        )
    return head + "\n" + "\n".join(rows) + ratio


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--shape", default="qwen2.5-3b")
    a.add_argument("--out", required=True)
    a.add_argument("--rows", type=int, default=400)
    a.add_argument("--seq", type=int, default=1024)
    b = sub.add_parser("timed")
    b.add_argument("--json", required=True)
    b.add_argument(
        "--skip", type=int, default=1, help="step intervals left out of the median (warm-up)"
    )
    b.add_argument("command", nargs=argparse.REMAINDER)
    c = sub.add_parser("table")
    c.add_argument("outdir")
    c.add_argument("phase")
    args = p.parse_args(argv)
    if args.cmd == "table":
        print(table(args.outdir, args.phase, {"sft": 16 * 1024}.get(args.phase)))
        return 0
    if args.cmd == "prepare":
        prepare(args.shape, args.out, args.rows, args.seq)
        return 0
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    return timed(cmd, args.json, args.skip)


if __name__ == "__main__":
    sys.exit(main())
