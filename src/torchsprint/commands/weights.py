"""`torchsprint weights get|path`: pretrained weights fetched into (or looked up in) the libraries' caches, the same
caches a run reads: fetch on a login node with network, train on compute nodes without."""

from __future__ import annotations

import sys

from torchsprint.errors import UsageError


def _model_for(spec: str, model: str | None) -> str | None:
    if spec.startswith("torchvision:") and spec.endswith(":DEFAULT") and not model:
        raise UsageError(f"{spec} names a model's default weights: add --model (e.g. --model resnet50).")
    return model


def weights_cli(args) -> int:
    """`weights get SPEC`: download into the cache (a no-op when there) and print the file's path on stdout.
    `weights path SPEC`: print where the file is or would be; exit 0 when it is there, 1 when not, or when the file
    there must not be used (not weights, another sha256 than the URL's pin: said on stderr, as a run would refuse
    it)."""
    from torchsprint.models.download import fetch, pin
    from torchsprint.models.weights import locate
    from torchsprint.models.weights_cache import cached_problem

    model = _model_for(args.spec, args.model)
    if args.weights_command == "get":
        path = fetch(args.spec, model, key="weights")
        if not path.is_file():  # a local path that is not there: nothing to fetch it from
            raise UsageError(
                f"weights {args.spec}: no such file, and not a library's or URL's weights (torchvision:, "
                "timm:, hf-hub:, https://)."
            )
        print(path)
        return 0
    src = locate(args.spec, model, key="weights")
    print(src.cached or src.target)
    get = f"torchsprint weights get {args.spec}" + (f" --model {model}" if model else "")
    if src.cached is not None:
        if src.kind != "file" and (problem := cached_problem(src.cached, pin(src))) is not None:
            print(f"in the cache, but the file there {problem}: `{get}` downloads it again", file=sys.stderr)
            return 1
        print("in the cache", file=sys.stderr)
        return 0
    where = f"; `{get}` downloads it from {src.published}" if src.published else ""
    print(f"not there{where}", file=sys.stderr)
    return 1
