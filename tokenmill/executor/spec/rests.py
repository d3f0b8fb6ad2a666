"""When a drafter (executor/spec/draft.py, and the EAGLE head after it) drafts, how many
drafts each request makes, and when it rests: adaptive speculation's choice
(executor/spec/adaptive.py) asked for the step's candidates, and the rests that spare the
asking while drafts do not pay.

DraftChoice is a mixin of DraftModel: it reads the drafter's costs (`cost`, `draft_cost`),
the proposer's rates (`prior`, `later`, `evidence`), exploration and rests (Proposer).
"""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.executor.spec.adaptive import acceptance, choose_num_drafts
from tokenmill.executor.spec.calibration import Calibration

EXPLORE_EVIDENCE = 32  # verified drafts (accepted ones and rejecting steps) before drafts are chosen
# steps without drafts, without asking (see DraftChoice._choose): an ask costs 0.3-0.5 ms on a
# 2-core CPU (the choice, and for an EAGLE head its waiting pairs handed out), 4% of a step of 4
# requests asked every 16 steps; up to 64, an EAGLE engine at 4 requests whose drafts did not
# pay ran at 0.950x of no speculation against 0.936x (4 of 6 rounds ahead)
MAX_REST = 64


class DraftChoice:
    """The drafts each step makes, and the steps that rest (see `_choose`)."""

    @property
    def choosing(self) -> bool:
        """Adaptive speculation chooses the drafts once the proposer's acceptance is known:
        until then every request drafts (a draft's worth at the 0.5 prior can be below its
        cost, and a proposer that never drafts never learns its rate)."""
        return self.cost is not None and self.evidence >= EXPLORE_EVIDENCE

    def _choose(self, requests: list[Request], limits: list[int], out: SchedulerOutput,
                inputs: Callable[[], tuple[list[int], list[int], list[int]]]) -> list[int]:
        """The drafts each candidate request makes this step (choose_num_drafts' arguments;
        `inputs()` gives its contexts, behind and first_rows), after the step `out`, whose
        requests the next step runs; while exploring, all it has room for.
        When no draft pays, the next steps get none without asking: 1 step, then 2, 4, ... up
        to MAX_REST while the answer stays no. On this 2-core CPU the choice costs 0.1-0.5 ms
        of numpy and Python a step, 1.5-4% of a step at 16-64 requests, and while drafts do
        not pay, the rates and costs change slowly. Half the candidates ask again at once (a
        smaller batch makes drafts cheaper)."""
        if not requests:  # a batch without candidates: the next one starts afresh
            self.resting = self.rest_length = 0
        if not self.choosing or not requests:
            return limits
        if self._rests(len(requests)) or self.measuring:
            return [0] * len(requests)
        rates = [acceptance(r.spec_accepted, r.spec_rejected, self.prior) for r in requests]
        contexts, behind, first_rows = inputs()
        remaining = [r.max_tokens - r.num_output_tokens for r in requests]
        # the next step's context: each request's tokens after this step (a rejected draft's too, a few)
        num_tokens, context = len(out.requests), sum(out.num_computed_tokens) + out.total_num_scheduled_tokens

        def choose(rates: list[float], calibration: Calibration | None = None) -> list[int]:
            return choose_num_drafts(rates, limits, num_tokens, self.cost, self.draft_cost, contexts, behind,
                                     remaining, first_rows, calibration, self.later, context)

        # an exploration's catch-up prices, only where one is due (this runs every step that asks)
        catch_up, step = ([late * self.draft_cost.catch_up for late in behind], self.cost(num_tokens, context)) \
            if self.exploring and self.draft_cost is not None else (None, 0.0)
        if (ks := self.explore(rates, limits, choose, catch_up, step)) is not None:
            self.rest_length = self.resting = 0
            return ks
        ks = self.chose(choose(rates, self.calibration))
        self._rest_after(ks, len(requests), MAX_REST)
        return ks

    def idle(self, out: SchedulerOutput, num_sampling: int) -> bool:
        """Whether the step's drafting does nothing at all, so that the runner need not call
        `run`: a step that rests (see `_choose`) with nothing to release. It is counted as one
        of the rest's steps here."""
        if out.preempted or not self._rests(num_sampling):
            return False
        self._new_step()  # (no drafting time; the drafts' cost fades, as in a resting `_run`)
        self.draft_cost.fade()
        return True
