"""`torchsprint bench`'s variant matrix: which variants there are, in report order, what each changes from the
seeds' baseline, and why one cannot run on this machine."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class Variant:
    """One row of the matrix: a name, the overrides it applies to the baseline, and why it may not run here."""

    name: str
    overrides: list[str]
    what: str
    skip: str | None = None
    processes: int = 1  # > 1: measured under DDP with this many processes (torchrun)
    results: list[dict] = field(default_factory=list)


def _cuda():
    import torch

    return torch.cuda.is_available()


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def decodes_files(cfg) -> bool:
    """Whether the dataset is image files decoded while loading (image_folder...) rather than already in memory
    (digits, CIFAR): the baseline's PIL decoder and the decoder choice only exist for the former."""
    from torchsprint.data import DATASETS

    return hasattr(DATASETS.get(cfg.data.dataset)(cfg.data).train, "samples")


def seeds_baseline(decodes: bool = True) -> list[str]:
    """The seeds' setup: fp32, a plain DataLoader (with PIL decoding when there are files), no speed switches
    (seed 004's loop). Backend-specific settings of the user's config are reset with the backend."""
    workers = min(8, os.cpu_count() or 1)  # seed 004 uses num_workers=8; never more than the cores here
    return [
        "precision.mode=fp32",
        "strategy.name=single",
        "data.backend=cpu",
        "data.cpu_fraction=0.0",
        "data.fallback=null",
        *(["data.decoder=pil"] if decodes else []),
        f"data.num_workers={workers}",
        "data.persistent_workers=false",
        "speed.channels_last=false",
        "speed.compile=false",
        "speed.cuda_graphs=false",
        "speed.cudnn_benchmark=false",
        "speed.tf32=false",
        "optim.impl=for_loop",
    ]


def variants(cfg, decodes: bool = True) -> list[Variant]:
    """Every variant, in report order; each `skip` says why it cannot run on this machine. `decodes`: the
    dataset is files decoded while loading (see decodes_files); the rows say what they really do."""
    cuda, gpus = _cuda(), _gpus()
    no_gpu = "needs a CUDA GPU; none here"
    cores = os.cpu_count() or 1
    v = [
        Variant(
            "baseline (seeds)",
            [],
            "fp32, plain DataLoader + PIL decoding, no switches"
            if decodes
            else "fp32, plain DataLoader over the in-memory images (nothing to decode), no switches",
        ),
        Variant(
            "+ tuned cpu loader",
            [*(["data.decoder=auto"] if decodes else []), "data.persistent_workers=true", f"data.num_workers={cores}"],
            "fastest installed decoder, persistent workers, one worker per core"
            if decodes
            else "persistent workers, one worker per core",
        ),
        Variant(
            "+ gpu loader",
            ["data.backend=gpu"],
            "nvJPEG decode + GPU augmentation",
            None if cuda and decodes else no_gpu if not cuda else "decodes image files; this dataset is in memory",
        ),
        Variant("+ memory loader", ["data.backend=memory"], "decoded dataset on the device, batched augmentation"),
        Variant(
            "+ dali",
            ["data.backend=dali"],
            "NVIDIA DALI pipeline",
            None if cuda and _has("nvidia.dali") else ("needs NVIDIA DALI (pip install torchsprint[dali]) and a GPU"),
        ),
        Variant(
            "+ tf32 + cudnn autotune",
            ["speed.tf32=true", "speed.cudnn_benchmark=true"],
            "TF32 matrix products and convolutions, cuDNN algorithm search (torchsprint's defaults on CUDA)",
            None if cuda else "CUDA-only switches",
        ),
        Variant("+ channels_last", ["speed.channels_last=true"], "NHWC memory format"),
        Variant("+ amp_bf16", ["precision.mode=amp_bf16"], "bfloat16 autocast"),
        Variant(
            "+ amp_fp16",
            ["precision.mode=amp_fp16"],
            "float16 autocast + loss scaling",
            None if cuda else "fp16 autocast needs a CUDA GPU (on CPU use amp_bf16)",
        ),
        Variant("+ compile", ["speed.compile=true"], "torch.compile"),
        Variant("+ cuda graphs", ["speed.cuda_graphs=true"], "CUDA graph of the train step", None if cuda else no_gpu),
        Variant("+ foreach optimizer", ["optim.impl=foreach"], "multi-tensor optimizer update"),
        Variant(
            "+ dp",
            ["strategy.name=dp"],
            f"nn.DataParallel over {gpus} GPUs",
            None if gpus >= 2 else f"needs >= 2 GPUs; {gpus} here",
        ),
    ]
    n = gpus if gpus >= 2 else (2 if not cuda and cores >= 2 else 0)
    v.append(
        Variant(
            f"+ ddp x{n or 2}",
            ["strategy.name=ddp"],
            f"DistributedDataParallel, {n or 2} processes",
            None if n else "needs >= 2 GPUs (or a CPU-only machine with >= 2 cores)",
            processes=max(n, 2),
        )
    )
    return v
