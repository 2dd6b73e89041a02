"""Greedy generation with the inference cache under data parallel (tests/engine/test_generate.py): 2
ranks, gloo.

Every rank generates from the same prompt with ``megatrain.inference_cache: true``: each layer comes
from its owner's upload by broadcast, once per version (not once per token), and the tokens and
logits equal a plain PyTorch copy of the model; after a training step (each rank its own batch) the
next generate uses the new weights. The model is tests/models.py's PlainLM and the loop a plain
greedy one (K no-grad forwards of the growing sequence, as ``generate()`` without a KV cache):
importing transformers would double the test's time. Each rank writes ``OUT/rank{R}.json``.
"""

import argparse
import copy
import json
import os
from pathlib import Path

os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatrain_ds  # noqa: E402
from tests.models import PlainLM  # noqa: E402

K, VOCAB = 5, 64


def generate(model, ids):
    """K greedy tokens and the logits they were chosen from ([K, batch, vocab])."""
    logits = []
    with torch.no_grad():
        for _ in range(K):
            logits.append(model(ids)[:, -1].float())
            ids = torch.cat([ids, logits[-1].argmax(-1, keepdim=True)], dim=1)
    return ids, torch.stack(logits)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model = PlainLM(vocab=VOCAB, width=32, depth=3)
    plain = copy.deepcopy(model).eval()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "megatrain": {"inference_cache": True, "keep_activations": 0, "gpu_optimizer_layers": 0},
    }
    engine, *_ = megatrain_ds.initialize(model=model, config=config)
    rank = dist.get_rank()
    ids = torch.tensor([[5, 17, 42, 9], [3, 1, 60, 7]])
    ex = engine.executor
    report = {"rank": rank, "world": dist.get_world_size()}
    tokens, logits = generate(engine.module, ids)
    want_tokens, want_logits = generate(plain, ids)
    report["first"] = {
        "same_tokens": tokens.tolist() == want_tokens.tolist(),
        "max_logit_diff": float((logits - want_logits).abs().max()),
        "loads": {d: list(v) for d, v in ex.h2d_loads.items()},
    }
    batch = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(10 + rank))
    logits = engine(batch)
    engine.backward(
        torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1)
        )
    )
    engine.step()
    tokens, logits = generate(engine.module, ids)
    plain.load_state_dict(engine.master_state_dict())  # a collective: every rank calls it
    want_tokens, want_logits = generate(plain, ids)
    report["after_step"] = {
        "same_tokens": tokens.tolist() == want_tokens.tolist(),
        "max_logit_diff": float((logits - want_logits).abs().max()),
        "loads": {d: list(v) for d, v in ex.h2d_loads.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    engine.destroy()
    dist.barrier()


if __name__ == "__main__":
    main()
