"""POST /v1/chat/completions: messages through the chat template, JSON or SSE chunks out."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from tokenmill.engine.request import RequestOutput
from tokenmill.server.protocol import APIError, ChatCompletionRequest
from tokenmill.server.serving import Choice, Envelope, Origin, OpenAIServing, usage

# used when the tokenizer has no chat template of its own
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# apply_chat_template's own arguments: chat_template_kwargs only feeds the template's variables
_RESERVED_TEMPLATE_ARGS = {"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                           "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                           "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


class ChatServing(OpenAIServing):
    def prepare_chat(self, req: ChatCompletionRequest, origin: Origin = Origin()) -> tuple[str, list[Choice]]:
        if self.tokenizer is None:
            raise APIError(400, "messages: chat needs a tokenizer (its template), and this server runs with "
                           "--skip-tokenizer-init; use /v1/completions with token ids", param="messages")
        if req.tools:
            raise APIError(400, "tools: not supported", param="tools")
        if req.echo:
            raise APIError(400, "echo: not supported on chat completions (use /v1/completions)", param="echo")
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "prompt_logprobs: returned in a whole chat answer only, not in a stream",
                           param="prompt_logprobs")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
        prompt_ids = self.chat_prompt(req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, max_tokens, logprobs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return rid, self.submit([prompt_ids], params, req.n, rid, prompt_param="messages", origin=origin)

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        return chat_prompt_ids(self.tokenizer, req)

    async def chat(self, req: ChatCompletionRequest, rid: str, choices: list[Choice]) -> dict[str, Any]:
        finals = await self.final_outputs(choices, req.n)
        out_choices = []
        for c, out in zip(choices, finals):
            comp = out.outputs[0]
            logprobs = None
            if req.logprobs:
                logprobs = {"content": self._chat_logprobs(comp.token_ids, comp.logprobs or [], req.top_logprobs or 0)}
            out_choices.append({"index": c.index, "message": {"role": "assistant", "content": comp.text},
                                "logprobs": logprobs, "finish_reason": comp.finish_reason})
        envelope = Envelope(rid, "chat.completion", self.model_name(req.model))
        response = envelope.response(out_choices, usage(choices, finals, req.n))
        if req.prompt_logprobs is not None:
            response["prompt_logprobs"] = self.prompt_logprobs(finals[0], req.prompt_logprobs)
        return response

    async def chat_stream(self, req: ChatCompletionRequest, rid: str, choices: list[Choice]) -> AsyncIterator[str]:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        envelope = Envelope(rid, "chat.completion.chunk", self.model_name(req.model), include_usage)

        def choice(index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None) -> dict:
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

        for c in choices:
            yield envelope.chunk(choice(c.index, {"role": "assistant", "content": ""}))

        def chunks(index: int, out: RequestOutput) -> Iterator[str]:
            logprobs = None
            if req.logprobs and out.new_token_ids:
                logprobs = {"content": self._chat_logprobs(out.new_token_ids, out.new_logprobs or [],
                                                           req.top_logprobs or 0)}
            if out.new_text or logprobs:
                yield envelope.chunk(choice(index, {"content": out.new_text}, logprobs))
            if out.finished:
                yield envelope.chunk(choice(index, {}, finish=out.outputs[0].finish_reason))

        async for chunk in self.sse_stream(choices, envelope, req.n, chunks):
            yield chunk

    def _chat_logprobs(self, token_ids: Sequence[int], entries: Sequence[dict[int, float]],
                       top_n: int) -> list[dict[str, Any]]:
        content = []
        for token, entry in zip(token_ids, entries):
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({**self._chat_token(token, entry.get(token, float("-inf"))),
                            "top_logprobs": [self._chat_token(t, lp) for t, lp in top]})
        return content

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_prompt_ids(tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids: the messages through the tokenizer's chat template (a plain
    `role: content` one when it has none); raises APIError naming what it rejects. The
    standalone router (router/server.py) tokenizes chat requests with it too, to route them."""
    conversation = []
    for i, message in enumerate(req.messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type")
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content[{j}]: content parts of type {kind!r} are not "
                                   "supported (only 'text' with a string 'text')",
                                   param=f"messages[{i}].content[{j}].type")
                texts.append(part["text"])
            content = "\n".join(texts)
        conversation.append({"role": message.role, "content": content or ""})
    template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
    extra = req.chat_template_kwargs or {}
    reserved = sorted(set(extra) & _RESERVED_TEMPLATE_ARGS)
    if reserved:
        raise APIError(400, f"chat_template_kwargs: {', '.join(reserved)} cannot be set here",
                       param="chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                             add_generation_prompt=req.add_generation_prompt, **extra)
    except Exception as e:  # noqa: BLE001 - jinja raises what the template raises
        raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages") from e
    return tokenizer.encode(text, add_special_tokens=False)
