"""The chunked LM-head cross-entropy equals the whole-logits loss, in value and gradients."""

import pytest
import torch
import torch.nn.functional as F

from megatrain_ds.model.loss import IGNORE_INDEX, linear_cross_entropy


def _reference(hidden, weight, bias, labels, num_items=None):
    logits = F.linear(hidden, weight, bias)  # fp64 in, fp64 reference
    shift = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        shift.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    denom = num_items if num_items is not None else (shift != IGNORE_INDEX).sum()
    return loss / denom


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("num_items", [None, 37])
def test_chunked_matches_whole_logits(with_bias, num_items):
    torch.manual_seed(0)
    B, S, H, V = 3, 11, 16, 50
    hidden = torch.randn(B, S, H, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, dtype=torch.float64, requires_grad=True) if with_bias else None
    labels = torch.randint(0, V, (B, S))
    labels[0, :4] = IGNORE_INDEX
    got = linear_cross_entropy(hidden, weight, bias, labels, num_items, chunk_rows=7)
    (got * 2.5).backward()  # a scaled loss: backward must scale the stored gradients
    grads = [t.grad.clone() for t in (hidden, weight, bias) if t is not None]
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    want = _reference(hidden, weight, bias, labels, num_items)
    (want * 2.5).backward()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    for g, t in zip(grads, [t for t in (hidden, weight, bias) if t is not None]):
        torch.testing.assert_close(g, t.grad, rtol=1e-9, atol=1e-12)


def test_whole_logits_never_exist():
    """Peak extra memory of the loss is one chunk of logits, not [tokens, vocab]."""
    # CPU tensors are not tracked by tracemalloc; count via the allocator
    import tracemalloc  # noqa: F401

    torch.manual_seed(0)
    N, H, V, rows = 512, 8, 4096, 32
    hidden = torch.randn(1, N, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    labels = torch.randint(0, V, (1, N))
    seen = []
    orig = F.linear

    def spy(x, w, b=None):
        out = orig(x, w, b)
        seen.append(out.shape[0])
        return out

    F.linear = spy
    try:
        linear_cross_entropy(hidden, weight, None, labels, chunk_rows=rows).backward()
    finally:
        F.linear = orig
    assert seen and max(seen) <= rows  # no logits tensor ever had more than one chunk of rows
