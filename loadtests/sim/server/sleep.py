"""vLLM's sleep mode on the simulated engine: ``POST /sleep?level=N``, ``POST
/wake_up`` and ``GET /is_sleeping``, as vLLM serves them with
``VLLM_SERVER_DEV_MODE=1`` and ``--enable-sleep-mode``.

Each takes the time the profile's :class:`~loadtests.sim.profile.Activation` says
(model seconds, so ``--time-scale`` shortens it). Asleep, or on the way to sleep or
back, the engine answers a completion request 503 (vLLM, asleep, has nothing to run
it on); ``/sleep`` with requests in the engine is refused with 409 (the proxy drains
a model before it puts it to sleep, and a test that forgets should hear so). Either
level drops the KV cache, so the prefix cache is empty after a wake. One transition
at a time: a second ``/sleep`` or ``/wake_up`` waits for the first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from loadtests.sim.profile import Activation
from loadtests.sim.server.errors import APIError
from loadtests.sim.step_loop import SimEngine
from proxy.clock import WallClock


@dataclass
class SleepMode:
    """The engine's sleep state: ``level`` 0 awake, 1 or 2 asleep; ``moving`` while a
    transition runs (the engine serves nothing then)."""

    engine: SimEngine
    clock: WallClock
    activation: Activation
    level: int = 0
    moving: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def serving(self) -> bool:
        return self.level == 0 and not self.moving

    def check_serving(self) -> None:
        """Raise the 503 a request gets while the engine is not awake."""
        if not self.serving:
            state = "going to sleep or waking" if self.moving else f"asleep (level {self.level})"
            raise APIError(
                f"The engine is {state}; it serves nothing until POST /wake_up has answered.",
                status=HTTPStatus.SERVICE_UNAVAILABLE,
            )

    async def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise APIError("level must be 1 or 2", param="level")
        async with self.lock:
            if self.level:
                return  # asleep already
            if self.engine.has_unfinished_requests:
                raise APIError(
                    "Requests are in the engine; let them finish before it sleeps.",
                    status=HTTPStatus.CONFLICT,
                )
            await self._take(self.activation.sleep_s(level))
            self.engine.scheduler.kv.reset_prefix_cache()
            self.level = level

    async def wake_up(self) -> None:
        async with self.lock:
            if not self.level:
                return
            await self._take(self.activation.wake_s(self.level))
            self.level = 0

    async def _take(self, model_s: float) -> None:
        self.moving = True
        try:
            await asyncio.sleep(self.clock.to_wall(model_s))
        finally:
            self.moving = False


def install_sleep_routes(app: FastAPI, mode_of: Callable[[Request], SleepMode]) -> None:
    """The three routes on ``app``; ``mode_of(request)`` gives the running engine's
    :class:`SleepMode`."""
    get_mode = mode_of

    async def sleep(request: Request) -> Response:
        raw = request.query_params.get("level", "1")
        try:
            level = int(raw)
        except ValueError:
            raise APIError("level must be 1 or 2", param="level") from None
        await get_mode(request).sleep(level)
        return Response(status_code=200)

    async def wake_up(request: Request) -> Response:
        await get_mode(request).wake_up()
        return Response(status_code=200)

    async def is_sleeping(request: Request) -> JSONResponse:
        return JSONResponse({"is_sleeping": get_mode(request).level > 0})

    app.add_api_route("/sleep", sleep, methods=["POST"])
    app.add_api_route("/wake_up", wake_up, methods=["POST"])
    app.add_api_route("/is_sleeping", is_sleeping, methods=["GET"])
