"""`python -m torchsprint` is the same as the `torchsprint` console script."""

from torchsprint.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
