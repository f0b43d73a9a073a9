"""Waking an engine on a card and putting it to sleep: the engine-side action of a
swap (:mod:`proxy.scheduler.residency` decides when).

- **Sleep mode** (``activation: {sleep_level: N}``): ``POST /sleep?level=N`` and
  ``POST /wake_up`` on vLLM started with ``--enable-sleep-mode`` (the routes are
  served with ``VLLM_SERVER_DEV_MODE=1``); the process stays, its card memory is
  freed (level 1 keeps the weights in CPU memory, level 2 drops them).
- **Commands** (``activation: {start: CMD, stop: CMD}``): ``start`` is run with
  ``sh -c`` in a process group of its own (in the proxy's session) and left
  running (it may be the engine itself, ``vllm serve ...``, or a command that
  starts one elsewhere); the engine is awake
  once its ``/health`` answers. ``stop`` is run to its end; without one the process
  group ``start`` began is sent SIGTERM (SIGKILL after :data:`STOP_GRACE_S`). Either
  way the engine is asleep once its ``/health`` no longer answers.

A wake that does not finish within :data:`WAKE_LIMIT_S` (or a start command that
exits first) raises :class:`ActivationFailed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

from proxy.config import Activation
from proxy.engines._client import EngineClient
from proxy.engines._exceptions import UpstreamError

logger = logging.getLogger(__name__)

WAKE_LIMIT_S = 900.0  # a cold vLLM start on a CPU (compilation, weights) takes minutes
STOP_GRACE_S = 30.0
POLL_S = 0.2
HEALTH_LIMIT_S = 2.0


class ActivationFailed(Exception):
    """An engine could not be woken or put to sleep."""


class Activator:
    """Puts one engine on a card to sleep and wakes it (see the module docstring)."""

    def __init__(
        self,
        engine: EngineClient,
        activation: Activation,
        wake_limit_s: float = WAKE_LIMIT_S,
        poll_s: float = POLL_S,
    ) -> None:
        self.engine = engine
        self.activation = activation
        self.wake_limit_s = wake_limit_s
        self.poll_s = poll_s
        self.process: asyncio.subprocess.Process | None = None  # what ``start`` began

    @property
    def name(self) -> str:
        return self.engine.name

    async def awake(self) -> bool:
        """Whether the engine serves now: answering and, under sleep mode, not asleep."""
        if not await self.engine.health(HEALTH_LIMIT_S):
            return False
        if self.activation.by_command:
            return True
        try:
            return not await self.engine.is_sleeping()
        except UpstreamError as exc:
            logger.warning("engine %s: cannot tell whether it sleeps: %s", self.name, exc)
            return False

    async def sleep(self) -> None:
        """Put the engine to sleep (stop it); returns once it is."""
        a = self.activation
        if not a.by_command:
            try:
                await self.engine.sleep(a.sleep_level, self.wake_limit_s)
            except UpstreamError as exc:
                raise ActivationFailed(f"engine {self.name}: sleep failed: {exc}") from exc
            return
        if a.stop:
            code = await _run(a.stop)
            if code != 0:
                raise ActivationFailed(f"engine {self.name}: stop command exited {code}")
        else:
            await self._terminate()
        await self._until(False, "stop answering its health check")

    async def wake(self) -> None:
        """Wake the engine (start it); returns once it serves."""
        a = self.activation
        if not a.by_command:
            try:
                await self.engine.wake_up(self.wake_limit_s)
            except UpstreamError as exc:
                raise ActivationFailed(f"engine {self.name}: wake_up failed: {exc}") from exc
            await self._until(True, "serve after its wake_up")
            return
        if self.process is None or self.process.returncode is not None:
            # a process group of its own (stopped whole), in the proxy's session: a new
            # session is a new scheduling group under the kernel's autogroup, and vLLM's
            # engine core busy-waits, starving the other groups (docs/real-vllm.md)
            # (``preexec_fn``: uvloop knows no ``process_group``)
            self.process = await asyncio.create_subprocess_shell(a.start, preexec_fn=os.setpgrp)
        await self._until(True, "answer its health check after its start command")

    async def close(self) -> None:
        """The proxy stops: a process ``start`` began and still running is stopped
        (returns once the engine no longer answers, or after :data:`STOP_GRACE_S`)."""
        if self.process is not None and self.process.returncode is None:
            if self.activation.stop:
                await _run(self.activation.stop)
            await self._terminate()
            with contextlib.suppress(ActivationFailed):
                await self._until(False, "stop answering", STOP_GRACE_S)

    async def _until(self, awake: bool, what: str, limit_s: float | None = None) -> None:
        """Poll until the engine is ``awake`` (or not); :class:`ActivationFailed` past
        the limit (``limit_s``, else the wake's), or when the process ``start`` began
        has exited during a wake."""
        loop = asyncio.get_running_loop()
        limit_s = self.wake_limit_s if limit_s is None else limit_s
        deadline = loop.time() + limit_s
        while await self.awake() != awake:
            process = self.process
            if awake and process is not None and process.returncode is not None:
                raise ActivationFailed(
                    f"engine {self.name}: its start command exited {process.returncode}"
                )
            if loop.time() >= deadline:
                raise ActivationFailed(f"engine {self.name}: did not {what} within {limit_s:g} s")
            await asyncio.sleep(self.poll_s)

    async def _terminate(self) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), STOP_GRACE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()


async def _run(command: str) -> int:
    """Run ``command`` with ``sh -c`` to its end; its exit code."""
    process = await asyncio.create_subprocess_shell(command)
    return await process.wait()
