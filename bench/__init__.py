"""pyengine's benchmarks, a package run module by module from the repository root:

    python -m bench.kv_cache --quick
    python -m bench.docs            # docs/benchmarks.md from bench/results/*.json

Each benchmark writes bench/results/<name>.json (see bench/common.py); the pure-Python
peers some of them measure against live in bench/reference/, the CUDA ones in bench/gpu/.

`python -m` puts the working folder first on sys.path, so from the repository root
`import pyengine` finds the source tree's pyengine/. That is what an editable install
(`pip install -e .`) wants. After a plain `pip install .` the source tree has no compiled
_C and pyengine's import says so; run from a folder that holds only a link to bench/:

    mkdir -p /tmp/pyengine-bench && ln -sfn "$PWD/bench" /tmp/pyengine-bench/bench
    (cd /tmp/pyengine-bench && python -m bench.kv_cache --quick)

(bench/gpu/run.sh does that). Results still land in this checkout's bench/results/.
"""
