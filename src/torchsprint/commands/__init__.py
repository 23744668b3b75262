"""The CLI's commands beyond train: eval helpers, export, predict, bench, report, average, lr-find."""
