"""`torchsprint data compare`: the eval preprocessing through every decoder and backend, pixel by pixel
(`data check` is in commands/data/check.py).

torch is imported inside the functions so that `torchsprint --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path

from torchsprint.train.resolve import resolve

# ---------------------------------------------------------------- compare


def _eval_paths(cfg, raw, n: int) -> dict:
    """The eval spec applied to the first n samples by every available path -> {name: uint8 NCHW}.

    Paths: the cpu backend with each installed CPU decoder; the batched (gpu-backend) ops with CPU
    decoding; nvJPEG + batched ops on CUDA; DALI when registered and CUDA is present.
    """
    import torch

    from torchsprint.data.core import LOADERS, as_backend
    from torchsprint.data.preprocess.augment import compile_batch_spec
    from torchsprint.data.preprocess.decode import DECODERS, decode_bytes, read_bytes
    from torchsprint.data.preprocess.on_device import decode_on_device, preprocess_on_device
    from torchsprint.data.preprocess.transforms import compile_spec, decode_hint
    from torchsprint.runtime.core import Runtime

    spec = cfg.data.eval.transforms
    cpu_p = compile_spec(spec, "data.eval.transforms", 3)
    batch_p = compile_batch_spec(spec, "data.eval.transforms", 3, "compare")
    paths = [raw.samples[i][0] for i in range(min(n, len(raw)))]
    blobs = [read_bytes(p) for p in paths]
    hint = decode_hint(spec, "data.eval.transforms")
    out: dict = {}
    for dec in DECODERS.names():
        imgs = [decode_bytes(b, decoder=dec) for b in blobs]
        out[f"cpu: {dec} decode + torchvision v2"] = torch.stack([cpu_p.cpu(x) if cpu_p.cpu else x for x in imgs])
        if dec != "torchvision" and hint is not None:
            scaled = [decode_bytes(b, decoder=dec, min_size_for=hint) for b in blobs]
            out[f"cpu: {dec} DCT-scaled decode + v2"] = torch.stack([cpu_p.cpu(x) if cpu_p.cpu else x for x in scaled])

    def batched(imgs):  # what the gpu backend runs: the fused head when the spec has one
        return preprocess_on_device(
            batch_p, imgs, batch_p.draw(torch.zeros(len(imgs), dtype=torch.int64)), imgs[0].device
        )

    out["gpu-backend ops on CPU (torchvision decode)"] = batched([decode_bytes(b) for b in blobs])
    notes = []
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
        imgs = decode_on_device(data, dev)
        if any(x is None for x in imgs):
            notes.append("some files could not be decoded by nvJPEG")
        else:
            out["gpu: nvJPEG + batched ops"] = batched(imgs).cpu()
        if (why_not := as_backend(LOADERS.get("dali")).cannot_run(Runtime(dev))) is None:
            notes.append(_dali_compare(cfg, raw, n, out))
        else:
            notes.append(f"dali: {why_not}")
    else:
        notes.append("GPU paths unavailable: this machine has no CUDA device (compared the CPU decoders and ops only)")
    return {"paths": out, "files": paths, "notes": [x for x in notes if x]}


def _dali_compare(cfg, raw, n: int, out) -> str:
    """The eval spec through the dali backend's own loader (nvJPEG + DALI resize) on the first n samples."""
    import torch

    from torchsprint.data.backends.dali import DaliLoader, check_dali_spec
    from torchsprint.data.core import EpochSampler
    from torchsprint.data.preprocess.augment import compile_batch_spec
    from torchsprint.errors import UsageError
    from torchsprint.runtime.core import Runtime

    p = compile_batch_spec(cfg.data.eval.transforms, "data.eval.transforms", 3, "dali")
    try:
        check_dali_spec(p, "data.eval.transforms")
    except UsageError as e:
        return f"dali: {e}"
    loader = DaliLoader(
        raw,
        p,
        EpochSampler(min(n, len(raw)), seed=0, shuffle=False, pad=False),
        n,
        False,
        Runtime(torch.device("cuda")),
        lambda x: x,
        2,
        2,
        "error",
        cfg.data.max_image_pixels,
        raw.decoder,
    )
    loader.set_epoch(0)
    out["dali: nvJPEG + DALI ops"] = torch.cat([x for x, _ in loader]).cpu()
    return ""


def compare(cfg, images: int = 64, run: str | None = None) -> dict:
    """Max and mean absolute pixel difference (uint8 units) of every path against the cpu/torchvision one,
    and, with a run folder, the top-1 agreement of that run's model on the normalised outputs."""
    import torch

    from torchsprint.data.core import DATASETS
    from torchsprint.data.preprocess.normalize import DeviceNormalize
    from torchsprint.data.preprocess.transforms import compile_spec
    from torchsprint.errors import UsageError

    splits = DATASETS.get(cfg.data.dataset)(cfg.data)
    raw = splits.val if len(splits.val) else splits.train
    if not hasattr(raw, "samples"):
        raise UsageError(
            f"data compare decodes image files; dataset '{cfg.data.dataset}' is already decoded, so "
            "every backend sees the same pixels."
        )
    res = _eval_paths(cfg, raw, images)
    paths = res["paths"]
    ref_name = "cpu: torchvision decode + torchvision v2"
    ref = paths[ref_name]
    rows = []
    for name, x in paths.items():
        if x.shape != ref.shape:
            rows.append({"path": name, "error": f"shape {tuple(x.shape)} vs {tuple(ref.shape)}"})
            continue
        d = (x.int() - ref.int()).abs()
        rows.append({"path": name, "max_abs": int(d.max()), "mean_abs": float(d.float().mean())})
    if run is not None:
        from safetensors.torch import load_file

        from torchsprint.config.saved import load_run_config, naming_imports
        from torchsprint.models import build_model

        rcfg = load_run_config(Path(run))  # never imports the modules the run's config lists
        wpath = Path(run) / "best.safetensors"
        if not wpath.is_file():
            wpath = Path(run) / "last.safetensors"
        if not wpath.is_file():
            raise UsageError(f"{run} has no best.safetensors or last.safetensors; train it first.")
        with naming_imports(rcfg.imports, run):
            model = build_model(rcfg.model, len(splits.classes), splits.in_channels)
        p = compile_spec(cfg.data.eval.transforms, "data.eval.transforms", splits.in_channels)
        norm = DeviceNormalize(p.mean, p.std, torch.device("cpu"))
        with torch.no_grad():
            model(norm(ref[:1]))  # materialise lazy layers
            model.load_state_dict(load_file(str(wpath)))
            model.eval()
            preds = {name: model(norm(x)).argmax(1) for name, x in paths.items() if x.shape == ref.shape}
        for r in rows:
            if r["path"] in preds:
                r["top1_agreement"] = float((preds[r["path"]] == preds[ref_name]).float().mean())
    return {"reference": ref_name, "images": len(res["files"]), "rows": rows, "notes": res["notes"]}


def compare_cli(args) -> int:
    """`torchsprint data compare -c cfg [--images N] [--run RUN_DIR]`: print the difference table."""
    from torchsprint import config

    cfg = resolve(config.load(args.config, args.overrides))
    r = compare(cfg, args.images, args.run)
    print(f"eval preprocessing on {r['images']} images; reference: {r['reference']} (uint8 pixel units)")
    for row in r["rows"]:
        if "error" in row:
            print(f"  {row['path']:<48} {row['error']}")
            continue
        agree = f"  top-1 agreement {row['top1_agreement']:.3f}" if "top1_agreement" in row else ""
        print(f"  {row['path']:<48} max |diff| {row['max_abs']:>3}  mean |diff| {row['mean_abs']:.3f}{agree}")
    for n in r["notes"]:
        print(f"note: {n}")
    return 0
