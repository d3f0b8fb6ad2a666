"""Adaptive speculation's check of its own predictions (see executor/spec/adaptive.py): what
the chosen drafts really added to the steps that verified them, against what choosing them
predicted."""

from __future__ import annotations

# the share of the tokens per second predicted that confirms the drafts (Calibration.confirmed):
# where they are confirmed, a request's catch-up is spread over more steps (adaptive.CATCH_UP_STEPS)
CONFIRMED = 0.9

# the most a drafting step's added seconds count for, and the calibration's seconds ratio, in
# times the prediction
SECONDS_LIMIT = 4.0


class Calibration:
    """What the chosen drafts really added to the steps that verified them, against what
    choosing them predicted; the ratios scale the next choices' tokens and seconds.

    The step cost and the acceptance rates are models, and their errors can favour drafts:
    on a 2-core CPU the built-in draft model at 4 requests chose drafts predicted to give
    5.5 tokens in 21.2 ms (against 4 tokens in 13.7 ms without), while the steps that
    verified them gave 5.1 tokens in 23.0 ms, and steps without drafts took 12.3 ms: 222
    tokens/s drafting against 320 without. Whatever part of the model is off (the
    target's verifying forward slower once the drafter has evicted its weights from cache,
    overhead learnt from drafting steps that made steps without drafts look dearer), each
    step that verifies chosen drafts measures it: the tokens they added (accepted drafts)
    against the tokens expected, and the seconds they added (the drafting before the step,
    and the step's time over its cost without the drafts) against the seconds predicted.
    The ratios are moving sums over those steps, starting from `prior_tokens` predicted
    tokens' worth of steps as predicted; a step's weight decays by `decay` for each token
    predicted after it, so that the sums hold about the last 100 predicted tokens at any
    batch size. (Decaying by 0.95 a step, they held 20 steps: at one request 20-30 tokens,
    where a request's run of rejected drafts, which its own rate followed already, took the
    tokens' ratio to 0.5-0.6 for a while, and the next request's prompt then never seemed
    worth catching up with: the built-in draft model drafted for none of its 128 tokens.)"""

    def __init__(self, decay: float = 0.99, prior_tokens: float = 10.0, keep: float = 0.999) -> None:
        self.decay, self.prior_tokens, self.keep = decay, prior_tokens, keep
        self.tokens = 1.0  # tokens drafts added / predicted
        self.seconds = 1.0  # seconds drafts added / predicted
        self.sums: list[float] | None = None  # real tokens, predicted tokens, real seconds, predicted seconds
        # whether the drafts gave at least CONFIRMED of the tokens per second predicted, as of
        # the last step that verified chosen ones (fading does not confirm them)
        self.confirmed = False
        # this step's choice: extra (tokens, seconds) predicted, its catch-ups left out, and of
        # the seconds, the target's forward and attention for the drafts (StepCost.observe_verify)
        self.chosen: tuple[float, float, float] | None = None
        # the last step's choice, and its drafting's seconds and the catch-ups' part of them
        self.pending: tuple[float, float, float, float, float] | None = None

    def observe(self, predicted_tokens: float, predicted_seconds: float, tokens: float, seconds: float) -> None:
        """A step verified chosen drafts: they added `tokens` and `seconds` against the
        predicted ones. A stall counts for at most 4 times the prediction; a step faster
        than its cost without drafts, for no added time."""
        if predicted_seconds <= 0:
            return
        seconds = min(max(seconds, 0.0), SECONDS_LIMIT * predicted_seconds)
        predicted_tokens = max(predicted_tokens, 1e-6)
        d = self.decay ** predicted_tokens
        if self.sums is None:
            w = self.prior_tokens / predicted_tokens
            self.sums = [w * predicted_tokens, w * predicted_tokens, w * predicted_seconds, w * predicted_seconds]
        s = self.sums
        s[0], s[1] = d * s[0] + tokens, d * s[1] + predicted_tokens
        s[2], s[3] = d * s[2] + seconds, d * s[3] + predicted_seconds
        self._ratios()
        self.confirmed = self.tokens >= CONFIRMED * self.seconds

    def fade(self) -> None:
        """A step without drafts teaches nothing here; what made drafts lose (another load on
        the machine, a phase of the outputs) may have passed, so the ratios return towards 1
        (x0.999 of their distance a step) and drafting is tried again some time. Not faster:
        at x0.99 an EAGLE engine of 16 requests on the rewrite set forgot in about 200 steps
        that its drafts had cost twice the seconds predicted, drafted again (its requests'
        catch-ups first), learnt it again, and ran at 0.955x of no speculation against
        0.981x (medians of 4 rounds, taking turns); explorations still try drafts again."""
        if self.sums is not None:
            s, k = self.sums, self.keep
            s[0], s[2] = k * s[0] + (1 - k) * s[1], k * s[2] + (1 - k) * s[3]
            self._ratios()

    def _ratios(self) -> None:
        s = self.sums
        self.tokens = min(4.0, max(0.25, s[0] / s[1])) if s[1] > 0 else 1.0
        self.seconds = min(SECONDS_LIMIT, max(0.25, s[2] / s[3]))

    def __repr__(self) -> str:
        return f"drafts give {self.tokens:.2f}x the tokens predicted, in {self.seconds:.2f}x the seconds"
