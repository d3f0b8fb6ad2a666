"""What completions and chat share on top of EngineClient: sampling parameters, one
engine request per choice (prompts x n), merged output streams, usage, errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.async_engine import EngineClient, QueueFullError
from tokenmill.engine.request import Request, RequestOutput
from tokenmill.sampling_params import ParamError, SamplingParams
from tokenmill.server.protocol import APIError, _SamplingRequest
from tokenmill.server.structured_outputs import constraints, named, structured_field, structured_outputs


@dataclass(frozen=True, slots=True)
class Origin:
    """Who sent a request, as the engine's queue policies see it (server/tenancy.py)."""

    tenant: str | None = None
    weight: float = 1.0
    priority: int = 0


@dataclass(slots=True)
class Meter:
    """The tokens one answer has generated so far, over all its prompts and the sequences it
    returns: what its tenant is charged for completion (server/tenancy.py)."""

    completion_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.completion_tokens += len(out.new_token_ids)


@dataclass(slots=True)
class Choice:
    index: int
    request: Request
    prompt_text: str | None
    meter: Meter = field(default_factory=Meter)  # shared by all choices of one answer


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class OpenAIServing:
    def __init__(self, engine: EngineClient, served_model_names: Sequence[str]) -> None:
        self.engine = engine
        self.model_names = list(served_model_names)
        self.tokenizer = engine.tokenizer
        self._token_text: dict[int, str] = {}

    # -- shared ---------------------------------------------------------------
    def model_name(self, requested: str | None) -> str:
        if requested is None:
            return self.model_names[0]
        if requested not in self.model_names:
            raise APIError(404, f"The model `{requested}` does not exist; this server serves "
                           f"{', '.join(self.model_names)}", param="model", code="model_not_found")
        return requested

    def sampling_params(self, req: _SamplingRequest, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None, best_of: int | None = None) -> SamplingParams:
        if self.tokenizer is None and constraints(req):
            field = structured_field(req)
            raise APIError(400, f"{field}: structured outputs need a tokenizer, and this server runs with "
                           "--skip-tokenizer-init", param=field)
        defaults = SamplingParams()
        try:
            return SamplingParams(
                max_tokens=max_tokens, n=req.n, best_of=best_of, seed=req.seed, stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                temperature=defaults.temperature if req.temperature is None else req.temperature,
                top_p=defaults.top_p if req.top_p is None else req.top_p,
                top_k=defaults.top_k if req.top_k is None else req.top_k,
                min_p=defaults.min_p if req.min_p is None else req.min_p,
                ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                logit_bias=req.logit_bias, bad_words=req.bad_words,
                prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                structured_outputs=structured_outputs(req))
        except ValueError as e:
            raise bad_request(e) from e

    async def compile_grammar(self, req: _SamplingRequest, choices: list[Choice]) -> None:
        """The request's grammar compiled against the tokenizer (or found in the cache) before
        it is queued: one that only fails there (a token the vocabulary lacks) is a 400 naming
        its field, not a failed generation."""
        spec = choices[0].request.sampling_params.structured_outputs if choices else None
        if spec is None or self.engine.grammars is None:
            return
        try:
            await asyncio.wrap_future(self.engine.grammars.compile(spec))
        except ParamError as e:
            raise named(e, structured_field(req)) from e

    def submit(self, prompts: Sequence[str | list[int]], params: SamplingParams, n: int, base_id: str,
               prompt_param: str = "prompt", origin: Origin = Origin()) -> list[Choice]:
        """Validates one engine request per prompt (its n sequences are forked inside the
        engine) and checks the queue bound; nothing is queued yet. Returns the n choices of
        each prompt, in order, sharing their prompt's request."""
        if not self.engine.is_running:
            raise APIError(503, "the engine is not running", type="server_error", code="engine_unavailable")
        total = len(prompts) * params.num_sequences
        if total > self.engine.max_waiting_requests:
            param = "best_of" if params.best_of else "n"
            raise APIError(400, f"this request asks for {total} sequences (prompts x {param}); the server queues "
                           f"at most {self.engine.max_waiting_requests}", param=param)
        try:
            self.engine.check_capacity(len(prompts))
        except QueueFullError as e:
            raise APIError(503, str(e), type="server_error", code="overloaded", headers={"Retry-After": "1"}) from e
        choices = []
        meter = Meter()
        for i, prompt in enumerate(prompts):
            try:
                request, text = self.engine.make_request(prompt, params, request_id=f"{base_id}-{i}",
                                                         priority=origin.priority, tenant=origin.tenant,
                                                         tenant_weight=origin.weight)
            except ValueError as e:
                raise bad_request(e, prompt_param, index=i if len(prompts) > 1 else None) from e
            choices.extend(Choice(i * n + j, request, text, meter) for j in range(n))
        return choices

    async def outputs(self, choices: list[Choice], n: int) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output delta of that choice's sequence) as they come, from every
        prompt's request; closing it aborts them all."""
        requests = choices[::n]
        if len(requests) == 1:
            c = requests[0]
            async with contextlib.aclosing(self.engine.generate(c.request, c.prompt_text)) as gen:
                async for out in gen:
                    c.meter.add(out)
                    yield c.index + out.outputs[0].index, out
            return
        merged: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

        async def pump(c: Choice) -> None:
            async for out in self.engine.generate(c.request, c.prompt_text):
                c.meter.add(out)
                merged.put_nowait((c.index + out.outputs[0].index, out))

        tasks = [asyncio.ensure_future(pump(c)) for c in requests]
        try:
            remaining = len(tasks)
            while remaining:
                index, out = await merged.get()
                remaining -= out.finished
                yield index, out
        finally:
            for t in tasks:
                t.cancel()

    async def deltas(self, choices: list[Choice], n: int, finals: dict[int, RequestOutput]
                     ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """outputs(), keeping each choice's last output, once its sequence has finished, in
        `finals`; raises GenerationFailed when a request ends in an error (the others are
        then aborted)."""
        async with contextlib.aclosing(self.outputs(choices, n)) as stream:
            async for index, out in stream:
                finish = out.outputs[0].finish_reason
                if out.error is not None or finish == "abort":
                    raise GenerationFailed(out.error or "aborted by the server")
                if finish is not None:
                    finals[index] = out
                yield index, out

    async def sse_stream(self, choices: list[Choice], envelope: Envelope, n: int,
                         chunks: Callable[[int, RequestOutput], Iterable[str]],
                         generated: bool = True) -> AsyncIterator[str]:
        """The SSE body of a streamed answer: `chunks(index, output)` for every delta, then an
        error event if a choice failed, else the usage chunk (when asked for), then [DONE].
        `generated=False`: the answer leaves out the generated tokens (echo with max_tokens 0)."""
        finals: dict[int, RequestOutput] = {}
        try:
            async for index, out in self.deltas(choices, n, finals):
                for chunk in chunks(index, out):
                    yield chunk
        except GenerationFailed as e:
            yield error_event(e)
        else:
            if envelope.include_usage:
                yield envelope.usage_chunk(usage(choices, [finals[c.index] for c in choices], n, generated))
        yield SSE_DONE

    async def final_outputs(self, choices: list[Choice], n: int) -> list[RequestOutput]:
        """Each choice's last output, in choice order."""
        finals: dict[int, RequestOutput] = {}
        try:
            async for _ in self.deltas(choices, n, finals):
                pass
        except GenerationFailed as e:
            raise APIError(500, str(e), type="server_error", code="generation_failed") from e
        return [finals[c.index] for c in choices]

    def prompt_logprobs(self, out: RequestOutput, top_n: int) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's `prompt_logprobs` field: per prompt token (None for the first) the top-N and
        the token itself, {token id: {"logprob", "decoded_token"}}."""
        if out.prompt_logprobs is None:
            return None
        return [None if entry is None else {str(t): {"logprob": lp, "decoded_token": self.token_text(t)}
                                            for t, lp in top_entries(entry, token, top_n)}
                for token, entry in zip(out.prompt_token_ids, out.prompt_logprobs)]

    def token_text(self, token_id: int) -> str:
        """A token as text; without a tokenizer (skip_tokenizer_init) "token_id:N", as vLLM's
        return_tokens_as_token_ids writes it."""
        text = self._token_text.get(token_id)
        if text is None:
            text = f"token_id:{token_id}" if self.tokenizer is None else self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text


# -- helpers ------------------------------------------------------------------------------------
def top_entries(entry: dict[int, float], token: int, top_n: int) -> list[tuple[int, float]]:
    """The top-N of a logprobs dict, most likely first, plus `token` where it is not among them."""
    top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
    if token in entry and all(t != token for t, _ in top):
        top.append((token, entry[token]))
    return top


def bad_request(e: ValueError, prompt_param: str = "prompt", index: int | None = None) -> APIError:
    """A ValueError from SamplingParams or the engine as a 400 naming its parameter (a
    ParamError carries it in `.param`)."""
    message = str(e)
    param = getattr(e, "param", None)
    if param in ("prompt", "prompt_token_ids"):
        param = prompt_param if index is None else f"{prompt_param}[{index}]"
        if index is not None:
            message = f"{prompt_param}[{index}]: {message}"
    return APIError(400, message, param=param)


def usage(choices: Sequence[Choice], finals: Sequence[RequestOutput], n: int,
          generated: bool = True) -> dict[str, int]:
    # a prompt counts once, however many samples it had
    prompt = sum(len(c.request.prompt_token_ids) for c in choices[::n])
    completion = sum(len(out.outputs[0].token_ids) for out in finals) if generated else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class GenerationFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(f"generation failed: {reason}")


@dataclass(slots=True)
class Envelope:
    """The fields every answer and every chunk of one request repeats; a chunk's JSON around
    its choice is rendered once."""

    id: str
    object: str
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    _head: str = field(init=False, repr=False)
    _tail: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        head = sse({"id": self.id, "object": self.object, "created": self.created, "model": self.model})
        self._head = head[:-len("}\n\n")] + ',"choices":['
        # OpenAI: usage is null on every chunk but the last when usage was asked for
        self._tail = '],"usage":null}\n\n' if self.include_usage else "]}\n\n"

    def response(self, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage}

    def chunk(self, choice: dict[str, Any]) -> str:
        return self._head + json.dumps(choice, ensure_ascii=False, separators=(",", ":")) + self._tail

    def usage_chunk(self, usage: dict[str, int]) -> str:
        return sse({"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                    "choices": [], "usage": usage})


def error_event(e: GenerationFailed) -> str:
    return sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": "generation_failed"}})


SSE_DONE = "data: [DONE]\n\n"
