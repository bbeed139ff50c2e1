"""How a broken endpoint is healed (pure: the health verdicts and the attempts' ends in, effects out).

An episode runs from the first broken verdict until the stages are ready again. In it, one attempt at a time, each
with a deadline (`deadline_s`):

- `Reload(models)`: Triton's model control API reloads the failing stages' models (gateway/triton/reload.py);
- `Restart`: a Triton this gateway started is killed whole, its supervisor starts a new one;
- nothing this gateway can do (a Triton it did not start that will not reload, or no stage to name): said on
  /health (`why`), and tried again at the deadline.

The next attempt is made when the one before it ended and fresh evidence (rounds begun after its end) says a stage
is broken again (a second stage that died during a reload, a reloaded stub that died again), or when its deadline
passed without the stages ready (a load that never finishes: a stub killed while its model loads leaves Triton at
`loading` forever), and at once when Triton refused a reload. An attempt still running at its deadline is cancelled
(`Cancel`). It escalates: a reload that was refused or did not heal in time is followed by a restart where the
gateway owns Triton (else by the reload again); a restart by another restart. Past `reloads_before_restart`
reloads since Triton last started, an owned Triton is restarted rather than reloaded (each reload leaves the dead
stub's old instance mapped in Triton 2.51). Sessions are told (`TellSessions`) as each attempt begins, unless every
failing stage is `stateless`: a reload of one loses no session's state, and a session whose step meets it dead is told
by that step (the retryable `stage_unavailable`), so a dead vision encoder ends no audio-only call.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

READY, BROKEN = "ready", "broken"
NOT_HEALED_HINT = "restart this Triton, or start it in explicit model control mode"


@dataclass(frozen=True)
class TellSessions:
    """The endpoint's live sessions are told `backend_unavailable` (retryable) and ended."""


@dataclass(frozen=True)
class Reload:
    models: tuple[str, ...]
    since: float  # when the evidence began (the clock `observe` is given): a reload begun after it makes this one moot


@dataclass(frozen=True)
class Restart:
    why: str


@dataclass(frozen=True)
class Cancel:
    """The running attempt is given up (its deadline passed)."""


Effect = TellSessions | Reload | Restart | Cancel


@dataclass
class Attempt:
    kind: str  # reload | restart | none (this gateway can do nothing: said, and tried again at the deadline)
    models: tuple[str, ...]
    deadline: float
    running: bool  # a reload awaits Triton's answer; a restart or none is done once made


@dataclass
class Healer:
    deadline_s: float  # an attempt that has not healed the endpoint in this long: the next one
    owned: bool  # this gateway started the Triton: it may restart it
    reloads_before_restart: int = 3
    failed_rounds: int = 2  # fresh failing rounds in a row that call for the next attempt (one may be a fluke)
    stateless: frozenset[str] = frozenset()  # models that keep no session state (their reload ends no session)
    why: str = ""  # what it is doing, or why the endpoint is not healed (/health's stages_why)
    reloads: int = 0  # reloads made since Triton last started (an owned one is restarted past the bound)
    attempt: Attempt | None = None
    _fresh_after: float = float("-inf")  # rounds begun before this saw the stages before the last attempt's end
    _streak: int = 0  # fresh failing rounds in a row
    _since: float = 0.0  # when the first of them began
    _models: tuple[str, ...] = field(default=())  # the stages last named broken
    _escalate: bool = False  # the last attempt was refused or did not heal in time
    _outcome: str = ""  # why, then

    def observe(self, state: str, failed: Collection[str], began: float, now: float,
                live: bool | None = True) -> list[Effect]:
        """One health round: its verdict (`state`), the stages whose probe failed, when it began; `now`, after it.
        Returns what to do."""
        if live is False:
            self.reloads = 0  # Triton is down: the one that comes next holds no old instances
        if state == READY:  # the episode is over
            self.attempt, self.why, self._streak, self._escalate = None, "", 0, False
            self._fresh_after = now
            return []
        if began >= self._fresh_after:
            if failed:
                self._since = began if self._streak == 0 else self._since
                self._streak += 1
                self._models = tuple(sorted(failed))
            else:
                self._streak = 0
        attempt = self.attempt
        if attempt is None:
            return self._next(now) if state == BROKEN else []  # loading or silent: the supervisor's and the pool's
        if attempt.running:
            if now < attempt.deadline:
                return []
            attempt.running = False  # a reload that never finished: a load that hangs
            self._ended(f"the reload of {', '.join(attempt.models)} did not finish in {self.deadline_s:.0f} s", now)
            return [Cancel(), *self._next(now)]
        if state == BROKEN and self._streak >= self.failed_rounds and not self._escalate:
            return self._next(now)  # a stage broke (again) since the attempt healed its own: at once
        # a refused attempt (where no restart was possible) is tried again at its deadline, not at every round
        if attempt.kind != "restart" and now >= attempt.deadline:  # a new Triton is its supervisor's until it answers
            if not self._escalate:
                self._ended(f"not ready {self.deadline_s:.0f} s after the {attempt.kind}", now)
            return self._next(now)
        return []

    def ended(self, now: float, reloaded: Collection[str] = (), refused: str = "") -> list[Effect]:
        """The running reload answered: `reloaded` (here, or by another gateway meanwhile: none), or `refused`."""
        attempt = self.attempt
        if attempt is None or not attempt.running:
            return []  # given up already (its deadline), or the endpoint is ready
        attempt.running = False
        self.reloads += len(reloaded)
        if refused:
            self._ended(refused, now)
            return self._next(now) if self.owned else []  # a reload Triton refuses: restarted now, if ours
        self._fresh_after, self._streak = now, 0
        self.why = f"healing: reloaded {', '.join(attempt.models)}; waiting for every stage to answer"
        return []

    def _ended(self, outcome: str, now: float) -> None:
        """The attempt did not heal: the next one escalates."""
        self._outcome, self._escalate = outcome, True
        self._fresh_after, self._streak = now, 0
        if not self.owned:
            self.why = f"not healed: {outcome} ({NOT_HEALED_HINT}); tried again in {self.deadline_s:.0f} s"

    def _next(self, now: float) -> list[Effect]:
        models, escalate = self._models, self._escalate
        self._escalate = False
        if self.owned and (escalate or not models or self.reloads >= self.reloads_before_restart):
            why = self._outcome if escalate else \
                f"{self.reloads} reloads left their dead stubs' memory mapped" if models else "no stage named"
            self.attempt = Attempt("restart", (), now + self.deadline_s, running=False)
            self.reloads = 0
            self.why = f"healing: restarting Triton ({why})"
            return [TellSessions(), Restart(why)]
        self.attempt = Attempt("reload" if models else "none", models, now + self.deadline_s, running=bool(models))
        if not models:
            self.why = f"not healed: no stage named, nothing to reload ({NOT_HEALED_HINT})"
            return [TellSessions()]
        if not escalate:  # a retry after a refusal keeps saying why it is not healed
            self.why = f"healing: reloading {', '.join(models)}"
        tell: list[Effect] = [] if set(models) <= self.stateless else [TellSessions()]
        return [*tell, Reload(models, self._since)]
