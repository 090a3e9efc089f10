#!/usr/bin/env bash
# Prepares a lent GPU machine (python3 with a CUDA torch, no network) to run dslab:
# installs wheels carried in .whl/ (pydantic and the like) into /tmp/site and dslab itself.
# Source it:  . benchmarks/gpu_setup.sh
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  export PATH=/tmp/site/bin:$PATH  # ninja's wheel puts its launcher there (DeepSpeed's JIT builds need it)
fi
# DeepSpeed for the peer arms of suites/zero: its sdist builds offline without its ops (FusedAdam
# is compiled on first use, for the H200's sm_90). It imports hjson, py-cpuinfo, msgpack and einops
# and builds with ninja: carry their wheels in .whl/ beside pydantic's (and tabulate's for its
# autotuner, benchmarks/autotune_vs_deepspeed.sh).
if ls .whl/deepspeed-*.tar.gz >/dev/null 2>&1 && ! python3 -c "import deepspeed" 2>/dev/null; then
  DS_BUILD_OPS=0 python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
    .whl/deepspeed-*.tar.gz >/tmp/deepspeed_install.log 2>&1 \
    || { echo "gpu_setup: deepspeed did not install (its arms will be skipped); log:" >&2; tail -5 /tmp/deepspeed_install.log >&2; }
fi
# DeepSpeed's JIT builder (FusedAdam) reads this; it cannot parse the '9.0a' spelling of Hopper
export TORCH_CUDA_ARCH_LIST=9.0
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install --no-deps --no-build-isolation -e .
if ! python3 -c "import pydantic" 2>/dev/null; then
  echo "gpu_setup: pydantic is missing on this machine: carry its wheels in .whl/ (see the device README's" \
       "pip download recipe: pydantic, pydantic_core, annotated_types, typing_inspection for cp312)" >&2
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
