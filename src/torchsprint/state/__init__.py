"""What a run carries beyond the model's code: precision, EMA and SWA state, checkpoints and resume, the run folder.

Import the modules themselves; this face re-exports nothing.
"""
