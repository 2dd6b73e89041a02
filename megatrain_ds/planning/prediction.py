"""The capacity check's result: ``Prediction``, what one plan needs and what this machine has per
tier (host RAM, disk, GPU), with ``table()`` (what ``megatrain-ds plan`` and the engine print) and
``to_dict()`` (``--json``), and the byte and count formatting the table and the refusals use
(``fmt_bytes``, ``fmt_count``). capacity_count.py's ``Counting.prediction`` builds it; capacity.py's
``check_capacity`` returns it (and re-exports it: ``from megatrain_ds.planning.capacity import
Prediction``), and ``CapacityError`` carries it. It counts nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .decisions import Decisions
from .host_bytes import GiB, MiB


# ----------------------------------------------------------------------------------------- the plan
@dataclass
class Prediction:
    """The plan: per tier, what is needed and what this machine has. ``table()`` is what the CLI and
    the engine print; ``to_dict()`` what ``--json`` prints."""

    model: str
    n_layers: int
    params: int
    trainable: int
    compute: str
    wire: str
    grad: str
    ga: int
    micro_batch: int
    seq: int | None
    world: int
    device: str  # "cuda" or "cpu": where the engine computes
    # engine state parts (summed over ranks), then staging and what is beside it
    host_parts: dict[str, int]
    host_state_bytes: int  # = engine.host_memory()["total_bytes"] (summed over ranks)
    host_need_bytes: int  # state + NVMe staging + optimizer scratch + offloaded activations
    host_budget_bytes: int
    host_budget_source: str
    host_available_bytes: int
    host_total_bytes: int
    nvme: bool
    nvme_path: str | None
    disk_layers: int
    nvme_masters: bool
    disk_bytes: int
    disk_free_bytes: int | None
    gpu_parts: dict[str, int]  # at the configured micro-batch, in the peak phase
    gpu_phase: str
    # torch.cuda.max_memory_allocated after a step (None: no sequence length)
    gpu_allocated_bytes: int | None
    gpu_min_bytes: int  # allocated before any activation (slots, resident, GPU-held state)
    gpu_overhead_bytes: int  # CUDA context, NCCL: not torch's
    gpu_total_bytes: int | None
    gpu_source: str
    max_micro_batch: int | None
    max_micro_batch_limit: str  # what stops a larger micro-batch
    binding: str  # "host RAM", "disk" or "GPU": the tier closest to (or over) its capacity
    fits: bool
    problems: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    decisions: Decisions | None = None  # what was counted (decisions.resolve); not in to_dict()

    @property
    def gpu_need_bytes(self) -> int | None:
        """What must fit in the device's memory at the configured micro-batch (context included)."""
        return (
            None
            if self.gpu_allocated_bytes is None
            else self.gpu_allocated_bytes + self.gpu_overhead_bytes
        )

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("decisions")
        out["gpu_need_bytes"] = self.gpu_need_bytes
        return out

    def table(self) -> str:
        lines = [
            f"megatrain-ds plan: {self.model} ({self.n_layers} streamed layers, "
            f"{fmt_count(self.params)} parameters, "
            f"{fmt_count(self.trainable)} trainable; {self.compute} compute, {self.wire} wire, "
            f"{self.grad} "
            f"gradients, GA {self.ga}; {self.world} {'GPU' if self.device == 'cuda' else 'process'}"
            f"{'s' if self.world > 1 else ''})"
        ]
        if self.seq:
            lines.append(
                f"micro-batch {self.micro_batch} x seq {self.seq} = {self.micro_batch * self.seq:,}"
                " tokens "
                f"per {'GPU' if self.device == 'cuda' else 'process'}"
            )
        lines.append("")
        lines.append(_tier("tier", "needed", "available", ""))
        lines.append(
            _tier(
                "host RAM",
                fmt_bytes(self.host_need_bytes),
                fmt_bytes(self.host_budget_bytes),
                f"budget: {self.host_budget_source}",
            )
        )
        lines += _part_lines(self.host_parts)
        if self.nvme:
            free = "?" if self.disk_free_bytes is None else fmt_bytes(self.disk_free_bytes)
            what = "fp32 masters and Adam moments" if self.nvme_masters else "Adam moments"
            lines.append(
                _tier(
                    "disk",
                    fmt_bytes(self.disk_bytes),
                    free,
                    f"{what} of the last {self.disk_layers} layer(s) on "
                    f"{self.nvme_path or '(no nvme_path)'}",
                )
            )
        else:
            free = "" if self.disk_free_bytes is None else f"{fmt_bytes(self.disk_free_bytes)}"
            lines.append(
                _tier(
                    "disk",
                    fmt_bytes(0),
                    free,
                    "no NVMe tier (zero_optimization.offload_optimizer.device is not nvme)",
                )
            )
        if self.device == "cuda":
            need = "?" if self.gpu_need_bytes is None else fmt_bytes(self.gpu_need_bytes)
            have = fmt_bytes(self.gpu_total_bytes) if self.gpu_total_bytes else "-"
            lines.append(
                _tier("GPU", need, have, f"{self.gpu_source}; per GPU, peak in {self.gpu_phase}")
            )
            lines += _part_lines(self.gpu_parts)
        else:
            lines.append(
                _tier(
                    "GPU",
                    "-",
                    "-",
                    "the engine computes on the CPU: its working set is counted in host RAM",
                )
            )
        lines.append("")
        if self.max_micro_batch is not None:
            lines.append(
                f"largest micro-batch per {'GPU' if self.device == 'cuda' else 'process'} at seq "
                f"{self.seq}: {self.max_micro_batch} (limited by {self.max_micro_batch_limit})"
            )
        else:
            lines.append(f"largest micro-batch: not known ({self.max_micro_batch_limit})")
        lines.append(f"binding limit: {self.binding}" + ("" if self.fits else "  -- DOES NOT FIT"))
        for p in self.problems:
            lines.append(f"  problem: {p}")
        for a in self.advice:
            lines.append(f"  change: {a}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n} B"


def fmt_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


def _tier(name: str, need: str, have: str, text: str) -> str:
    """One row of the plan's tier table: the tier, what it needs, what it has, and why."""
    return f"{name:<10}{need:>14}{have:>14}  {text}"


def _part_lines(parts: dict[str, int]) -> list[str]:
    """The indented rows under a tier: each non-zero part's bytes."""
    return [f"  {name:<44}{fmt_bytes(n):>12}" for name, n in parts.items() if n]
