"""OpenAI request/response schemas (pydantic) and the OpenAI-style error body.

Requests are validated strictly (a string is not a number) and extra fields that
OpenAI clients send (`user`, `metadata`, ...) are ignored. Fields that would
change the output but are not implemented are rejected with a 400, not ignored.
Extensions follow vLLM's names: `top_k`, `min_p`, `ignore_eos`, `min_tokens`,
`stop_token_ids`, `skip_special_tokens`, `include_stop_str_in_output`,
`repetition_penalty`, `bad_words`, `prompt_logprobs`, `structured_outputs` and the older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 128
MAX_TOP_LOGPROBS = 20


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """Raised anywhere in a handler; answered as `{"error": {...}}` with `status_code`."""

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code, self.message, self.param = status_code, message, param
        self.type, self.code, self.headers = type, code, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class JSONSchema(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs (exactly one of json, regex, choice, grammar, json_object)."""

    model_config = ConfigDict(strict=True, extra="forbid")  # structural_tag and others: not supported

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    whitespace_pattern: str | None = None


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat. None means the default."""

    model: str | None = Field(None, description="served model name; default: the one served")
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="extension: -1 or 0 disables")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="extension")
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = Field(None, description="up to 4 strings (OpenAI); more are accepted")
    stop_token_ids: list[int] | None = Field(None, description="extension")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="extension: generate max_tokens tokens whatever they are")
    min_tokens: int = Field(0, ge=0, description="extension")
    skip_special_tokens: bool = Field(True, description="extension")
    include_stop_str_in_output: bool = Field(False, description="extension")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0, description="extension (vLLM); 1: off")
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    bad_words: list[str] | None = Field(None, description="extension (vLLM): words never generated")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                        description="extension (vLLM): top-N logprobs of every prompt token")
    response_format: ResponseFormat | None = Field(None, description="json_object, or json_schema with its schema")
    structured_outputs: StructuredOutputs | None = Field(None, description="extension (vLLM)")
    guided_json: str | dict[str, Any] | None = Field(None, description="extension (vLLM, older name)")
    guided_regex: str | None = Field(None, description="extension (vLLM, older name)")
    guided_choice: list[str] | None = Field(None, description="extension (vLLM, older name)")
    guided_grammar: str | None = Field(None, description="extension (vLLM, older name): Lark or GBNF")
    guided_whitespace_pattern: str | None = Field(None, description="extension (vLLM, older name)")
    user: str | None = None
    priority: int | None = Field(None, ge=-(2**31), lt=2**31,
                                 description="extension (vLLM): lower runs first; with tenants, at least the "
                                             "tenant's own priority")


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="a string, a list of strings, a list of token ids, or a list of those")
    max_tokens: int | None = Field(16, ge=0, description="default 16, as OpenAI's; 0 only with echo")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="sequences generated, >= n; the n of highest "
                                "cumulative logprob are returned (not with stream)")
    suffix: str | None = Field(None, description="not supported")
    return_token_ids: bool = Field(False, description="extension (vLLM): prompt_token_ids and token_ids in each "
                                   "choice; always on when the server has no tokenizer (--skip-tokenizer-init)")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # parts other than text are answered with a 400 naming the part
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    max_completion_tokens: int | None = Field(None, ge=1, description="same as max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = Field(True, description="extension")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extension: passed to the template")
    tools: list[dict[str, Any]] | None = Field(None, description="not supported: must be empty")
    echo: bool = Field(False, description="not supported on chat (completions only)")


# -- responses (documented in /openapi.json; built as plain dicts on the hot path) ----------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    # extension (vLLM): per prompt token, None for the first, else {token id: {logprob, decoded_token}}
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    prompt_token_ids: list[int] | None = None  # extension (vLLM): with return_token_ids
    token_ids: list[int] | None = None  # extension (vLLM): with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatChoice(BaseModel):
    index: int
    message: dict[str, Any]
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # extension (vLLM), as in completions


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenmill"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
