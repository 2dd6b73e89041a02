"""One owner of every persistent tensor of the trained model: the streamed layers' state
(``LayerStates``, layer_state.py) and the resident parameters' (``ResidentState``,
resident_state.py).

Each parameter the engine trains carries a home (``param.megatrain_home``): ``LayerParamHome`` for a
parameter of a streamed layer, ``ResidentParamHome`` for a resident one (embeddings, final norm,
head). Both answer the same questions (is its state held on this rank, is it trained, its fp32
master, its moments, its gradient of the window), so DeepSpeed's per-parameter calls
(``GatheredParameters``, ``safe_get_full_*``, checkpoints) ask the home and never branch on the
kind.

The engine builds one ``ModelState`` and gives it the few things that belong to the running engine:
``synchronize`` (wait for queued updates), ``on_layer_written`` (a layer's slots are stale after a
write), the gradient windows (``layer_landings``: the executor's ``has_grad``/``sq_norm``;
``resident_landings``: ``ResidentParams``), the resident device copies' refresh, the step counters
that ``mark`` reports, whether an optimizer trains the model (``trains``) and the fp16 loss scale
(``loss_scale``). DeepSpeed's per-parameter calls (``safe_get_full_fp32_param`` and the rest of
``deepspeed.utils``, ``param._z3_optimizer``) are answered here (``full_fp32_param`` ...), so they
reach this object through the parameter's home and never the engine.

Data parallel (dp.py): a layer's or a trained resident parameter's state is held by its owner rank
only; reading it is a collective over the gloo group (the owner's value to every rank), and a write
takes rank 0's value (DeepSpeed's ``GatheredParameters(modifier_rank=0)``).
"""

from __future__ import annotations

from typing import Callable

import torch

from .layer_state import LayerStates
from .resident_state import ResidentState

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _nothing(*_args) -> None:
    return None


class LayerParamHome:
    """A streamed layer's parameter: slot ``slot`` of layer ``index`` in its flat buffers."""

    materialized = False
    """``param.data`` holds no storage outside a gather (a ZeRO-3 partitioned parameter)."""

    def __init__(self, model_state: ModelState, index: int, slot) -> None:
        self.model_state, self.index, self.slot, self.name = model_state, index, slot, slot.name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.slot.shape)

    def describe(self) -> str:
        return f"layer {self.index}'s {self.name}"

    def held_here(self) -> bool:
        """This rank holds the layer's state (one process: always)."""
        return self.model_state.layers.holds(self.index)

    def trained(self) -> bool:
        """In an optimizer group: it has a master, moments and a gradient."""
        return self.slot.trainable

    def owner_rank(self) -> int:
        dp = self.model_state.parallel
        return 0 if dp is None else dp.owner(self.index)

    def layers_to_refresh(self) -> list[int]:
        """The GPU-held layers whose host master a read of this parameter needs refreshed
        (``settle_reads``)."""
        return [self.index] if self.held_here() else []

    def read_master(self, settled: bool = False) -> torch.Tensor:
        """The fp32 master, a host copy; data parallel, a collective (the owner's value on every
        rank). ``settled``: the caller ran ``ModelState.settle_reads`` over the homes it reads."""
        ms = self.model_state
        # the optimizer may be writing these bytes; a GPU-held layer's master from the device first
        if not settled:
            ms.settle_reads([self])
        states, dp = ms.layers, ms.parallel
        if dp is None:
            return states.param_master(self.index, self.name).to(torch.float32, copy=True)
        import torch.distributed as dist

        if self.held_here():
            value = states.param_master(self.index, self.name).to(torch.float32, copy=True)
        else:
            value = torch.empty(self.shape, dtype=torch.float32)
        dist.broadcast(value, src=self.owner_rank(), group=dp.cpu_group)
        return value

    def write_master(self, value: torch.Tensor) -> None:
        """Overwrite the master and every copy made from it (wire, GPU-held master); the layer's
        slots holding the old weights are invalidated (every rank: the slots' versions stay in
        step)."""
        ms = self.model_state
        ms.synchronize()
        value = ms.rank0_value(value)
        if self.held_here():
            ms.layers.set_param_master(self.index, self.name, value)
        ms.on_layer_written(self.index)

    def device_copy(self, device: torch.device) -> torch.Tensor:
        """An fp32 copy of the live master on ``device``: a GPU-held layer's from its device master
        (no device-to-host copy), else from the host. One process; the caller has synchronized."""
        states = self.model_state.layers
        master = states.device_param(self.index, self.name)
        if master is None:
            master = states.param_master(self.index, self.name)
        return master.to(device, torch.float32, copy=True)

    def moment(self, key: str) -> torch.Tensor | None:
        """The live Adam moment ``key`` shaped like the parameter (GPU-held, a RAM view, or a copy
        of an NVMe layer's: ``commit_moment`` writes it back); None when it is not trained. The
        caller has synchronized and holds the layer."""
        if not self.slot.trainable:
            return None
        slot = self.slot
        flat = self.model_state.layers.moments(self.index)[_MOMENTS.index(key)]
        return flat[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def commit_moment(self) -> None:
        """After writing into ``moment(key)``: an NVMe layer's copy goes back to disk."""
        self.model_state.layers.commit_moments(self.index)

    def has_window_grad(self) -> bool:
        """A gradient landed for it in this window (every rank's answer: each records them)."""
        return bool(self.model_state.layer_landings.has_grad[self.index])

    def window_grad(self) -> torch.Tensor | None:
        """Its accumulated gradient of the window, once the last landing was folded in (waits for
        it); None where this rank does not hold the layer."""
        if not self.held_here():
            return None
        slot, landings = self.slot, self.model_state.layer_landings
        landing, flat = landings.sq_norm[self.index], self.model_state.layers.grad(self.index)
        grad = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
        if landing is not None:
            # the host worker has folded the last landing into the buffer (waits for its D2H)
            landing.result()
        return grad

    def checkpoint_flat(self, kind: str) -> torch.Tensor:
        """Its ``kind`` ("master", "exp_avg", "exp_avg_sq") flat as the host keeps it (the caller
        has synced the GPU-held layers to the host): a view, or a copy of an NVMe layer's; a frozen
        one's master is in the frozen region (a compact store keeps it in the wire copy)."""
        states, slot, i = self.model_state.layers, self.slot, self.index
        if kind == "master":
            flat = states.master(i) if slot.trainable else states.frozen(i)
        else:
            flat = states.host_moments(i)[_MOMENTS.index(kind)]
        return flat[slot.offset : slot.offset + slot.numel]


class ResidentParamHome:
    """A resident parameter (embeddings, final norm, head): entry ``index`` of the
    ``ResidentState``."""

    materialized = True
    """``param.data`` is the device copy the forward uses (outside a gather)."""

    def __init__(self, model_state: ModelState, index: int) -> None:
        self.model_state, self.index = model_state, index

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.model_state.resident.params[self.index].shape)

    def describe(self) -> str:
        return f"resident parameter {self.index} (shape {self.shape})"

    def held_here(self) -> bool:
        """This rank holds its state (one process: always)."""
        return self.model_state.parallel is None or self.model_state.resident.owned[self.index]

    def trained(self) -> bool:
        return self.model_state.resident.trained[self.index]

    def owner_rank(self) -> int:
        dp = self.model_state.parallel
        return 0 if dp is None else dp.resident_owner(self.index)

    def layers_to_refresh(self) -> list[int]:
        return []

    def read_master(self, settled: bool = False) -> torch.Tensor:
        """The fp32 master on the engine's device, where HF's ``model.device`` (the embedding) sends
        generate's inputs; data parallel, a collective from its owner."""
        ms, k = self.model_state, self.index
        if not settled:
            ms.settle_reads([self])
        return ms.resident.master_copy(k).view(self.shape).to(ms.device, torch.float32)

    def write_master(self, value: torch.Tensor) -> None:
        """Overwrite the fp32 master (its owner's), its wire copy and the device copy the forward
        uses."""
        ms = self.model_state
        ms.synchronize()
        ms.resident.write_master(self.index, ms.rank0_value(value))

    def device_copy(self, device: torch.device) -> torch.Tensor:
        """An fp32 copy of the master on ``device`` (one process; the caller has synchronized)."""
        master = self.model_state.resident.master[self.index].detach()
        return master.to(device, torch.float32, copy=True).view(self.shape)

    def moment(self, key: str) -> torch.Tensor | None:
        """The live Adam moment ``key`` (host or device); None when it is not trained here."""
        return getattr(self.model_state.resident, key)[self.index]

    def commit_moment(self) -> None:
        """Nothing to write back: a resident moment is always the live tensor."""

    def has_window_grad(self) -> bool:
        return bool(self.model_state.resident_landings.has_grad[self.index])

    def window_grad(self) -> torch.Tensor | None:
        """Its gradient of the window once landed (waits for the landing): the landing buffer itself
        when the window had one gradient, else the fp32 home; None where another rank holds its
        state."""
        k, landings = self.index, self.model_state.resident_landings
        if self.model_state.resident.grad[k] is None:
            return None
        landing = landings.sq_norm[k]
        if landing is not None:
            landing.result()
        return landings.grad_of(k)

    def checkpoint_flat(self, kind: str) -> torch.Tensor:
        """Its ``kind`` ("master", "exp_avg", "exp_avg_sq") flat, where it is kept."""
        return getattr(self.model_state.resident, kind)[self.index].detach().reshape(-1)


ParamHome = LayerParamHome | ResidentParamHome


class ModelState:
    """Every persistent tensor of the trained model, and each parameter's home in it."""

    def __init__(
        self,
        layers: LayerStates,
        resident: ResidentState,
        dp,
        device: torch.device,
        block_name: str,
        module: torch.nn.Module | None = None,
        synchronize: Callable[[], None] = _nothing,
        on_layer_written: Callable[..., None] = _nothing,
        layer_landings=None,
        resident_landings=None,
        refresh_device_copies: Callable[[], None] = _nothing,
        step_counts: Callable[[], tuple[int, int]] = lambda: (0, 0),
        pending_device_bytes: Callable[[], int] = lambda: 0,
        trains: bool = True,
        loss_scale: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.layers, self.resident, self.dp, self.device = layers, resident, dp, device
        self.block_name, self.module = block_name, module
        self.synchronize = synchronize  # waits for the queued updates (the engine's)
        # a layer's index (None: every layer): its slots are stale
        self.on_layer_written = on_layer_written
        # the gradient windows: ``has_grad``/``sq_norm`` per layer (the executor), and
        # ResidentParams' (with grad_of)
        self.layer_landings, self.resident_landings = layer_landings, resident_landings
        # the resident device copies hold the last update
        self.refresh_device_copies = refresh_device_copies
        self.step_counts = step_counts  # (micro_steps, global_steps), reported by ``mark``
        # device bytes a generate's inference cache may take
        self.pending_device_bytes = pending_device_bytes
        self.trains = trains  # an optimizer updates the trained parameters (initialize's optimizer)
        # fp16's current loss scale (None: no scaling), divided out of grads
        self.loss_scale = loss_scale
        self.layer_homes = {
            (i, slot.name): LayerParamHome(self, i, slot)
            for i, layout in enumerate(layers.layouts)
            for slot in layout.slots
        }
        self.resident_homes = [ResidentParamHome(self, k) for k in range(len(resident.params))]
        # a checkpoint's listing of a parameter: (layer, start in its [trainable | frozen] flat), or
        # (None, k)
        self._by_position = {
            (i, h.slot.offset + (0 if h.slot.trainable else layers.layouts[i].n_train)): h
            for (i, _), h in self.layer_homes.items()
        }
        self._by_position.update({(None, k): h for k, h in enumerate(self.resident_homes)})

    # ------------------------------------------------------------------ one parameter's full state
    # deepspeed.utils' safe_get/set_full_fp32_param, safe_get_full_grad,
    # safe_get/set_full_optimizer_state and param._z3_optimizer (api/utils.py, api/zero.py); the
    # engine's methods of the same names delegate here. Values come back as copies on the device, as
    # DeepSpeed returns them. Data parallel: each is a collective, as DeepSpeed's are under ZeRO-3
    # (every rank calls it for the same parameter).
    def full_fp32_param(self, param) -> torch.Tensor:
        """``param``'s fp32 master weights. Waits for the queued updates (a CPU-GPU sync)."""
        return self.home_of(param).read_master().to(self.device)

    def set_full_fp32_param(self, param, value: torch.Tensor) -> None:
        """Write ``param``'s fp32 master and every copy made from it (wire, device copy, slots)."""
        self.home_of(param).write_master(value.detach())

    def _moment_home(self, param, key: str):
        if key not in _MOMENTS:
            raise KeyError(
                f"optimizer state {key!r}: megatrain_ds's AdamW keeps 'exp_avg' and 'exp_avg_sq'"
            )
        home = self.home_of(param)
        self.synchronize()  # queued updates write the moments (a speculative one is rolled back)
        return home, self.trains and home.trained()  # every rank's answer: the layouts are theirs

    def full_optimizer_state(self, param, key: str) -> torch.Tensor | None:
        """Adam's ``exp_avg`` / ``exp_avg_sq`` of ``param`` (None: frozen, or no optimizer)."""
        home, trained = self._moment_home(param, key)
        if not trained:
            return None
        # the device's (GPU-held), host RAM (a view), or a layer on the NVMe tier (a copy)
        moment = self.from_owner(home, home.moment(key) if home.held_here() else None)
        return moment.detach().to(self.device, torch.float32, copy=True)

    def set_full_optimizer_state(self, param, value: torch.Tensor, key: str) -> None:
        home, trained = self._moment_home(param, key)
        if not trained:
            raise ValueError(
                f"set_full_optimizer_state({key!r}): this parameter has no optimizer "
                "state (frozen, or the engine has no optimizer)"
            )
        value = self.rank0_value(value)
        if home.held_here():
            moment = home.moment(key)
            moment.copy_(value.reshape(moment.shape))
            home.commit_moment()  # an NVMe layer's copy goes back to disk

    def full_grad(self, param) -> torch.Tensor | None:
        """``param``'s gradient accumulated since the last step, in fp32, as the optimizer will see
        it before clipping: summed over the micro-batches of the window, the fp16 loss scale divided
        out; data parallel, the mean over the ranks. None before the window's first backward and for
        a parameter the optimizer does not train (DeepSpeed's contract: between ``backward()`` and
        ``step()``)."""
        home = self.home_of(param)
        if not (self.trains and home.trained()) or not home.has_window_grad():
            return None  # every rank's answer (each records the landings)
        # the owner's (mean) gradient once landed (GA 1, a resident one: its landing buffer itself)
        grad = self.from_owner(home, home.window_grad())
        # GPU-held gradients accumulate on the compute stream, the current one: this copy follows
        out = grad.to(self.device, torch.float32, copy=True)
        scale = self.loss_scale()
        return out.div_(scale) if scale is not None else out

    @property
    def parallel(self):
        """The ``DataParallel`` when several processes train (dp.py), else None."""
        return self.dp if self.dp is not None and self.dp.active else None

    def mark(self, phase: str) -> None:
        """Data parallel: report this rank's position before a collective (dp.py's ``mark``)."""
        if self.parallel is not None:
            self.parallel.mark(phase, *self.step_counts())

    # ------------------------------------------------------------------ homes
    def home_of(self, param) -> ParamHome:
        """The home stamped on ``param`` by ``mark_params``; ValueError when this model state does
        not hold it."""
        home = getattr(param, "megatrain_home", None)
        if home is None or home.model_state is not self:
            shape = tuple(getattr(param, "ds_shape", param.shape))
            raise ValueError(
                f"this parameter (shape {shape}) is not trained by this megatrain_ds "
                "engine (not a parameter of engine.module)"
            )
        return home

    def home_at(self, layer: int | None, start: int) -> ParamHome:
        """The home of a parameter as a checkpoint lists it: a layer and its start in the layer's
        ``[trainable | frozen]`` flat, or (None, k): resident parameter k."""
        return self._by_position[(layer, start)]

    def mark_params(self, layers, mark: Callable) -> None:
        """Stamp every parameter with its home (``mark(param, home)``: DeepSpeed's ZeRO-3
        attributes, api/zero.py) and its ``ds_tensor``: a streamed one's where it is kept
        (``LayerStates.ds_tensor``), a resident one's its device copy."""
        for i, layer in enumerate(layers):
            by_name = dict(layer.named_parameters(remove_duplicate=False))
            for slot in self.layers.layouts[i].slots:
                mark(by_name[slot.name], self.layer_homes[(i, slot.name)])
                by_name[slot.name].ds_tensor = self.layers.ds_tensor(i, slot)
        for k, p in enumerate(self.resident.params):
            mark(p, self.resident_homes[k])
            p.ds_tensor = p.data

    def unmark(self, params) -> None:
        """The homes this model state stamped leave ``params`` (the module outlives the engine)."""
        for p in params:
            home = getattr(p, "megatrain_home", None)
            if home is not None and home.model_state is self:
                del p.megatrain_home

    # ------------------------------------------------------------------ one parameter
    def settle_reads(self, homes) -> None:
        """Before reading many masters (a gather): wait once, and copy each GPU-held layer among
        them to the host once; ``read_master(home, settled=True)`` then reads the host copies."""
        self.synchronize()
        self.layers.refresh_host_masters(sorted({i for h in homes for i in h.layers_to_refresh()}))

    def read_master(self, home: ParamHome, settled: bool = False) -> torch.Tensor:
        return home.read_master(settled)

    def write_master(self, home: ParamHome, value: torch.Tensor) -> None:
        home.write_master(value)

    def rank0_value(self, value: torch.Tensor) -> torch.Tensor:
        """Data parallel: rank 0's ``value`` on every rank (fp32, host); one process: ``value``."""
        dp = self.parallel
        if dp is None:
            return value.detach()
        import torch.distributed as dist

        value = value.detach().to("cpu", torch.float32, copy=True).contiguous()
        dist.broadcast(value, src=0, group=dp.cpu_group)
        return value

    def from_owner(self, home: ParamHome, local: torch.Tensor | None) -> torch.Tensor:
        """Data parallel: ``local`` (the owner's value of a tensor of ``home``'s state) on every
        rank, fp32 on the host; one process: ``local`` itself."""
        dp = self.parallel
        if dp is None:
            return local
        import torch.distributed as dist

        src = home.owner_rank()
        buf = (
            local.detach().to("cpu", torch.float32, copy=True).contiguous()
            if dp.rank == src
            else torch.empty(home.shape, dtype=torch.float32)
        )
        dist.broadcast(buf, src=src, group=dp.cpu_group)
        return buf

    # ------------------------------------------------------------------ the whole model
    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights keyed like ``module.state_dict()`` (views of host memory, no copy);
        frozen parameters (no optimizer group) as they are kept, in the compute dtype when it is not
        fp32 (host_state.py). Data parallel: a collective (every rank calls it); the layers other
        ranks own come over gloo, as copies."""
        self.synchronize()
        self.layers.sync_to_host()
        store, dp, out = self.layers.store, self.parallel, {}
        prefix = self.block_name + "."
        for i, layout in enumerate(store.layouts):
            if dp is not None:  # from layer i's owner, one layer at a time
                import torch.distributed as dist

                flat = (
                    self.layers.full_master(i)
                    if self.layers.holds(i)
                    else torch.empty(layout.numel)
                )
                dist.broadcast(flat, src=dp.owner(i), group=dp.cpu_group)
                for slot in layout.slots:
                    start = slot.offset + (0 if slot.trainable else layout.n_train)
                    value = flat[start : start + slot.numel].view(slot.shape)
                    # as one process gives it: its kept dtype
                    if store.compact and not slot.trainable:
                        value = value.to(store.wire_dtype)
                    elif store.master_dtype != torch.float32:  # bf16 masters (the wire): likewise
                        value = value.to(store.master_dtype)
                    out[f"{prefix}{i}.{slot.name}"] = value
                continue
            for slot in layout.slots:
                out[f"{prefix}{i}.{slot.name}"] = store.param_master(i, slot.name)
        names, res = {id(p): n for n, p in self.module.named_parameters()}, self.resident
        # data parallel: from each one's owner
        for k, (p, master) in enumerate(zip(res.params, res.master)):
            if dp is not None and res.trained[k]:
                out[names[id(p)]] = res.master_copy(k).view(p.shape)
            else:
                out[names[id(p)]] = master.view(p.shape).cpu()
        return out

    def load_master_state_dict(self, state: dict, strict: bool = True) -> None:
        """Write fp32 weights keyed like ``master_state_dict()`` into the host masters (and every
        copy derived from them: wire copy, GPU-held masters, resident device copies, slots).
        Everything is checked (names when ``strict``, shapes always) before the first write: a
        mismatch leaves the state as it was."""
        self.synchronize()
        store, res = self.layers.store, self.resident
        names = {id(p): n for n, p in self.module.named_parameters()}
        layer_keys = {
            f"{self.block_name}.{i}.{slot.name}": (i, slot)
            for i, layout in enumerate(store.layouts)
            for slot in layout.slots
        }
        resident_keys = {names[id(p)]: k for k, p in enumerate(res.params)}
        shapes = {key: tuple(slot.shape) for key, (_, slot) in layer_keys.items()}
        shapes.update({key: tuple(res.params[k].shape) for key, k in resident_keys.items()})
        wrong = [
            f"{key}: {tuple(state[key].shape)} given, {shape} in the model"
            for key, shape in shapes.items()
            if key in state and tuple(state[key].shape) != shape
        ]
        missing, unexpected = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
        if wrong or (strict and (missing or unexpected)):
            raise RuntimeError(
                f"state does not match the model: wrong shapes {wrong[:5]}, "
                f"missing {missing[:5]}, unexpected {unexpected[:5]} "
                "(strict=False loads what matches; nothing was loaded)"
            )
        # streamed layers: written where each lives (layer_state.py), NVMe masters staged until the
        # resident ones
        staged = self.layers.load_masters(
            [(*layer_keys[key], state[key]) for key in layer_keys if key in state]
        )
        for key, k in resident_keys.items():
            if key in state:
                p, master = res.params[k], res.master[k]
                # data parallel: another rank holds its state; the device copy is this rank's
                if master is None:
                    p.data.copy_(state[key].reshape(p.shape))
                    continue
                master.copy_(state[key].reshape(master.shape))
                if res.wire[k] is not None:
                    res.wire[k].copy_(master)
                if p.data is not master:  # a frozen one's master is p.data
                    p.data.copy_(master)
        # NVMe masters, every wire copy, the GPU-held masters
        self.layers.finish_loading_masters(staged)
        self.on_layer_written(None)  # every slot is stale

    def host_memory(self) -> dict:
        """Host bytes of the persistent state, and per parameter. ``base``: parameters in no
        optimizer group (a LoRA base), kept in the compute dtype only; ``trainable``: with fp32
        master and AdamW moments. Resident tensors on the host count (on a CPU device that includes
        their compute copies)."""
        res, store = self.resident, self.layers.store
        host = lambda t: t is not None and t.device.type == "cpu"  # noqa: E731
        kinds = (res.master, res.exp_avg, res.exp_avg_sq, res.grad, res.wire, res.landing)
        resident = sum(
            t.numel() * t.element_size()
            for ts in kinds
            for t in {id(x): x for x in ts if host(x)}.values()
        )
        # (this rank's)
        held = [(p.numel(), t) for p, t, mine in zip(res.params, res.trained, res.owned) if mine]
        trainable = store.n_train + sum(n for n, t in held if t)
        params = store.n_full + sum(n for n, _ in held)
        total = store.nbytes() + resident
        return {
            "layers_bytes": store.nbytes(),
            "resident_bytes": resident,
            "total_bytes": total,
            "disk_bytes": store.disk_nbytes(),
            "params": params,
            "trainable": trainable,
            "base": params - trainable,
            "bytes_per_param": total / max(params, 1),
            "bytes_per_base_param": total / max(params - trainable, 1),
        }
