#!/usr/bin/env bash
# Wheels that the lent GPU machine lacks for benchmarks/gpu_session.py's serve_load step (lmforge serve:
# fastapi, uvicorn; its client: openai), with everything they need, for that machine's Python 3.12.
# Run here, in the repo root; the session's run then carries .whl (see gpu_session.py's docstring).
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl/' >> .git/info/exclude; }
rm -rf .whl
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl fastapi uvicorn openai
du -sh .whl
