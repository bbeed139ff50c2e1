"""The health verdict (gateway/stage_health.py, pure): what rounds of liveness and stage probes mean; the healing
(gateway/healing.py, pure): what follows, attempt after attempt with deadlines, until the backend is ready again; a
probe's answer; a watch that does not die."""

from __future__ import annotations

import asyncio

import pytest

from gateway import stage_health
from gateway.healing import Cancel, Healer, Reload, Restart, TellSessions
from gateway.stage_health import Report, StageHealth, Verdict, failure

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
    # the first failing round is not ready already (no new session there), but not yet broken (one may be a fluke); a
    # round with a failing probe used to read `ready`, which ended a healing episode before its second fault
    assert states([(1, READY), (2, DEAD), (3, DEAD), (4, READY)]) == ["ready", "loading", "broken", "ready"]
    assert states([(1, READY), (2, DEAD), (3, READY)]) == ["ready", "loading", "ready"]
    assert states([(1, LOADING), (2, DEAD), (3, DEAD)]) == ["loading", "loading", "broken"]


def test_a_silent_triton_is_unresponsive_after_the_timeout() -> None:
    assert states([(1, READY), (3, SILENT), (5, SILENT), (7, SILENT)]) == ["ready", "ready", "ready", "unresponsive"]


def test_slow_probes_keep_a_busy_server_ready_until_the_hang_bound() -> None:
    assert states([(1, READY), (10, SLOW), (50, SLOW), (62, SLOW)]) == ["ready", "ready", "ready", "broken"]


def test_loading_and_down_are_not_ready_and_not_broken() -> None:
    assert states([(1, LOADING), (2, DOWN), (3, LOADING), (100, LOADING), (101, READY)]) == \
        ["loading", "loading", "loading", "loading", "ready"]


# ---- healing (gateway/healing.py, pure): each sequence the hostile pass found, and what ends it ----

def run(healer: Healer, rounds: list[tuple[float, str, tuple[str, ...]]], live: bool | None = True) -> list[list]:
    """Each round (when, verdict, failing stages) observed; the effects of each."""
    return [healer.observe(state, failed, began=t, now=t + 0.1, live=live) for t, state, failed in rounds]


def broken(t: float, *failed: str) -> tuple[float, str, tuple[str, ...]]:
    return (t, "broken", failed)


def test_a_dead_stub_is_reloaded_and_sessions_told_then_the_episode_ends() -> None:
    healer = Healer(deadline_s=60, owned=False)
    assert run(healer, [(1, "ready", ()), broken(2, "llm")]) == [[], [TellSessions(), Reload(("llm",), 2)]]
    assert healer.why == "healing: reloading llm"
    assert run(healer, [broken(3, "llm")]) == [[]]  # the reload runs: nothing more meanwhile
    assert healer.ended(4, reloaded=["llm"]) == []
    assert run(healer, [(5, "ready", ())]) == [[]] and healer.why == "" and healer.attempt is None


def test_a_second_stage_dying_during_a_reload_is_reloaded_next() -> None:
    healer = Healer(deadline_s=60, owned=False)
    run(healer, [broken(2, "llm")])
    assert run(healer, [broken(3, "llm", "tts"), broken(4, "llm", "tts")]) == [[], []]  # the llm's reload runs
    healer.ended(5, reloaded=["llm"])
    # fresh evidence (rounds begun after the reload ended): tts, twice
    assert run(healer, [broken(5.5, "tts"), broken(6, "tts")]) == [[], [TellSessions(), Reload(("tts",), 5.5)]]


def test_a_reloaded_stub_that_dies_again_is_reloaded_again() -> None:
    """The old watch healed once per episode of brokenness: a stub that died again before a ready round was never
    healed."""
    healer = Healer(deadline_s=60, owned=False)
    run(healer, [broken(2, "llm")])
    healer.ended(3, reloaded=["llm"])
    assert run(healer, [broken(2.9, "llm"), broken(3.5, "llm")]) == [[], []]  # a round begun before its end: stale
    assert run(healer, [broken(4, "llm")]) == [[TellSessions(), Reload(("llm",), 3.5)]]


def test_a_load_that_never_finishes_restarts_an_owned_triton_at_its_deadline() -> None:
    """A stub killed while its model loads leaves Triton at `loading` forever, and the reload waiting on it."""
    healer = Healer(deadline_s=20, owned=True)
    run(healer, [broken(2, "llm")])
    assert run(healer, [(10, "loading", ()), (21, "loading", ())]) == [[], []]
    restart = run(healer, [(23, "loading", ())])[0]
    assert restart[0] == Cancel() and isinstance(restart[-1], Restart) and "did not finish" in restart[-1].why
    assert healer.why.startswith("healing: restarting Triton")
    assert healer.ended(24, reloaded=["llm"]) == []  # the cancelled reload's late answer changes nothing
    # the new Triton is its supervisor's until it answers: no second restart while it starts, however long
    assert run(healer, [(30, "loading", ()), (200, "loading", ())], live=False) == [[], []]
    assert run(healer, [(201, "ready", ())]) == [[]] and healer.attempt is None


def test_a_stuck_load_on_a_triton_not_ours_is_said_and_tried_again() -> None:
    healer = Healer(deadline_s=20, owned=False)
    run(healer, [broken(2, "llm")])
    assert run(healer, [(23, "loading", ())]) == [[Cancel(), TellSessions(), Reload(("llm",), 2)]]
    assert healer.why.startswith("not healed: the reload of llm did not finish in 20 s")
    assert run(healer, [(30, "loading", ())]) == [[]] and healer.why.startswith("not healed")  # said every round


def test_a_reload_that_heals_nothing_by_its_deadline_escalates() -> None:
    healer = Healer(deadline_s=20, owned=True)
    run(healer, [broken(2, "llm")])
    healer.ended(5, reloaded=["llm"])
    effects = run(healer, [(10, "loading", ()), (26, "loading", ())])
    assert effects[0] == [] and isinstance(effects[1][-1], Restart), effects


def test_a_refused_reload_restarts_an_owned_triton_at_once() -> None:
    healer = Healer(deadline_s=60, owned=True)
    run(healer, [broken(2, "llm")])
    effects = healer.ended(3, refused="Triton would not reload llm: explicit model control mode is not enabled")
    assert isinstance(effects[-1], Restart) and "would not reload" in effects[-1].why


def test_a_refused_reload_on_a_triton_not_ours_keeps_saying_why() -> None:
    """/health's stages_why says why the endpoint is not healed for as long as it is not (it used to say it for one
    round, then the verdict's own words replaced it)."""
    seen: list[str] = []
    health = StageHealth("x", 1, 5, 60, lambda state, why: seen.append(why), lambda: None, deadline_s=30)
    health.verdict = Verdict(5, 60, _last_live=0.0, _last_probed=0.0)
    for t in (1, 2):
        health.apply(DEAD, t, t + 0.1)
    health.healer.ended(3, refused="Triton would not reload llm: explicit model control mode is not enabled")
    for t in (4, 5, 6):
        health.apply(DEAD, t, t + 0.1)
        assert "not healed: Triton would not reload llm" in health.why and "explicit" in health.why
    assert "llm: Stub process" in health.why  # and the verdict's own words beside it
    assert run(health.healer, [broken(34, "llm")])[0][-1] == Reload(("llm",), 4)  # tried again at its deadline


def test_past_the_reload_bound_an_owned_triton_is_restarted_whole() -> None:
    """Each reload leaves the dead stub's old instance in Triton 2.51: once `reloads_before_restart` are made, a
    Triton the gateway owns is restarted (which frees them) instead of reloading again, and the count starts over
    once Triton is seen down."""
    healer = Healer(deadline_s=60, owned=True, reloads_before_restart=3)
    healer.reloads = 3
    assert isinstance(run(healer, [broken(2, "llm")])[0][-1], Restart) and healer.reloads == 0
    healer.reloads = 2
    run(healer, [(3, "loading", ())], live=False)
    assert healer.reloads == 0


def test_a_dead_stateless_encoder_is_reloaded_without_ending_anyone() -> None:
    """Its reload loses no session's state: an audio-only call never meets it; one that does is told by its step."""
    healer = Healer(deadline_s=60, owned=False, stateless=frozenset({"audio_encoder", "vision_encoder"}))
    assert run(healer, [broken(2, "vision_encoder")]) == [[Reload(("vision_encoder",), 2)]]
    healer.ended(3, reloaded=["vision_encoder"])
    assert run(healer, [broken(4, "llm", "vision_encoder"), broken(5, "llm", "vision_encoder")])[1] == \
        [TellSessions(), Reload(("llm", "vision_encoder"), 4)]


def test_broken_with_no_stage_named_restarts_an_owned_triton_or_says_so() -> None:
    owned = Healer(deadline_s=60, owned=True)
    assert isinstance(run(owned, [broken(2)])[0][-1], Restart)
    other = Healer(deadline_s=60, owned=False)
    assert run(other, [broken(2)]) == [[TellSessions()]] and "no stage named" in other.why


def test_a_silent_triton_is_reported_but_its_sessions_are_the_failovers_to_tell() -> None:
    """One silence detector: the endpoint pool's failover ends the sessions of a server that answers nothing; the
    stage watch reports it unresponsive (/health) and tells nobody a second time."""
    seen: list[str] = []
    told: list[int] = []
    health = StageHealth("x", 1, 5, 60, lambda state, why: seen.append(state), lambda: told.append(1))
    health.verdict = Verdict(5, 60, _last_live=0.0, _last_probed=0.0)
    effects = [health.apply(r, t, t) for t, r in [(1, READY), (3, SILENT), (7, SILENT), (9, SILENT)]]
    assert seen[-1] == "unresponsive" and effects == [[], [], [], []]


# ---- probes ----

def test_a_retryable_refusal_is_an_answer_not_a_failure() -> None:
    """A full KV pool refuses a new sequence `pool_full`: the stage is alive and busy (the old probe, a model request
    that admission refused, took a full pool for a dead stage and ended every session)."""
    assert failure(RuntimeError("[pool_full] the KV pool has 3 free blocks of 512: retry later")) is None
    assert failure(RuntimeError("[queue_full] 8 new voices are being prepared")) is None
    assert failure(RuntimeError("Stub process 'llm_0_0' is not healthy.")) == "Stub process 'llm_0_0' is not healthy."
    assert failure(RuntimeError("[numeric_error] NaN\nin the logits")) == "[numeric_error] NaN"


async def test_the_watch_does_not_die_of_a_failing_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round that raises (a lock file that is a directory used to end the task, with nothing logged) is logged, and
    the next one comes."""
    calls: list[int] = []

    async def check(client: object, url: str, timeout_s: float) -> Report:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the round broke")
        return READY

    monkeypatch.setattr(stage_health, "check", check)
    health = StageHealth("127.0.0.1:9", 0.01, 5, 60, lambda state, why: None, lambda: None)
    task = asyncio.get_running_loop().create_task(health.watch())
    try:
        async with asyncio.timeout(10):
            while health.rounds < 4:
                await asyncio.sleep(0.01)
        assert not task.done()
    finally:
        task.cancel()
