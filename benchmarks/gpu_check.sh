#!/bin/bash
# The GPU checks of issue 33 in one run (about 8 minutes on an H100 / H200): the CUDA tests
# (bit-exactness of the fused fake quant, the BatchNorm fold in its launch, the direct Triton
# launches, the integer model's kernels), then the QAT step's time against torch.ao's and the
# float model's, eager at batch 64 with kernel counts, and compiled (ResNet-18).
#
#   bash benchmarks/gpu_check.sh 2>&1 | tee gpu_check.log
#
# The numbers it prints go to benchmarks/RESULTS.md ("On a GPU: ...").
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
s=$SECONDS
nvidia-smi -L
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 300 python -m pytest -q -p no:cacheprovider -p no:logging -rf \
    tests/quantized/test_triton_launch.py tests/test_cuda.py \
    tests/quantized/test_gpu_eval_kernels.py tests/quantized/test_fake_quant_ops.py \
    -k "cuda or not interpreted" 2>&1 | tail -8
echo "== CUDA tests $((SECONDS - s)) s"
s=$SECONDS
timeout 120 python benchmarks/qat_speed.py --device cuda --batch 64 --iters 10 --warmup 3 \
    --profile --only float fxq torch.ao 2>&1 | tail -10
echo "== eager QAT step $((SECONDS - s)) s"
s=$SECONDS
timeout 180 python benchmarks/qat_speed.py --device cuda --batch 64 --iters 5 --warmup 1 \
    --compile --models resnet18 --only float fxq "float compiled" "fxq compiled" 2>&1 | tail -8
echo "== compiled QAT step $((SECONDS - s)) s"
