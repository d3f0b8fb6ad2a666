"""POST /v1/completions: prompts (text or token ids) in, JSON or SSE chunks out."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from tokenmill.engine.request import RequestOutput
from tokenmill.server.protocol import APIError, CompletionRequest
from tokenmill.server.serving import Choice, Envelope, OpenAIServing, usage


class CompletionServing(OpenAIServing):
    def prepare_completion(self, req: CompletionRequest) -> tuple[str, list[Choice]]:
        if req.suffix:
            raise APIError(400, "suffix: not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of: only best_of == n is supported", param="best_of")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs needs prompt logprobs, which this server does not compute yet",
                           param="echo")
        prompts = _completion_prompts(req.prompt)
        params = self.sampling_params(req, req.max_tokens, req.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        return rid, self.submit(prompts, params, req.n, rid)

    async def completion(self, req: CompletionRequest, rid: str, choices: list[Choice]) -> dict[str, Any]:
        finals = await self.final_outputs(choices)
        out_choices = []
        for c, out in zip(choices, finals):
            comp = out.outputs[0]
            text = (self._prompt_text(c) + comp.text) if req.echo else comp.text
            logprobs = None
            if req.logprobs is not None:
                logprobs = self._completion_logprobs(comp.token_ids, comp.logprobs or [], 0)
            out_choices.append({"index": c.index, "text": text, "logprobs": logprobs,
                                "finish_reason": comp.finish_reason})
        envelope = Envelope(rid, "text_completion", self.model_name(req.model))
        return envelope.response(out_choices, usage(choices, finals, req.n))

    async def completion_stream(self, req: CompletionRequest, rid: str, choices: list[Choice]) -> AsyncIterator[str]:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        envelope = Envelope(rid, "text_completion", self.model_name(req.model), include_usage)

        def choice(index: int, text: str, logprobs: dict | None = None, finish: str | None = None) -> dict:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

        if req.echo:
            for c in choices:
                yield envelope.chunk(choice(c.index, self._prompt_text(c)))
        offsets = {c.index: 0 for c in choices}

        def chunks(index: int, out: RequestOutput) -> Iterator[str]:
            logprobs = None
            if req.logprobs is not None and out.new_token_ids:
                logprobs = self._completion_logprobs(out.new_token_ids, out.new_logprobs or [], offsets[index])
                offsets[index] += sum(len(t) for t in logprobs["tokens"])
            finish = out.outputs[0].finish_reason if out.finished else None
            if out.new_text or logprobs or finish:
                yield envelope.chunk(choice(index, out.new_text, logprobs, finish))

        async for chunk in self.sse_stream(choices, envelope, req.n, chunks):
            yield chunk

    def _completion_logprobs(self, token_ids: Sequence[int], entries: Sequence[dict[int, float]],
                             offset: int) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token, entry in zip(token_ids, entries):
            text = self.token_text(token)
            tokens.append(text)
            token_logprobs.append(entry.get(token))
            top.append({self.token_text(t): lp for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _prompt_text(self, c: Choice) -> str:
        return c.prompt_text if c.prompt_text is not None else self.tokenizer.decode(c.request.prompt_token_ids)


def _completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be an empty list", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]
