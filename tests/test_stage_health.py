"""The health verdict (gateway/stage_health.py, pure): what rounds of liveness and stage probes mean, and what
follows (sessions told once, Triton healed once) until the backend is ready again."""

from __future__ import annotations

from gateway.stage_health import Report, StageHealth, Verdict

READY = Report(live=True, models_ready=True, probes_answered=True)
SLOW = Report(live=True, models_ready=True, probes_answered=False)  # probes queued behind real work
DEAD = Report(live=True, models_ready=True, failed={"llm": "Stub process 'llm_0_0' is not healthy."},
              probes_answered=True)
SILENT = Report(live=None)  # no liveness answer in time
DOWN = Report(live=False)  # refused: not up
LOADING = Report(live=True)


def states(reports: list[tuple[float, Report]], timeout_s: float = 5, hang_s: float = 60) -> list[str]:
    verdict = Verdict(timeout_s, hang_s, _last_live=0.0, _last_probed=0.0)
    return [verdict.observe(r, t) for t, r in reports]


def test_a_dead_stub_is_broken_on_the_second_failing_round() -> None:
    assert states([(1, READY), (2, DEAD), (3, DEAD), (4, READY)]) == ["ready", "ready", "broken", "ready"]


def test_a_silent_triton_is_unresponsive_after_the_timeout() -> None:
    assert states([(1, READY), (3, SILENT), (5, SILENT), (7, SILENT)]) == ["ready", "ready", "ready", "unresponsive"]


def test_slow_probes_keep_a_busy_server_ready_until_the_hang_bound() -> None:
    assert states([(1, READY), (10, SLOW), (50, SLOW), (62, SLOW)]) == ["ready", "ready", "ready", "broken"]


def test_loading_and_down_are_not_ready_and_not_broken() -> None:
    assert states([(1, LOADING), (2, DOWN), (3, LOADING), (100, LOADING), (101, READY)]) == \
        ["loading", "loading", "loading", "loading", "ready"]


def test_sessions_are_told_once_and_triton_healed_once_per_episode() -> None:
    seen: list[str] = []
    told: list[int] = []
    health = StageHealth("x", 1, 5, 60, lambda state, why: seen.append(state), lambda: told.append(1))
    health.verdict = Verdict(5, 60, _last_live=0.0, _last_probed=0.0)
    heal_now = [health.apply(r, t) for t, r in [(1, READY), (2, DEAD), (3, DEAD), (4, DEAD), (5, DOWN),
                                                (6, LOADING), (7, READY), (8, DEAD), (9, DEAD)]]
    assert seen[-1] == "broken" and len(told) == 2
    assert heal_now == [False, False, True, False, False, False, False, False, True]


def test_a_silent_triton_is_reported_but_its_sessions_are_the_failovers_to_tell() -> None:
    """One silence detector: the endpoint pool's failover ends the sessions of a server that answers nothing; the
    stage watch reports it unresponsive (/health) and tells nobody a second time."""
    seen: list[str] = []
    told: list[int] = []
    health = StageHealth("x", 1, 5, 60, lambda state, why: seen.append(state), lambda: told.append(1))
    health.verdict = Verdict(5, 60, _last_live=0.0, _last_probed=0.0)
    for t, r in [(1, READY), (3, SILENT), (7, SILENT), (9, SILENT)]:
        health.apply(r, t)
    assert seen[-1] == "unresponsive" and told == []


class _Owned:
    def __init__(self) -> None:
        self.killed = 0

    def kill(self) -> None:
        self.killed += 1

    def note_regions(self) -> None:
        pass


async def test_past_the_reload_bound_an_owned_triton_is_restarted_whole() -> None:
    """Each reload leaves the dead stub's old instance in Triton 2.51: once `reloads_before_restart` are made, a
    Triton the gateway owns is restarted (which frees them) instead of reloading again, and the count starts over
    once Triton is seen down."""
    owned = _Owned()
    health = StageHealth("x", 1, 5, 60, lambda state, why: None, lambda: None, owned=owned, reloads_before_restart=3)
    health.reloads = 3
    await health.heal(None, ["llm"])  # type: ignore[arg-type]  (no reload is tried: no client needed)
    assert owned.killed == 1 and health.reloads == 0
    health.reloads = 2
    health.apply(DOWN, 1)
    assert health.reloads == 0
