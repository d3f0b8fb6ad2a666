"""Compiles the engine's Triton kernels for a GPU without one: every launch configuration the
attention backend and the layer kernels make for a set of model shapes, built to a cubin for
Hopper (sm_90, the H100/H200 the device sessions lend) by Triton's own compiler and ptxas.

    python scripts/compile_triton_kernels.py [--arch 90] [--quick]

A kernel that the interpreter runs (tests/kernels, TRITON_INTERPRET=1) can still fail to
compile for a GPU: the interpreter allows `tl.dot` shapes, types and control flow the compiler
refuses, and it never allocates shared memory. Here the wrappers (TritonBackend, triton_ops,
triton_fp8_gemm) run on CPU tensors as the engine calls them, each launch is recorded instead
of run, specialized as Triton's launcher (`JITFunction.run`) does for the target (argument
types, pointers and integers divisible by 16, integers equal to 1 made constants, warps and
stages), and each distinct configuration is compiled. A configuration that does not compile, or needs
more shared memory than an H100's block may have, fails the run, named. Nothing runs: the
figures (registers, speed) are a device session's. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

SHARED_LIMIT = 232_448  # bytes of shared memory a block may have on sm_90 (227 KB)
# (heads, kv heads, head dim): Qwen3-0.6B, Llama-3-8B, the built-in model, GQA 1 and MQA with
# padded head dims
SHAPES = [(16, 8, 128), (32, 8, 128), (4, 2, 64), (8, 8, 80), (8, 1, 256), (12, 4, 96)]


class Launches:
    """Records each Triton launch instead of running it, specialized as Triton's own launcher
    would for the target (`JITFunction.run`: the argument types, the pointers and integers
    divisible by 16, the integers equal to 1 made constants, the launch options)."""

    def __init__(self, arch: int = 90) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.target = GPUTarget("cuda", arch, 32)
        self.backend = make_backend(self.target)
        self.binders: dict = {}
        self.seen: dict[tuple, tuple] = {}  # (kernel, specialization, options) -> what compile_one builds

    def __enter__(self) -> "Launches":
        from triton.runtime.jit import JITFunction

        self.original = JITFunction.run
        launches = self

        def record(fn, *args, grid, warmup, **kwargs):
            launches.add(fn, args, kwargs)

        JITFunction.run = record
        return self

    def __exit__(self, *exc) -> None:
        from triton.runtime.jit import JITFunction

        JITFunction.run = self.original

    def add(self, fn, args: tuple, kwargs: dict) -> None:
        from triton import knobs
        from triton.runtime.jit import create_function_from_signature

        kwargs = {"debug": fn.debug or knobs.runtime.debug,
                  "instrumentation_mode": knobs.compilation.instrumentation_mode, **kwargs}
        if fn not in self.binders:
            self.binders[fn] = create_function_from_signature(fn.signature, fn.params, self.backend)
        bound, specialization, options = self.binders[fn](*args, **kwargs)
        key = (fn.__name__, repr(specialization), repr(sorted(options.items())))
        if key not in self.seen:
            options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound, specialization, options)
            self.seen[key] = (fn, signature, constexprs, attrs, options.__dict__, self.target)


# the attention steps: (query lengths, context lengths, split count, longest run): a mixed step
# (decodes and prompt chunks); decodes split 16 ways (the most planned); verifications of 4 drafts
# a request as the graphs run them (a row a token, in runs), split; a draft model's forward 1
# (k + 2 rows); a verification of 16 drafts (runs as long as the backend takes: max_span)
STEPS = {"mixed": ([1, 9, 1, 70], [40, 9, 3, 200], None, None), "split": ([1, 1], [90, 250], 16, None),
         "runs": ([5, 3], [40, 90], 4, 5), "draft": ([6, 2], [40, 90], None, 6),
         "long": ([17, 9], [60, 90], 4, 17)}
BF16, F32, I8, E4M3, E5M2 = torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2
# --quick (the test suite's): each code path once, not every product: the kernels' variants are the
# cache's (16-bit, 8-bit read in float32 or float16), the dtype's (float32 keeps IEEE dots), the
# head dim's (256 takes narrower key tiles and 8 warps), the GQA group's and a run's (tile rows)
QUICK = [((16, 8, 128), BF16, None, ("mixed", "split", "runs", "draft", "long")),
         ((16, 8, 128), BF16, I8, ("mixed", "runs")), ((16, 8, 128), BF16, E4M3, ("mixed", "runs")),
         ((16, 8, 128), F32, None, ("mixed", "runs")), ((16, 8, 128), F32, I8, ("mixed",)),
         ((8, 1, 256), BF16, None, ("mixed", "split", "runs", "long")), ((32, 8, 128), BF16, None, ("runs", "long")),
         ((4, 2, 64), F32, None, ("mixed", "draft"))]


def attention_launches(launches: Launches, quick: bool) -> None:
    """The attention backend's launches (STEPS) for each shape, model dtype and KV cache dtype."""
    from tokenmill.executor.attention import AttentionMetadata, row_spans, token_rows
    from tokenmill.executor.attention.base import default_to_device
    from tokenmill.executor.attention.kv_cache import KVCache
    from tokenmill.executor.attention.triton import TritonBackend

    block = 16
    to_device = default_to_device(torch.device("cpu"))
    cases = QUICK if quick else [(shape, dtype, kv, tuple(STEPS)) for shape in SHAPES
                                 for dtype in (BF16, torch.float16, F32) for kv in (None, I8, E4M3, E5M2)]
    for (heads, kv_heads, dim), dtype, kv_dtype, steps in cases:
        cache = KVCache.allocate(1, 64 * block, kv_heads, dim, kv_dtype or dtype, torch.device("cpu"))
        for query_lens, seq_lens, splits, span in (STEPS[step] for step in steps):
            query_lens, seq_lens = np.array(query_lens, dtype=np.int32), np.array(seq_lens, dtype=np.int32)
            table = np.arange(64, dtype=np.int32).reshape(4, 16)[:len(query_lens)]
            lens = query_lens
            if span:  # a row a token
                seq_lens = np.concatenate([np.arange(s - q + 1, s + 1) for q, s in zip(query_lens, seq_lens)])
                table, lens = token_rows(table, query_lens), np.ones(len(seq_lens), dtype=np.int32)
            tokens = int(lens.sum())
            md = AttentionMetadata.from_host(lens, seq_lens.astype(np.int32), table,
                                             torch.zeros(tokens, dtype=torch.int64), block, to_device)
            backend = TritonBackend(cache, block, heads, num_splits=splits)
            if span:  # as the graph runner caps it
                span = min(span, backend.max_span)
                md.row_spans, md.max_span = to_device(row_spans(query_lens, span)), span
            backend.begin_step(md)
            backend(torch.zeros(tokens, heads, dim, dtype=dtype), torch.zeros(tokens, kv_heads, dim, dtype=dtype),
                    torch.zeros(tokens, kv_heads, dim, dtype=dtype), 0)


def layer_launches(launches: Launches, quick: bool) -> None:
    """The layer kernels' launches (norms, rotary, activation, FP8 quantization and GEMM) at the
    shapes' widths."""
    from tokenmill.executor.layers import triton_fp8_gemm, triton_ops

    widths = [(1024, 3072, 16, 8, 128), (4096, 14336, 32, 8, 128)] + ([] if quick else [(256, 704, 4, 2, 64)])
    for dtype in [torch.bfloat16, torch.float32] if quick else [torch.bfloat16, torch.float16, torch.float32]:
        for hidden, inter, heads, kv_heads, dim in widths[:1] if quick and dtype == torch.float32 else widths:
            for rows in (1, 64, 300):
                x = torch.zeros(rows, hidden, dtype=dtype)
                triton_ops.rms_norm(x, None, torch.ones(hidden, dtype=dtype), 1e-6)
                triton_ops.rms_norm(x, torch.zeros_like(x), torch.ones(hidden, dtype=dtype), 1e-6)
                qkv = torch.zeros(rows, (heads + 2 * kv_heads) * dim, dtype=dtype)
                q, k = qkv[:, :heads * dim].view(rows, heads, dim), qkv[:, heads * dim:(heads + kv_heads) * dim]
                k = k.view(rows, kv_heads, dim)
                cos_sin = torch.zeros(64, dim, dtype=torch.float32)
                positions = torch.zeros(rows, dtype=torch.int64)
                for norm in (torch.ones(dim, dtype=dtype), None):
                    triton_ops.qk_norm_rotary(q, k, norm, norm, 1e-6, positions, cos_sin)
                triton_ops.silu_and_mul(torch.zeros(rows, 2 * inter, dtype=dtype))
                if dtype != torch.float32 or not quick:
                    triton_ops.quantize_fp8_rows(x)
                    for residual in (None, torch.zeros_like(x)):
                        triton_ops.rms_norm_fp8(x, residual, torch.ones(hidden, dtype=dtype), 1e-6)
                    triton_ops.silu_and_mul_fp8(torch.zeros(rows, 2 * inter, dtype=dtype))
                    for n, kk in ((hidden, inter), (inter * 2, hidden)):
                        if rows <= triton_fp8_gemm.SMALL_M:
                            triton_fp8_gemm.fp8_gemm(torch.zeros(rows, kk, dtype=torch.float8_e4m3fn),
                                                     torch.ones(rows, 1), torch.zeros(n, kk, dtype=torch.float8_e4m3fn),
                                                     torch.ones(1, n), None, dtype)


_CONFIGS: list[tuple] = []  # what compile_one's forked workers compile, by index


def reason(e: BaseException) -> str:
    """What a failed compile says: Triton's innermost error that names one, with its place in
    the source (a CompilationError's own message is the source around the failing call)."""
    while getattr(e, "error_message", None) is None and e.__cause__ is not None:
        e = e.__cause__
    said = getattr(e, "error_message", None) or str(e).strip().splitlines()[-1]
    node, src = getattr(e, "node", None), getattr(e, "src", None)
    where = ""
    if hasattr(node, "lineno") and src:  # the function's name, from its source's first line
        where = f" at line {node.lineno} of {src.lstrip().split('(')[0].removeprefix('def ')}"
    return f"{type(e).__name__}{where}: {said[:300]}"


def compile_one(index: int, arch: int, resources: bool = False) -> tuple[str, str | None]:
    """Builds configuration `index` of _CONFIGS for sm_`arch`: (what it is, with its registers,
    stack and shared memory a thread block from cuobjdump if `resources`; None, or what failed)."""
    import triton
    from triton.compiler import ASTSource

    fn, signature, constexprs, attrs, options, target = _CONFIGS[index]
    what = f"{fn.__name__}({', '.join(f'{fn.arg_names[i]}={v!r}' for (i,), v in constexprs.items())})"
    try:
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                target=target, options=options)
    except Exception as e:  # noqa: BLE001 - every configuration is tried, the failures listed
        return what, f"{what}: {reason(e)}"
    if resources:
        what += f" num_warps={options['num_warps']}: {usage(kernel.asm['cubin'])}"
    if kernel.metadata.shared > SHARED_LIMIT:
        return what, f"{what}: {kernel.metadata.shared} bytes of shared memory, over sm_{arch}'s {SHARED_LIMIT}"
    return what, None


def usage(cubin: bytes) -> str:
    """A cubin's registers, stack (spills) and shared memory a thread, from Triton's cuobjdump."""
    import subprocess
    import tempfile

    import triton.backends.nvidia as nvidia

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(Path(nvidia.__file__).parent / "bin" / "cuobjdump"), "--dump-resource-usage",
                              f.name], capture_output=True, text=True).stdout
    line = next((x for x in out.splitlines() if "REG:" in x), "")
    return " ".join(f for f in line.split() if f.split(":")[0] in ("REG", "STACK", "SHARED", "LOCAL"))


def compile_all(launches: Launches, arch: int, resources: bool = False) -> list[tuple[str, str | None]]:
    """Every recorded configuration built, on as many processes as there are cores (forked:
    the kernels are the ones this process imported): compile_one's answers."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from functools import partial

    _CONFIGS[:] = launches.seen.values()
    workers = min(len(_CONFIGS), os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(partial(compile_one, arch=arch, resources=resources), range(len(_CONFIGS))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="the compute capability to build for (90: Hopper)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and dtypes (the test suite's run)")
    p.add_argument("--resources", action="store_true",
                   help="print each configuration's registers, stack (spills) and shared memory a thread")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("run without TRITON_INTERPRET=1: the interpreter's kernels do not compile")
    start = time.perf_counter()
    with Launches(args.arch) as launches:
        attention_launches(launches, args.quick)
        layer_launches(launches, args.quick)
    built = compile_all(launches, args.arch, args.resources)
    failures = [failed for _, failed in built if failed is not None]
    if args.resources:
        for what, _ in built:
            print(what)
    kernels = sorted({key[0] for key in launches.seen})
    print(f"{len(launches.seen)} configurations of {len(kernels)} kernels ({', '.join(kernels)}) compiled for "
          f"sm_{args.arch} in {time.perf_counter() - start:.0f}s; {len(failures)} failed")
    for failure in failures:
        print("  " + failure)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
