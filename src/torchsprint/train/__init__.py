"""Training: the plan, the loop, validation, batch size, the speed probe, distillation, the run's flow."""
