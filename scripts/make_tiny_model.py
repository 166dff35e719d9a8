#!/usr/bin/env python3
"""Write a tiny Hugging Face-style model directory (tokenizer + config, no weights).

The NVIDIA Dynamo mocker worker and frontend only read the tokenizer and a few
config values, so a directory with these files is enough for them to serve
``/v1/completions`` and ``/v1/chat/completions`` without any hub access:

- ``config.json``: llama-like shape (the mocker estimates KV bytes from it),
- ``tokenizer.json``: a byte-level BPE tokenizer trained locally (~365 tokens),
- ``tokenizer_config.json``: must contain a ``chat_template``; without it the
  Dynamo frontend never materialises the model,
- ``generation_config.json`` and ``special_tokens_map.json``.

The tokenizer built here is also reused by ``make_tiny_gguf.py`` so both engines
see the same vocabulary.

Usage: ``make_tiny_model.py OUT_DIR`` (needs the ``tokenizers`` package).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

#: Special tokens, in id order: bos = 0, eos = 1, pad = 2.
SPECIAL_TOKENS: tuple[str, str, str] = ("<s>", "</s>", "<pad>")
BOS, EOS, PAD = SPECIAL_TOKENS

#: Minimal Jinja chat template: "role: content" lines, then "assistant: ".
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

_CORPUS: tuple[str, ...] = (
    "hello world this is a tiny tokenizer for canary health checks",
    "the quick brown fox jumps over the lazy dog 0123456789",
    "ping pong ok yes no user assistant system",
)


def build_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Train a deterministic byte-level BPE tokenizer on a fixed tiny corpus.

    Every byte is in the initial alphabet, so any input text can be encoded.
    The special tokens get ids 0, 1 and 2.
    """
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) * 50, trainer)
    return tok


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def write_model_dir(out: Path) -> None:
    """Write the tokenizer and config files of the tiny model into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    ids = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}

    _write_json(
        out / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": tok.get_vocab_size(),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "torch_dtype": "float16",
            "bos_token_id": ids[BOS],
            "eos_token_id": ids[EOS],
            "pad_token_id": ids[PAD],
            "tie_word_embeddings": True,
        },
    )
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "model_max_length": 2048,
            "add_bos_token": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS]},
    )
    _write_json(
        out / "special_tokens_map.json",
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write (created if missing)")
    args = parser.parse_args(argv)
    write_model_dir(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
