"""What the proposers share: which requests may speculate, how many drafts each has room
for, and the counts the metrics report."""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.executor.spec.adaptive import (EXPLORE_AFTER, EXPLORE_SHARE, MAX_EXPLORE_AFTER, MEASURE_EVERY,
                                              OPTIMISTIC_RATE, StepCost)
from tokenmill.executor.spec.calibration import Calibration

RECHECK = 0.8  # a plain step this much under the cost: the next step is measured without drafts too
STALL = 2.0  # the most a plain step slower than the target's cost counts for, in times the cost
FADE = 0.9  # what a request's evidence keeps in a step it gets no drafts (Proposer.fade)


def can_speculate(request: Request) -> str | None:
    """None when the request's drafts can be verified exactly here; else what rules it out
    (the request is then served without speculation)."""
    sp = request.sampling_params
    if sp.has_penalties or request.bad_words_token_ids:
        return "penalties"  # each position's logits would depend on the drafts before it
    if request.num_output_tokens < sp.min_tokens:
        return "min_tokens"  # so would EOS's mask; once it is lifted, the request may speculate
    if request.grammar is not None:
        return "structured_outputs"
    if request.ranked_by_logprob or request.num_forks:
        return "best_of"
    return None


class Proposer:
    """After each step, `propose(changed requests, ...)` sets the drafts each one verifies
    next step (request.spec_token_ids); `release(request_id)` drops what it kept for one."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, cost: StepCost | None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.cost = cost if config.adaptive else None  # the target step's cost (adaptive speculation)
        self.num_unspeculated_steps = 0  # request-steps served without speculation by their features
        self.num_steps_by_k = [0] * (config.num_speculative_tokens + 1)  # request-steps by drafts verified
        self.calibration = Calibration()  # what chosen drafts really added (adaptive speculation)
        self.seconds = 0.0  # the last step's drafting for the next, outside the target's step (a drafter's)
        self.catch_up_seconds = 0.0  # of it, the drafter's catching up with requests (its forwards' rows beyond drafts)
        self._accepted = 0  # drafts accepted over all steps, when the last step ended
        self.dry_steps = 0  # decode steps in a row that verified no drafts
        self.plain_steps_ago = 0  # decode steps since the last one that verified no drafts
        self.explore_after = EXPLORE_AFTER  # dry steps before one request drafts all it can
        # the last plain step's cost and tokens, and the start-up forward's seconds at them
        self._plain: tuple[StepCost | None, int, float] = (None, 0, 0.0)
        self.resting = 0  # steps left that get no drafts without asking (see `_rests`)
        self.rest_length = 0  # the last rest's steps (doubled each time drafts still do not pay)
        self.rest_batch = 0  # the candidates when the rest began

    @property
    def exploring(self) -> bool:
        """Whether the next choice is an exploration (see `explore`)."""
        return self.dry_steps >= self.explore_after

    def explore(self, rates: list[float], limits: list[int], choose: Callable[[list[float]], list[int]] | None = None,
                catch_up: list[float] | None = None, step: float = 0.0) -> list[int] | None:
        """After `explore_after` decode steps without a verified draft, one request, the
        likeliest, drafts all it can: a rate learnt from a few unlucky drafts would otherwise
        stay below what drafts are worth, and drafting would never start again. The built-in
        EAGLE head at concurrency 1 on a 2-core CPU (float32) accepted 28% of its drafts in
        its first 32 (the exploring phase), after which a request's rate started at 0.53 and
        no draft was chosen; with every draft verified, 61% were accepted and the time per
        output token was 1.51x better. None: the step chooses as usual (a choice with drafts
        resets the interval; an exploration doubles it).
        `choose`: the step's choice for given rates. The exploration is made only where it
        would keep drafts at OPTIMISTIC_RATE: at 16 requests an EAGLE head's exploring request
        ran its 512 waiting pairs through the head first, a step's worth of time, where no
        rate could make its drafts pay.
        `catch_up`: the seconds a drafter would spend catching up with each request before
        its drafts, `step` a step's seconds: an exploration waits until its catch-up is at most
        EXPLORE_SHARE of the steps since the last (a request that rested since its prompt is
        behind by all its tokens: the built-in draft model at 4 requests spent 15-19 ms on
        one, two to three steps' worth, every 64 steps)."""
        if not self.exploring or not any(limits):
            return None
        best = max(range(len(rates)), key=lambda i: (limits[i] > 0, rates[i]))
        if catch_up is not None and step > 0:
            wait = int(catch_up[best] / (EXPLORE_SHARE * step))
            if self.dry_steps < min(wait, MAX_EXPLORE_AFTER):
                self.explore_after = min(wait, MAX_EXPLORE_AFTER)
                return None
        self.dry_steps = 0
        self.explore_after = min(MAX_EXPLORE_AFTER, 2 * self.explore_after)
        if choose is not None and not any(choose([max(OPTIMISTIC_RATE, r) for r in rates])):
            return None
        return [limits[i] if i == best else 0 for i in range(len(rates))]

    def _rests(self, candidates: int) -> bool:
        """Whether this step rests: no drafts and no asking, while drafts do not pay (see
        `_rest_after`), counted as one of the rest's steps; a batch of `candidates` half the
        size of the one the rest began with asks again (a smaller batch makes drafts cheaper)."""
        if self.resting > 0 and 2 * candidates > self.rest_batch and not self.exploring:
            self.resting -= 1
            return True
        return False

    def _rest_after(self, ks: list[int], candidates: int, most: int) -> None:
        """After a choice of `ks` for `candidates` requests: drafts end the rests; none start
        the next, twice as long as the last (1 step, then 2, 4, ... up to `most`). While
        drafts do not pay, the rates and costs change slowly, and asking costs the choice
        (0.1-0.5 ms of numpy and Python a step on a 2-core CPU, 1.5-4% of a step at 16-64
        requests) and the proposal before it."""
        if any(ks):
            self.rest_length = self.resting = 0
        else:
            self.rest_length = min(most, 2 * self.rest_length or 1)
            self.resting, self.rest_batch = self.rest_length, candidates

    def _propose_none(self, requests: list[Request]) -> None:
        """`propose` after a step that made no drafts (most steps of a batch whose drafts do not
        pay): each request keeps the empty drafts the scheduler's update left it, and its evidence
        fades. (The loop of `propose`, per request, took 1.7 us on this 2-core CPU: 0.5% of a
        step at 16 requests of the built-in model, resting.)"""
        keep, resting = FADE, 0
        for request in requests:
            if request.status.finished:
                self.release(request.request_id)
            elif can_speculate(request) is not None:
                self.num_unspeculated_steps += 1
            else:
                request.spec_accepted *= keep
                request.spec_rejected *= keep
                resting += 1
        self.num_steps_by_k[0] += resting

    def chose(self, ks: list[int]) -> list[int]:
        """A choice with drafts resets the interval before the next exploration."""
        if any(ks):
            self.explore_after = EXPLORE_AFTER
        return ks

    @property
    def measuring(self) -> bool:
        """Whether the next step verifies no drafts, so that the step's cost without them is
        measured again (see MEASURE_EVERY)."""
        return self.plain_steps_ago >= MEASURE_EVERY

    def observe_step(self, out: SchedulerOutput, seconds: float, accepted: int) -> None:
        """Adaptive speculation learns from a step that has run: `seconds` its wall time,
        the drafting for the next step included (`self.seconds` of it); `accepted` the drafts
        accepted over all steps. A decode step that verified no drafts teaches the target's
        step cost (its overhead); one that verified chosen drafts, the calibration: their
        accepted tokens, and the drafting before the step plus the step's time over its
        cost without them, against what the choice predicted. Catch-ups are left out on
        both sides: the prediction leaves out their price, the step their measured time (the
        drafter's `catch_up_seconds`). A prompt's catch-up, priced a share a step, counted in
        full against that share's prediction, clipped at 4x, made drafts look 4x dearer after
        every prompt; left out at the drafter's learnt rate, a catch-up slower than that rate
        (4-21 ms against 4-7 for the built-in draft's prompts on a 2-core CPU) still made the
        drafts' seconds 1.3-1.6x the prediction at one request, and a request's first drafts
        then looked too dear ever to pay for its catch-up."""
        cal = self.calibration
        tokens, self._accepted = accepted - self._accepted, accepted
        seconds -= self.seconds
        predicted, cal.pending = cal.pending, (*cal.chosen, self.seconds, self.catch_up_seconds) \
            if cal.chosen else None
        cal.chosen = None
        total = out.total_num_scheduled_tokens
        drafts = total - len(out.spec_token_ids)  # in a decode-only step, each request's 1 + its drafts
        if drafts and not out.is_decode_only:  # (no drafts and one token each: decode-only, at C speed)
            return
        context = sum(out.num_computed_tokens)  # what the requests' tokens attend to beyond themselves
        if drafts == 0:
            self.dry_steps += 1
            self._observe_plain(total, seconds, context)
            cal.fade()
            return
        self.plain_steps_ago += 1
        self.dry_steps = 0
        if predicted is not None:  # (drafts verified while exploring were not chosen)
            extra_tokens, extra_seconds, verifying, drafting, catch_up = predicted
            in_step = seconds - self.cost(total - drafts, context)
            self.cost.observe_verify(in_step - verifying)
            cal.observe(extra_tokens, extra_seconds, tokens, drafting - catch_up + in_step)

    def _observe_plain(self, num_tokens: int, seconds: float, context: int = 0) -> None:
        """A decode step without drafts over `context` tokens of context took `seconds`: the
        target's step cost learns its overhead beyond the forward and the attention (a moving
        average, 0.1 a step), a step counting for at most STALL times the
        cost (a stall slows drafts too, and passes). A plain step under RECHECK times the
        cost has the next step measured without drafts too, until they agree: an overhead
        learnt while the machine was slow (another load) makes drafts look cheap, and a batch
        that drafts every step measures a plain step only every MEASURE_EVERY steps. (Without
        this, an engine of 16 EAGLE requests whose steps a second process had slowed went on
        drafting in every step after it ended, at 0.93x the throughput of one without drafts.
        Weighing a faster plain step up to half, as tried, learnt the overhead too low where
        drafts pay a little: EAGLE at 4 requests stopped drafting.)"""
        cost, plain = self.cost, self._plain
        if plain[0] is not cost or plain[1] != num_tokens:  # (an interpolation is 5 us; a batch keeps its size)
            plain = self._plain = (cost, num_tokens, float(cost.forward(num_tokens)))
        x = plain[2] + cost.attention * context
        predicted = x + cost.overhead
        cost.observe_curve(x, min(seconds, STALL * predicted))
        self.plain_steps_ago = MEASURE_EVERY if seconds < RECHECK * predicted else 0

    def room(self, request: Request, new_tokens: int = 0) -> int:
        """The drafts that fit, with the token after them, within max_tokens and max_model_len,
        once the request has `new_tokens` more tokens."""
        return min(self.config.num_speculative_tokens,
                   request.max_tokens - request.num_output_tokens - new_tokens - 1,
                   self.max_model_len - request.num_tokens - new_tokens - 1)

    def release(self, request_id: str) -> None:
        pass

    @staticmethod
    def fade(request: Request, num_drafts: int, keep: float = FADE) -> None:
        """A request given no drafts gathers no evidence; what it had fades, so that its rate
        returns towards the proposer's overall one and it is tried again (drafts that failed
        early in an output often succeed once it repeats itself)."""
        if num_drafts == 0:
            request.spec_accepted *= keep
            request.spec_rejected *= keep
