"""The config's tune section and run.train_time: bad spaces refused in one line naming the dimension."""

import pytest

from torchsprint import config
from torchsprint.errors import UsageError

BAD = [
    ("tune.space={optim.lrr: {uniform: [0.1, 1]}}", "tune.space.optim.lrr: not a setting"),
    ("tune.space={optim.lr: {uniform: [1, 0.1]}}", "low must be below high"),
    ("tune.space={optim.lr: {loguniform: [0, 1]}}", "needs low > 0"),
    ("tune.space={data.batch_size: {choice: []}}", "non-empty list"),
    ("tune.space={data.batch_size: {int: [1.5, 3]}}", "whole numbers"),
    ("tune.space={optim.lr: {uniform: [0.1, 1], loguniform: [0.1, 1]}}", "write one of choice"),
    ("tune.space={optim.lr: {normal: [0, 1]}}", "write one of choice"),
    ("tune.space={run.dir: {choice: [a, b]}}", "cannot change where"),
    ("tune.space={data.sampler: {choice: [sqrt, sqrt]}}", "twice"),
    ("tune.metric=[]", "a list of different metrics"),
]


@pytest.mark.parametrize("override, says", BAD, ids=[b[1][:24] for b in BAD])
def test_a_bad_space_is_refused_in_one_line(override, says):
    with pytest.raises(UsageError) as e:
        config.load(None, [override])
    assert says in str(e.value) and "\n" not in str(e.value).strip()


def test_a_good_space_loads_with_shortcuts_and_free_form_keys():
    cfg = config.load(
        None,
        [
            "tune.space={optim.lr: {loguniform: [0.01, 0.3]}, image_size: {choice: [64, 96]}, "
            "model.args.zero_init_residual: {choice: [true, false]}, optim.accum_steps: {int: [1, 4]}}"
        ],
    )
    assert cfg.tune.space["optim.lr"] == {"loguniform": [0.01, 0.3]}
    assert set(cfg.tune.space) == {"optim.lr", "image_size", "model.args.zero_init_residual", "optim.accum_steps"}


@pytest.mark.parametrize("clash", ["run.max_steps=5", "sched.interval=epoch", "swa.enabled=true"])
def test_train_time_refuses_what_fixes_the_length_otherwise(clash):
    with pytest.raises(UsageError, match=clash.split("=")[0]):
        config.load(None, ["run.train_time=5m", clash])


def test_train_time_reads_durations():
    assert config.load(None, ["run.train_time=2m30s"]).run.train_time == "2m30s"
    with pytest.raises(UsageError, match="duration"):
        config.load(None, ["run.train_time=soon"])
