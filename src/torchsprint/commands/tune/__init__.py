"""`torchsprint tune`: the search space (space.py), one trial as a training run (trial.py), the Optuna study
(study.py), what the study leaves in its folder (report.py), the command (command.py) and its arguments (args.py)."""
