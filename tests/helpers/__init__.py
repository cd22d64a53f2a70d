"""Helpers the tests share: references, fakes and tiny models, imported as `helpers.<module>`.

Not test modules (pytest collects nothing here), and no fixtures: those live in conftest.py.
`tests/` is on sys.path through pyproject.toml's `pythonpath = ["tests"]`; the repository
root never is, so `import pyengine` finds the installed package, not the source tree.
"""
