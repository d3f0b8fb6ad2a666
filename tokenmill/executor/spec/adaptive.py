"""Adaptive speculation: how many drafts each request verifies next step, 0 included.

Drafts pay when the tokens they are expected to add are worth the time they add to the
step. Both are estimated:
- time: the step's cost as a function of the tokens it computes: the forward, measured
  once at start-up (spec/timing.py: decode-shaped forwards at 1..budget tokens, interpolated
  between), plus the attention over the batch's contexts (per context token, timed then
  too), plus the rest of the step (scheduling, sampling's host work, outputs), learnt from
  the engine's decode steps without drafts as they run;
- tokens: a request whose first draft is accepted with probability a, and each later one
  with probability c given the one before was, gets a + ac + ... + ac^(k-1) extra tokens
  from k drafts. a is estimated per request from its own verifications, starting from the
  proposer's overall rate; c is the larger of a and how often the proposer's later drafts
  were accepted after an accepted one (acceptance runs in stretches: see `continuation`).

Each step ranks every draft of the batch by its expected gain and keeps as many of the
most likely ones as gives the step the most expected tokens per second. At a small batch a draft
costs little and most are kept; at a large GEMM-bound batch each draft costs about what
a token is worth and only likely ones stay; a request whose drafts keep failing gets none.

Both estimates are checked against what the drafts then really gave and cost (Calibration),
and after a long run of steps without drafts one request drafts anyway (Proposer.explore),
so that an estimate that went wrong in drafts' disfavour is corrected too.
"""

from __future__ import annotations

import numpy as np

from tokenmill.executor.spec.calibration import Calibration


class StepCost:
    """Seconds of one step by its tokens: the forward (piecewise linear in the tokens,
    timed at start-up), plus the decode attention over the batch's contexts (`attention` a
    context token, timed at start-up too), plus `overhead`, the rest of the step, which a
    draft does not add to, learnt from the steps as the engine runs them. `robust` (the draft model's cost):
    stalls are clipped and the overhead fades while nothing is timed (see `observe_curve`)."""

    def __init__(self, tokens: list[int], seconds: list[float], robust: bool = False) -> None:
        self.tokens = np.asarray(tokens, dtype=np.float64)
        # a step never gets cheaper with more tokens (timing noise can say otherwise)
        self.seconds = np.maximum.accumulate(np.asarray(seconds, dtype=np.float64))
        self.overhead = 0.0
        self.robust = robust
        self.attention = 0.0  # seconds a decoding sequence's query adds per token of context it attends to
        self.query_attention = 0.0  # what one more query of that sequence adds (a verified draft's)
        self.catch_up = 0.0  # a drafter's seconds per token it computes to catch up (prompt-shaped)
        self.fixed = 0.0  # what a step that drafts adds besides the drafter's forwards (learnt)
        # what verifying drafts adds to the target's step beyond its forward and attention (learnt):
        # the host work of the verification, the accepted tokens' updates and outputs
        self.verify = 0.0
        # past the last measured point, its last slope: one more point far out (interpolation
        # is one numpy call, which matters for choosing drafts in every step)
        t, s = self.tokens, self.seconds
        slope = (s[-1] - s[-2]) / (t[-1] - t[-2]) if len(t) > 1 else s[-1] / t[-1]
        far = t[-1] + 1e9
        self._tokens, self._seconds = np.append(t, far), np.append(s, s[-1] + slope * (far - t[-1]))

    def forward(self, num_tokens):
        """The forward's seconds at `num_tokens` (an int or an array of them); past the last
        measured point, its last slope."""
        return np.interp(num_tokens, self._tokens, self._seconds)

    def __call__(self, num_tokens: int, context: float = 0.0) -> float:
        """A decode step's seconds: `num_tokens` one-token queries over `context` tokens of
        context in all."""
        return float(self.forward(num_tokens)) + self.attention * context + self.overhead

    def observe(self, num_tokens: int, seconds: float, context: float = 0.0, decay: float = 0.9) -> None:
        """A step of `num_tokens` over `context` tokens of context took `seconds` in the
        engine: what the forward and the attention do not explain is overhead (a moving
        average over steps)."""
        self.observe_curve(float(self.forward(num_tokens)) + self.attention * context, seconds, decay)

    def observe_curve(self, x: float, seconds: float, decay: float = 0.9) -> None:
        """`observe`, given the start-up forward's seconds `x` for the step's tokens.

        `robust` (the draft model): the start-up timing ran the draft alone, its weights in
        cache; in the engine's step they are not, and a forward costs more. One step counts
        for at most 4 times what the cost predicted (the first: 4 times the start-up time),
        so that a single stall (a page fault, another process) does not stop drafts for long,
        while a lasting slowdown is learnt in a few steps (the prediction can grow 1.3x a
        step)."""
        if self.robust:
            seconds = min(seconds, 4 * (self.overhead + x))
        self.overhead = decay * self.overhead + (1 - decay) * max(0.0, seconds - x)

    def observe_catch_up(self, seconds: float, decay: float = 0.9) -> None:
        """A catch-up forward took `seconds` a token in the engine's step (a moving average;
        one forward counts for at most 4 times the estimate, as in `observe_curve`). At
        start-up the draft ran alone; in the step its weights are out of cache, and a
        catch-up token cost 1-4x as much (25-85 us against 18-25 us for the built-in model's
        draft and head on a 2-core CPU)."""
        self.catch_up = decay * self.catch_up + (1 - decay) * min(seconds, 4 * self.catch_up)

    def observe_fixed(self, seconds: float, decay: float = 0.9) -> None:
        """A step that drafted spent `seconds` on drafting besides the drafter's forwards: its
        host work (a moving average; a stall counts for at most 4 times a forward of one row
        plus the estimate)."""
        seconds = min(max(0.0, seconds), 4 * (float(self.forward(1)) + self.fixed))
        self.fixed = decay * self.fixed + (1 - decay) * seconds

    def observe_verify(self, seconds: float, decay: float = 0.9) -> None:
        """A step that verified drafts took `seconds` more than its cost without them and what
        the forward and the attention of the drafts were priced at: what verifying adds (a
        moving average; one step counts for at most a step without drafts, either way). On a
        2-core CPU the built-in model's step at one request, priced 0.04-0.10 ms more for 2-4
        drafts, took 0.24-0.37 ms more on average."""
        limit = float(self.forward(1)) + self.overhead
        self.verify = max(0.0, decay * self.verify + (1 - decay) * min(max(seconds, -limit), limit))

    def fade(self, keep: float = 0.99) -> None:
        """A step that chose no drafts, so nothing to time: what made drafting slow (another
        load on the machine) may have passed, so the overhead fades and drafting is tried
        again some time."""
        self.overhead *= keep

    def __repr__(self) -> str:
        return ", ".join(f"{int(n)}: {1e3 * s:.2f} ms" for n, s in zip(self.tokens, self.seconds)) + \
            f"; attention {1e9 * self.attention:.1f} ns per context token" + \
            (f" ({1e9 * self.query_attention:.1f} ns a draft)" if self.query_attention else "") + \
            (f"; catching up {1e6 * self.catch_up:.1f} us per token" if self.catch_up else "") + \
            (f"; {1e3 * self.fixed:.2f} ms a drafting step besides forwards" if self.fixed else "") + \
            (f"; {1e3 * self.verify:.2f} ms verifying drafts" if self.verify else "")


# while every step would draft, one step in this many verifies none, so that the step's
# cost without drafts (what Calibration compares a drafting step against) stays measured
MEASURE_EVERY = 32
# after this many decode steps in a row without a verified draft, one request drafts all it
# can (the likeliest by its rate); while that does not restart drafting, 2x as many steps
# before the next try, up to MAX_EXPLORE_AFTER
EXPLORE_AFTER = 64
MAX_EXPLORE_AFTER = 1024
# an exploration whose drafter must first catch up with the request waits until that costs
# at most this share of the time since the last (Proposer.explore)
EXPLORE_SHARE = 0.01
# an exploration is made only where the choice would keep drafts if every request's were
# accepted this often: where not even that pays (a large batch, a long catch-up), it would
# cost a step's worth of time to learn nothing that could change the choice
OPTIMISTIC_RATE = 0.9


def continuation(later: tuple[int, int], prior: float) -> float:
    """P(a draft is accepted | the draft before it was), over all requests so far: `later` is
    (accepted, verified) of the drafts after a request's first whose draft before was accepted.
    Acceptance runs in stretches (a request copying code the prompt holds, then a new name):
    the built-in draft model, every draft verified at 4 requests, had its first drafts accepted
    at 0.61 and the later ones at 0.72, 0.73 and 0.67 given the one before; the EAGLE head
    0.86, then 0.84, 0.90 and 0.89. A request's own rate, learnt mostly from first drafts where
    the choice keeps one or two, then priced its third and fourth drafts at a^3 and a^4: at one
    request adaptive EAGLE kept 1-2 drafts where 4 pay (1.22x against 1.35x with every draft
    verified, in one run)."""
    accepted, verified = later
    return acceptance(accepted, verified - accepted, prior)


def acceptance(accepted: int, rejected: int, prior: float, weight: float = 2.0) -> float:
    """P(a draft is accepted | the drafts before it were): accepted / (accepted + steps that
    rejected one), with `weight` pseudo-observations at `prior`."""
    return (accepted + weight * prior) / (accepted + rejected + weight)


# a drafter's catch-up with a request (the tokens it has not computed: a prompt, or the
# steps the request did not draft in) is counted against the request's first draft, spread
# over this many steps (fewer if the request ends sooner): once caught up, the request
# drafts at the usual cost. That holds where the calibration has confirmed the drafts:
# they gave at least CONFIRMED (spec/calibration.py) of the tokens per second predicted. Where it has not, a
# catch-up buys drafts whose worth is in doubt, and is spread over DOUBTFUL_CATCH_UP_STEPS.
# (Over 16 steps always, a prompt's catch-up outweighed the first draft of each request
# that joined a drafting batch: EAGLE at 4 requests on the rewrite set drafted only in a
# run's first steps, 0.98x of no speculation against 1.12x over 64. Over 64 always, the
# draft model at 4 requests and EAGLE at 16, whose drafts do not pay there, caught up with
# every prompt to find that out: 0.965x against 0.985x and 0.966x against 0.984x.)
CATCH_UP_STEPS = 64
DOUBTFUL_CATCH_UP_STEPS = 16


def choose_num_drafts(rates: list[float], limits: list[int], num_tokens: int, cost: StepCost,
                      draft: StepCost | None = None, contexts: list[int] | None = None,
                      behind: list[int] | None = None, remaining: list[int] | None = None,
                      first_rows: list[int] | None = None, calibration: Calibration | None = None,
                      later: float | None = None, batch_context: float | None = None) -> list[int]:
    """How many drafts each request verifies: `rates` are their acceptance probabilities,
    `limits` the drafts each has, `num_tokens` what the step computes without drafts (one
    token per request at least). The drafts, most likely first (request i's j-th is worth
    rates[i] ** j tokens; with `later`, the proposer's continuation, rates[i] * c ** (j - 1)
    for c = max(rates[i], later)), are kept up to the count that gives the most tokens per
    second.
    `draft`: the draft model's forward cost; its j-th forward makes every j-th draft, so
    the drafts kept add those forwards' time too, and a step with any draft draft.fixed
    (the drafting's host work besides its forwards). `contexts`: each request's tokens, which
    each of its drafts attends to in the target's forward (one more query of the request's,
    cost.query_attention a token) and the draft's. `behind`: the
    tokens the draft has to catch up with before drafting for each request; their cost
    (draft.catch_up each, over CATCH_UP_STEPS, or DOUBTFUL_CATCH_UP_STEPS unless the calibration
    has confirmed the drafts) goes with the request's first draft, which
    ranks lower by what that time is worth in tokens (and its later drafts no higher).
    `remaining`: the tokens each request may still produce; one that ends sooner than
    CATCH_UP_STEPS steps at its rate spreads its catch-up over the steps it has left.
    `first_rows`: the rows each request has in the draft's first forward of a step it drafts
    in, its catch-up aside (default 1). A draft model computes the request's last token
    before the step and the tokens the step gave it: 2 + its accepted drafts.
    `calibration`: its ratios scale the drafts' tokens and added seconds (not the catch-ups',
    which the drafter learns apart), and the choice's prediction (before scaling, catch-ups
    left out) is left in `calibration.chosen` for the step that verifies it.
    `batch_context`: the context tokens of every request the step runs, whose attention
    (cost.attention a token) the step without drafts costs; default: the sum of `contexts`."""
    if batch_context is None:
        batch_context = float(sum(contexts)) if contexts is not None else 0.0
    attention = cost.attention * batch_context
    if len(rates) == 1 and limits[0] > 0:
        return [_choose_one(rates[0], int(limits[0]), num_tokens, cost, draft, contexts, behind, remaining,
                            first_rows, calibration, later, attention)]
    return _choose_many(rates, limits, num_tokens, cost, draft, contexts, behind, remaining, first_rows, calibration,
                        later, attention)


def _choose_many(rates: list[float], limits: list[int], num_tokens: int, cost: StepCost,
                 draft: StepCost | None = None, contexts: list[int] | None = None,
                 behind: list[int] | None = None, remaining: list[int] | None = None,
                 first_rows: list[int] | None = None, calibration: Calibration | None = None,
                 later: float | None = None, attention: float = 0.0) -> list[int]:
    """choose_num_drafts over a batch, in array operations; `attention`: the step's over the
    batch's contexts without drafts."""
    rates = np.asarray(rates, dtype=np.float64)
    limits = np.asarray(limits, dtype=np.int64)
    total = int(limits.sum())
    if total == 0:
        if calibration is not None:
            calibration.chosen = None
        return [0] * len(rates)
    owner = np.repeat(np.arange(len(rates)), limits)
    first = np.cumsum(limits) - limits  # each request's first draft
    some = limits > 0  # the requests with a draft (`first` is theirs)
    depth = np.arange(total) - np.repeat(first, limits) + 1  # j = 1..limit
    own = rates[owner]
    gain = own ** depth if later is None else own * np.maximum(own, later) ** (depth - 1)
    base = float(cost.forward(num_tokens)) + attention + cost.overhead
    catch = np.zeros(total)  # a first draft's share of its request's catch-up
    if behind is not None and draft is not None and draft.catch_up > 0:
        most_steps = CATCH_UP_STEPS if calibration is not None and calibration.confirmed else DOUBTFUL_CATCH_UP_STEPS
        spread = np.full(len(rates), float(most_steps))
        if remaining is not None:  # steps left: its tokens over the tokens a step gives it with its drafts
            per_step = 1 + np.bincount(owner, weights=gain, minlength=len(rates))
            spread = np.clip(np.asarray(remaining, dtype=np.float64) / per_step, 1.0, most_steps)
        catch[first[some]] = np.asarray(behind, dtype=np.float64)[some] * draft.catch_up / spread[some]
    # the rank: a first draft's worth less its catch-up's time in tokens (at the step's rate
    # without drafts); a later draft ranks no higher than its request's first
    more, dearer = (calibration.tokens, calibration.seconds) if calibration is not None else (1.0, 1.0)
    rank = more * gain - catch * len(rates) / base
    rank = np.minimum(rank, rank[np.repeat(first, limits)])
    # a draft model's j-th forward costs about as much for one row as for a few: the first
    # draft kept j deep adds a forward, the others that deep a row each. So the prefixes of
    # one order by worth can miss a shallower choice for more requests: at 4 requests of the
    # built-in EAGLE head, a request accepted at 0.95 had its 4 drafts rank above the others'
    # first (0.8), 4 forwards, where one draft each was 1 forward and the target's step as
    # cheap. Each cap on the depth (1, 2, 3, 4, 8, 16 and the deepest) is an order of its
    # own, the drafts at most that deep by worth; the best prefix of any of them is kept.
    most = int(limits.max())
    caps = np.array([most] if draft is None else sorted({d for d in (1, 2, 3, 4, 8, 16) if d < most} | {most}))
    within = depth[None, :] <= caps[:, None]  # [caps, drafts]
    orders = np.argsort(-np.where(within, rank[None, :], -np.inf), axis=1, kind="stable")  # j before j + 1
    zero = np.zeros((len(caps), 1))
    expected = len(rates) + np.concatenate((zero, np.cumsum(gain[orders], axis=1)), axis=1)
    seconds = zero + (cost.forward(num_tokens + np.arange(total + 1)) + attention + cost.overhead)  # [caps, kept]
    catching = np.concatenate((zero, np.cumsum(catch[orders], axis=1)), axis=1)  # (not scaled by the calibration)
    context = np.asarray(contexts, dtype=np.float64)[owner[orders]] if contexts is not None else None
    if context is not None:
        seconds = seconds + np.concatenate((zero, np.cumsum(cost.query_attention * context, axis=1)), axis=1)
    verifying = seconds - seconds[:, :1]  # the target's forward and attention for the drafts kept
    seconds[:, 1:] += cost.verify  # once a step, if it verifies any
    if context is not None and draft is not None:
        seconds = seconds + np.concatenate((zero, np.cumsum(draft.attention * context, axis=1)), axis=1)
    if draft is not None:  # rows of the draft's j-th forward among the first m drafts kept
        weight = np.ones(total)  # a draft's rows in its forward: its first's first_rows
        if first_rows is not None:
            weight[first[some]] = np.asarray(first_rows, dtype=np.float64)[some]
        rows = np.zeros((len(caps), total + 1, most))
        rows[np.arange(len(caps))[:, None], np.arange(1, total + 1)[None, :], depth[orders] - 1] = weight[orders]
        rows = np.cumsum(rows, axis=1)
        seconds = seconds + np.where(rows > 0, draft.forward(rows) + draft.overhead, 0.0).sum(axis=2)
        seconds[:, 1:] += draft.fixed  # once a step, if it drafts at all
    n = len(rates)
    rate = (n + more * (expected - n)) / (seconds[:, :1] + dearer * (seconds - seconds[:, :1]) + catching)
    rate[np.arange(total + 1)[None, :] > within.sum(axis=1)[:, None]] = -np.inf  # past a cap's drafts
    cap, keep = divmod(int(np.argmax(rate)), total + 1)
    if calibration is not None:
        calibration.chosen = (float(expected[cap, keep]) - n, float(seconds[cap, keep] - seconds[cap, 0]),
                              float(verifying[cap, keep])) if keep else None
    return np.bincount(owner[orders[cap, :keep]], minlength=len(rates)).tolist()


def _choose_one(rate: float, limit: int, num_tokens: int, cost: StepCost, draft: StepCost | None,
                contexts: list[int] | None, behind: list[int] | None, remaining: list[int] | None,
                first_rows: list[int] | None, calibration: Calibration | None, later: float | None,
                attention: float = 0.0) -> int:
    """choose_num_drafts for one request, in plain Python: its drafts go in depth order, so the
    choice is the k in 0..limit with the most tokens a second, the same model term by term.
    (The general form's numpy calls took 0.125 ms a step, 4% of a drafting step of the built-in
    model and its EAGLE head at one request; this takes a few microseconds.)"""
    c = rate if later is None else max(rate, later)
    gains = [rate * c ** (j - 1) if later is not None else rate ** j for j in range(1, limit + 1)]
    forward = cost.forward(num_tokens + np.arange(limit + 1)).tolist()  # (one interpolation)
    catch = 0.0  # the request's catch-up's share in this step
    if behind is not None and draft is not None and draft.catch_up > 0:
        most_steps = CATCH_UP_STEPS if calibration is not None and calibration.confirmed else DOUBTFUL_CATCH_UP_STEPS
        spread = float(most_steps)
        if remaining is not None:
            spread = min(max(remaining[0] / (1 + sum(gains)), 1.0), most_steps)
        catch = behind[0] * draft.catch_up / spread
    batch = attention  # the step's attention without drafts, then with each draft's in both forwards
    per_query = per_token = 0.0  # a draft's attention in the target's forward, and in both forwards
    if contexts is not None:
        per_query = cost.query_attention * contexts[0]
        per_token = per_query + (draft.attention * contexts[0] if draft is not None else 0.0)
    drafting, fixed = [], 0.0  # the draft's j-th forward's seconds, and once a step that drafts
    if draft is not None:
        fixed = draft.fixed
        first = float(first_rows[0]) if first_rows is not None else 1.0
        one, rows = draft.forward(np.array([first, 1.0])).tolist()
        drafting = [(one if j == 1 else rows) + draft.overhead for j in range(1, limit + 1)]
    more, dearer = (calibration.tokens, calibration.seconds) if calibration is not None else (1.0, 1.0)
    base = forward[0] + attention + cost.overhead
    best, best_rate, expected, forwards = 0, 1.0 / base, 1.0, 0.0
    chosen = None
    for k in range(1, limit + 1):
        expected += gains[k - 1]
        batch += per_token
        if drafting:
            forwards += drafting[k - 1]
        seconds = forward[k] + cost.overhead + cost.verify + batch + forwards + fixed
        k_rate = (1 + more * (expected - 1)) / (base + dearer * (seconds - base) + catch)
        if k_rate > best_rate:
            best, best_rate, chosen = k, k_rate, (expected - 1, seconds - base, forward[k] - forward[0] + k * per_query)
    if calibration is not None:
        calibration.chosen = chosen if best else None
    return best
