"""The tests, in tiers (tests/README.md). A package, so that a test module in one tier can import
another's helpers as tests.<tier>.<module>; the shared helpers beside this file are on pytest's
pythonpath (pyproject.toml)."""
