"""The CLI's commands beyond train: export, predict, serve, bench, report, average, lr-find, weights, DDP launching,
`data` (check, compare, shard)."""
