"""Data loading: the loader backends' throughput, image folders against shards, what `data.backend: auto` picks."""
