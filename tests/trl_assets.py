"""What TRL's published scripts need, built offline: a tokenizer with a chat template, tiny random
Qwen2 models, local datasets in TRL's conversational formats, and a reward function for GRPO/RLOO
(tests/integration/test_trl.py runs them).

    # writes OUT_DIR/{tokenizer-based models, data/*}, prints the paths
    python -m tests.trl_assets OUT_DIR

Tokenizer: byte-level BPE without merges (every byte one token, ids 0-255) plus the ChatML special
tokens, and a ChatML chat template with ``{% generation %}`` markers (TRL's assistant-only loss
reads them). Models: Qwen2, 2 layers, hidden 32, vocabulary 272 (the tokenizer's 259 rounded up),
untied head; a causal LM (SFT/DPO/GRPO/RLOO) and a sequence classifier with one label (the reward
trainer). Data: JSON lines a ``--dataset_name <dir>`` finds (``load_dataset`` on a folder:
``train.jsonl`` and ``test.jsonl`` become the splits).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# ---- sizes ---------------------------------------------------------------------------------------
HIDDEN = 32  # model width
LAYERS = 2  # decoder layers
VOCAB = 272  # model vocabulary (>= the tokenizer's 259 tokens)
TRAIN_ROWS = 48  # rows per training split
TEST_ROWS = 8  # rows per test split

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% "
    "endgeneration %}"
    "{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' "
    "}}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

WORDS = (
    "red green blue cat dog bird one two three sun moon star tree leaf rock sea sky rain snow wind "
    "fire "
    "apple bread milk salt"
).split()


def write_tokenizer(path: Path) -> None:
    """A byte-level tokenizer (ids 0-255 the bytes, then the special tokens) with a ChatML chat
    template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = 256
    tok.save_pretrained(path)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer maps bytes
    through."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def write_models(root: Path, tokenizer_dir: Path) -> dict[str, Path]:
    """``root/lm`` (Qwen2ForCausalLM) and ``root/rm`` (Qwen2ForSequenceClassification, one label),
    seeded, each with the tokenizer beside it (from_pretrained of the folder finds both)."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    out = {}
    for name, cls, extra in (
        ("lm", transformers.Qwen2ForCausalLM, {}),
        ("rm", transformers.Qwen2ForSequenceClassification, {"num_labels": 1}),
    ):
        torch.manual_seed(0)
        model = cls(transformers.Qwen2Config(**config.to_dict(), **extra))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.eos_token_id = tok.eos_token_id
            model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = root / name
    return out


def _phrase(rng, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _rows(kind: str, count: int, seed: int) -> list[dict]:
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        prompt = [{"role": "user", "content": _phrase(rng, rng.randint(2, 5))}]
        answer = _phrase(rng, rng.randint(2, 6))
        if kind == "sft":  # conversational language modeling
            rows.append({"messages": prompt + [{"role": "assistant", "content": answer}]})
        elif kind == "preference":  # conversational preference, explicit prompt
            worse = _phrase(rng, rng.randint(1, 4))
            rows.append(
                {
                    "prompt": prompt,
                    "chosen": [{"role": "assistant", "content": answer}],
                    "rejected": [{"role": "assistant", "content": worse}],
                }
            )
        elif kind == "prompt":  # conversational prompt-only (GRPO, RLOO)
            rows.append({"prompt": prompt})
        else:
            raise ValueError(kind)
    return rows


def write_datasets(root: Path) -> dict[str, Path]:
    """``root/{sft,preference,prompt}/{train,test}.jsonl``; returns the folders."""
    out = {}
    for seed, kind in enumerate(("sft", "preference", "prompt")):
        folder = root / kind
        folder.mkdir(parents=True, exist_ok=True)
        for split, count in (("train", TRAIN_ROWS), ("test", TEST_ROWS)):
            rows = _rows(kind, count, seed=10 * seed + (split == "test"))
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        out[kind] = folder
    return out


def char_code_reward(completions, **kwargs) -> list[float]:
    """GRPO/RLOO reward (``--reward_funcs tests.trl_assets.char_code_reward``): the mean of (code
    point mod 16) / 15 over the completion's characters. Deterministic in the text (equal
    completions, equal rewards in both engines) and spread out for a random model's byte soup, so
    every group has a nonzero advantage and a gradient."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ord(ch) % 16 for ch in t) / (15 * len(t)) if t else 0.0 for t in texts]


def write_all(root: Path) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    write_tokenizer(root / "tokenizer")
    return {**write_models(root, root / "tokenizer"), **write_datasets(root / "data")}


if __name__ == "__main__":
    for key, value in write_all(Path(sys.argv[1])).items():
        print(key, value)
