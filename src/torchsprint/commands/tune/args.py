"""`torchsprint tune`'s arguments (no torch or Optuna import: `torchsprint --help` stays fast)."""

from __future__ import annotations

import argparse

from torchsprint.commands.args import Count, Output


def args_tune(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-c", "--config", default=None, help="the config file to tune (default: the defaults; data.root=...)"
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides applied to every trial, e.g. data.root=photos",
    )
    p.add_argument(
        "--out",
        type=Output(folder=True),
        default="tune",
        metavar="DIR",
        help="the study's folder: its storage, trials/<n>/ run folders, trials.md, search.png, best.yaml "
        "(default tune)",
    )
    p.add_argument(
        "--trials",
        type=Count(1),
        default=None,
        metavar="N",
        help="trials in all (the study's, across --resume and joined processes); default 20 without --budget",
    )
    p.add_argument(
        "--budget",
        default=None,
        metavar="TIME",
        help="wall-clock bound of this search, e.g. 2h: no trial starts that would not end within it",
    )
    p.add_argument(
        "--trial-time",
        default=None,
        metavar="TIME",
        help="every trial trains this long (run.train_time: its length and schedule fitted to the time), e.g. 5m: "
        "trials compare at equal cost; without it each trains the config's run.epochs",
    )
    p.add_argument("--resume", action="store_true", help="continue the study in --out (interrupted trials run again)")
    p.add_argument(
        "--workers",
        type=Count(1),
        default=1,
        metavar="N",
        help="trials side by side on this machine, the CPUs split between them",
    )
    p.add_argument(
        "--storage",
        default=None,
        metavar="URL",
        help="a study shared by processes or machines: sqlite:///f.db, postgresql://..., mysql://..., redis://..., "
        "or a journal file path; each process joins it (default: a journal file in --out)",
    )
    p.add_argument("--study", default="tune", metavar="NAME", help="the study's name in --storage (default tune)")
    p.add_argument(
        "--nproc-per-node",
        type=Count(1),
        default=None,
        metavar="N",
        help="each trial a DDP run of N processes (train --nproc-per-node)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the space (each setting with why) and the plan, check every value a trial may take; run nothing",
    )
    p.add_argument("--no-test", action="store_true", help="do not evaluate the best trial on the data's test split")
