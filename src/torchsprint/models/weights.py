"""Where pretrained weights live: a spec (a file, torchvision:, timm:, hf-hub:, an http(s) URL) -> its cache path,
download address and expected hash. No network here: models/download.py fetches what this locates."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import unquote, urlparse

from torchsprint.errors import UsageError

# The spec prefixes of weights that come from a library or a server (anything else is a local file).
REMOTE_PREFIXES = ("torchvision:", "timm:", "hf-hub:", "https://", "http://")
HF_FILES = ("model.safetensors", "pytorch_model.bin")  # what timm's hf-hub loader looks for, in its order
MIRROR_ENV = "TORCHSPRINT_WEIGHTS_MIRROR"


@dataclass(frozen=True)
class WeightsSource:
    """One spec located: the file in the cache (or where it goes), and how to fetch it.

    kind: file | torchvision | timm | hf-hub | url. `target`: the cached file, or where to put it by hand.
    `url`: the download address (the mirror applied); `published`: the library's own address, for messages.
    `hash_prefix`: the start of the sha256 the downloaded bytes must have (torchvision's file names carry it; a
    URL's `#sha256=<hex>`). hf-hub and timm: `repo`, `revision` and the candidate `filenames` in order.
    """

    spec: str
    kind: str
    target: Path
    cached: Path | None = None
    url: str = ""
    published: str = ""
    hash_prefix: str | None = None
    repo: str = ""
    revision: str = "main"
    filenames: tuple[str, ...] = ()


def is_remote(spec: str | None) -> bool:
    """Whether a model.pretrained value names weights to fetch (a library's or a URL) rather than a local file."""
    return bool(spec) and spec.startswith(REMOTE_PREFIXES)


def mirrored(url: str) -> str:
    """A library URL with its scheme and host replaced by TORCHSPRINT_WEIGHTS_MIRROR (its path prefix kept in front).

    TORCHSPRINT_WEIGHTS_MIRROR=http://mirror.local/pytorch turns https://download.pytorch.org/models/x.pth into
    http://mirror.local/pytorch/models/x.pth: a corporate mirror, or a test's local server. The cached file keeps
    the library's name, so a run with and a run without the mirror share it.
    """
    mirror = os.environ.get(MIRROR_ENV, "").strip()
    if not mirror:
        return url
    if urlparse(mirror).scheme not in ("http", "https"):
        raise UsageError(
            f"{MIRROR_ENV}={mirror}: not an http(s) address; set it like http://mirror.example.com/models "
            "(it replaces the scheme and host of library download URLs), or unset it."
        )
    parts = urlparse(url)
    return mirror.rstrip("/") + parts.path + (f"?{parts.query}" if parts.query else "")


def hub_checkpoints() -> Path:
    """torch.hub's cache of downloaded weights (TORCH_HOME/hub/checkpoints; read from the environment now)."""
    import torch.hub

    return Path(torch.hub.get_dir()) / "checkpoints"


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment now (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub"


def hf_endpoint() -> str:
    """The Hugging Face hub's address: HF_ENDPOINT read now (huggingface_hub reads it once, at its import)."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def torchvision_source(spec: str, model_name: str | None, key: str = "model.pretrained") -> WeightsSource:
    """`torchvision:<Enum>.<NAME>` or `torchvision:DEFAULT` (for `model_name`): torchvision's own cache entry.

    The file is where torchvision's loader caches it (torch.hub.load_state_dict_from_url): torch.hub.get_dir()/
    checkpoints/<file name of weights.url>, TORCH_HOME moving it; the name's `-<hex>` part is the sha256 prefix
    torch.hub checks (check_hash=True).
    """
    import torch.hub
    import torchvision

    name = spec.split(":", 1)[1]
    try:
        enum = torchvision.models.get_model_weights(model_name) if model_name else None
    except (ValueError, KeyError):
        enum = None
    if name == "DEFAULT":
        if enum is None:
            raise UsageError(
                f"{key}={spec}: model {model_name} is not a torchvision model with weights; name the "
                "weights (torchvision:ResNet18_Weights.IMAGENET1K_V1) or pass a weights file."
            )
        weights = enum.DEFAULT
    else:
        try:
            weights = torchvision.models.get_weight(name)
        except (ValueError, KeyError, AttributeError):
            options = [f"torchvision:{type(w).__name__}.{w.name}" for w in enum] if enum is not None else []
            raise UsageError(
                f"{key}={spec}: torchvision has no weights '{name}'"
                f"{'; for ' + model_name + ': ' + ', '.join(options) if options else ''}."
            ) from None
        if enum is not None and type(weights) is not enum:
            raise UsageError(
                f"{key}={spec} are {type(weights).__name__}, not weights of model.name={model_name} "
                f"({enum.__name__}); use torchvision:{enum.__name__}.DEFAULT or another model.name."
            )
    filename = os.path.basename(urlparse(weights.url).path)
    target = hub_checkpoints() / filename
    found = torch.hub.HASH_REGEX.search(filename)
    return WeightsSource(
        spec,
        "torchvision",
        target,
        target if target.is_file() else None,
        mirrored(weights.url),
        weights.url,
        found.group(1) if found else None,
    )


def timm_source(spec: str, model_name: str | None, key: str = "model.pretrained") -> WeightsSource:
    """`timm:<architecture>.<tag>`: its Hugging Face repo and file, looked up in the hub cache as timm's loader does.

    A file put by hand at <cache>/models--timm--<name>/snapshots/main/model.safetensors is found there.
    """
    try:
        import timm
    except ImportError:
        raise UsageError(f"{key}={spec}: timm is not installed (pip install 'torchsprint[timm]').") from None
    tag = spec.split(":", 1)[1]
    try:
        cfg = timm.models.get_pretrained_cfg(tag) if "." in tag else None
    except RuntimeError:  # timm: "Invalid pretrained tag (...) for <arch>"
        cfg = None
    arch = tag.split(".")[0]
    if cfg is None:
        known = timm.list_pretrained(f"{arch}.*")[:8]
        raise UsageError(
            f"{key}={spec}: timm has no pretrained weights '{tag}'"
            f"{'; for ' + arch + ': ' + ', '.join('timm:' + k for k in known) if known else ''}."
        )
    if model_name is not None and model_name.removeprefix("timm/") != arch:
        raise UsageError(
            f"{key}={spec} are weights of timm's {arch}, but model.name={model_name}; set model.name=timm/{arch}."
        )
    if not cfg.hf_hub_id and cfg.url:  # a few tags live on GitHub releases only: timm fetches them through torch.hub
        return replace(url_source(cfg.url, key), spec=spec)
    files = (cfg.hf_hub_filename,) if cfg.hf_hub_filename else HF_FILES
    return _hf_source(spec, "timm", cfg.hf_hub_id or f"timm/{tag}", "main", files)


def hf_hub_source(spec: str, key: str = "model.pretrained") -> WeightsSource:
    """`hf-hub:<org>/<name>[@<revision>]` (timm's convention): the repo's model.safetensors, else pytorch_model.bin."""
    repo, _, revision = spec.split(":", 1)[1].partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise UsageError(
            f"{key}={spec}: not a Hugging Face repo; write hf-hub:<org>/<name> (e.g. "
            "hf-hub:timm/resnet18.a1_in1k), optionally @<revision>."
        )
    return _hf_source(spec, "hf-hub", repo, revision or "main", HF_FILES)


def _hf_source(spec: str, kind: str, repo: str, revision: str, files: tuple[str, ...]) -> WeightsSource:
    from huggingface_hub import try_to_load_from_cache

    cache = hf_hub_cache()
    for filename in files:
        found = try_to_load_from_cache(repo, filename, cache_dir=str(cache), revision=revision)
        if isinstance(found, str) and Path(found).is_file():
            return WeightsSource(spec, kind, Path(found), Path(found), repo=repo, revision=revision, filenames=files)
    target = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / revision / files[0]
    address = f"{hf_endpoint()}/{repo}/resolve/{revision}/{files[0]}"
    return WeightsSource(
        spec,
        kind,
        target,
        None,
        address,
        f"https://huggingface.co/{repo}/resolve/{revision}/{files[0]}",
        repo=repo,
        revision=revision,
        filenames=files,
    )


def url_source(spec: str, key: str = "model.pretrained") -> WeightsSource:
    """An http(s) URL: cached in torch.hub's checkpoints folder under the URL's file name (as
    torch.hub.load_state_dict_from_url does); `#sha256=<hex>` (a prefix of 8 or more digits) is checked."""
    parts = urlparse(spec)
    name = os.path.basename(unquote(parts.path))
    if not parts.netloc or not name:
        raise UsageError(f"{key}={spec}: a URL must end in a file name (https://host/path/weights.pth).")
    digest = None
    if parts.fragment:
        found = re.fullmatch(r"sha256=([0-9a-fA-F]{8,64})", parts.fragment)
        if not found:
            raise UsageError(f"{key}={spec}: the URL's #{parts.fragment} is not #sha256=<hex> (8 to 64 hex digits).")
        digest = found.group(1).lower()
    target = hub_checkpoints() / name
    url = parts._replace(fragment="").geturl()
    return WeightsSource(spec, "url", target, target if target.is_file() else None, url, url, digest)


def locate(spec: str, model_name: str | None, key: str = "model.pretrained") -> WeightsSource:
    """The WeightsSource of a model.pretrained value (no network).

    Args:
        spec: a file path, torchvision:<weights>, timm:<arch.tag>, hf-hub:<repo>[@rev], or an http(s) URL.
        model_name: the run's model.name (torchvision:DEFAULT needs it; timm's tag is checked against it); None
            where no model is known (`torchsprint weights get` without --model).
        key: the setting named in messages (model.pretrained, distill.teacher.weights).
    """
    if spec.startswith("torchvision:"):
        return torchvision_source(spec, model_name, key)
    if spec.startswith("timm:"):
        return timm_source(spec, model_name, key)
    if spec.startswith("hf-hub:"):
        return hf_hub_source(spec, key)
    if spec.startswith(("https://", "http://")):
        return url_source(spec, key)
    path = Path(spec).expanduser()
    return WeightsSource(spec, "file", path, path if path.is_file() else None)
