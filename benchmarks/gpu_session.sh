#!/usr/bin/env bash
# The GPU checks of docs/benchmarks/index.md section 5, as one script for a lent one-GPU machine (its torch and
# transformers; PuLP and highspy from wheels in .whl/ when present). Writes logs and JSON lines under OUT.
#   OUT=out bash benchmarks/gpu_session.sh            # from the repository root (VERIFY_ONLY=1: no timing)
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
tiny="--layers 2 --batch 8 --seq 16 --set hidden=32 --set heads=4"
step() { local log=$1; shift; local t0=$SECONDS; timeout 200 "$@" >"$OUT/$log" 2>&1; echo "=== $log rc=$? ($((SECONDS - t0)) s): $*"; grep -E "^verify|hapnb verify:|Error" "$OUT/$log" | cut -c1-300; }
# correctness, small models, in parallel: NCCL with one rank (float64 against one device), and several
# ranks on the one GPU through gloo with CUDA tensors (uneven plans; grouped gathers, reduce-scatters)
step v1.log python3 -m hapnb verify --model gpt $tiny --cluster 1xH100 --backend nccl --quiet &
step v2.log python3 -m hapnb verify --model examples.corpus:llama --set size=tiny --cluster 1xH100 --backend nccl --quiet &
step v3.log python3 -m hapnb verify --model gpt $tiny --cluster 1xV100+2xP100 --device cuda --quiet &
step v4.log python3 -m hapnb verify --model mlp --batch 8 --set hidden=32 --cluster 1xV100+2xP100 --pin layers.0.weight=G0 --pin layers.1.weight=G1 --device cuda --quiet &
step v5.log python3 -m hapnb verify --model examples.corpus:llama --set size=tiny --cluster 1xV100+1xP100 --pin input_ids=G0 --device cuda --quiet &
wait
# the generated one-device program against the plain model (NCCL, one rank), real sizes, one at a time
[ "${VERIFY_ONLY:-0}" = 1 ] && exit 0
step overhead.log python3 benchmarks/gpu_overhead.py --steps 5 --warmup 2 --out "$OUT/overhead.jsonl" resnet50 llama gpt2
grep '^{' "$OUT/overhead.log" | cut -c1-600
