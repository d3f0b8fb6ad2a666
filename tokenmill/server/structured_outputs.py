"""The output constraint of a request (structured outputs), from whichever field gives it:
OpenAI's `response_format`, vLLM's `structured_outputs`, or vLLM's older `guided_*`
fields; a bad one is a 400 naming the field it came in."""

from __future__ import annotations

from tokenmill.sampling_params import ParamError, StructuredOutputsParams
from tokenmill.server.protocol import APIError, _SamplingRequest


def constraints(req: _SamplingRequest) -> list[tuple[str, dict]]:
    """(field, StructuredOutputsParams arguments) of every output constraint the request gives."""
    given: list[tuple[str, dict]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format: type json_schema needs json_schema.schema", param="response_format")
        given.append(("response_format", {"json": fmt.json_schema.schema_}))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", req.structured_outputs.model_dump(by_alias=True, exclude_none=True)))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            given.append((name, {key: getattr(req, name)}))
    return given


def structured_field(req: _SamplingRequest) -> str:
    """The field the request's output constraint came in."""
    return constraints(req)[0][0]


def named(e: ParamError, param: str) -> APIError:
    return APIError(400, f"{param}: {str(e).removeprefix('structured_outputs: ')}", param=param)


def structured_outputs(req: _SamplingRequest) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever field gives it: OpenAI's
    response_format, vLLM's structured_outputs, or vLLM's older guided_* fields. A bad one is
    a 400 naming the field it came in."""
    given = constraints(req)
    if not given:
        return None
    if len(given) > 1:
        raise APIError(400, f"{given[1][0]}: only one output constraint per request, and {given[0][0]} gives one "
                       "already", param=given[1][0])
    param, spec = given[0]
    if req.guided_whitespace_pattern is not None:
        try:
            StructuredOutputsParams(json_object=True, whitespace_pattern=req.guided_whitespace_pattern)
        except ParamError as e:
            raise named(e, "guided_whitespace_pattern") from e
        spec.setdefault("whitespace_pattern", req.guided_whitespace_pattern)
    try:
        return StructuredOutputsParams(**spec)
    except ParamError as e:
        raise named(e, param) from e
