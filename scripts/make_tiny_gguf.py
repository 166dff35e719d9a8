#!/usr/bin/env python3
"""Write a random-weight llama-architecture GGUF model for llama.cpp's ``llama-server``.

The weights are random F32 values, so the text is gibberish, but the server does
real inference with them: tokenisation, prompt processing, sampling, metrics and
the ``/health`` loading phase all behave as with a real model.

- default shape (n_embd 64, 2 layers, ff 128): about 0.5 MB, written in < 1 s,
  server ready about 0.1 s after launch;
- ``--embd 1024 --layers 12 --ff 4096``: about 800 MB, written in a few seconds;
  ``llama-server --load-mode dio`` then answers ``/health`` 503 "Loading model"
  for about 1.4 s.

The tokenizer is the byte-level BPE one from ``make_tiny_model.py`` (stored as
``tokenizer.ggml.model=gpt2``, ``pre=gpt-2``) together with a chat template, so
both ``/v1/completions`` and ``/v1/chat/completions`` work.

Usage: ``make_tiny_gguf.py OUT [--embd N --layers N --ff N --heads N --seed N]``
(needs ``gguf==0.19.0``, ``tokenizers`` and ``numpy``).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt
from make_tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer

BOS, EOS, PAD = SPECIAL_TOKENS


@dataclass(frozen=True)
class Shape:
    """Hyper-parameters of the random llama model."""

    n_embd: int = 64
    n_layer: int = 2
    n_ff: int = 128
    n_head: int = 4
    n_ctx: int = 2048

    def validate(self) -> None:
        if min(self.n_embd, self.n_layer, self.n_ff, self.n_head, self.n_ctx) <= 0:
            raise ValueError(f"all dimensions must be positive: {self}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")


@dataclass(frozen=True)
class Vocab:
    """Token list, merges and special-token ids in the form GGUF stores them."""

    tokens: list[str]
    merges: list[str]
    ids: dict[str, int]


def load_vocab() -> Vocab:
    """Train the shared tiny tokenizer and convert it to GGUF's gpt2 representation."""
    data = json.loads(build_tokenizer().to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda item: item[1])]
    if [vocab[tok] for tok in tokens] != list(range(len(tokens))):
        raise RuntimeError("tokenizer ids are not contiguous")
    # tokenizers >= 0.20 stores merges as pairs, older versions as "a b" strings.
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return Vocab(tokens=tokens, merges=merges, ids={name: vocab[name] for name in SPECIAL_TOKENS})


def write_gguf(out: Path, shape: Shape, seed: int = 0) -> None:
    """Write the model to ``out`` atomically (temporary file in the same directory)."""
    shape.validate()
    vocab = load_vocab()
    n_vocab = len(vocab.tokens)
    rng = np.random.default_rng(seed)

    def rand(*dims: int) -> npt.NDArray[np.float32]:
        arr = rng.standard_normal(dims, dtype=np.float32)
        arr *= np.float32(0.02)
        return arr

    def ones(n: int) -> npt.NDArray[np.float32]:
        return np.ones(n, dtype=np.float32)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    try:
        writer.add_name("tiny-random-llama")
        writer.add_context_length(shape.n_ctx)
        writer.add_embedding_length(shape.n_embd)
        writer.add_block_count(shape.n_layer)
        writer.add_feed_forward_length(shape.n_ff)
        writer.add_head_count(shape.n_head)
        writer.add_head_count_kv(shape.n_head)
        writer.add_rope_dimension_count(shape.n_embd // shape.n_head)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_rope_freq_base(10000.0)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)

        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(vocab.tokens)
        writer.add_token_types(
            [
                gguf.TokenType.CONTROL if tok in SPECIAL_TOKENS else gguf.TokenType.NORMAL
                for tok in vocab.tokens
            ]
        )
        writer.add_token_merges(vocab.merges)
        writer.add_bos_token_id(vocab.ids[BOS])
        writer.add_eos_token_id(vocab.ids[EOS])
        writer.add_pad_token_id(vocab.ids[PAD])
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)

        writer.add_tensor("token_embd.weight", rand(n_vocab, shape.n_embd))
        writer.add_tensor("output_norm.weight", ones(shape.n_embd))
        writer.add_tensor("output.weight", rand(n_vocab, shape.n_embd))
        for i in range(shape.n_layer):
            blk = f"blk.{i}."
            writer.add_tensor(blk + "attn_norm.weight", ones(shape.n_embd))
            for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
                writer.add_tensor(f"{blk}{name}.weight", rand(shape.n_embd, shape.n_embd))
            writer.add_tensor(blk + "ffn_norm.weight", ones(shape.n_embd))
            writer.add_tensor(blk + "ffn_gate.weight", rand(shape.n_ff, shape.n_embd))
            writer.add_tensor(blk + "ffn_up.weight", rand(shape.n_ff, shape.n_embd))
            writer.add_tensor(blk + "ffn_down.weight", rand(shape.n_embd, shape.n_ff))

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    defaults = Shape()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="GGUF file to write")
    parser.add_argument("--embd", type=int, default=defaults.n_embd, help="embedding size")
    parser.add_argument("--layers", type=int, default=defaults.n_layer, help="block count")
    parser.add_argument("--ff", type=int, default=defaults.n_ff, help="feed-forward size")
    parser.add_argument("--heads", type=int, default=defaults.n_head, help="attention heads")
    parser.add_argument("--seed", type=int, default=0, help="random seed for the weights")
    args = parser.parse_args(argv)
    shape = Shape(n_embd=args.embd, n_layer=args.layers, n_ff=args.ff, n_head=args.heads)
    try:
        write_gguf(args.out, shape, seed=args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes, {shape})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
