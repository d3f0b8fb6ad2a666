"""A tensor-parallel worker rank (`python -m tokenmill.executor.distributed.worker_proc`, started
by TensorParallelWorkers): its arguments come pickled on stdin, then one StepInput per step
until None or the end of stdin. A module of its own, so that importing tokenmill never
imports it before runpy runs it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys

import torch
import torch.distributed as dist

from tokenmill.executor.distributed.parallel import TensorParallel
from tokenmill.executor.distributed.workers import COLLECTIVE_TIMEOUT


def _die_with_parent() -> None:
    """The kernel SIGKILLs this process when its parent (the driver's thread that started it)
    ends, wherever it is waiting: a collective, the store, its stdin (Linux's PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux: the end of stdin still stops it between steps
        pass


def main() -> None:
    """A worker rank: builds its ModelRunner, then runs the steps the driver sends."""
    _die_with_parent()
    # Ctrl-C or a SIGTERM to the process group (systemd) reach the workers too: the driver
    # stops them once its requests have drained (None on stdin), or they die with it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    args = pickle.load(stdin)
    rank, size = args["rank"], args["size"]
    if args["cpus"]:
        os.sched_setaffinity(0, args["cpus"])
        torch.set_num_threads(len(args["cpus"]))
    logging.basicConfig(level=args["log_level"], format=f"%(levelname)s %(name)s (tp rank {rank}): %(message)s")
    store = dist.TCPStore("127.0.0.1", args["port"], size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    try:
        from tokenmill.executor.model_runner import ModelRunner

        runner_args = args["runner_args"]
        device = runner_args["device"]
        if device.type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        store.set(f"joined{rank}", "1")  # the driver joins the group once every worker is about to
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
