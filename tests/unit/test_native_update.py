"""The native host update ([Note: native host update], megatrain_ds/optim/host_update.py) inside the
engine: training with ``megatrain.host_kernel: native`` equals training with torch's fused AdamW
(``torch``) bit for bit over 20 steps, in every layout the host update meets: the default (fp32
master streamed, bf16 gradients landed where the torch kernel lands fp32 ones), a bf16 wire, GA 2
(fp32 accumulator), bf16 masters, a LoRA model (compact store), the NVMe tier, fp16 with skipped
steps, clipping that fires on every step. (fp32 compute runs the same one-dtype loop as the
default's fp32 landing: tests/unit/test_host_update.py.) Against plain torch (``torch.optim.AdamW``
after ``clip_grad_norm_``) over 20 steps: within the bound the clip's rounding allows."""

import pytest
import torch

import megatrain_ds
from megatrain_ds.optim import host_update
from tests.models import tiny_hf

pytestmark = pytest.mark.skipif(
    host_update.native_library() is None,
    reason="no C compiler here: the native kernel cannot be built",
)
STEPS = 20


def _batches(seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 12), generator=g) for _ in range(STEPS)]


def _config(kernel, *, precision="bf16", ga=1, clip=1.0, megatrain=None, extra=None):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01, "eps": 1e-8}},
        "megatrain": {
            "host_kernel": kernel,
            "gpu_optimizer_layers": 0,
            "keep_activations": 0,
            **(megatrain or {}),
        },
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "bf16_masters":
        cfg["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True}
    # a loss scale high enough that the first steps overflow and are skipped
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 30, "loss_scale_window": 4}
    cfg.update(extra or {})
    return cfg


def _train(model, config, steps=STEPS):
    engine, *_ = megatrain_ds.initialize(model=model, config=config)
    ga = config["gradient_accumulation_steps"]
    batches = _batches()
    losses = []
    for k in range(steps * ga):
        ids = batches[k % STEPS]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = {n: t.clone() for n, t in engine.master_state_dict().items()}
    skipped = engine.skipped_steps
    kernel = engine.host_kernel
    rolled_back = engine.optimizer.policy.rolled_back
    engine.destroy()
    return losses, state, skipped, kernel, rolled_back


# rollbacks are not here: an undone-and-redone layer differs from a plain update by the undo's
# rounding, and which
CASES = {
    "default": {},
    "bf16_wire": {"megatrain": {"stream_fp32_master": False}},
    "ga2": {"ga": 2},
    "bf16_masters": {"precision": "bf16_masters"},
    "fp16_skips": {"precision": "fp16"},
    "clip_always": {"clip": 1e-3},
}
# layers were speculated before the norm was known is a race, so two runs are equal only to that
# rounding (tests/engine/test_speculation.py holds both kernels to torch AdamW; test_host_update the
# native undo to adamw_undo)


@pytest.mark.parametrize("case", list(CASES))
def test_native_trains_as_torch_kernel(case):
    runs = {
        k: _train(tiny_hf("llama", seed=3), _config(k, **CASES[case])) for k in ("native", "torch")
    }
    (l_n, s_n, skip_n, k_n, rb_n), (l_t, s_t, skip_t, k_t, rb_t) = runs["native"], runs["torch"]
    assert (k_n, k_t) == ("native", "torch")
    assert l_n == l_t and skip_n == skip_t and rb_n == rb_t
    assert s_n.keys() == s_t.keys()
    for name in s_n:
        assert torch.equal(s_n[name], s_t[name]), name
    assert l_n[-1] < l_n[0]  # it trained
    if case == "fp16_skips":
        assert skip_n > 0


def test_native_lora_and_nvme(tmp_path):
    """The compact store (LoRA: frozen base in the wire only) and the NVMe tier (moments staged from
    disk)."""
    peft = pytest.importorskip("peft")

    def lora():
        return peft.get_peft_model(
            tiny_hf("llama", seed=4),
            peft.LoraConfig(
                r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]
            ),
        )

    nvme = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": None},
        },
        "aio": {"block_size": 65536, "queue_depth": 4, "intra_op_parallelism": 1},
    }
    results = {}
    for kernel in ("native", "torch"):
        (tmp_path / kernel).mkdir()
        nvme["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path / kernel)
        results[kernel] = (
            _train(lora(), _config(kernel), steps=8),
            _train(
                tiny_hf("llama", seed=4),
                _config(kernel, extra=nvme, megatrain={"nvme_layers": 2}),
                steps=8,
            ),
        )
    for a, b in zip(results["native"], results["torch"]):
        assert a[0] == b[0]
        assert all(torch.equal(a[1][n], b[1][n]) for n in a[1])


# the kernel takes a thread per 64 Ki elements
@pytest.mark.parametrize("threads,n", [(1, 10_001), (3, 200_003)])
def test_native_against_torch_adamw_with_clipping(threads, n):
    """20 steps on a flat fp32 parameter, clipping firing on some: torch.optim.AdamW (fused) after
    clip_grad_norm_ against the native kernel given the clip coefficient, on 1 and on 3 threads (the
    suite runs with one OpenMP thread per process: the kernel's split across threads is asked for
    here). torch multiplies the gradient by the coefficient, the kernel divides by its fp32
    reciprocal (as the engine's fused path does): the gradients differ by at most an ulp, so the
    masters stay within a thousandth of a step (lr) of each other; a wrong gradient or moment would
    be off by orders of magnitude more."""
    g = torch.Generator().manual_seed(0)
    p_ref = torch.nn.Parameter(torch.randn(n, generator=g) * 0.02)
    opt = torch.optim.AdamW(
        [p_ref], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True
    )
    master, m, v = p_ref.detach().clone(), torch.zeros(n), torch.zeros(n)
    fired = 0
    for step in range(1, 21):
        # norm ~2 or ~0.2 against clip 1
        grad = torch.randn(n, generator=g) * (0.02 if step % 3 else 0.002)
        p_ref.grad = grad.clone()
        norm = torch.nn.utils.clip_grad_norm_([p_ref], 1.0)
        opt.step()
        coef = min(1.0, 1.0 / (float(norm) + 1e-6))
        fired += coef < 1.0
        hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step)
        host_update.native_adam(master, grad, m, v, hp, coef, True, threads=threads)
        # in units of lr (Adam's step is about lr)
        off = (master - p_ref.detach()).abs().max().item() / 1e-3
        assert off < 1e-3, (step, off)
    assert 0 < fired < 20
    for got, want in ((m, opt.state[p_ref]["exp_avg"]), (v, opt.state[p_ref]["exp_avg_sq"])):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
