"""One `torchsprint tune` search process with a stub in place of training (tests/e2e/cli/test_tune_storage.py): the
real Study, Search, storage, sampler and stale-trial recovery of commands/tune/study.py, so that two of these
processes on one storage, or one killed and another resuming, show what the storage and the sampler do at the cost
of a sleep per trial.

Usage: python tune_worker.py OUT STORAGE TRIALS LOG [--resume] [--block-at N] [--together DIR N]
  STORAGE: a journal file or URL shared by processes, or `-` for the journal in OUT (tune's default).
  LOG: each trial appends {"pid", "trial", "params"} as it starts.  --block-at N: trial N never ends (to be killed).
  --together DIR N: each process's first trial waits until N processes have started one (a file each in DIR), so
  that every process takes part whatever their start-up times.
"""

import json
import math
import os
import sys
import time
from pathlib import Path


def main(argv):
    import optuna

    from torchsprint import config
    from torchsprint.commands.tune.command import write_base
    from torchsprint.commands.tune.space import Dimension
    from torchsprint.commands.tune.study import Search, Study, open_storage, recover_stale
    from torchsprint.commands.tune.trial import TrialResult

    out, storage, trials, log_path = Path(argv[0]), argv[1], int(argv[2]), Path(argv[3])
    resume = "--resume" in argv
    block_at = int(argv[argv.index("--block-at") + 1]) if "--block-at" in argv else None
    together = (
        (Path(argv[argv.index("--together") + 1]), int(argv[argv.index("--together") + 2]))
        if "--together" in argv
        else None
    )
    started = []
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def runner(spec, report, log):
        with log_path.open("a") as f:  # one short O_APPEND write per line: whole lines from both processes
            f.write(json.dumps({"pid": os.getpid(), "trial": spec.number, "params": spec.params}) + "\n")
        if together and not started:  # a barrier across processes: no one runs ahead before the others ask
            started.append(1)
            folder, n = together
            (folder / str(os.getpid())).touch()
            deadline = time.monotonic() + 120
            while len(list(folder.iterdir())) < n and time.monotonic() < deadline:
                time.sleep(0.02)
        if spec.number == block_at:
            time.sleep(3600)
        time.sleep(0.05)
        value = 1.0 - abs(math.log10(spec.params["optim.lr"] / 0.1)) - abs(spec.params["loss.label_smoothing"] - 0.05)
        report(value, 1)
        return TrialResult([value], seconds=0.05)

    dims = [
        Dimension("optim.lr", "loguniform", [0.01, 1.0], "test"),
        Dimension("loss.label_smoothing", "choice", [0.0, 0.05, 0.1], "test"),
    ]
    out.mkdir(parents=True, exist_ok=True)
    base_path, base = write_base(config.load(None, []), out, False)
    d = Study(out, base_path, base, dims, ["val/top1"], ["maximize"], None, 3, "tpe", "none")
    st = open_storage(None if storage == "-" else storage, out, resume)
    study = optuna.create_study(storage=st, study_name="tune", direction="maximize", load_if_exists=True)
    recover_stale(study, print)
    Search(study, d, trials=trials, deadline=None, workers=1, log=print, runner=runner).run()


if __name__ == "__main__":
    main(sys.argv[1:])
