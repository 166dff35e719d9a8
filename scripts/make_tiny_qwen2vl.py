#!/usr/bin/env python3
"""Write a tiny random-weight Qwen2-VL (an image-to-text model) as a Hugging Face model directory,
for a real SGLang encoder (SGLang 0.5.23's ``--encoder-only``, the E of its EPD disaggregation).

SGLang's encoder serves only the vision models it knows; Qwen2-VL is the smallest of them to
build from scratch. Nothing is downloaded. ``Qwen2VLForConditionalGeneration`` of:

- a Qwen2-VL vision tower: embed_dim 32, 1 block, 2 heads of 16, mlp_ratio 2, patches of 14
  (temporal patch 2), spatial merge 2; its merger projects onto the text width (128). The image
  processor keeps every image between 28 x 28 and 112 x 112 pixels, so the 32 x 32 PNG of
  SGLang's ``/health`` becomes 2 x 2 patches, merged into 1 image token: a 1 x 128 float32
  embedding;
- a Qwen2 text model: hidden 128, 1 layer, 2 heads of 64 (2 KV heads), intermediate 256, tied
  embeddings, M-RoPE with ``mrope_section`` [8, 12, 12] (half of head_dim). The encoder never
  runs it; a language server would;

seed 0, float32, about 1.3 MB. The tokenizer is ``make_tiny_hf_model.py``'s byte-level BPE with
Qwen2-VL's special tokens ``<|im_start|>``, ``<|im_end|>``, ``<|vision_start|>``,
``<|vision_end|>``, ``<|image_pad|>`` and ``<|video_pad|>`` (ids 512-517); the chat template is
Qwen's, with ``<|vision_start|><|image_pad|><|vision_end|>`` for every image item. The processor
is ``Qwen2VLProcessor`` with the PIL image processor and Qwen2-VL's video processor (which
imports torchvision: run this with the SGLang site directory on ``PYTHONPATH``).

Two fields are added to the saved ``config.json`` for SGLang, which reads the names of the
original Qwen2-VL checkpoints: ``vision_config.in_chans`` (its ``Qwen2VisionTransformer``;
transformers 5 writes only ``in_channels``) and a top-level ``rope_scaling`` with the
``mrope_section`` (its Qwen2-VL text model). transformers 5's weight names
(``model.visual.*``, ``model.language_model.*``) load in SGLang as they are.

Usage: ``make_tiny_qwen2vl.py OUT_DIR`` with a python that has torch, torchvision, transformers
5, tokenizers, safetensors and pillow (scripts/prepare_engines.sh runs it with the SGLang venv's
python and its encoder site directory).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_tiny_hf_model import SEED, SPECIAL_TOKENS, build_tokenizer  # the directory above

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    IM_START,
    IM_END,
    VISION_START,
    VISION_END,
    IMAGE_PAD,
    VIDEO_PAD,
)

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
MIN_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2  # 28 x 28: one image token
MAX_PIXELS = (PATCH_SIZE * MERGE_SIZE * 4) ** 2  # 112 x 112: at most 16 image tokens
VISION_HIDDEN = 32
TEXT_HIDDEN = 128
HEAD_DIM = 64
MROPE_SECTION = [8, 12, 12]  # sums to HEAD_DIM // 2
IMAGE_ITEM = VISION_START + IMAGE_PAD + VISION_END  # the processor repeats the pad per token
VIDEO_ITEM = VISION_START + VIDEO_PAD + VISION_END
CHAT_TEMPLATE = (
    "{% for m in messages %}" + IM_START + "{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}" + IMAGE_ITEM + "{% elif part['type'] in "
    "('video', 'video_url') %}" + VIDEO_ITEM + "{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}" + IM_END + "\n{% endfor %}"
    "{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}"
)


def save_processor(out: Path) -> dict[str, int]:
    """The tokenizer (with Qwen2-VL's special tokens), the image and video processors and the
    processor, with the chat template; the special tokens' ids and the vocabulary size."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast, Qwen2VLProcessor, Qwen2VLVideoProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    backend = build_tokenizer()
    backend.add_special_tokens(
        [AddedToken(token, normalized=False, special=True) for token in QWEN_SPECIAL_TOKENS]
    )
    bos, eos, pad = SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        extra_special_tokens={"image_token": IMAGE_PAD, "video_token": VIDEO_PAD},
        model_max_length=2048,
    )
    shape: dict[str, Any] = {
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
    }
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(**shape),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**shape),
        chat_template=CHAT_TEMPLATE,
    )
    out.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(out)
    tokenizer.chat_template = CHAT_TEMPLATE  # also where a tokenizer-only reader looks
    tokenizer.save_pretrained(out)
    names = (*SPECIAL_TOKENS, *QWEN_SPECIAL_TOKENS)
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in names}
    ids["vocab"] = len(tokenizer)
    return ids


def sglang_config_fields(out: Path, rope: dict[str, Any]) -> None:
    """Add the config fields SGLang reads under the original checkpoints' names."""
    path = out / "config.json"
    saved = json.loads(path.read_text())
    saved["vision_config"]["in_chans"] = saved["vision_config"]["in_channels"]
    saved.setdefault("rope_scaling", {**rope, "type": "mrope"})
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def write_model_dir(out: Path) -> None:
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = save_processor(out)
    bos, _, pad = SPECIAL_TOKENS
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE_SECTION}
    text = {
        "vocab_size": ids["vocab"],
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": 2 * TEXT_HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": TEXT_HIDDEN // HEAD_DIM,
        "num_key_value_heads": TEXT_HIDDEN // HEAD_DIM,
        "max_position_embeddings": 2048,
        "max_window_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_parameters": rope,
        "bos_token_id": ids[bos],
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[pad],
        "tie_word_embeddings": True,
    }
    vision = {
        "depth": 1,
        "embed_dim": VISION_HIDDEN,
        "hidden_size": TEXT_HIDDEN,  # the merger's output: the text width
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "in_channels": 3,
        "hidden_act": "quick_gelu",
    }
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    sglang_config_fields(out, rope)
    for path in out.iterdir():
        if path.is_file():
            path.chmod(0o644)  # readable by an engine in a container that mounts the directory
    params = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(
        f"wrote {out}: Qwen2-VL, {params} parameters, {size / 1e6:.1f} MB; vocab {ids['vocab']}, "
        f"{IMAGE_PAD} = id {ids[IMAGE_PAD]}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write (created if missing)")
    args = parser.parse_args(argv)
    write_model_dir(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
