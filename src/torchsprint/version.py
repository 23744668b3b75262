"""The package version (one place; the package face and env.json read it from here)."""

__version__ = "0.1.0"
