"""`python -m torchsprint` is the same as the `torchsprint` console script."""

import os
import sys

# `python -m` puts the working folder first on sys.path, where a stray torch.py or sklearn.py would
# shadow the library; torchsprint is installed, so drop it (user modules named with --import are
# searched there after the installed packages: config.import_modules).
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from torchsprint.cli import main  # noqa: E402

if __name__ == "__main__":
    code = main()
    if "TORCHELASTIC_RUN_ID" in os.environ and isinstance(code, int):
        from torchsprint.runtime.core import exit_process

        exit_process(code)  # a torchrun worker: skip interpreter shutdown (see exit_process)
    raise SystemExit(code)
