"""OpenAI-style completions, as every HTTP engine's API and the transfer probe speak them: the
body of a greedy token-id completion, and the checks of its answer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sidecar.probes.base import PROMPT_TOKEN_IDS
from sidecar.probes.exchange import engine_said


def token_completion_body(
    model: str | None, max_tokens: int, prompt: Sequence[int] = PROMPT_TOKEN_IDS
) -> dict[str, Any]:
    """A greedy OpenAI-style completion of a token-id prompt (the canary's unless given) that
    generates exactly ``max_tokens`` tokens (vLLM, TensorRT-LLM)."""
    return {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": False,
    }


def body_error(answer: dict[str, Any]) -> str | None:
    """The error an OpenAI-style JSON body carries, or None."""
    error = answer.get("error")
    if error is None or error == {}:
        return None
    if isinstance(error, dict):
        return engine_said(error.get("message") or error)
    return engine_said(error)


def completion_problem(
    answer: Any, expected_tokens: int | None, *, exact: bool = True
) -> str | None:
    """Check an OpenAI-style completion: a choice with a finish reason and, when reported, the
    number of generated tokens (exactly ``expected_tokens`` when ``exact``, else at most)."""
    if not isinstance(answer, dict):
        return "body is not a JSON object"
    if (err := body_error(answer)) is not None:
        return f"engine error in body: {err}"
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return "no choices in body"
    finish = choices[0].get("finish_reason")
    if not isinstance(finish, str) or not finish:
        return "no finish_reason in first choice"
    if exact and finish != "length":
        return f"finish_reason {finish!r}, expected 'length'"
    usage = answer.get("usage")
    if expected_tokens is not None and isinstance(usage, dict) and "completion_tokens" in usage:
        got = usage["completion_tokens"]
        if not isinstance(got, int) or got < 0:
            return f"usage.completion_tokens {got!r} is not a count"
        if (exact and got != expected_tokens) or got > expected_tokens:
            return f"usage.completion_tokens {got}, expected {expected_tokens}"
    return None


def generic_problem(answer: Any) -> str | None:
    """Shape check for a user-supplied payload's answer: JSON, no error, and a finish reason
    wherever the engine's answer shape has one."""
    if not isinstance(answer, dict):
        return "body is not a JSON object"
    if (err := body_error(answer)) is not None:
        return f"engine error in body: {err}"
    if "choices" in answer:
        return completion_problem(answer, None, exact=False)
    meta = answer.get("meta_info")
    if isinstance(meta, dict) and not meta.get("finish_reason"):
        return "no meta_info.finish_reason in body"
    return None
