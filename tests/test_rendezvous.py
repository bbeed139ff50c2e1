"""The meeting point before the LLM: concurrent steps go together, a lone step waits for nothing,
and under load the first step holds the door for the ones that follow."""

from __future__ import annotations

import asyncio

import pytest

from minicpmo_triton.serving.rendezvous import BatchWindow, RecentPeak, Rendezvous

from .virtual_clock import now, virtual_time

# Every time window below is on the loop's virtual clock (tests/virtual_clock.py): exact, whatever the load.


@virtual_time
async def test_a_lone_step_does_not_wait() -> None:
    meet = Rendezvous(max_wait_s=5.0)
    t0 = now()
    async with meet.member() as m:
        await m.arrive()
    assert now() - t0 == 0.0
    assert meet.met == 0


@virtual_time
async def test_steps_in_flight_are_released_together_when_the_last_arrives() -> None:
    meet = Rendezvous(max_wait_s=5.0)
    released: list[tuple[int, float]] = []

    async def step(i: int, work_s: float) -> None:
        async with meet.member() as m:
            await asyncio.sleep(work_s)  # the audio encoder, taking a different time per step
            await m.arrive()
            released.append((i, now()))

    await asyncio.gather(step(0, 0.0), step(1, 0.05), step(2, 0.1))
    times = [t for _, t in released]
    assert times == [pytest.approx(0.1)] * 3, "all three go at once, when the slowest arrives"
    assert meet.met == 3


@virtual_time
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
            t0 = now()
            await m.arrive()
            return now() - t0

    slow_task = asyncio.create_task(slow())
    results = await asyncio.gather(quick(), fails(), return_exceptions=True)
    waited = results[0]
    assert isinstance(results[1], RuntimeError)
    assert waited == pytest.approx(0.1), "waits for the slow one at most max_wait_s"
    await slow_task


@virtual_time
async def test_the_window_is_held_only_under_load_and_shrinks_as_sessions_grow() -> None:
    window = BatchWindow(target=8, max_s=0.25, min_sessions=16, max_sessions=100)
    assert window.hold_s(15) == 0.0  # below the threshold nothing is held
    assert window.hold_s(16) == 0.25  # 7 more would take 467 ms: capped
    assert window.hold_s(32) == pytest.approx(7 / 31)  # the time 7 of the other 31 take to come
    assert window.hold_s(64) == pytest.approx(7 / 63)
    assert BatchWindow(target=8, max_s=0.0).hold_s(64) == 0.0  # off
    # From max_sessions on the queues batch by themselves: nothing is held.
    assert BatchWindow(target=8, max_s=0.25, min_sessions=16, max_sessions=40).hold_s(39) > 0
    assert BatchWindow(target=8, max_s=0.25, min_sessions=16, max_sessions=40).hold_s(40) == 0.0


@virtual_time
async def test_under_load_later_steps_join_the_first_and_the_door_opens_at_the_target() -> None:
    # 4 live sessions: 3 more steps are expected within a second, the window (capped at 5 s)
    meet = Rendezvous(max_wait_s=0.01, window=BatchWindow(target=4, max_s=5.0, min_sessions=2),
                      live_sessions=lambda: 4)
    released: list[float] = []
    t0 = now()

    async def step(start_s: float) -> None:
        await asyncio.sleep(start_s)  # a caller's own phase: it was not in flight when the first arrived
        async with meet.member() as m:
            await m.arrive()
            released.append(now() - t0)

    await asyncio.gather(*(step(s) for s in (0.0, 0.05, 0.1, 0.15)))
    assert released == [pytest.approx(0.15)] * 4, "the first held the door; all four went at the fourth"
    assert meet.met == 4


@virtual_time
async def test_a_held_door_opens_after_the_window_and_an_end_rides_along() -> None:
    meet = Rendezvous(max_wait_s=0.01, window=BatchWindow(target=8, max_s=0.2, min_sessions=2),
                      live_sessions=lambda: 2)
    t0 = now()

    async def step() -> float:
        async with meet.member() as m:
            await m.arrive()
        return now() - t0

    async def end_later() -> float:
        await asyncio.sleep(0.05)
        await meet.pass_through()
        return now() - t0

    step_at, end_at = await asyncio.gather(step(), end_later())
    assert step_at == pytest.approx(0.2), "the target never came: the window's end opened the door"
    assert end_at == step_at, "the END went with the held step"
    assert meet.met == 2


@virtual_time
async def test_the_window_holds_only_while_recent_steps_leave_it_room() -> None:
    window = BatchWindow(target=8, max_s=0.25, min_sessions=16, budget_s=0.5)
    assert window.hold_s(32, recent_s=0.1) == pytest.approx(7 / 31)  # room for the whole hold
    assert window.hold_s(32, recent_s=0.4) == pytest.approx(0.1)  # what is left of the budget
    assert window.hold_s(32, recent_s=0.6) == 0.0  # near saturation the queues batch by themselves


@virtual_time
async def test_a_loaded_server_stops_holding_the_door() -> None:
    meet = Rendezvous(max_wait_s=0.01, window=BatchWindow(target=4, max_s=5.0, min_sessions=2, budget_s=0.5),
                      live_sessions=lambda: 4)

    async def lone_step() -> float:
        async with meet.member() as m:
            t0 = now()
            await m.arrive()
            return now() - t0

    assert await lone_step() == pytest.approx(0.5), "room in the budget: the door is held for the others"
    for _ in range(64):
        meet.recent.add(0.7)  # steps now take 700 ms to their first event without the door
    assert await lone_step() == 0.0, "no room: straight on"
    assert meet.recent.quantile() == pytest.approx(0.7)


@virtual_time
async def test_the_member_knows_how_long_it_waited_at_the_door() -> None:
    meet = Rendezvous(max_wait_s=0.1)

    async def early() -> float:
        async with meet.member() as m:
            await m.arrive()
        return m.waited_s

    async def late() -> float:
        async with meet.member() as m:
            await asyncio.sleep(0.05)
            await m.arrive()
        return m.waited_s

    late_wait, early_wait = await asyncio.gather(late(), early())  # both in flight, then early arrives
    assert early_wait == pytest.approx(0.05) and late_wait == 0.0


@virtual_time
async def test_sessions_winding_down_still_count_as_the_load_they_were_part_of() -> None:
    now = [0.0]
    peak = RecentPeak(span_s=5.0, clock=lambda: now[0])
    assert peak.see(48) == 48
    now[0] = 4.0
    assert peak.see(30) == 48, "the last of a 48-session wave: not a 30-session load"
    now[0] = 6.0
    assert peak.see(20) == 48, "the previous bucket still remembers"
    now[0] = 11.0
    assert peak.see(20) == 20, "a bucket later the wave is forgotten"
    now[0] = 30.0
    assert peak.see(3) == 3, "after an idle stretch nothing is remembered"


@virtual_time
async def test_a_step_working_aside_does_not_hold_the_others() -> None:
    """A long prefill's leading chunks (or a voice prompt's encoding) go aside: the step at the door goes on
    without waiting for it, and the step, back, arrives as any other."""
    meet = Rendezvous(max_wait_s=0.5)

    async def long_prefill() -> float:
        async with meet.member() as m:
            async with m.aside():
                await asyncio.sleep(2.0)
            await m.arrive()
            return now()

    async def quick() -> float:
        async with meet.member() as m:
            await asyncio.sleep(0.01)
            await m.arrive()
            return now()

    long_done, quick_done = await asyncio.gather(long_prefill(), quick())
    assert quick_done == pytest.approx(0.01), "not held for the step that is aside"
    assert long_done == pytest.approx(2.0)
