"""Tiny model factories shared by the tests (random init, no downloads)."""

import torch
from torch import nn


def tiny_hf(arch: str, tied: bool = True, layers: int = 3, seed: int = 0) -> nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=256, tie_word_embeddings=tied)
    if arch == "llama":
        cfg = tf.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            **common,
        )
        return tf.LlamaForCausalLM(cfg)
    if arch == "qwen2":
        cfg = tf.Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            **common,
        )
        return tf.Qwen2ForCausalLM(cfg)
    if arch == "qwen3":
        cfg = tf.Qwen3Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            head_dim=16,
            num_attention_heads=4,
            num_key_value_heads=2,
            **common,
        )
        return tf.Qwen3ForCausalLM(cfg)
    if arch == "mistral":
        cfg = tf.MistralConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            **common,
        )
        return tf.MistralForCausalLM(cfg)
    if arch == "gpt2":
        cfg = tf.GPT2Config(
            n_embd=64,
            n_layer=layers,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
        return tf.GPT2LMHeadModel(cfg)
    raise ValueError(arch)


class PlainBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class PlainLM(nn.Module):
    """A plain nn.Module LM: embedding, an nn.ModuleList of blocks, a head; returns logits."""

    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 3, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(PlainBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def token_batches(n: int, seed: int = 1, shape=(2, 12), vocab: int = 256) -> list[torch.Tensor]:
    """``n`` seeded batches of random token ids (the tiny models' vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, shape, generator=g) for _ in range(n)]


def train_lm(engine, batches) -> list[float]:
    """One forward/backward/step per batch (labels = inputs); the losses."""
    losses = []
    for ids in batches:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses
