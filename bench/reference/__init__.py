"""Pure-Python peers of pyengine's C++ core, written the way vLLM v1's Python is: the
KV-cache manager (kv_cache_manager.py) and the scheduler (scheduler.py). The benchmarks
time pyengine against them; tests/core/test_reference_equivalence.py checks that both make
the same decisions on the benchmarks' seeded workloads. No pyengine import here."""
