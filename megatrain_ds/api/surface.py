"""The DeepSpeed surface that published training scripts touch beyond ``initialize`` and the
training calls.

docs/deepspeed_surface.md is the survey behind this file: which scripts call what, and which test
shows it.

- ``EngineSurface``: engine attributes and methods (``tput_timer``, ``global_rank``,
  ``was_step_applied()``, ``steps_per_print()``, ``_consolidated_16bit_state_dict()``,
  ``offload_states()``, one parameter's full fp32 state for ``deepspeed.utils.safe_get_full_*``,
  ...). ``MegaTrainEngine`` inherits it; the core engine file keeps only what the streaming engine
  itself needs.
- ``module_getattr``: names looked up on the module itself (``deepspeed.get_accelerator()``,
  ``deepspeed.init_inference``, ...) when a script says ``import megatrain_ds as deepspeed``. Pure
  helpers are DeepSpeed's own; what megatrain_ds cannot run raises AttributeError naming it and
  saying what to do.
- ``adopt_zero3_model``: a model that real DeepSpeed's ``zero.Init`` already partitioned is made
  whole again before the engine splits it.
"""

from __future__ import annotations

import torch

from .. import _version
from ..parallel import comm


class EngineSurface:
    """DeepSpeed engine attributes beyond the training calls (a mixin of ``MegaTrainEngine``).

    The parallel-rank queries answer for the run's processes (comm.py): every process is a
    data-parallel rank (parallel/dp.py), so the data-parallel world is the whole world; there is no
    model, pipeline or sequence parallelism (model-parallel rank 0 of 1, sequence-parallel size 1).
    Before ``torch.distributed`` exists they answer from the launcher's environment (RANK,
    WORLD_SIZE).
    """

    # The loader ``initialize(training_data=...)`` built (initialize sets it, as DeepSpeed's engine
    # keeps it).
    training_dataloader = None

    # ------------------------------------------------------------------ throughput (DeepSpeed-Chat)
    @property
    def tput_timer(self):
        """DeepSpeed's ``ThroughputTimer`` (throughput.py), built on first use."""
        timer = self.__dict__.get("_tput_timer")
        if timer is None:
            from .throughput import make_throughput_timer

            settings = self.config_settings
            timer = make_throughput_timer(
                settings.raw, settings.train_batch_size, settings.steps_per_print
            )
            self.__dict__["_tput_timer"] = timer
        return timer

    def _end_step_surface(self, boundary: bool) -> None:
        """What DeepSpeed's ``step`` does last: stop the throughput timer (a global step at a
        boundary) and record whether this call updated the weights (``was_step_applied``)."""
        self.tput_timer.stop(global_step=boundary, report_speed=self.global_rank == 0)
        skipped = self.optimizer is not None and getattr(self.optimizer, "last_step_skipped", False)
        self.__dict__["_step_applied"] = boundary and self.optimizer is not None and not skipped

    def scale(self, loss):
        """DeepSpeed's ``engine.scale(loss)`` before a script's own ``loss.backward()``: the loss
        times the fp16 loss scale (in bf16 and fp32 the loss itself); [Note: loss.backward()] in
        engine.py."""
        if self.optimizer is None:
            raise RuntimeError("engine.scale(loss) needs an optimizer (as DeepSpeed's does)")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
            raise ValueError("engine.scale(loss): the loss must be a scalar tensor with a grad_fn")
        # the next loss.backward() was scaled: fp16 allows it
        self.__dict__["_manual_scaled"] = True
        scaler = self.loss_scaler
        return loss * scaler.scale if scaler is not None else loss

    def was_step_applied(self) -> bool:
        """Whether the latest ``step()`` updated the weights: False between accumulation boundaries,
        on an fp16 overflow (the step is skipped), and for an engine without an optimizer."""
        return self.__dict__.get("_step_applied", False)

    # --------------------------------------------------------------- the world (data parallel only)
    @property
    def global_rank(self) -> int:
        return comm.get_rank()

    @property
    def world_size(self) -> int:
        return comm.get_world_size()

    @property
    def dp_world_size(self) -> int:
        """Data-parallel processes: all of them (no model parallelism)."""
        return comm.get_world_size()

    @property
    def seq_dp_world_size(self) -> int:
        """DeepSpeed's data x sequence parallel size (what it divides gradients by): the
        data-parallel size."""
        return self.dp_world_size

    @property
    def mp_world_size(self) -> int:
        return 1

    @property
    def sequence_parallel_size(self) -> int:
        return 1

    @property
    def data_parallel_group(self):
        """The default process group (scripts call ``engine.data_parallel_group.rank()``); None
        before ``torch.distributed`` is initialized."""
        import torch.distributed as dist

        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    @property
    def seq_data_parallel_group(self):
        """DeepSpeed's data x sequence parallel group: the data-parallel group (no sequence
        parallelism)."""
        return self.data_parallel_group

    def get_data_parallel_rank(self) -> int:
        return comm.get_rank()

    def get_data_parallel_world_size(self) -> int:
        return self.dp_world_size

    def get_model_parallel_rank(self) -> int:
        return 0

    # ------------------------------------------------------------------ config queries
    def steps_per_print(self) -> int | None:
        spp = self.config_settings.steps_per_print
        return None if spp == float("inf") else int(spp)

    def wall_clock_breakdown(self) -> bool:
        return self.config_settings.wall_clock_breakdown

    def gradient_clipping(self) -> float:
        return self.config_settings.gradient_clipping

    def loss_scale(self) -> float:
        """DeepSpeed's ``fp16.loss_scale``: the static scale, 0 when dynamic (and without fp16)."""
        scaler = self.loss_scaler
        return 0.0 if scaler is None or scaler.dynamic else float(scaler.scale)

    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale() == 0

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    # ------------------------------------------------------------------ exports and state movement
    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """DeepSpeed >= 0.16's name for the consolidated export (OpenRLHF's ``save_model`` calls
        it)."""
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's old name for ``save_16bit_model``."""
        return self.save_16bit_model(save_dir, save_filename)

    def offload_states(
        self, include=None, device=None, pin_memory: bool = True, non_blocking: bool = False
    ) -> None:
        """DeepSpeed moves ZeRO-3 optimizer state, fp32 masters and gradient buffers off the GPU
        between the phases of colocated RLHF (OpenRLHF, DeepSpeed's offload_states example).
        megatrain_ds keeps those in host memory already, so there is nothing to move -- unless
        ``megatrain.gpu_optimizer_layers`` placed some layers' state on the GPU, which this does not
        move back."""
        gpu_layers = self.layer_states.gpu_layers()
        if gpu_layers is not None:
            raise NotImplementedError(
                "engine.offload_states(): megatrain.gpu_optimizer_layers keeps the optimizer state "
                "of layers "
                f"[0, {gpu_layers.stop}) on the GPU and megatrain_ds does not move it back to the "
                "host; set "
                "megatrain.gpu_optimizer_layers to 0 when the GPU must be freed between phases"
            )

    def reload_states(self, non_blocking: bool = False) -> None:
        """The inverse of ``offload_states``: nothing moved, nothing to bring back."""

    def empty_partition_cache(self) -> None:
        """DeepSpeed frees gathered ZeRO-3 parameters here. megatrain_ds holds no gathered copies
        between calls (the layer slots are its working set); the caching allocator's free blocks are
        returned."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ one parameter's full state
    # deepspeed.utils.safe_get/set_full_fp32_param, safe_get_full_grad,
    # safe_get/set_full_optimizer_state (megatrain_ds/api/utils.py; DeepSpeed's own functions reach
    # these through param._z3_optimizer, zero.py). Values come back as copies on the engine's
    # device, as DeepSpeed returns them. Data parallel (dp.py): a streamed layer's state lives on
    # its owner only, so each of these is a collective, as DeepSpeed's are under ZeRO-3 (every rank
    # calls it for the same parameter): the owner's value comes to every rank over the engine's gloo
    # group; a setter writes rank 0's value (GatheredParameters' ``modifier_rank=0``). A resident
    # parameter's state is held by its owner too (dp.py), and reached the same way. Each answers
    # from the parameter's home (host/model_state.py), whatever the kind: a streamed layer's or a
    # resident parameter's.
    def full_fp32_param(self, param) -> torch.Tensor:
        """``param``'s fp32 master weights (``ModelState.full_fp32_param``)."""
        return self.model_state.full_fp32_param(param)

    def set_full_fp32_param(self, param, value: torch.Tensor) -> None:
        """Write ``param``'s fp32 master and every copy made from it."""
        self.model_state.set_full_fp32_param(param, value)

    def full_optimizer_state(self, param, key: str) -> torch.Tensor | None:
        """Adam's ``exp_avg`` / ``exp_avg_sq`` of ``param`` (None when frozen or no optimizer)."""
        return self.model_state.full_optimizer_state(param, key)

    def set_full_optimizer_state(self, param, value: torch.Tensor, key: str) -> None:
        self.model_state.set_full_optimizer_state(param, value, key)

    def full_grad(self, param) -> torch.Tensor | None:
        """``param``'s fp32 gradient of the window, before clipping (``ModelState.full_grad``)."""
        return self.model_state.full_grad(param)

    # ---------------------------------------------------------------- what megatrain_ds does not do
    def compile(
        self, backend=None, compile_kwargs=None, schedule=None, compiled_autograd_enabled=False
    ) -> None:
        raise NotImplementedError(
            "engine.compile(): megatrain_ds runs each decoder layer through a template bound to "
            "streamed weights "
            "and does not compile the engine. Leave torch.compile off (accelerate: dynamo_backend "
            "'no'; "
            "OpenRLHF: no --deepcompile; TrainingArguments(torch_compile=False))"
        )

    @property
    def is_compiled(self) -> bool:
        return False

    def train_batch(self, data_iter=None):
        raise NotImplementedError(
            "engine.train_batch() is DeepSpeed's pipeline-parallel engine "
            "(deepspeed.pipe.PipelineModule); "
            "megatrain_ds streams the layers of a plain nn.Module on each GPU: loop over the "
            "batches with "
            "loss = engine(batch); engine.backward(loss); engine.step()"
        )

    def eval_batch(self, data_iter=None, **kwargs):
        raise NotImplementedError(
            "engine.eval_batch() is DeepSpeed's pipeline-parallel engine "
            "(deepspeed.pipe.PipelineModule); "
            "evaluate with `with torch.no_grad(): out = engine(batch)`"
        )


# ---------------------------------------------------------------------- names on the module itself


def _real(module_name: str):
    import importlib

    return importlib.import_module(module_name)


# Pure DeepSpeed helpers that work unchanged beside megatrain_ds: the real object is returned.
_FORWARDED = {
    "accelerator": lambda: _real("deepspeed.accelerator"),
    "get_accelerator": lambda: _real("deepspeed.accelerator").get_accelerator,
    # checkpoint.utils.clone_tensors_for_torch_save
    "checkpoint": lambda: _real("deepspeed.checkpoint"),
}

_ONE_GPU = "megatrain_ds trains a whole model copy in each process (data parallelism only)"
_UNSUPPORTED = {
    "init_inference": "DeepSpeed-Inference (kernel injection, tensor-parallel serving) is not part "
    "of "
    "megatrain_ds: generate with the trained model (engine.module.generate(...)) or serve it "
    "with real DeepSpeed / vLLM",
    "InferenceEngine": "see deepspeed.init_inference: DeepSpeed-Inference is not part of "
    "megatrain_ds",
    "tp_model_init": f"AutoTP tensor parallelism: {_ONE_GPU}; drop tensor_parallel / tp_size",
    "pipe": f"pipeline parallelism (PipelineModule, PipelineEngine): {_ONE_GPU} and streams the "
    "layers itself; "
    "pass the plain nn.Module (its blocks in an nn.ModuleList) to initialize",
    "PipelineModule": f"pipeline parallelism: {_ONE_GPU}; pass the plain nn.Module to initialize",
    "PipelineEngine": f"pipeline parallelism: {_ONE_GPU}; pass the plain nn.Module to initialize",
    "moe": "DeepSpeed's MoE layers and expert parallelism are not provided: use the model's own "
    "MoE blocks",
    "module_inject": "DeepSpeed's kernel injection is not provided: the model's own layers run",
    "replace_transformer_layer": "DeepSpeed's kernel injection is not provided: the model's own "
    "layers run",
    "DeepSpeedTransformerLayer": "DeepSpeed's fused transformer kernel is not provided: use the "
    "model's layers",
    "DeepSpeedTransformerConfig": "DeepSpeed's fused transformer kernel is not provided: use the "
    "model's layers",
    "DeepSpeedConfig": "megatrain_ds parses the DeepSpeed config itself "
    "(megatrain_ds.parse_config); "
    "initialize(config=...) takes the dict or path",
    "compression": "DeepSpeed Compression (quantization-aware training, pruning) is not provided",
    "profiling": "DeepSpeed's FLOPs profiler is not provided: wall_clock_breakdown prints the step "
    "breakdown",
    "sequence_parallel": f"Ulysses sequence parallelism: {_ONE_GPU}",
}


def module_getattr(name: str):
    """``megatrain_ds.<name>`` for names DeepSpeed's top-level module has and megatrain_ds does not
    define."""
    if name in _FORWARDED:
        return _FORWARDED[name]()
    if name == "version":  # DeepSpeed exposes both; scripts compare either with a DeepSpeed release
        return _version.__version__
    if name in _UNSUPPORTED:
        raise AttributeError(
            f"deepspeed.{name} (megatrain_ds imported as deepspeed): {_UNSUPPORTED[name]}"
        )
    raise AttributeError(
        f"module 'megatrain_ds' has no attribute {name!r} (docs/deepspeed_surface.md lists the "
        "DeepSpeed names megatrain_ds provides)"
    )


# ------------------------------------------------------------ models built by DeepSpeed's zero.Init

# What DeepSpeed's zero.Init adds to each parameter besides ``ds_*`` attributes
# (deepspeed/runtime/zero/partition_parameters.py, ``_convert_to_deepspeed_param``): bound methods
# that gather and partition through DeepSpeed's own bookkeeping, which megatrain_ds does not keep.
_DS_PARAM_METHODS = (
    "all_gather",
    "all_gather_coalesced",
    "partition",
    "reduce_gradients_at_owner",
    "partition_gradients",
    "aligned_size",
    "padding_size",
    "partition_numel",
    "item",
    "convert_to_zero_parameters",
    "is_external_param",
    "nvme_swapper",
)


def adopt_zero3_model(model: torch.nn.Module) -> None:
    """Make whole, on the host, every parameter that real DeepSpeed's ``zero.Init`` partitioned.

    A script that says ``import megatrain_ds as deepspeed`` but registers a ZeRO-3 config with
    transformers (``HfDeepSpeedConfig``: DeepSpeed-Chat's ``create_hf_model``, OpenRLHF's ``Actor``)
    gets its model built by transformers under the real ``deepspeed.zero.Init``: each parameter is
    then an empty tensor plus DeepSpeed's partition (the whole tensor in one process, 1/N of it on
    each of N). It is gathered here (one parameter at a time, to the host; with N processes an
    all-gather that every rank makes, in the same parameter order, as ``initialize`` is called on
    every rank), and DeepSpeed's attributes are removed so the engine sees a plain model.
    """
    partitioned = [
        p for p in model.parameters() if hasattr(p, "ds_id") and not hasattr(p, "megatrain_home")
    ]
    if not partitioned:
        return
    # partition_parameters' own class: under the switch (compat/)
    # ``deepspeed.zero.GatheredParameters`` is ours
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    for p in partitioned:
        with GatheredParameters([p]):
            whole = p.data.detach().to("cpu", copy=True)
        for attr in list(vars(p)):
            if attr.startswith("ds_") or attr in _DS_PARAM_METHODS:
                delattr(p, attr)
        p.data = whole
