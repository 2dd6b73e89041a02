"""TRL's own training scripts, unmodified, on real DeepSpeed and on megatrain_ds
(``MEGATRAIN_DS=1``): same numbers.

Every run is what a TRL user types (docs/trl.md has the lines)::

    accelerate launch --config_file zero3.yaml [--num_processes 2] $TRL/scripts/sft.py
        --model_name_or_path ...
    MEGATRAIN_DS=1 accelerate launch ...   (the same line; $TRL: the installed trl package's folder)

``zero3.yaml`` is an ordinary accelerate DeepSpeed config whose ``deepspeed_config_file`` is
accelerate's published ``tests/deepspeed/ds_config_zero3.json`` (a verbatim copy in
tests/trl_files/: ZeRO-3, parameters and optimizer offloaded to the CPU, AdamW and WarmupLR with
"auto" values; the yaml sets ``zero3_init_flag``). CPU only (CUDA hidden), gloo, fp32. The model is
a tiny random Qwen2 with a byte-level tokenizer and a ChatML chat template, the data local JSON
lines in TRL's conversational formats (tests/trl_assets.py builds them). Nothing is downloaded.

What is compared: each run saves a Trainer checkpoint at its last step; its ``trainer_state.json``
holds the logged metrics at full precision (the console prints 4 digits). Every metric both engines
log (loss, grad_norm, learning rate, eval_loss, token accuracy, DPO's rewards/accuracies and
log-probs, GRPO's reward and KL, ...) must agree to RTOL -- a gradient off by a factor or missing a
layer moves grad_norm at the first step, where the learning rate is still 0 (WarmupLR's first two
steps); the steps after it move the losses. What the script's ``trainer.save_model`` leaves must
hold equal weights: a DeepSpeed checkpoint (the config's "auto" 16-bit gather resolves to off),
rebuilt through DeepSpeed's own zero_to_fp32, or a PEFT adapter.

The runs (``SPECS``): SFT full (2 ranks, gradient checkpointing, eval every 3 steps, a checkpoint
every 3) and its resume from checkpoint-3 in a fresh launch; SFT LoRA (``--use_peft``, TRL's
reentrant gradient checkpointing) with packing (padding-free, position_ids); DPO (2 ranks, gradient
checkpointing off; TRL builds the reference model with a second ``deepspeed.initialize``, no
optimizer); GRPO with transformers' generate, its reference model (beta > 0) and a reward function,
with ``ds3_gather_for_generation`` true (TRL's default: it gathers the whole model and calls its
remove_hooks/add_hooks on the engine) and false (megatrain_ds only: compared with DeepSpeed's
gathered run, docs/trl.md says why); RLOO (the same generation path); the reward trainer (a sequence
classifier). One DeepSpeed run per configuration, shared by the tests; the launches of the selected
tests start together when the module starts, two at a time (``PARALLEL``), so the DeepSpeed and
megatrain_ds runs of one configuration overlap. Real DeepSpeed's 2-rank launches get accelerate's
CPU process count fixed as the switch fixes it (tests/trl_files/cpu_world/); without that DeepSpeed
stops at its batch-size check on a CPU-only machine. (Not tests/trl/: pytest puts tests/ on
sys.path, where a folder named trl would be a namespace package ``import trl`` finds when TRL is not
installed.)

Cost: about 8 CPU-minutes, nearly all of it 33 Python processes importing torch, transformers,
DeepSpeed and TRL (14 launches, 5 of them 2 ranks); on the 2-core CI machine the two parallel
launches keep both cores busy.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.launch import run_again_after_exit_abort

trl = pytest.importorskip(
    "trl",
    minversion="1.16.0",
    reason=(
        "TRL 1.16 or newer is not installed: `make test` installs it (pyproject's test extra); "
        "`make oldest` leaves it "
        "out: TRL 1.16 needs accelerate>=1.10.1, the oldest set pins 1.0.1 (docs/trl.md)"
    ),
)

REPO = Path(__file__).resolve().parents[2]
# accelerate's tests/deepspeed/ds_config_zero3.json
DS_CONFIG = REPO / "tests" / "trl_files" / "ds_config_zero3.json"
# sitecustomize: accelerate's CPU process count, real DeepSpeed
CPU_WORLD = REPO / "tests" / "trl_files" / "cpu_world"
TRL_SCRIPTS = Path(trl.__file__).resolve().parent / "scripts"
ENGINE_LINE = "[megatrain_ds] MEGATRAIN_DS=1: the engine is megatrain_ds"
RTOL, ATOL = 1e-4, 1e-6  # fp32 on both sides; DeepSpeed and megatrain_ds reduce in different orders
PARALLEL = 2  # launches at a time (a 2-rank launch is two processes)
# wall-clock, bookkeeping: not numbers
IGNORED = re.compile(r"runtime|time|per_second|flos|^epoch$|^step$")

# Accelerate's config with the DeepSpeed JSON: the other deepspeed_config keys must stay out
# (accelerate refuses them beside deepspeed_config_file), so precision comes from the JSON ("auto":
# TRL's --bf16 False -> fp32).
YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {config}
  zero3_init_flag: true
machine_rank: 0
main_training_function: main
num_machines: 1
num_processes: 1
rdzv_backend: static
same_network: true
use_cpu: false
"""
# Every launch: fp32 (TRL defaults to bf16), a log line and the lr every step, GA 1 as the JSON says
COMMON = [
    "--report_to",
    "none",
    "--seed",
    "0",
    "--bf16",
    "False",
    "--logging_steps",
    "1",
    "--learning_rate",
    "1e-3",
    "--gradient_accumulation_steps",
    "1",
    "--save_strategy",
    "steps",
]
SFT = (
    "--per_device_train_batch_size",
    "2",
    "--max_length",
    "64",
    "--gradient_checkpointing",
    "True",
    "--eval_strategy",
    "steps",
    "--eval_steps",
    "3",
    "--per_device_eval_batch_size",
    "4",
    "--save_steps",
    "3",
)
GENERATION = [
    "--num_generations",
    "2",
    "--max_completion_length",
    "8",
    "--per_device_train_batch_size",
    "4",
    "--beta",
    "0.1",
    "--reward_funcs",
    "tests.trl_assets.char_code_reward",
]


@dataclass(frozen=True)
class Spec:
    """One configuration: a TRL script, its data and model (tests/trl_assets.py names), its
    arguments."""

    script: str
    model: str
    data: str
    steps: int
    args: tuple = ()
    ranks: int = 1
    # "<run key>:<checkpoint step>": a fresh launch resumed from that checkpoint
    resume_from: str | None = None


SPECS = {
    "sft": Spec("sft.py", "lm", "sft", 6, ranks=2, args=SFT),
    "sft-resume": Spec("sft.py", "lm", "sft", 6, ranks=2, resume_from="sft:3", args=SFT),
    "sft-lora": Spec(
        "sft.py",
        "lm",
        "sft",
        5,
        args=(
            "--use_peft",
            "--lora_r",
            "8",
            "--lora_alpha",
            "16",
            "--packing",
            "--per_device_train_batch_size",
            "2",
            "--max_length",
            "64",
            "--gradient_checkpointing",
            "True",
            "--save_steps",
            "5",
        ),
    ),
    "dpo": Spec(
        "dpo.py",
        "lm",
        "preference",
        5,
        ranks=2,
        args=(
            "--per_device_train_batch_size",
            "2",
            "--max_length",
            "64",
            "--gradient_checkpointing",
            "False",
            "--save_steps",
            "5",
        ),
    ),
    "grpo": Spec("grpo.py", "lm", "prompt", 4, args=(*GENERATION, "--save_steps", "4")),
    "grpo-no-gather": Spec(
        "grpo.py",
        "lm",
        "prompt",
        4,
        args=(*GENERATION, "--save_steps", "4", "--ds3_gather_for_generation", "False"),
    ),
    "rloo": Spec("rloo.py", "lm", "prompt", 4, args=(*GENERATION, "--save_steps", "4")),
    "reward": Spec(
        "reward.py",
        "rm",
        "preference",
        5,
        args=("--per_device_train_batch_size", "2", "--max_length", "64", "--save_steps", "5"),
    ),
}


@dataclass
class Run:
    key: str
    returncode: int
    log: str
    out: Path
    # trainer_state.json's log_history at the last checkpoint
    history: list = field(default_factory=list)

    def check(self) -> "Run":
        assert self.returncode == 0, (
            f"{self.key} failed (exit {self.returncode}):\n{self.log[-8000:]}"
        )
        assert self.history, f"{self.key}: no trainer_state.json in {self.out}"
        return self

    def series(self, name: str) -> list[tuple[int, float]]:
        return [(entry["step"], entry[name]) for entry in self.history if name in entry]

    def metrics(self) -> set[str]:
        return {
            k
            for entry in self.history
            for k, v in entry.items()
            if isinstance(v, (int, float)) and not IGNORED.search(k)
        }


def _env(switch: bool, root: Path) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("MEGATRAIN_DS", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    # real DeepSpeed on CPU with several ranks needs accelerate's process count fixed
    # (tests/trl_files/cpu_world/)
    paths = [str(REPO)] if switch else [str(CPU_WORLD), str(REPO)]
    env.update(
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        # not the user's cache
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(root / "hf_datasets"),
        PYTHONPATH=os.pathsep.join(p for p in (*paths, env.get("PYTHONPATH")) if p),
    )
    if switch:
        env["MEGATRAIN_DS"] = "1"
    return env


def _last_checkpoint(out: Path) -> Path | None:
    found = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return found[-1] if found else None


class Runs:
    """The module's launches, keyed "<spec>/<engine>" (engine: deepspeed or megatrain): the ``runs``
    fixture submits those of the selected tests at the start, each test waits for the ones it reads.
    A resumed launch waits (in its pool thread) for the launch whose checkpoint it takes, which was
    submitted before it."""

    def __init__(self, root: Path, assets: dict) -> None:
        self.root, self.assets = root, assets
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=PARALLEL)
        self.futures: dict[str, concurrent.futures.Future] = {}
        self.lock = threading.RLock()
        (root / "zero3.yaml").write_text(YAML.format(config=DS_CONFIG))

    def submit(self, key: str) -> concurrent.futures.Future:
        with self.lock:
            if key not in self.futures:
                spec = SPECS[key.split("/")[0]]
                if spec.resume_from:  # its checkpoint's run goes first
                    self.submit(f"{spec.resume_from.split(':')[0]}/{key.split('/')[1]}")
                self.futures[key] = self.pool.submit(self._launch, key)
            return self.futures[key]

    def __getitem__(self, key: str) -> Run:
        return self.submit(key).result()

    def _launch(self, key: str) -> Run:
        name, engine = key.split("/")
        spec, switch = SPECS[name], engine == "megatrain"
        out = self.root / name / engine
        args = list(spec.args)
        if spec.resume_from:
            source, step = spec.resume_from.split(":")
            first = self[f"{source}/{engine}"].check()
            out.mkdir(parents=True)
            checkpoint = out / f"checkpoint-{step}"
            # as if interrupted after that step
            shutil.copytree(first.out / f"checkpoint-{step}", checkpoint)
            args += ["--resume_from_checkpoint", str(checkpoint)]
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            self.root / "zero3.yaml",
            "--num_processes",
            str(spec.ranks),
            "--main_process_port",
            "0",
            TRL_SCRIPTS / spec.script,
            "--model_name_or_path",
            self.assets[spec.model],
            "--dataset_name",
            self.assets[spec.data],
            "--output_dir",
            out,
            "--max_steps",
            str(spec.steps),
            *COMMON,
            *args,
        ]
        env = _env(switch, self.root)
        proc = run_again_after_exit_abort(
            lambda: subprocess.run(
                [str(c) for c in cmd],
                cwd=self.root,
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
        )
        log = proc.stdout + proc.stderr
        out.parent.mkdir(parents=True, exist_ok=True)
        # beside the output, for a failure's whole story
        (out.parent / f"{engine}.log").write_text(log)
        checkpoint = _last_checkpoint(out)
        history = []
        if checkpoint is not None and (checkpoint / "trainer_state.json").is_file():
            history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
        return Run(key, proc.returncode, log, out, history)


def uses(*keys: str):
    """Marks a test with the launches it reads (the module starts them all at once)."""

    def mark(fn):
        fn.trl_runs = keys
        return fn

    return mark


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    from tests.trl_assets import write_all

    return {k: str(v) for k, v in write_all(tmp_path_factory.mktemp("trl_assets")).items()}


@pytest.fixture(scope="module")
def runs(request, assets, tmp_path_factory):
    runs = Runs(tmp_path_factory.mktemp("trl_runs"), assets)
    module = request.module.__name__
    for item in request.session.items:  # the selected tests' launches, in file order
        if item.module.__name__ == module:
            for key in getattr(item.function, "trl_runs", ()):
                runs.submit(key)
    yield runs
    runs.pool.shutdown(wait=True, cancel_futures=True)


# -------------------------------------------------------------------------------------- comparisons
def _close(got: float, want: float, rtol: float = RTOL) -> bool:
    return abs(got - want) <= rtol * abs(want) + ATOL


def assert_same_metrics(ours: Run, real: Run, required: tuple[str, ...], steps: int) -> None:
    """Every metric both logged agrees at every step; ``required`` ones must be there (and at each
    step)."""
    ours.check(), real.check()
    assert ENGINE_LINE in ours.log and ENGINE_LINE not in real.log
    for name in required:
        assert name in real.metrics(), f"{real.key} did not log {name!r}: {sorted(real.metrics())}"
    assert [s for s, _ in ours.series("loss")] == list(range(1, steps + 1))
    bad = []
    for name in sorted(real.metrics() & ours.metrics()):
        got, want = ours.series(name), real.series(name)
        assert [s for s, _ in got] == [s for s, _ in want], (
            f"{name}: logged at steps {got} vs {want}"
        )
        bad += [
            f"{name}@{s}: megatrain_ds {g!r} vs DeepSpeed {w!r}"
            for (s, g), (_, w) in zip(got, want)
            if not _close(g, w)
        ]
    assert not bad, f"{ours.key} vs {real.key}:\n" + "\n".join(bad)
    assert real.metrics() <= ours.metrics(), (
        f"not logged by megatrain_ds: {real.metrics() - ours.metrics()}"
    )


def saved_weights(run: Run) -> dict[str, torch.Tensor]:
    """What the script's ``trainer.save_model`` wrote to the output dir, as fp32 tensors: a PEFT
    adapter (``adapter_model.safetensors``: the Trainer gathers it with
    ``_zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)``), else the DeepSpeed
    checkpoint the Trainer writes when the 16-bit gather is off, rebuilt by DeepSpeed's own
    zero_to_fp32 (what a user runs next)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    if (run.out / "adapter_model.safetensors").is_file():
        return {k: v.float() for k, v in load_file(run.out / "adapter_model.safetensors").items()}
    assert (run.out / "latest").is_file(), (
        f"{run.key}: save_model left no DeepSpeed checkpoint in {run.out}"
    )
    return get_fp32_state_dict_from_zero_checkpoint(str(run.out))


def assert_same_weights(ours: Run, real: Run) -> None:
    got, want = saved_weights(ours), saved_weights(real)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=RTOL, atol=1e-5, msg=lambda m: f"{name}: {m}"
        )


def assert_trained(run: Run, initial: str) -> None:
    """The saved weights moved away from the initial ones (the comparison is not between two
    untouched models)."""
    import transformers

    start = transformers.AutoModel.from_pretrained(initial).state_dict()
    final = saved_weights(run)
    moved = [
        n
        for n, w in final.items()
        if (s := start.get(n.removeprefix("model."))) is not None
        and s.shape == w.shape
        and not torch.equal(s, w)
    ]
    assert moved, f"{run.key}: no weight changed"


# ---------------------------------------------------------------------------------------------- SFT
@uses("sft/deepspeed", "sft/megatrain")
def test_sft_two_ranks_matches_deepspeed(runs):
    """Full fine-tuning, 2 ranks, gradient checkpointing, an evaluation every 3 steps."""
    ours, real = runs["sft/megatrain"], runs["sft/deepspeed"]
    assert_same_metrics(
        ours, real, ("loss", "grad_norm", "eval_loss", "mean_token_accuracy"), steps=6
    )
    assert len(real.series("eval_loss")) == 2
    assert ours.log.count(ENGINE_LINE) == 2  # one line per rank


@uses("sft/deepspeed", "sft/megatrain")
def test_sft_save_model_weights_match_deepspeed(runs, assets):
    ours, real = runs["sft/megatrain"].check(), runs["sft/deepspeed"].check()
    assert_same_weights(ours, real)
    assert_trained(ours, assets["lm"])
    for step in (3, 6):  # Trainer checkpoints in DeepSpeed's layout, both ranks' states
        folder = ours.out / f"checkpoint-{step}" / f"global_step{step}"
        assert sorted(p.name for p in folder.glob("*optim_states.pt")) == sorted(
            p.name
            for p in (real.out / f"checkpoint-{step}" / f"global_step{step}").glob(
                "*optim_states.pt"
            )
        )


@uses("sft/deepspeed", "sft/megatrain", "sft-resume/megatrain")
def test_sft_resume_from_checkpoint_continues_the_same_run(runs):
    """A fresh launch given checkpoint-3 (``--resume_from_checkpoint``) logs steps 4-6 as the
    uninterrupted run did, and as DeepSpeed's uninterrupted run did."""
    full, resumed, real = (
        runs["sft/megatrain"].check(),
        runs["sft-resume/megatrain"].check(),
        runs["sft/deepspeed"],
    )
    fresh = resumed.log.count("'loss'")  # the console lines of this launch only
    assert fresh == 3, f"the resumed launch logged {fresh} steps, expected 4-6"
    for name in ("loss", "grad_norm", "eval_loss", "learning_rate"):
        after = lambda run: [(s, v) for s, v in run.series(name) if s > 3]  # noqa: E731
        assert after(resumed), name
        for (s, got), (_, want), (_, ds) in zip(after(resumed), after(full), after(real)):
            assert _close(got, want, rtol=1e-6) and _close(got, ds), (
                f"{name}@{s}: {got} vs {want} / DeepSpeed {ds}"
            )
    assert_same_weights(resumed, real)


@uses("sft-lora/deepspeed", "sft-lora/megatrain")
def test_sft_lora_with_packing_matches_deepspeed(runs):
    """``--use_peft`` (LoRA on the attention projections, the base frozen; TRL then forces reentrant
    gradient checkpointing under ZeRO-3) and ``--packing`` (best-fit packing, padding-free: one row
    per batch, sequences told apart by position_ids)."""
    ours, real = runs["sft-lora/megatrain"], runs["sft-lora/deepspeed"]
    assert_same_metrics(ours, real, ("loss", "grad_norm", "mean_token_accuracy"), steps=5)
    assert all("lora_" in name for name in saved_weights(real))  # the adapter only
    assert_same_weights(ours, real)


# ---------------------------------------------------------------------------------------------- DPO
@uses("dpo/deepspeed", "dpo/megatrain")
def test_dpo_two_ranks_matches_deepspeed(runs):
    """The policy trains; the reference model is TRL's second ``deepspeed.initialize`` (no
    optimizer). Gradient checkpointing off (TRL's default is on: the other runs)."""
    ours, real = runs["dpo/megatrain"], runs["dpo/deepspeed"]
    assert_same_metrics(
        ours,
        real,
        ("loss", "grad_norm", "rewards/accuracies", "rewards/margins", "logps/chosen"),
        steps=5,
    )
    margins = [v for _, v in real.series("rewards/margins")]
    assert any(v != 0 for v in margins), (
        "the policy never left the reference: the comparison would be vacuous"
    )
    assert_same_weights(ours, real)


# ---------------------------------------------------------------------------------------- online RL
@uses("grpo/deepspeed", "grpo/megatrain")
def test_grpo_gathered_generation_matches_deepspeed(runs):
    """transformers' generate on the gathered model (TRL's default ds3_gather_for_generation),
    reference model, reward function: same completions (so the same rewards), same gradients."""
    ours, real = runs["grpo/megatrain"], runs["grpo/deepspeed"]
    assert_same_metrics(ours, real, ("loss", "grad_norm", "reward", "reward_std", "kl"), steps=4)
    assert any(v != 0 for _, v in real.series("kl")), "the policy never left the reference"


@uses("grpo/deepspeed", "grpo-no-gather/megatrain")
def test_grpo_without_gathering_matches_deepspeed(runs):
    """``--ds3_gather_for_generation False``: generate runs through the engine's module as it
    stands."""
    assert_same_metrics(
        runs["grpo-no-gather/megatrain"],
        runs["grpo/deepspeed"],
        ("loss", "grad_norm", "reward", "reward_std", "kl"),
        steps=4,
    )


@uses("rloo/deepspeed", "rloo/megatrain")
def test_rloo_matches_deepspeed(runs):
    assert_same_metrics(
        runs["rloo/megatrain"], runs["rloo/deepspeed"], ("loss", "grad_norm", "reward"), steps=4
    )


@uses("reward/deepspeed", "reward/megatrain")
def test_reward_model_matches_deepspeed(runs):
    """TRL's reward trainer: a sequence classifier (a score head, no LM head) on chosen/rejected
    pairs."""
    ours, real = runs["reward/megatrain"], runs["reward/deepspeed"]
    assert_same_metrics(ours, real, ("loss", "grad_norm", "accuracy", "margin"), steps=5)
    assert_same_weights(ours, real)
