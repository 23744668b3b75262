"""Processes sharing one tune study (tests/e2e/workers/tune_worker.py: the real search, storage and sampler of
commands/tune/study.py, a sleep in place of each trial's training): two processes joined to one journal run each
trial once and the count the study asked for, and a process killed with SIGKILL mid-trial, then resumed, leaves the
same trials as an uninterrupted study."""

import json
import signal
import subprocess
import sys
import time

import optuna
import pytest

from paths import WORKERS

pytestmark = pytest.mark.dist


def worker(out, storage, trials, log, *extra):
    cmd = [sys.executable, str(WORKERS / "tune_worker.py"), str(out), storage, str(trials), str(log), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(p, timeout=120):
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, out + err
    return out


def lines(log):
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def trials_of(storage, states=("COMPLETE",)):
    study = optuna.load_study(
        study_name="tune",
        storage=optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(storage))),
    )
    return [t for t in study.get_trials() if t.state.name in states]


def test_two_processes_on_one_storage_run_each_trial_once_and_the_count_asked(tmp_path):
    # Each process checks the count and samples on its own: without the storage shared they would run 20 trials each;
    # with a seed per process (Optuna's) both would draw the same settings at once; with the count checked before
    # the ask only, both could take the last trial (21 in all). The last two are races: the old per-process seeding
    # drew one setting twice in 1 of 3 runs of 10 trials here, so this catches it sometimes, not every time.
    journal, log = tmp_path / "shared.journal", tmp_path / "ran.jsonl"
    (tmp_path / "ready").mkdir()
    together = ("--together", str(tmp_path / "ready"), "2")
    a, b = (worker(tmp_path / f"out{i}", str(journal), 20, log, *together) for i in range(2))
    finished(a), finished(b)
    ran = lines(log)
    assert len(ran) == 20 and len({r["trial"] for r in ran}) == 20
    assert {r["pid"] for r in ran} == {a.pid, b.pid}  # both took part
    assert len({json.dumps(r["params"], sort_keys=True) for r in ran}) == 20  # no setting drawn twice
    done = trials_of(journal)
    assert sorted(t.number for t in done) == sorted(r["trial"] for r in ran)
    assert {t.number: t.params for t in done} == {r["trial"]: r["params"] for r in ran}


def test_a_tune_killed_mid_trial_resumes_to_the_trials_of_an_uninterrupted_one(tmp_path):
    # A real SIGKILL while trial 3 runs: the trial stays RUNNING in the journal with a dead pid. The resumed process
    # fails it, runs its settings again, and samples the rest as the uninterrupted study did (seed + rank). A bug that
    # counts the killed trial runs 5 trials; one that seeds by trial number draws others after the kill.
    whole_log = tmp_path / "whole.jsonl"
    finished(worker(tmp_path / "whole", "-", 6, whole_log))
    log = tmp_path / "part.jsonl"
    p = worker(tmp_path / "part", "-", 6, log, "--block-at", "3")
    deadline = time.monotonic() + 120
    while len(lines(log)) < 4 and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    assert len(lines(log)) == 4, p.communicate()
    p.send_signal(signal.SIGKILL)
    p.wait()
    out = finished(worker(tmp_path / "part", "-", 6, log, "--resume"))
    assert "1 interrupted trial(s)" in out
    params = lambda ts: sorted(json.dumps(t.params, sort_keys=True) for t in ts)  # noqa: E731
    whole = trials_of(tmp_path / "whole" / "study.journal")
    part = trials_of(tmp_path / "part" / "study.journal")
    assert len(whole) == len(part) == 6 and params(part) == params(whole)
    failed = trials_of(tmp_path / "part" / "study.journal", states=("FAIL",))
    assert [t.number for t in failed] == [3] and failed[0].params == lines(log)[3]["params"]
