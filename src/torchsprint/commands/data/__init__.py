"""The `torchsprint data` commands: check (a data set's health), compare (decoders and backends side by side),
shard (image folders -> WebDataset tar shards).

Import the modules themselves; this face re-exports nothing.
"""
