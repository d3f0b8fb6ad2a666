#!/usr/bin/env bash
# Wheels for the packages tokenmill needs that the device machine's image lacks
# (compressed-tensors and what it pulls in), for that machine's Python (3.12, x86-64),
# into .whl/ (git-ignored through .git/info/exclude). A device call then carries .whl and
# starts with:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "compressed-tensors==0.20.0" "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0" \
  "typing-inspection==0.4.5" "loguru==0.7.3"
ls .whl
