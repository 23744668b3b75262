"""Where the tests' own files are, for a test at any depth below tests/ (unit/<package>/, e2e/<area>/)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent  # tests/: conftest.py, the helpers, faults/, data/
REPO = TESTS.parent
DATA = TESTS / "data"  # small files the tests read as they are
WORKERS = TESTS / "e2e" / "workers"  # the programs DDP tests start in each rank
