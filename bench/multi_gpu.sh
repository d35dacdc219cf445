#!/usr/bin/env bash
# Issue 14 on a machine with 2 GPUs, in one go: verify-bridge and verify-train over NCCL (CLI and
# the GPU tests of tests/test_multi_gpu.py), then bench/bridge.py over NCCL, twice.
# Expects webdataset and braceexpand wheels in .whl/ (the device machine has no registry).
# Log lines: "== step" headers, RESULT JSON lines from the tests, the benches' JSON lines.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/webdataset-*.whl .whl/braceexpand-*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || exit 1
echo "== machine"; nvidia-smi -L; nvidia-smi topo -m
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'

echo "== verify-bridge (CLI)"
for dtype in fp32 bf16; do
  timeout 120 python3 -m mimo verify-bridge --world 2 --src tp=1,dp=2 --dst tp=2,dp=1 --colocated --hidden 1024 --device cuda --dtype $dtype
  timeout 120 python3 -m mimo verify-bridge --world 2 --src tp=2,dp=1 --dst tp=1,dp=2,shard=seq --colocated --hidden 1024 --device cuda --dtype $dtype
  timeout 120 python3 -m mimo verify-bridge --world 2 --src tp=1 --dst tp=1 --non-colocated --hidden 1024 --device cuda --dtype $dtype
done

echo "== GPU tests (bridges and world-2 training layouts, fp32 and bf16)"
timeout 420 python3 -m pytest tests/test_multi_gpu.py -q -s -rs -p no:cacheprovider

echo "== verify-train (CLI)"
python3 -m mimo make-demo-data /tmp/demo --train-samples 1000 --heldout-samples 20 >/dev/null
D="data.shards=/tmp/demo/train-{000000..000001}.tar data.tokenizer=/tmp/demo/tokenizer train.checkpoint.dir=/tmp/demo/ckpt"
L="world_size=2 modules.vision.parallel.dp=2 modules.vision.parallel.ranks=0:2 modules.language.parallel.dp=1 modules.language.parallel.ranks=0:2"
for p in fp32 bf16; do
  timeout 240 python3 -m mimo verify-train configs/demo.yaml $D $L --device cuda --precision $p --steps 3
done

echo "== bench/bridge.py over NCCL (twice)"
for run in 1 2; do
  timeout 240 python3 bench/bridge.py --backend nccl --hidden 4096 --samples 16 --iters 20 | tee -a $OUT/bridge_nccl.jsonl
done
