"""Request bodies the fake engine understands; unknown fields are accepted like real engines do."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fakeengine.state import count_text_tokens

DEFAULT_MAX_TOKENS = 16
MEDIA_PART_TYPES = frozenset({"image_url", "input_image", "image", "audio_url", "input_audio"})


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class OpenAIRequest(_Lenient):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions`` on every backend."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    ignore_eos: bool = False
    stream: bool = False
    request_id: str | None = None
    return_token_ids: bool = False
    # vLLM NixlConnector
    kv_transfer_params: dict[str, Any] | None = None
    # TensorRT-LLM
    disaggregated_params: dict[str, Any] | None = None
    # SGLang
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


class CompletionRequest(OpenAIRequest):
    prompt: str | list[int]

    def prompt_tokens(self) -> int:
        return _count(self.prompt)

    def wanted_tokens(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS


class ChatMessage(_Lenient):
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = self.content or []
        return " ".join(str(part.get("text", "")) for part in parts if part.get("type") == "text")

    def media_parts(self) -> int:
        if not isinstance(self.content, list):
            return 0
        return sum(1 for part in self.content if part.get("type") in MEDIA_PART_TYPES)


class ChatRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def prompt_tokens(self) -> int:
        text = " ".join(message.text() for message in self.messages)
        return count_text_tokens(text) + self.media_parts()

    def media_parts(self) -> int:
        return sum(message.media_parts() for message in self.messages)

    def media_items(self) -> list[dict[str, Any]]:
        """The media content parts, in order."""
        return [
            part
            for message in self.messages
            if isinstance(message.content, list)
            for part in message.content
            if part.get("type") in MEDIA_PART_TYPES
        ]

    def wanted_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS


class SamplingParams(_Lenient):
    max_new_tokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=0)
    temperature: float | None = None
    ignore_eos: bool = False


class GenerateRequest(_Lenient):
    """SGLang native ``/generate``."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    rid: str | None = None
    stream: bool = False
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    # GenerateReqInput.data_parallel_rank: "for data parallel rank routing".
    data_parallel_rank: int | None = None

    def prompt_tokens(self) -> int:
        if self.input_ids is not None:
            return len(self.input_ids)
        return count_text_tokens(self.text or "")


class LlamaCompletionRequest(_Lenient):
    """llama.cpp native ``/completion``."""

    prompt: str | list[int]
    n_predict: int = Field(default=DEFAULT_MAX_TOKENS, ge=-1)
    stream: bool = False

    def prompt_tokens(self) -> int:
        return _count(self.prompt)

    def wanted_tokens(self) -> int:
        return DEFAULT_MAX_TOKENS if self.n_predict < 0 else self.n_predict


def _count(prompt: str | list[int]) -> int:
    if isinstance(prompt, list):
        return len(prompt)
    return count_text_tokens(prompt)
