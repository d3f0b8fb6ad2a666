"""benchmarks/gpu_throughput.py, the device session's script, as far as the CPU runs it: its
sections run in the order --only names them (so that a short budget keeps the first ones), and
an unknown section is refused before anything runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def gpu_script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/gpu_throughput.py", "--smoke", "--output-dir", str(tmp_path),
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_sections_run_in_the_order_only_names_them(tmp_path):
    for only, first, second in (("spec_attn,fp8", "verification attention", "FP8 W8A8"),
                                ("fp8,spec_attn", "FP8 W8A8", "verification attention")):
        out = gpu_script(tmp_path, "--only", only)
        assert out.returncode == 0, out.stderr
        table = out.stdout[out.stdout.rindex("\n\n"):]  # the last table
        assert table.index(first) < table.index(second), table


def test_an_unknown_section_is_refused_by_name(tmp_path):
    out = gpu_script(tmp_path, "--only", "fp8,specattn")
    assert out.returncode == 2 and "--only: unknown sections ['specattn']" in out.stderr
    assert not (tmp_path / "results.json").exists()
