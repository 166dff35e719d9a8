"""``/_fake/*``: the test-only control API (faults, request log, state). Real engines lack it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException

from fakeengine.state import EngineState, Faults


def admin_router(state: EngineState) -> APIRouter:
    router = APIRouter(prefix="/_fake")

    @router.get("/fault")
    async def get_fault() -> dict[str, Any]:
        return state.faults.model_dump()

    @router.post("/fault")
    async def set_fault(update: Faults) -> dict[str, Any]:
        """Merge the given fields into the current faults; omitted fields keep their value. The
        answer is the fields set, as they now are (GET /_fake/fault shows every fault)."""
        outside = [rank for rank in update.hang_ranks if rank >= state.dp_size]
        if outside:
            raise HTTPException(
                422, f"hang_ranks {outside}: the engine has ranks [0, {state.dp_size})"
            )
        changed = update.model_fields_set
        return state.update_faults(update.model_dump(include=changed)).model_dump(include=changed)

    @router.post("/reset")
    async def reset() -> dict[str, Any]:
        return state.reset_faults().model_dump()

    @router.get("/requests")
    async def list_requests() -> list[dict[str, Any]]:
        return list(state.requests)

    @router.delete("/requests")
    async def clear_requests() -> dict[str, int]:
        cleared = len(state.requests)
        state.requests.clear()
        return {"cleared": cleared}

    @router.get("/state")
    async def get_state() -> dict[str, Any]:
        return state.snapshot()

    return router
