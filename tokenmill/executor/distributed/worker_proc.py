"""A tensor-parallel worker rank (`python -m tokenmill.executor.distributed.worker_proc`, started
by TensorParallelWorkers): its arguments come pickled on stdin, then one StepInput per step
until None or the end of stdin. A module of its own, so that importing tokenmill never
imports it before runpy runs it.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys

import torch
import torch.distributed as dist

from tokenmill.executor.distributed.parallel import TensorParallel
from tokenmill.executor.distributed.workers import COLLECTIVE_TIMEOUT


def main() -> None:
    """A worker rank: builds its ModelRunner, then runs the steps the driver sends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops it (or its stdin closes)
    stdin = sys.stdin.buffer
    args = pickle.load(stdin)
    rank, size = args["rank"], args["size"]
    if args["cpus"]:
        os.sched_setaffinity(0, args["cpus"])
        torch.set_num_threads(len(args["cpus"]))
    logging.basicConfig(level=args["log_level"], format=f"%(levelname)s %(name)s (tp rank {rank}): %(message)s")
    store = dist.TCPStore("127.0.0.1", args["port"], size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    try:
        store.set(f"joined{rank}", "1")
        from tokenmill.executor.model_runner import ModelRunner

        runner_args = args["runner_args"]
        device = runner_args["device"]
        if device.type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        dist.init_process_group(args["backend"], store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
        runner = ModelRunner(**{**runner_args, "device": device}, tp=TensorParallel(rank, size, device))
    except BaseException as e:
        store.set(f"error{rank}", f"{type(e).__name__}: {e}")
        raise
    while True:
        try:
            step = pickle.load(stdin)
        except EOFError:  # the driver is gone
            break
        if step is None:
            break
        runner.run_worker_step(step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
