"""LM head + cross-entropy without whole logits.

The ``[tokens, vocab]`` logits of a 16K-token step at vocab 152K are 10 GB in fp32: they must never
exist whole. ``linear_cross_entropy`` runs the head in row chunks; for each chunk it forms the
logits, takes the loss and, in the same pass, the gradients with respect to the chunk's hidden rows
and the head weight (the gradient work is done in forward, as liger-kernel's fused linear
cross-entropy does), then frees the chunk. Backward only scales the stored gradients by the incoming
grad. On CUDA with liger-kernel installed its Triton kernel is used instead; on CPU (and without
liger) the torch implementation below.

Semantics match Hugging Face's causal-LM loss: labels are shifted left by one, ``ignore_index`` -100
is skipped, logits are upcast to fp32, reduction is the mean over counted tokens or the sum divided
by ``num_items_in_batch`` when that is given. ``fused_loss_parts`` says which models' loss this
computes exactly (a causal LM whose head is a plain linear layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .model_map import plain_lm_head

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """(B, S) labels -> (B*S,) targets for next-token prediction, last position ignored."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1).reshape(-1)


def default_chunk_rows(vocab: int) -> int:
    """Rows per chunk so one chunk's fp32 logits stay near 256 MiB (e.g. 441 rows at vocab 152K)."""
    return max(64, (1 << 26) // max(vocab, 1))


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, denom, chunk_rows):
        # hidden (N, h), weight (V, h), targets (N,), denom: python float or 0-dim tensor
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        # loss and weight-grad accumulation dtype
        acc = torch.promote_types(hidden.dtype, torch.float32)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        w = weight.detach().requires_grad_(need_w)
        b = bias.detach().requires_grad_(need_b) if bias is not None else None
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            with torch.enable_grad():
                h = hidden[rows].detach().requires_grad_(need_h)
                logits = F.linear(h, w, b)  # (n, V): the only logits alive at any time
                # upcast, never down
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
                loss = F.cross_entropy(
                    logits, targets[rows], ignore_index=IGNORE_INDEX, reduction="sum"
                )
                wrt = [t for t, need in ((h, need_h), (w, need_w), (b, need_b)) if need]
                grads = list(torch.autograd.grad(loss, wrt)) if wrt else []
            total += loss.detach()
            if need_h:
                grad_h[rows] = grads.pop(0)
            if need_w:
                grad_w += grads.pop(0)
            if need_b:
                grad_b += grads.pop(0)
            del logits, loss
        scale = 1.0 / (denom.to(acc) if isinstance(denom, torch.Tensor) else denom)
        ctx.grads = (grad_h, grad_w, grad_b, scale)
        ctx.w_dtype = weight.dtype  # autograd wants each gradient in its input's dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        return total * scale

    @staticmethod
    def backward(ctx, grad_loss):
        # the gradients were handed out by the first backward and freed with it
        if ctx.grads is None:
            raise RuntimeError(
                "Trying to backward through the fused LM-head loss a second time: its gradients "
                "were "
                "freed by the first backward (use retain_graph=True, or compute the loss again)"
            )
        grad_h, grad_w, grad_b, scale = ctx.grads
        ctx.grads = None
        g = grad_loss * scale
        out_h = grad_h.mul_(g.to(grad_h.dtype)) if grad_h is not None else None
        out_w = (grad_w * g).to(ctx.w_dtype) if grad_w is not None else None
        out_b = (grad_b * g).to(ctx.b_dtype) if grad_b is not None else None
        return out_h, out_w, out_b, None, None, None


def _liger_fn():
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except Exception:  # liger is optional (GPU only); any import problem means "use the torch path"
        return None
    return LigerFusedLinearCrossEntropyFunction


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    num_items_in_batch=None,
    chunk_rows: int = 0,
    use_liger: bool = True,
) -> torch.Tensor:
    """Causal-LM loss of ``hidden @ weight.T + bias`` against ``labels`` without whole logits.

    hidden: (B, S, h); weight: (V, h); labels: (B, S) with -100 for ignored positions.
    """
    h2 = hidden.reshape(-1, hidden.shape[-1])  # (N, h)
    targets = shift_labels(labels.to(hidden.device))
    if num_items_in_batch is not None:
        denom = num_items_in_batch
        if isinstance(denom, torch.Tensor):
            denom = denom.to(hidden.device, torch.float32).clamp_min(1.0)
        else:
            denom = max(float(denom), 1.0)
    else:  # a device tensor: no CPU-GPU sync between the last layer and the loss
        denom = (targets != IGNORE_INDEX).sum().clamp_min(1).to(torch.float32)
    liger = _liger_fn() if (use_liger and hidden.is_cuda) else None
    if liger is not None:
        # positional: ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction,
        # softcap, return_z_loss, accum_dtype (fp32 accumulation of the head's weight gradient)
        out = liger.apply(
            h2,
            weight,
            targets,
            bias,
            None,
            IGNORE_INDEX,
            0.0,
            0.0,
            "sum",
            None,
            False,
            torch.float32,
        )
        loss = out[0] if isinstance(out, tuple) else out
        return loss / denom
    rows = chunk_rows or default_chunk_rows(weight.shape[0])
    return _ChunkedLinearCE.apply(h2, weight, bias, targets, denom, rows)


def fused_loss_parts(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """(decoder, LM head) when ``model`` is a Hugging Face causal LM (possibly wrapped by PEFT)
    whose loss is the decoder's hidden states through a plain linear head into cross-entropy; None
    otherwise (the model's own forward then runs: heads that do more than a matmul, LoRA on the
    head). The engine's fused loss and the planner's loss model both ask here."""
    # PEFT
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    name = type(base).__name__
    if not isinstance(head, nn.Linear) or not (
        name.endswith("ForCausalLM") or name.endswith("LMHeadModel")
    ):
        return None
    decoder = getattr(base, getattr(base, "base_model_prefix", ""), None)
    if not isinstance(decoder, nn.Module) or decoder is base:
        return None
    head_name = next((n for n, m in base.named_children() if m is head), None)
    if head_name is None or plain_lm_head(base, head_name, base.base_model_prefix) is not None:
        # the head does more than a matmul (soft-capping, logit scales), or another loss: own
        # forward
        return None
    return decoder, head
