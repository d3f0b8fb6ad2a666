"""How long `tokenmill serve` takes from the command to its first 200 on /health, on an
installed machine (CPU kernels already compiled), on the built-in model.

    python benchmarks/startup.py [--rounds 3]

Target (issue 15): under 10 s.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_ready(extra: list[str]) -> float:
    port = free_port()
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - start < 300:
            if proc.poll() is not None:
                raise RuntimeError(f"tokenmill serve exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("not ready in 300 s")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("serve_args", nargs="*", help="more `tokenmill serve` flags")
    args = p.parse_args()
    times = [time_to_ready(args.serve_args) for _ in range(args.rounds)]
    print(f"tokenmill serve ready in {statistics.median(times):.2f} s (median of {len(times)}: "
          f"{', '.join(f'{t:.2f}' for t in times)}); target < 10 s")


if __name__ == "__main__":
    main()
