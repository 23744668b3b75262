"""`torchsprint tune` end to end on digits: real trials (child train processes), the study's files, best.yaml
training the best trial again, and --trial-time fitting each trial's length."""

import json
import subprocess
import sys

import pytest
import yaml


def tune(tmp_path, *args):
    cmd = [sys.executable, "-m", "torchsprint", "tune", "--out", str(tmp_path / "study"), "--no-test", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_a_study_leaves_its_trials_and_a_best_yaml_that_trains_the_best_trial_again(tmp_path):
    space = "tune.space={loss.label_smoothing: {choice: [0.0, 0.1]}}"
    r = tune(tmp_path, "--trials", "2", "run.epochs=1", space, "tune.pruner=none")
    assert r.returncode == 0, r.stdout + r.stderr
    study = tmp_path / "study"
    rows = (study / "trials.md").read_text().splitlines()[2:]
    assert len(rows) == 2 and all("| complete |" in x for x in rows)
    assert (study / "search.png").stat().st_size > 1000
    best = json.loads((study / "tune.json").read_text())["best"]
    trial_summary = json.loads((study / "trials" / f"{best['trial']:04d}" / "summary.json").read_text())
    # The trial ran with the setting asked (config.yaml read back), and best.yaml trains it again: the same
    # machine, seed and settings give the same metric (a best.yaml missing a setting, or the wrong trial's, differs).
    ran = yaml.safe_load((study / "trials" / f"{best['trial']:04d}" / "config.yaml").read_text())
    assert ran["loss"]["label_smoothing"] == best["params"]["loss.label_smoothing"]
    again = subprocess.run(
        [sys.executable, "-m", "torchsprint", "train", "-c", str(study / "best.yaml"), f"run.dir={tmp_path / 'again'}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert again.returncode == 0, again.stderr
    summary = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert summary["best_metric"] == trial_summary["best_metric"] == best["values"][0]


@pytest.mark.slow  # over ~10 s on an AVX2-only 2-core machine: .ci/slow
def test_trial_time_fits_each_trial_and_a_bad_space_is_refused_before_any_trial(tmp_path):
    r = tune(tmp_path, "--trials", "1", "--trial-time", "4s", "tune.space={optim.lr: {loguniform: [0.05, 0.2]}}")
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads((tmp_path / "study" / "trials" / "0000" / "summary.json").read_text())
    assert s["train_time"]["fitted_steps"] == s["global_step"]  # stopped at its fitted length
    (tmp_path / "b").mkdir()
    bad = tune(tmp_path / "b", "--trials", "1", "tune.space={data.batch_size: {choice: [0, 32]}}")
    assert bad.returncode == 2 and "tune.space.data.batch_size=0" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "b" / "study").exists()  # refused: nothing written
