"""Training: the plan, the loop, validation, precision, EMA, SWA, checkpoints and resume, the run folder, batch size, distillation, the run's flow."""
