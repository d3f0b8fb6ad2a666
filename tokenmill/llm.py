"""LLM: the offline batch API, shaped like vLLM's so that code can switch.

    llm = LLM(model="path/to/checkpoint", max_num_seqs=64)
    outputs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from tokenmill.config import EngineConfig
from tokenmill.engine.engine import Engine
from tokenmill.engine.request import Request, RequestOutput
from tokenmill.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    """Loads a model once and generates for many prompts at a time.

    Keyword arguments are the engine arguments, with the CLI flags' names
    (`dtype`, `max_num_seqs`, `kv_cache_memory`, `scheduler`, ...; see EngineConfig).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        unknown = sorted(set(engine_args) - set(EngineConfig.field_names()))
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}; "
                             f"known: {', '.join(EngineConfig.field_names())}")
        self.engine = Engine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 tenant: Sequence[str] | None = None) -> list[RequestOutput]:
        """Generates for every prompt; returns one RequestOutput per prompt, in input order.

        `priority` (one per prompt, lower runs first) needs scheduling_policy 'priority' or
        'fair'; `tenant` (one per prompt) is whom each prompt is for under 'fair', which
        shares the engine between tenants (weight 1 each here; Engine.make_request takes weights).
        All prompts are validated before any runs: a bad one raises ValueError and
        nothing is queued.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts (give one, or one each)")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} values for {len(prompts)} prompts")
        if priority is not None and self.engine.config.scheduling_policy not in ("priority", "fair"):
            raise ValueError("priority: needs scheduling_policy='priority' or 'fair'")
        if tenant is not None and (isinstance(tenant, str) or len(tenant) != len(prompts)):
            raise ValueError(f"tenant: give one per prompt ({len(prompts)}), as a list")

        batch: list[tuple[int, Request, str | None]] = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            prio = priority[i] if priority is not None else 0
            who = tenant[i] if tenant is not None else None
            try:  # n > 1 is one request: the engine forks its sequences after one prefill
                request, text = self.engine.make_request(_prompt_input(prompt, i), sp, priority=prio, tenant=who)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}" if not str(e).startswith("prompts[") else str(e)) from e
            batch.append((i, request, text))
        for _, request, text in batch:
            self.engine.add_request(request, text, final_only=True)
        return self._run(batch, use_tqdm)

    def shutdown(self) -> None:
        """Stops the engine's worker processes (tensor_parallel_size > 1); the LLM is unusable after."""
        self.engine.shutdown()

    def _run(self, batch: list[tuple[int, Request, str | None]], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(batch), desc="generate", unit="req", disable=not use_tqdm or len(batch) < 2,
                   dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
        return [final[request.request_id] for _, request, _ in batch]


def _prompt_input(prompt: PromptType, index: int) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise ValueError(f"prompts[{index}].prompt_token_ids must be a list of integers")
            return list(ids)
        if "prompt" in prompt and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
    raise ValueError(f"prompts[{index}] must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
