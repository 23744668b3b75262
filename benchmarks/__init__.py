"""The project's benchmarks, one folder per kind; each script runs as `python -m benchmarks.<kind>.<name>` from the
repository root (torchsprint installed: `pip install -e .`). What they measured: BENCHMARKS.md; their files:
results/README.md."""
