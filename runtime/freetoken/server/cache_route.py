"""POST /v1/cache: resize the KV pool, the recurrent-state pool (hybrid models) and the expert
cache of a running server (`ft ctl cache`).

The resize waits for the step in flight, checks the new plan against free memory and swaps the
pools between two steps; a plan that does not fit is a 409 with the numbers, and the old pools
keep serving. The reply is the new pool stats.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from freetoken.server.errors import APIError
from freetoken.server.protocol import Strict, parse_body


class CacheResizeRequest(Strict):
    kv: int | None = Field(None, ge=1, description="KV pool size in tokens")
    moe: float | None = Field(None, gt=0.0, le=1.0,
                              description="expert cache rate: fraction of every expert on the GPU")
    states: int | None = Field(None, ge=1, description="recurrent-state slots (hybrid models)")
    wait: float = Field(0.0, ge=0.0, le=3600.0,
                        description="seconds to wait for requests holding KV pages or state "
                                    "slots past a shrunk pool's end")


def create_cache_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/cache")
    async def resize(request: Request) -> JSONResponse:
        from freetoken.engine.engine import EngineDead
        from freetoken.engine.live_resize import ResizeBusy
        from freetoken.engine.memory_plan import MemoryPlanError

        body = await parse_body(request, CacheResizeRequest)
        if body.kv is None and body.moe is None and body.states is None:
            raise APIError(400, "pass kv (tokens), moe (cache rate) and/or states (slots) to "
                                "resize", "kv")
        engine = request.app.state.ctx.engine
        try:
            stats = await asyncio.to_thread(engine.resize_pools, body.kv, body.moe, body.wait,
                                            body.states)
        except (MemoryPlanError, ResizeBusy) as exc:
            raise APIError(409, str(exc), _field(str(exc)) if isinstance(exc, ResizeBusy)
                           else None) from None
        except EngineDead as exc:
            raise APIError(503, str(exc)) from None
        except ValueError as exc:
            raise APIError(400, str(exc), _field(str(exc))) from None
        return JSONResponse(stats)

    return router


def _field(message: str) -> str:
    """The body field an engine refusal is about."""
    if "--states" in message or "state slots" in message:
        return "states"
    return "moe" if "--moe" in message or "expert" in message else "kv"
