"""The meeting point before the LLM: concurrent steps go together, a lone step waits for nothing."""

from __future__ import annotations

import asyncio
import time

import pytest

from minicpmo_triton.rendezvous import Rendezvous

pytestmark = pytest.mark.asyncio(loop_scope="function")


async def test_a_lone_step_does_not_wait() -> None:
    meet = Rendezvous(max_wait_s=5.0)
    t0 = time.perf_counter()
    async with meet.member() as m:
        await m.arrive()
    assert time.perf_counter() - t0 < 0.5
    assert meet.met == 0


async def test_steps_in_flight_are_released_together_when_the_last_arrives() -> None:
    meet = Rendezvous(max_wait_s=5.0)
    released: list[tuple[int, float]] = []

    async def step(i: int, work_s: float) -> None:
        async with meet.member() as m:
            await asyncio.sleep(work_s)  # the audio encoder, taking a different time per step
            await m.arrive()
            released.append((i, time.perf_counter()))

    await asyncio.gather(step(0, 0.0), step(1, 0.05), step(2, 0.1))
    times = [t for _, t in released]
    assert max(times) - min(times) < 0.03, "all three go at once, when the slowest arrives"
    assert meet.met == 3


async def test_waiting_is_bounded_and_a_member_that_leaves_does_not_hold_the_others() -> None:
    meet = Rendezvous(max_wait_s=0.1)

    async def slow() -> None:
        async with meet.member() as m:
            await asyncio.sleep(1.0)
            await m.arrive()

    async def fails() -> None:
        async with meet.member():
            await asyncio.sleep(0.02)
            raise RuntimeError("no LLM call for this step")

    async def quick() -> float:
        async with meet.member() as m:
            t0 = time.perf_counter()
            await m.arrive()
            return time.perf_counter() - t0

    slow_task = asyncio.create_task(slow())
    results = await asyncio.gather(quick(), fails(), return_exceptions=True)
    waited = results[0]
    assert isinstance(results[1], RuntimeError)
    assert 0.05 < waited < 0.5, "waits for the slow one at most max_wait_s"
    await slow_task


async def test_the_cadence_holds_steps_for_the_next_beat_only_under_load() -> None:
    from minicpmo_triton.cadence import Cadence

    now = [10.07]
    beat = Cadence(0.25, min_sessions=16, clock=lambda: now[0])
    assert beat.delay(15) == 0.0  # below the threshold nothing waits
    assert beat.delay(16) == pytest.approx(0.18)  # to 10.25
    now[0] = 10.25
    assert beat.delay(40) == pytest.approx(0.0)  # on the beat
    assert Cadence(0.0, 0, clock=lambda: 3.3).delay(100) == 0.0  # off
