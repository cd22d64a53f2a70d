"""The CUDA benchmarks, run on a GPU machine by bench/gpu/run.sh (python -m bench.gpu.<name>)."""
