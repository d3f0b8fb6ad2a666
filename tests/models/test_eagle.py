"""EAGLE speculative decoding on the built-in model with its built-in head, float32: the
drafts the engine makes are those of the head run densely over the target's own hidden
states (Hugging Face transformers' forward, the training script's head), through chunked
prefill and verification; greedy outputs equal decoding without drafts beside penalised
and sampled requests and across prefix-cache hits; bad heads are refused by name."""

from __future__ import annotations

import itertools
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tokenmill import LLM, SamplingParams
from tokenmill.config import DEFAULT_EAGLE_MODEL_DIR, DEFAULT_MODEL_DIR
from tests.models.test_speculative import PROMPTS, completions, run

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from train_eagle_head import EagleHead  # noqa: E402

SPEC = {"method": "eagle", "num_speculative_tokens": 3, "adaptive": False}


@pytest.fixture(scope="module")
def eagle():
    return LLM(dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=96, speculative_config=SPEC)


@pytest.fixture(scope="module")
def plain():
    return LLM(dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=96)


@torch.no_grad()
def reference_drafts(target, head: EagleHead, tokens: list[int], k: int,
                     vocab: torch.Tensor | None = None) -> list[int]:
    """The head's k greedy drafts after `tokens`, densely: pairs (token p + 1, the target's
    hidden state at p) for every known position, then the head's own outputs; `vocab`: the
    argmax over those token ids only (the head's token map)."""
    ids = torch.tensor(tokens)
    feats = target.model(ids[None, :-1]).last_hidden_state[0]
    pairs, own, drafts = ids[1:], feats, []
    for _ in range(k):
        out = head(target.model.embed_tokens(pairs)[None], own[None], torch.arange(len(pairs)))[0]
        logits = target.lm_head(out[-1])
        if vocab is not None:
            logits = torch.full_like(logits, -torch.inf).index_copy_(0, vocab, logits[vocab])
        drafts.append(int(logits.argmax()))
        pairs, own = torch.cat((pairs, torch.tensor(drafts[-1:]))), torch.cat((own, out[-1:]))
    return drafts


@pytest.mark.parametrize("waits", [False, True, "rests", "modules"],
                         ids=["fixed", "adaptive-waits", "adaptive-rests", "fixed-modules"])
def test_engine_drafts_are_the_heads_over_the_targets_hidden_states(eagle, waits, monkeypatch):
    """Prompts longer than the step's token budget arrive in chunks, whose pairs wait for the
    request's first drafting step; one request is held back by min_tokens for its first 10
    tokens, its pairs waiting meanwhile; `waits`: adaptive speculation, made to give every
    request no drafts in two choices of three, so that verified pairs wait too; asked every
    step, or ("rests") after rests of 1, 2, ... steps that ask nothing and keep every pair
    (logged, when each request computes one token, and handed out later); "modules": the head
    through its modules, not its one-call forward, as on a GPU (a step's later forwards fed the
    drafts before on the device, spec/chain.py).
    After each step every request's drafts equal the dense reference's for its tokens (an
    off-by-one in pairing tokens with hidden states, or a lost chunk, changes most)."""
    from transformers import AutoModelForCausalLM

    from tokenmill.executor.spec import rests as drafter
    from tokenmill.executor.spec.eagle import EagleProposer

    if waits == "modules":
        eagle = LLM(dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=96, speculative_config=SPEC)
        eagle.engine.runner.drafter.fused, eagle.engine.runner.drafter.fused_drafts = None, False
        waits = False
    elif waits:
        eagle = LLM(dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=96,
                    speculative_config={**SPEC, "adaptive": True})
        calls = itertools.count()
        monkeypatch.setattr(drafter, "choose_num_drafts", lambda rates, limits, *a, **kw:
                            list(limits) if next(calls) % 3 == 0 else [0] * len(limits))
        if waits != "rests":
            monkeypatch.setattr(drafter, "MAX_REST", 0)  # asked every step
    logged = []  # resting steps of one token a request, logged whole (EagleProposer._log_rest)
    log_rest = EagleProposer._log_rest
    monkeypatch.setattr(EagleProposer, "_log_rest", lambda self, *a: logged.append(1) or log_rest(self, *a))
    target = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    head = EagleHead(target.config)
    head.load_checkpoint(load_file(DEFAULT_EAGLE_MODEL_DIR / "model.safetensors"))
    head.eval()
    engine = eagle.engine
    vocab = engine.runner.drafter.vocab.ids.cpu()  # the built-in head's token map, on by default
    assert len(vocab) == 4096
    params = [SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=64, temperature=0, min_tokens=10),
              SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)]
    made = [engine.make_request(p, sp, request_id=f"ref{i}") for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    for request, text in made:
        engine.add_request(request, text, final_only=True)
    requests = [request for request, _ in made]
    same = total = 0
    late = requests[1]
    resting = []
    while engine.has_unfinished_requests():
        engine.step()
        resting.append(engine.runner.drafter.resting)
        assert not late.spec_token_ids or late.num_output_tokens >= 10
        for request in requests:
            if request.spec_token_ids:
                want = reference_drafts(target, head, request.all_token_ids, len(request.spec_token_ids), vocab)
                same += sum(a == b for a, b in zip(request.spec_token_ids, want))
                total += len(want)
    assert total > (50 if waits == "rests" else 100)  # (resting steps draft nothing)
    assert late.spec_accepted + late.spec_rejected > 0  # it drafted once min_tokens was met
    if waits:
        assert engine.stats()["spec_decode_num_steps_by_k"][0] > 20  # request-steps that waited
    if waits == "rests":
        assert max(resting) >= 2 and len(logged) > 10  # rests of 2 steps and more
    else:
        assert not logged
    print(f"{same} of {total} drafts equal")
    assert same >= 0.97 * total, (same, total)  # float32 both ways: only near-ties may differ


def test_greedy_outputs_equal_decoding_without_drafts(eagle, plain):
    """Greedy requests get the tokens and logprobs of decoding without drafts, beside a
    penalised one (served without drafts) and a sampled one; the cache's integrity holds
    after every step; the second round hits the prefix cache."""
    params = [SamplingParams(max_tokens=96, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=40, temperature=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=48, temperature=0, frequency_penalty=0.5, ignore_eos=True),
              SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, stop=["\n\n"])]
    for _ in range(2):
        a, b = run(plain, params), run(eagle, params)
        assert [completions([o])[0] for i, o in enumerate(b) if i != 1] == \
            [completions([o])[0] for i, o in enumerate(a) if i != 1]
        for lx, ly in zip(a[0].outputs[0].logprobs, b[0].outputs[0].logprobs):
            assert list(ly.values()) == pytest.approx(list(lx.values()), abs=1e-4)
    assert eagle.engine.kv_cache.prefix_hits > 0
    stats = eagle.engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_call_head_forward_equals_the_modules(dtype):
    """Where the head's layers and its token map's LM head run on amx_linear (AMX, bfloat16) or on
    small_linear (float32, AVX2 and FMA), its forwards run in one native call (small_eagle_draft),
    each token a row of its own: a request's pairs in a step's first forward, one a request for
    later drafts. Each gives the modules' outputs over the same rows and features bit for bit,
    and the drafts of the modules' argmax; a step's later forwards run in one call
    (small_draft_chain), whose drafts are those of the same forwards one by one; greedy outputs
    equal decoding without drafts."""
    import numpy as np

    from tokenmill.executor.attention import AttentionMetadata

    spec = {**SPEC, "num_speculative_tokens": 4}
    llm = LLM(dtype=dtype, kv_cache_memory="16MiB", max_num_seqs=3, speculative_config=spec)
    drafter = llm.engine.runner.drafter
    if drafter.fused is None:
        pytest.skip("the one-call head forward needs amx_linear (AMX-BF16) in bfloat16, small_linear (AVX2 and "
                    "FMA) in float32")
    assert drafter.fused_drafts  # the token map's head runs on the layers' kernel: the drafts come from the call
    kernels, rows = drafter.kernels, []

    class Both:
        @staticmethod
        def small_eagle_draft(model, ids, features, positions, table, block_size, at):
            drafts, hidden = kernels.small_eagle_draft(model, ids, features, positions, table, block_size, at)
            # the modules over the same rows (the same K/V written again), attention planned as _forward does
            slots = table[torch.arange(len(ids)), positions // block_size].long() * block_size + positions % block_size
            drafter.attn.begin_step(AttentionMetadata.from_host(np.ones(len(ids), dtype=np.int32),
                                                                (positions + 1).int().numpy(), table.numpy(), slots,
                                                                block_size, torch.from_numpy))
            want = drafter.model(torch.tensor(ids), positions, drafter.attn, features)[at]
            assert torch.equal(hidden, want)
            assert drafts == drafter._argmax(want).tolist()
            rows.append(len(ids))
            return drafts, hidden

        @staticmethod
        def small_draft_chain(model, firsts, positions, table, block_size, ks, features):
            chained = kernels.small_draft_chain(model, firsts, positions, table, block_size, ks, features)
            drafts, ks, active = [[first] for first in firsts], np.array(ks), np.arange(len(firsts))
            for j in range(1, int(ks.max())):  # the same forwards one by one: forward j feeds draft j and its output
                keep = np.flatnonzero(ks[active] > j)
                active, at = active[keep], torch.from_numpy(active[keep])
                nxt, features = Both.small_eagle_draft(model, [drafts[a][-1] for a in active],
                                                       features[torch.from_numpy(keep)], positions[at] + j - 1,
                                                       table[at], block_size, torch.arange(len(active)))
                for a, t in zip(active, nxt):
                    drafts[a].append(t)
            assert chained == [d[1:] for d in drafts]
            chains.append(len(firsts))
            return chained

    chains = []
    drafter.kernels = Both
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(PROMPTS)
    outputs = completions(run(llm, params))
    assert rows and min(rows) == 1 and max(rows) > 3  # later drafts of 1-3 requests, first forwards of more pairs
    assert chains and max(chains) > 1  # a step's later drafts in one call (small_draft_chain), of several requests
    if dtype == "float32":
        plain = LLM(dtype=dtype, kv_cache_memory="16MiB", max_num_seqs=3)
        assert outputs == completions(run(plain, params))


def test_a_long_rest_keeps_no_pairs_and_the_runner_skips_the_head(plain, monkeypatch):
    """After MAX_LOGGED_REST logged resting steps since the head last drafted, a resting decode
    step of IDLE_BATCH requests or more keeps no pairs and the runner does not call the head
    (EagleProposer.idle). When the
    requests draft again, after a rest of 31 steps, the head's cache lacks those positions:
    their drafts are worse, not wrong, and greedy outputs equal decoding without drafts."""
    from tokenmill.executor.spec import eagle as eagle_module
    from tokenmill.executor.spec import rests as drafter
    from tokenmill.executor.spec.eagle import EagleProposer

    monkeypatch.setattr(eagle_module, "MAX_LOGGED_REST", 4)
    calls = itertools.count()  # asks: drafts at the first and the seventh (rests of 1, 2, ..., 16 between)
    monkeypatch.setattr(drafter, "choose_num_drafts", lambda rates, limits, *a, **kw:
                        list(limits) if next(calls) in (0, 6) else [0] * len(limits))
    logged, idle = [], []
    log_rest, was_idle = EagleProposer._log_rest, EagleProposer.idle

    def logging(self, out, *args):  # (rested steps before it, the batch)
        logged.append((self.rested, len(out.requests)))
        return log_rest(self, out, *args)

    monkeypatch.setattr(EagleProposer, "_log_rest", logging)
    monkeypatch.setattr(EagleProposer, "idle", lambda self, *a: idle.append(was_idle(self, *a)) or idle[-1])
    monkeypatch.setattr(EagleProposer, "explore", lambda self, *a, **kw: None)  # (the asks above decide)
    eagle = LLM(dtype="float32", kv_cache_memory="16MiB", speculative_config={**SPEC, "adaptive": True})
    params = [SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)] * len(PROMPTS)
    assert completions(run(eagle, params)) == completions(run(plain, params))
    assert next(calls) > 7  # it drafted after the long rest, and asked again
    # idle steps; at most 4 logged since each drafting step, but in batches under IDLE_BATCH (4)
    assert sum(idle) > 20 and max(rested for rested, batch in logged if batch >= 4) < 4
    drafted = eagle.engine.stats()["spec_decode_num_steps_by_k"]
    assert sum(drafted[1:]) > 0 and drafted[0] > 60


def test_bad_heads_are_refused_naming_the_key(tmp_path):
    """A head whose hidden size is not the target's, one that is not a checkpoint, and an
    EAGLE head asked for a model without a built-in one: errors name speculative_config.model."""
    wrong = tmp_path / "wide"
    shutil.copytree(DEFAULT_EAGLE_MODEL_DIR, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**cfg, "hidden_size": 2 * cfg["hidden_size"]}))
    for model, match in ((str(wrong), "hidden size"), (str(tmp_path / "missing"), "does not load")):
        with pytest.raises(ValueError, match=r"speculative_config\.model.*" + match):
            LLM(dtype="float32", kv_cache_memory="16MiB", speculative_config={**SPEC, "model": model})
    other = tmp_path / "target"
    shutil.copytree(DEFAULT_MODEL_DIR, other)
    with pytest.raises(ValueError, match=r"speculative_config\.model: method 'eagle' needs an EAGLE head"):
        LLM(str(other), dtype="float32", kv_cache_memory="16MiB", speculative_config=SPEC)
