#!/usr/bin/env bash
# Checks and measurements around suites/zero on a lent machine with 2 or more GPUs, in one call:
# bf16 weight copies at stage 0 (one GPU with graphs, then 2 ranks against one process), the
# stage 3 graphed stack against stage 0 (2 GPUs), the comms logger's bus bandwidth against direct
# timing for all_reduce / all_gather / reduce_scatter at the suite's bucket sizes (bf16 and fp32),
# and DeepSpeed's FusedAdam JIT build, so that a suites/zero run right after finds it built.
#   BUSBW_MIB="16 50 100 256 1024"  BUSBW_TRIALS=5    bash benchmarks/zero_checks_gpu.sh
set -uo pipefail
. benchmarks/gpu_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nproc_gpu=$(nvidia-smi -L | wc -l)
echo "== bf16 weight copies: one GPU with graphs, then 2 ranks against one process"
timeout 240 python3 -m pytest -p no:xdist -q tests/engine/test_weight_copies.py -k gpu -m gpu 2>&1 | tail -2
timeout 240 python3 -m pytest -p no:xdist -q tests/engine/test_weight_copies_data_parallel.py 2>&1 | tail -2
echo "== stage 3 graphed stack against stage 0 (2 GPUs, GPT-2 tiny)"
STACK_WORKER_FAMILIES=gpt2 timeout 200 python3 -m pytest -p no:xdist -q tests/engine/zero/test_stage3_stack.py -k "not bert" 2>&1 | tail -2
for dtype in bfloat16 float32; do
  echo "== comms logger against direct timing, $dtype, $nproc_gpu ranks"
  timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node "$nproc_gpu" benchmarks/comms_busbw.py \
    --ops all_reduce all_gather reduce_scatter --mib ${BUSBW_MIB:-16 50 100 256 1024} --trials "${BUSBW_TRIALS:-5}" \
    --dtype "$dtype" 2>&1 | grep -v " trial " | tail -18
done
echo "== DeepSpeed FusedAdam JIT build"
timeout 240 python3 -c "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load(); print('FusedAdam built')" 2>&1 | tail -1
