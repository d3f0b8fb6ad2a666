"""POST /v1/completions: prompts (text or token ids) in, JSON or SSE chunks out.

`echo` with `logprobs` returns the prompt's tokens with their logprobs ahead of the
generated ones (prompt logprobs, computed in the prefill's forward), as OpenAI's
legacy API and lm-evaluation-harness's loglikelihood tasks use it; with
`max_tokens: 0` nothing generated is returned.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from tokenmill.engine.request import RequestOutput
from tokenmill.server.protocol import APIError, CompletionRequest
from tokenmill.server.serving import Choice, Envelope, OpenAIServing, Origin, top_entries, usage


class CompletionServing(OpenAIServing):
    def prepare_completion(self, req: CompletionRequest, origin: Origin = Origin()) -> tuple[str, list[Choice]]:
        if req.suffix:
            raise APIError(400, "suffix: not supported", param="suffix")
        if req.stream and req.best_of is not None and req.best_of > req.n:
            raise APIError(400, "best_of: cannot be streamed when it is above n (the best are known at the end)",
                           param="best_of")
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens: 0 is only allowed with echo (the prompt back, with its logprobs if "
                           "asked, and nothing generated); otherwise it must be >= 1", param="max_tokens")
        prompts = _completion_prompts(req.prompt)
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)
        # max_tokens 0: the prefill samples one token anyway; the answer leaves it out
        max_tokens = 1 if req.max_tokens == 0 else req.max_tokens
        params = self.sampling_params(req, max_tokens, req.logprobs, prompt_logprobs, req.best_of)
        rid = f"cmpl-{uuid.uuid4().hex}"
        return rid, self.submit(prompts, params, req.n, rid, origin=origin)

    async def completion(self, req: CompletionRequest, rid: str, choices: list[Choice]) -> dict[str, Any]:
        finals = await self.final_outputs(choices, req.n)
        out_choices = []
        for c, out in zip(choices, finals):
            comp = out.outputs[0]
            echo_only = req.max_tokens == 0
            text = "" if echo_only else comp.text
            token_ids = [] if echo_only else comp.token_ids
            entries = [] if echo_only else (comp.logprobs or [])
            if req.echo:
                text = self._prompt_text(c) + text
            logprobs = None
            if req.logprobs is not None:
                if req.echo:
                    token_ids = out.prompt_token_ids + token_ids
                    entries = out.prompt_logprobs + entries
                logprobs = self._completion_logprobs(token_ids, entries, 0, req.logprobs)
            choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": comp.finish_reason}
            if self._token_ids(req):
                choice.update(prompt_token_ids=out.prompt_token_ids, token_ids=[] if echo_only else comp.token_ids)
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.prompt_logprobs(out, req.prompt_logprobs)
            out_choices.append(choice)
        envelope = Envelope(rid, "text_completion", self.model_name(req.model))
        return envelope.response(out_choices, usage(choices, finals, req.n, generated=req.max_tokens != 0))

    async def completion_stream(self, req: CompletionRequest, rid: str, choices: list[Choice]) -> AsyncIterator[str]:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        envelope = Envelope(rid, "text_completion", self.model_name(req.model), include_usage)

        def choice(index: int, text: str, logprobs: dict | None = None, finish: str | None = None) -> dict:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

        # the echoed prompt goes first; with logprobs, prompt_logprobs or token ids it waits for the prefill
        with_ids = self._token_ids(req)
        wait_for_prefill = (req.echo and req.logprobs is not None) or req.prompt_logprobs is not None or with_ids
        if req.echo and not wait_for_prefill:
            for c in choices:
                yield envelope.chunk(choice(c.index, self._prompt_text(c)))
        offsets = {c.index: 0 for c in choices}
        first = {c.index for c in choices} if wait_for_prefill else set()
        by_index = {c.index: c for c in choices}

        def chunks(index: int, out: RequestOutput) -> Iterator[str]:
            if index in first:  # the prompt's part, once its logprobs are known
                first.discard(index)
                head = choice(index, self._prompt_text(by_index[index]) if req.echo else "")
                if req.echo and req.logprobs is not None:
                    head["logprobs"] = self._completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, 0,
                                                                 req.logprobs)
                    offsets[index] = _end_offset(head["logprobs"])
                if req.prompt_logprobs is not None:
                    head["prompt_logprobs"] = self.prompt_logprobs(out, req.prompt_logprobs)
                if with_ids:
                    head.update(prompt_token_ids=out.prompt_token_ids, token_ids=[])
                yield envelope.chunk(head)
            new_ids = [] if req.max_tokens == 0 else out.new_token_ids
            logprobs = None
            if req.logprobs is not None and new_ids:
                logprobs = self._completion_logprobs(new_ids, out.new_logprobs or [], offsets[index], req.logprobs)
                offsets[index] = _end_offset(logprobs)
            text = "" if req.max_tokens == 0 else out.new_text
            finish = out.outputs[0].finish_reason if out.finished else None
            if text or logprobs or finish or (with_ids and new_ids):
                body = choice(index, text, logprobs, finish)
                if with_ids:
                    body["token_ids"] = new_ids
                yield envelope.chunk(body)

        async for chunk in self.sse_stream(choices, envelope, req.n, chunks, generated=req.max_tokens != 0):
            yield chunk

    def _completion_logprobs(self, token_ids: Sequence[int], entries: Sequence[dict[int, float] | None],
                             offset: int, top_n: int) -> dict[str, Any]:
        """OpenAI's legacy logprobs object; an entry of None (the first prompt token) is null."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token, entry in zip(token_ids, entries):
            text = self.token_text(token)
            tokens.append(text)
            token_logprobs.append(None if entry is None else entry.get(token))
            top.append(None if entry is None else
                       {self.token_text(t): lp for t, lp in top_entries(entry, token, top_n)})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _token_ids(self, req: CompletionRequest) -> bool:
        """Token ids in the answer: asked for, or the only output there is (no tokenizer)."""
        return req.return_token_ids or self.tokenizer is None

    def _prompt_text(self, c: Choice) -> str:
        if c.prompt_text is not None:
            return c.prompt_text
        return "" if self.tokenizer is None else self.tokenizer.decode(c.request.prompt_token_ids)


def _end_offset(logprobs: dict[str, Any]) -> int:
    """text_offset just past the last token of a logprobs object."""
    if not logprobs["tokens"]:
        return 0
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def _completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be an empty list", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]
