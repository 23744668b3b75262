"""Numerics: how far two computations that should agree land apart (bf16 against fp32, serve against predict, one
loader backend against another), the figures the tests' tolerances are set from."""
