"""Code the benchmark scripts share (data generators, statistics, runs, GNU time), so that no script imports another."""
