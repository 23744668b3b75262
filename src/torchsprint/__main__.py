"""`python -m torchsprint` is the same as the `torchsprint` console script."""

import os
import sys

# `python -m` puts the working folder first on sys.path, where a stray torch.py or sklearn.py would
# shadow the library; torchsprint is installed, so drop it (user modules named with --import are
# searched there after the installed packages: config.import_modules).
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from torchsprint.cli import main  # noqa: E402


def _exit_worker(code: int) -> None:
    """A torchrun worker leaves with os._exit once everything is written and closed: interpreter shutdown
    would still destroy objects that hold gloo's worker threads (a DDP reducer's process-group reference)
    after the group is gone, which aborted about 1 run in 25 with "terminate called without an active
    exception" (exit 134; tests/stress/ddp_exit.py). Every file is closed by then (the run's logger and
    checkpoint writer close theirs); stdout and stderr are flushed here."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main()
    if "TORCHELASTIC_RUN_ID" in os.environ and isinstance(code, int):
        _exit_worker(code)
    raise SystemExit(code)
