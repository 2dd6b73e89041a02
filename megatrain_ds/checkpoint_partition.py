"""What one rank writes into its optimizer-states file, in DeepSpeed ZeRO-3's layout (checkpoint.py describes the
files; wayback.py computes the layout).

``_plan`` lists the parameters as ZeRO-3 does: the trained ones in real DeepSpeed's sub-groups for N ranks (its
optimizer groups' order, cut at ``zero_optimization.sub_group_size``), the frozen ones after. ``_RankState`` holds
this rank's ``fp32_flat_groups``, Adam moments and frozen fragments: for each parameter, rank r's ZeRO-3 partition
(``ceil(numel / N)`` elements, zero-padded past the end), in scratch files of the temporary folder mapped shared
(page cache, not process memory; allocated up front, so a full disk fails the save instead of faulting a write).
With N ranks a layer's state is held by its owner rank only, which scatters every rank its partitions of the layer
over the gloo group, one layer at a time; resident parameters are replicated, each rank cuts its own.
"""
from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import wayback
from .checkpoint_files import _partition
from .checkpoint_folder import _World


def _cut(dst: torch.Tensor, flat: torch.Tensor, rank: int, world: int) -> None:
    """``dst`` (one partition) = rank ``rank``'s ZeRO-3 partition of ``flat``, zero past its end."""
    p = dst.numel()
    lo = min(rank * p, flat.numel())
    hi = min(lo + p, flat.numel())
    dst[:hi - lo].copy_(flat[lo:hi])
    dst[hi - lo:].zero_()


def _scratch(folder: str, name: str, numel: int, paths: list[str], dtype: torch.dtype = torch.float32
             ) -> torch.Tensor:
    """A flat ``dtype`` tensor backed by the file ``folder/name``, mapped shared: the kernel may write its pages out
    and drop them, so filling it costs page cache rather than process memory. The file is allocated up front (a
    full disk fails here, as an exception, not later as a fault in a mapped write). Its path goes in ``paths``:
    the caller deletes it once what views the tensor is saved."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    path = os.path.join(folder, name)
    paths.append(path)
    nbytes = numel * torch.tensor([], dtype=dtype).element_size()
    with open(path, "wb") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, nbytes)
        except OSError as exc:  # a file system that cannot preallocate: sized only (ENOSPC is an error)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                free = shutil.disk_usage(folder).free
                raise OSError(exc.errno, f"save_checkpoint: the disk is full allocating the scratch file {path}: "
                              f"it needs {nbytes:,} bytes, {free:,} are free; the previous checkpoint is intact",
                              path) from exc
            f.truncate(nbytes)
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


@dataclass(slots=True)
class _Param:
    """One parameter as a checkpoint lists it, and where its fp32 master (and moments) are."""

    name: str
    shape: torch.Size
    layer: int | None  # streamed layer index; None: a resident parameter
    start: int  # layer: element offset in the layer's flat master (its moments: the same, trainable ones);
    # resident: its index in ``engine.resident``

    @property
    def numel(self) -> int:
        return self.shape.numel()


def _plan(engine, world: int, sub_group_size: int) -> tuple[list[list[_Param]], list[int], list[_Param]]:
    """(trained sub-groups, each one's optimizer param group, frozen parameters) as ZeRO-3 lists them in
    ``param_shapes`` and ``frozen_param_shapes``: the trained parameters in real DeepSpeed's sub-groups for
    ``world`` ranks (wayback.py: its parameter order and ``sub_group_size``), which its ``load_checkpoint`` copies
    by position; frozen ones (requires_grad False or in no optimizer group) layer by layer, then the resident
    ones."""
    trained, frozen = {}, []
    for i, layout in enumerate(engine.layer_states.layouts):
        for slot in layout.slots:
            start = slot.offset if slot.trainable else layout.n_train + slot.offset
            param = _Param(f"{engine.block_name}.{i}.{slot.name}", torch.Size(slot.shape), i, start)
            if slot.trainable:
                trained[param.name] = param
            else:
                frozen.append(param)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    for k, (p, is_trained) in enumerate(zip(engine.resident.params, engine.resident.trained)):
        param = _Param(names[id(p)], torch.Size(p.shape), None, k)
        if not is_trained:
            frozen.append(param)
        else:
            trained[param.name] = param
    groups = [[trained[names[id(p)]] for p in group["params"] if names.get(id(p)) in trained]
              for group in (engine.optimizer.param_groups if engine.optimizer is not None else [])]
    subs = wayback.sub_groups(groups, lambda p: p.numel, world, sub_group_size)
    return [params for _, params in subs], [g for g, _ in subs], frozen


def _source(engine, param: _Param, kind: str) -> torch.Tensor:
    """``param``'s fp32 ``kind`` ("master", "exp_avg", "exp_avg_sq"), flat: a view of the host state (a
    streamed layer this rank holds) or of the resident tensor (on the host or the device)."""
    if param.layer is None:
        return getattr(engine.resident, kind)[param.start].detach().reshape(-1)
    states = engine.layer_states  # the caller has synced the GPU-held layers to the host (sync_masters_to_host)
    if kind == "master":  # param.start is in [trainable | frozen]; a compact store keeps the frozen part in the wire
        layout = states.layouts[param.layer]
        if param.start >= layout.n_train:
            start = param.start - layout.n_train
            return states.frozen(param.layer)[start:start + param.numel]
        flat = states.master(param.layer)  # a view, or a copy of an NVMe layer's
    else:  # RAM views, or copies of a layer on the NVMe tier
        flat = states.host_moments(param.layer)[("exp_avg", "exp_avg_sq").index(kind)]
    return flat[param.start:param.start + param.numel]


class _RankState:
    """What this rank writes: its ``fp32_flat_groups`` and moments (one flat tensor per sub-group each) and its
    frozen fragments, all in files of the temporary folder mapped shared (``_scratch``): page cache, not process
    memory.

    Sub-group k holds, for each of its parameters in order, this rank's ZeRO-3 partition (``ceil(numel / N)``
    elements, zero past the end): ``offset[name]`` is where in the flat regions (master, exp_avg, exp_avg_sq:
    the sub-groups one after the other). A streamed layer's state is held by its owner rank only, which scatters
    every rank its partitions of the layer (one layer at a time); with one rank, and for the replicated resident
    parameters, each rank cuts its partitions itself. The sub-groups are DeepSpeed's (``_plan``), not the layers,
    so even one rank copies its masters and moments here (DeepSpeed's flat partition spans layers)."""

    def __init__(self, engine, world: _World, folder: str, groups: list[list[_Param]], frozen: list[_Param],
                 moments: bool) -> None:
        self.engine, self.world, self.groups, self.frozen = engine, world, groups, frozen
        self.kinds = ("master", "exp_avg", "exp_avg_sq") if moments else ("master",)
        self.folder = folder
        self.paths: list[str] = []
        n = world.size
        self.sizes = [sum(_partition(p.numel, n) for p in group) for group in groups]  # per group, per rank
        self.group_start = [sum(self.sizes[:k]) for k in range(len(groups))]
        self.offset, offset = {}, 0
        for group in groups:
            for p in group:
                self.offset[p.name] = offset
                offset += _partition(p.numel, n)
        total = offset
        self.frozen_start, offset = {}, 0
        for p in frozen:
            self.frozen_start[p.name] = offset
            offset += _partition(p.numel, n)
        # frozen weights are kept in the compute dtype (host_state.py: a compact store; the resident ones on the
        # device), and written so, as DeepSpeed writes its 16-bit frozen fragments; fp32 in fp32 mode
        frozen_dtype = engine.store.wire_dtype if engine.store.compact else torch.float32
        self.frozen_buf = _scratch(folder, f".frozen-rank{world.rank}.scratch", offset, self.paths, frozen_dtype)
        buf = _scratch(folder, f".optim-rank{world.rank}.scratch", total * len(self.kinds), self.paths)
        self.regions = list(buf.split(total)) if total else [buf] * len(self.kinds)

    def _size(self, p: _Param) -> int:
        return _partition(p.numel, self.world.size)

    def _own(self, train: list[_Param], frozen: list[_Param]) -> None:
        """This rank's partitions of parameters whose state it holds, cut straight into its regions."""
        rank, n = self.world.rank, self.world.size
        for region, kind in zip(self.regions, self.kinds):
            for p in train:
                at = self.offset[p.name]
                _cut(region[at:at + self._size(p)], _source(self.engine, p, kind), rank, n)
        for p in frozen:
            at = self.frozen_start[p.name]
            _cut(self.frozen_buf[at:at + self._size(p)], _source(self.engine, p, "master"), rank, n)

    def _payload(self, train: list[_Param], frozen: list[_Param], rank: int, out: torch.Tensor) -> None:
        """Rank ``rank``'s partitions of one layer: masters, moments, then frozen weights."""
        n, offset = self.world.size, 0
        for kind in self.kinds:
            for p in train:
                _cut(out[offset:offset + self._size(p)], _source(self.engine, p, kind), rank, n)
                offset += self._size(p)
        for p in frozen:
            _cut(out[offset:offset + self._size(p)], _source(self.engine, p, "master"), rank, n)
            offset += self._size(p)

    def _place(self, train: list[_Param], frozen: list[_Param], received: torch.Tensor) -> None:
        """A received ``_payload`` into this rank's regions, each parameter at its offset."""
        offset = 0
        for region in self.regions:
            for p in train:
                at, size = self.offset[p.name], self._size(p)
                region[at:at + size].copy_(received[offset:offset + size])
                offset += size
        for p in frozen:
            at, size = self.frozen_start[p.name], self._size(p)
            self.frozen_buf[at:at + size].copy_(received[offset:offset + size])
            offset += size

    def _exchange(self, owner: int, train: list[_Param], frozen: list[_Param]) -> None:
        """The ``owner`` of a layer's (or a resident parameter's) state scatters every rank its partitions of it (a
        collective of every rank)."""
        world = self.world
        width = sum(self._size(p) for p in train) * len(self.kinds) + sum(self._size(p) for p in frozen)
        received, chunks = torch.empty(width, dtype=torch.float32), None
        if world.rank == owner:
            send = torch.empty(world.size, width, dtype=torch.float32)
            for rank in range(world.size):
                self._payload(train, frozen, rank, send[rank])
            chunks = list(send.unbind(0))
        dist.scatter(received, chunks, src=world.peer(owner), group=world.group)
        self._place(train, frozen, received)

    def fill(self) -> None:
        """Collective with N ranks (every rank, layers in order)."""
        by_layer: dict[int | None, tuple[list, list]] = {}
        for p in [p for group in self.groups for p in group]:
            by_layer.setdefault(p.layer, ([], []))[0].append(p)
        for p in self.frozen:
            by_layer.setdefault(p.layer, ([], []))[1].append(p)
        for i in range(len(self.engine.layer_states.layouts)):
            train, frozen = by_layer.get(i, ([], []))
            if not train and not frozen:
                continue
            if self.world.size == 1:
                self._own(train, frozen)
            else:
                self._exchange(self.world.owner(i), train, frozen)
        train, frozen = by_layer.get(None, ([], []))  # resident parameters: frozen ones are every rank's copy; a
        self._own([], frozen)  # trained one's state is its owner's (dp.py), which scatters it as a layer's
        for p in train:
            if self.world.size == 1:
                self._own([p], [])
            else:
                self._exchange(self.world.dp.resident_owner(p.start), [p], [])
        self.fragments = {p.name: self.frozen_buf[self.frozen_start[p.name]:][:self._size(p)] for p in self.frozen}
        self.flat = [[region[start:start + size] for start, size in zip(self.group_start, self.sizes)]
                     for region in self.regions]  # per kind, per sub-group
        self.fp32 = self.flat[0]

    def optimizer_state(self, group_of: list[int]) -> dict | None:
        """The optimizer state as DeepSpeed ZeRO-3's CPU Adam saves it (wayback.py); megatrain_ds reads it too."""
        optimizer = self.engine.optimizer
        if optimizer is None:
            return None
        return wayback.optimizer_state(optimizer.param_groups, group_of, optimizer.step_count, self.flat[1],
                                       self.flat[2])

    def close(self) -> None:
        """Delete the scratch files (their pages are dropped unwritten) once the files are saved."""
        self.fp32 = self.flat = self.fragments = self.regions = self.frozen_buf = None
        for path in self.paths:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
