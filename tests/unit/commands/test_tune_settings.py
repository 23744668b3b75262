"""Each field of the config's `tune` section changes what `torchsprint tune` does (tests/e2e/train/test_every_setting.py
names these tests as the fields' probes): tune.metric what trials are scored by, tune.sampler and tune.seed which
settings are drawn, tune.pruner which trials stop early, tune.space what is searched. Real Optuna, a real journal
file, a stub in place of training (tests/unit/commands/test_tune_search.py)."""

import math

import optuna
import pytest

from torchsprint import config
from torchsprint.commands.tune.command import objectives, write_base
from torchsprint.commands.tune.space import Dimension, user_space
from torchsprint.commands.tune.study import Search, Study, open_storage
from torchsprint.commands.tune.trial import TrialResult
from torchsprint.errors import UsageError

optuna.logging.set_verbosity(optuna.logging.WARNING)

DIMS = [Dimension("optim.lr", "loguniform", [0.01, 1.0], "test")]


def search(tmp_path, *over, trials=10, runner=None):
    """A study of `trials` trials over DIMS with the tune section of `over`; its trials."""
    cfg = config.load(None, list(over))
    tmp_path.mkdir(parents=True, exist_ok=True)
    base_path, base = write_base(cfg, tmp_path, False)
    t = cfg.tune
    d = Study(tmp_path, base_path, base, DIMS, ["val/top1"], ["maximize"], None, t.seed, t.sampler, t.pruner)
    from torchsprint.commands.tune.study import make_pruner

    study = optuna.create_study(
        storage=open_storage(None, tmp_path, False),
        study_name="t",
        direction="maximize",
        pruner=make_pruner(t.pruner, False),
    )
    Search(study, d, trials=trials, deadline=None, workers=1, log=lambda *_: None, runner=runner or favours).run()
    return study.get_trials()


def favours(spec, report, log) -> TrialResult:
    """Best near lr 0.1."""
    value = 1.0 - abs(math.log10(spec.params["optim.lr"] / 0.1))
    report(value, 1)
    return TrialResult([value], seconds=0.01)


def lrs(trials):
    return [round(t.params["optim.lr"], 12) for t in trials]


def test_tune_metric_is_what_trials_are_scored_by_in_its_direction():
    # A bug that ignores tune.metric scores every study by checkpoint.monitor; one that takes every metric as
    # maximised searches for the worst loss.
    monitor = config.load(None, []).checkpoint.monitor
    assert objectives(config.load(None, [])) == ([monitor], ["maximize"])
    assert objectives(config.load(None, ["tune.metric=val/loss"])) == (["val/loss"], ["minimize"])
    both = config.load(None, ["tune.metric=[val/top1, train_images_per_s]", "tune.pruner=none"])
    assert objectives(both) == (["val/top1", "train_images_per_s"], ["maximize", "maximize"])
    # Imbalanced training classes: the monitor a default run would pick (balanced accuracy from data.sampler=auto's
    # 4x), unless the config set one; a study that kept val/top1 there would favour trials that drop the rare classes.
    cfg = config.load(None, [])
    assert objectives(cfg, [1400, 500, 200, 100]) == (["val/balanced_acc"], ["maximize"])
    assert objectives(cfg, [146, 139]) == ([monitor], ["maximize"])
    assert objectives(config.load(None, ["checkpoint.monitor=val/f1_macro"]), [1400, 100])[0] == ["val/f1_macro"]
    with pytest.raises(UsageError, match="prunes single-objective studies only"):
        objectives(config.load(None, ["tune.metric=[val/top1, train_images_per_s]", "tune.pruner=median"]))


def test_tune_sampler_and_tune_seed_decide_the_draws(tmp_path):
    # TPE's first 5 trials are random draws (n_startup_trials); from the 6th it samples near the best so far. A bug
    # that ignores tune.sampler draws the same 12 trials for both; one that ignores tune.seed the same for 0 and 1.
    tpe = search(tmp_path / "tpe", "tune.sampler=tpe", trials=12)
    rnd = search(tmp_path / "random", "tune.sampler=random", trials=12)
    assert lrs(tpe)[5:] != lrs(rnd)[5:]
    assert lrs(search(tmp_path / "seed0", "tune.seed=0", trials=3)) == lrs(tpe)[:3]  # seeded: the same draws again
    seed1 = lrs(search(tmp_path / "seed1", "tune.seed=1", trials=3))
    assert seed1 != lrs(tpe)[:3]
    # Not seed + n: then study 1's trials 0-1 were study 0's trials 1-2 (measured in the first tune benchmark)
    assert not set(seed1) & set(lrs(tpe)[:4])


def test_tune_pruner_stops_the_trials_that_fall_behind(tmp_path):
    # Trials report 4 times; those with lr above 0.1 report low values. median: once 3 trials finished, a trial below
    # the others' median at the same step stops. none: every trial runs to its end. A pruner not passed to the study
    # (Optuna's default is median) prunes under none too; halving prunes as well.
    def steps(spec, report, log) -> TrialResult:
        value = 1.0 if spec.params["optim.lr"] < 0.1 else 0.0
        for step in range(1, 5):
            if report(value, step):
                return TrialResult([value], seconds=0.01, pruned=True, reports=[(step, value)])
        return TrialResult([value], seconds=0.01)

    states = {
        p: [
            t.state.name
            for t in search(tmp_path / p, f"tune.pruner={p}", "tune.sampler=random", trials=12, runner=steps)
        ]
        for p in ("median", "halving", "none")
    }
    assert "PRUNED" in states["median"] and "PRUNED" in states["halving"]
    assert states["none"] == ["COMPLETE"] * 12


def test_tune_space_is_what_is_searched():
    # Each dimension of tune.space becomes one searched setting with its kind and range; a shortcut keeps its name.
    dims = user_space(
        config.load(
            None, ["tune.space={optim.lr: {loguniform: [0.01, 0.5]}, image_size: {choice: [32, 64]}}"]
        ).tune.space
    )
    assert [(d.key, d.kind, d.values) for d in dims] == [
        ("optim.lr", "loguniform", [0.01, 0.5]),
        ("image_size", "choice", [32, 64]),
    ]


def test_dry_run_prints_the_space_and_writes_nothing(tmp_path):
    # A dry run that opened the storage would leave a journal, and the real run after it would be refused for
    # want of --resume; one that skipped the values' check would pass a space the trials then refuse.
    import argparse

    from torchsprint.commands.tune.args import args_tune
    from torchsprint.commands.tune.command import tune

    p = argparse.ArgumentParser()
    args_tune(p)
    p.add_argument("--imports", default=[])
    out = tmp_path / "study"
    said = []
    space = "tune.space={optim.lr: {loguniform: [0.01, 0.5]}, data.batch_size: {choice: [16, 32]}}"
    got = tune(p.parse_args(["--out", str(out), "--dry-run", "--trials", "3", space]), log=said.append)
    assert got["dry_run"] and got["space"] == [
        ["optim.lr", "loguniform", [0.01, 0.5]],
        ["data.batch_size", "choice", [16, 32]],
    ]
    assert any("optim.lr: loguniform 0.01..0.5" in x for x in said) and any("3 trials" in x for x in said)
    assert not out.exists()
    with pytest.raises(UsageError, match=r"tune.space.data.batch_size=0"):
        tune(p.parse_args(["--out", str(out), "--dry-run", "tune.space={data.batch_size: {choice: [0, 32]}}"]))
    assert not out.exists()


def test_the_first_trial_is_the_config_as_it_stands():
    # The baseline trial: each dimension at the config's own value where it lies in the domain (a bug that reads the
    # schema's default instead of the config's, or data.sampler=auto as such, would start from another point).
    from torchsprint.commands.tune.space import baseline_params

    cfg = config.load(
        None,
        ["optim.lr=0.05", "data.train.transforms=[random_resized_crop: {size: 64, scale: [0.35, 1.0]}, hflip]"],
    )
    dims = [
        Dimension("optim.lr", "loguniform", [0.01, 0.2], "t"),
        Dimension("image_size", "choice", [32, 64], "t"),
        Dimension("crop_scale", "uniform", [0.08, 0.6], "t"),
        Dimension("data.sampler", "choice", ["sqrt", "balanced", "shuffle"], "t"),
        Dimension("data.batch_size", "choice", [32, 128], "t"),  # the config's 64 is not a choice: drawn instead
    ]
    assert baseline_params(dims, cfg, [1400, 100]) == {
        "optim.lr": 0.05,
        "image_size": 64,
        "crop_scale": 0.35,
        "data.sampler": "sqrt",
    }
    assert baseline_params(dims, cfg, [146, 139])["data.sampler"] == "shuffle"
