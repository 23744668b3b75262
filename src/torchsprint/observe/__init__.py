"""What a run shows and writes while it trains: console, metric sinks, progress, plots."""
