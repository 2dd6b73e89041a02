"""What one rank writes into its checkpoint files, in DeepSpeed ZeRO-3's layout (checkpoint.py
describes the files; wayback.py computes the layout).

``partition_plan`` lists the parameters as ZeRO-3 does: the trained ones in real DeepSpeed's
sub-groups for N ranks (its optimizer groups' order, cut at ``zero_optimization.sub_group_size``),
the frozen ones after. ``RankState`` gives this rank's ``fp32_flat_groups``, Adam moments and frozen
fragments as streamed tensors (checkpoint_stream.py): for each parameter, rank r's ZeRO-3 partition
(``ceil(numel / N)`` elements, zero-padded past the end), produced while its file is written,
straight from the host state: nothing is collected first, in memory or on disk. With N ranks a
layer's state is held by its owner rank only, which scatters every rank its partitions of the layer
over the gloo group (one layer and one kind at a time, as the files are written: every rank writes
its records in the same order); resident parameters are replicated, each rank cuts its own.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import wayback
from .checkpoint_files import partition_of
from .checkpoint_folder import CheckpointWorld
from .checkpoint_stream import StreamedStorage
from .parts import CheckpointParts

_CHUNK_ELEMENTS = 8 << 20  # a converted (or zero-padded) piece: 32 MiB of fp32 at most


def _cut(dst: torch.Tensor, flat: torch.Tensor, rank: int, world: int) -> None:
    """``dst`` (one partition) = rank ``rank``'s ZeRO-3 partition of ``flat``, zero past its end."""
    p = dst.numel()
    lo = min(rank * p, flat.numel())
    hi = min(lo + p, flat.numel())
    dst[: hi - lo].copy_(flat[lo:hi])
    dst[hi - lo :].zero_()


def _pieces(flat: torch.Tensor, dtype: torch.dtype):
    """``flat`` as chunks of ``dtype`` on the host: the tensor itself where it is one already (no
    copy), else converted (or fetched from the device: a resident parameter) piece by piece."""
    if flat.dtype == dtype and flat.device.type == "cpu":
        yield flat
        return
    for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
        yield flat[start : start + _CHUNK_ELEMENTS].to(device="cpu", dtype=dtype)


def _zeros(n: int, dtype: torch.dtype):
    for start in range(0, n, _CHUNK_ELEMENTS):
        yield torch.zeros(min(_CHUNK_ELEMENTS, n - start), dtype=dtype)


@dataclass(slots=True)
class PartitionParam:
    """One parameter as a checkpoint lists it, and where its fp32 master (and moments) are."""

    name: str
    shape: torch.Size
    layer: int | None  # streamed layer index; None: a resident parameter
    # layer: element offset in the layer's flat master (its moments: the same, trainable ones);
    # resident: its index in ``CheckpointParts.resident``
    start: int

    @property
    def numel(self) -> int:
        return self.shape.numel()


def partition_plan(
    parts: CheckpointParts, world: int, sub_group_size: int
) -> tuple[list[list[PartitionParam]], list[int], list[PartitionParam]]:
    """(trained sub-groups, each one's optimizer param group, frozen parameters) as ZeRO-3 lists
    them in ``param_shapes`` and ``frozen_param_shapes``: the trained parameters in real DeepSpeed's
    sub-groups for ``world`` ranks (wayback.py: its parameter order and ``sub_group_size``), which
    its ``load_checkpoint`` copies by position; frozen ones (requires_grad False or in no optimizer
    group) layer by layer, then the resident ones."""
    trained, frozen = {}, []
    for i, layout in enumerate(parts.layer_states.layouts):
        for slot in layout.slots:
            start = slot.offset if slot.trainable else layout.n_train + slot.offset
            name = f"{parts.block_name}.{i}.{slot.name}"
            param = PartitionParam(name, torch.Size(slot.shape), i, start)
            if slot.trainable:
                trained[param.name] = param
            else:
                frozen.append(param)
    names = {id(p): n for n, p in parts.module.named_parameters()}
    for k, (p, is_trained) in enumerate(zip(parts.resident.params, parts.resident.trained)):
        param = PartitionParam(names[id(p)], torch.Size(p.shape), None, k)
        if not is_trained:
            frozen.append(param)
        else:
            trained[param.name] = param
    groups = [
        [trained[names[id(p)]] for p in group["params"] if names.get(id(p)) in trained]
        for group in (parts.optimizer.param_groups if parts.optimizer is not None else [])
    ]
    subs = wayback.sub_groups(groups, lambda p: p.numel, world, sub_group_size)
    return [params for _, params in subs], [g for g, _ in subs], frozen


def _source(parts: CheckpointParts, param: PartitionParam, kind: str) -> torch.Tensor:
    """``param``'s fp32 ``kind`` ("master", "exp_avg", "exp_avg_sq"), flat: a view of the host state
    (a streamed layer this rank holds; the caller has synced the GPU-held layers to the host) or of
    the resident tensor (on the host or the device). Its home answers, whatever the kind
    (host/model_state.py)."""
    return parts.model_state.home_at(param.layer, param.start).checkpoint_flat(kind)


class RankState:
    """What this rank writes: its ``fp32_flat_groups`` and moments (one ``StreamedStorage`` per
    sub-group and kind) and its frozen fragments (one ``StreamedStorage``, a view per parameter),
    produced while the files are written.

    Sub-group k holds, for each of its parameters in order, this rank's ZeRO-3 partition
    (``ceil(numel / N)`` elements, zero past the end). With one rank a partition is the parameter
    itself: the chunks are views of the host state (converted to fp32 piece by piece where it is
    kept in another dtype). With N ranks, for each run of a sub-group's parameters of one streamed
    layer, the layer's owner scatters every rank its partitions of that run (``_exchange``, a
    collective), and a trained resident parameter's owner likewise; frozen resident parameters are
    cut locally. The sub-groups are DeepSpeed's (``partition_plan``), not the layers: a sub-group
    spans layers, its record is the concatenation."""

    def __init__(
        self,
        parts: CheckpointParts,
        world: CheckpointWorld,
        groups: list[list[PartitionParam]],
        frozen: list[PartitionParam],
        moments: bool,
    ) -> None:
        self.parts, self.world, self.groups, self.frozen = parts, world, groups, frozen
        self.kinds = ("master", "exp_avg", "exp_avg_sq") if moments else ("master",)
        # per group, this rank's elements
        sizes = [sum(self._size(p) for p in group) for group in groups]
        self.flat = [
            [
                StreamedStorage(
                    torch.float32, size, self._producer(kind, group, torch.float32)
                ).tensor()
                # per kind, per sub-group
                for size, group in zip(sizes, groups)
            ]
            for kind in self.kinds
        ]
        self.fp32 = self.flat[0]
        # frozen weights are kept in the compute dtype (host_state.py: a compact store; the resident
        # ones on the device), and written so, as DeepSpeed writes its 16-bit frozen fragments; fp32
        # in fp32 mode
        frozen_dtype = parts.store.wire_dtype if parts.store.compact else torch.float32
        storage = StreamedStorage(
            frozen_dtype,
            sum(self._size(p) for p in frozen),
            self._producer("master", frozen, frozen_dtype, trained=False),
        )
        self.fragments, offset = {}, 0
        for p in frozen:
            self.fragments[p.name] = storage.tensor(offset, self._size(p))
            offset += self._size(p)

    def _size(self, p: PartitionParam) -> int:
        return partition_of(p.numel, self.world.size)

    def _producer(
        self, kind: str, params: list[PartitionParam], dtype: torch.dtype, trained: bool = True
    ):
        """The chunks of one record: ``params``' partitions of ``kind``, in order. With N ranks a
        streamed layer's run comes from its owner, and so does a trained resident parameter's state
        (one host copy: dp.py's ``resident_owner``); a frozen resident parameter is every rank's
        copy, cut locally."""

        def chunks():
            for layer, run in itertools.groupby(params, key=lambda p: p.layer):
                run = list(run)
                if self.world.size > 1 and layer is not None:
                    yield self._exchange(self.world.owner(layer), run, kind, dtype)
                    continue
                for p in run:
                    if self.world.size > 1 and trained:
                        yield self._exchange(
                            self.world.dp.resident_owner(p.start), [p], kind, dtype
                        )
                    else:
                        yield from self._local(p, kind, dtype)

        return chunks

    def _local(self, p: PartitionParam, kind: str, dtype: torch.dtype):
        """This rank's partition of ``p`` from the state it holds (one rank: the whole parameter, a
        view)."""
        flat, rank = _source(self.parts, p, kind), self.world.rank
        size = self._size(p)
        lo = min(rank * size, flat.numel())
        hi = min(lo + size, flat.numel())
        yield from _pieces(flat[lo:hi], dtype)
        yield from _zeros(size - (hi - lo), dtype)

    def _exchange(
        self, owner: int, params: list[PartitionParam], kind: str, dtype: torch.dtype
    ) -> torch.Tensor:
        """The ``owner`` of ``params``' state (a layer's, or a resident parameter's) scatters every
        rank its partitions of them (a collective of every rank); returns this rank's."""
        world = self.world
        width = sum(self._size(p) for p in params)
        received, chunks = torch.empty(width, dtype=dtype), None
        if world.rank == owner:
            send = torch.empty(world.size, width, dtype=dtype)
            for rank in range(world.size):
                offset = 0
                for p in params:
                    _cut(
                        send[rank, offset : offset + self._size(p)],
                        _source(self.parts, p, kind),
                        rank,
                        world.size,
                    )
                    offset += self._size(p)
            chunks = list(send.unbind(0))
        dist.scatter(received, chunks, src=world.peer(owner), group=world.group)
        return received

    def optimizer_state(self, group_of: list[int]) -> dict | None:
        """The optimizer state as DeepSpeed ZeRO-3's CPU Adam saves it (wayback.py); megatrain_ds
        reads it too."""
        optimizer = self.parts.optimizer
        if optimizer is None:
            return None
        return wayback.optimizer_state(
            optimizer.param_groups, group_of, optimizer.step_count, self.flat[1], self.flat[2]
        )
