#!/usr/bin/env bash
# Prepares the run of benchmarks/gpu.py on a GPU machine that reaches no package index.
#
# Builds the kvgraft wheel and downloads, for that machine's Python 3.12 on x86-64, the
# wheels of kvgraft's runtime dependencies its image lacks (it has torch, transformers,
# safetensors, numpy, rich, click, attrs and markupsafe; typing-extensions travels too, as
# alembic needs 4.12 or later) into .gpu/, which git ignores and the run carries; then
# prints the command to run there. The versions are those the test suite runs with.
#
#   scripts/gpu_run.sh              # then run the printed command with carry [".gpu"]
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || py=python3
out=.gpu
rm -rf "$out"
mkdir -p "$out"
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$out" .
# The ones with compiled code are downloaded for the machine's interpreter, not this one's.
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$out" \
    sqlalchemy==2.1.9 greenlet==3.5.6 alembic==1.20.1 mako==1.4.3 zstandard==0.25.0 \
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
    rpds-py==2026.9.1 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 \
    securesystemslib==1.6.0 typing-extensions==4.16.0
du -sh "$out"
ls "$out"
cat <<'EOF'

On the GPU machine (device tool `run`, carry [".gpu"], timeout_s 600), from the repository root:

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/*.whl && export PYTHONPATH=/tmp/site || exit; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > $OUT/nvidia-smi.csv; PYTHONUNBUFFERED=1 timeout 560 python3 -m benchmarks.gpu --out $OUT/gpu.json --tokens 8192,32768 2>&1 | tee $OUT/log.txt
EOF
