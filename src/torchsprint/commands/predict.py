"""Predictor: run a trained model on images with the eval preprocessing stored with it (torch or onnxruntime).

What a prediction is comes from the run's task (tasks.TASKS): top-k classes, the labels above a
threshold (multilabel), or an output image (image_to_image).
"""

from __future__ import annotations

import csv
import json
import os
import sys
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from torchsprint.commands.inference import FP32
from torchsprint.errors import UsageError


def expand_inputs(inputs: list[str | Path]) -> list[tuple[str, str | None]]:
    """Files and folders -> [(path, error or None)]; a folder without images becomes one error entry."""
    from torchsprint.data.sources.folders import IMAGE_EXTENSIONS

    out: list[tuple[str, str | None]] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            # not is_file(): a FIFO or a device named x.png is listed, and its row says why it is not read
            files = sorted(f for f in p.rglob("*") if not f.is_dir() and f.suffix.lower() in IMAGE_EXTENSIONS)
            out += [(str(f), None) for f in files] or [(str(p), "folder contains no images")]
        elif not p.exists():
            out.append((str(p), "file not found"))
        else:
            out.append((str(p), None))
    return out


class Predictor:
    """Runs a trained model on image files or uint8 tensors with exactly the eval preprocessing.

    Build with `Predictor.from_run(run_dir)` or `Predictor.from_file(model.onnx | model.safetensors)`.
    """

    def __init__(
        self,
        forward,
        classes: list[str],
        in_channels: int,
        eval_transforms: list,
        data_cfg,
        device: torch.device,
        batch_size: int = 64,
        uint8_input: bool = False,
        task: str = "classification",
        threshold: float = 0.5,
        tta: str = "none",
        tta_in_forward: bool = False,
    ):
        """`tta`: eval.tta (tasks/tta.py): images load with its spec (tta.loading_spec) and, unless `tta_in_forward`
        (an exported graph that holds it), `forward` is wrapped to run the views and combine them."""
        from torchsprint.data.preprocess.normalize import DeviceNormalize
        from torchsprint.data.preprocess.transforms import compile_spec
        from torchsprint.tasks.core import get_task
        from torchsprint.tasks.tta import loading_spec, plan_tta, wrap_tta

        self.classes, self.in_channels = classes, in_channels
        self.task, self.threshold = get_task(task), threshold
        if "predict" in self.task.unsupported:
            raise UsageError(f"task={task}: predict is not supported: {self.task.unsupported['predict']}")
        self.tta = tta
        plan = plan_tta(tta, self.task, eval_transforms)
        self.forward = forward if tta_in_forward else wrap_tta(forward, plan)
        eval_transforms = loading_spec(eval_transforms, tta)  # multi-crop: the larger image the crops come from
        self.pipeline = compile_spec(eval_transforms, "data.eval.transforms", in_channels)
        self.normalize = None if uint8_input else DeviceNormalize(self.pipeline.mean, self.pipeline.std, device)
        self.data_cfg, self.device, self.batch_size = data_cfg, device, batch_size
        # On CUDA, 3-channel JPEGs decode with nvJPEG and the eval spec runs on the GPU (the `gpu` backend's
        # own code, so predict matches what that backend evaluates); other files take the CPU path.
        self.gpu_pipeline = None
        if device.type == "cuda" and in_channels == 3 and self.task.name == "classification":
            from torchsprint.data.preprocess.augment import compile_batch_spec

            try:
                self.gpu_pipeline = compile_batch_spec(eval_transforms, "data.eval.transforms", in_channels, "gpu")
            except UsageError:
                self.gpu_pipeline = None  # a step the GPU path lacks: decode and preprocess on the CPU
        self.cpu_fallbacks = 0  # JPEGs nvJPEG rejected, decoded on the CPU instead
        self.inference = FP32  # from_trained's choice replaces it (commands/inference.py)
        self.graph_input: tuple | None = None  # an ONNX graph's input dims (int: fixed, None: dynamic); from_file

    def input_refusal(self, shape) -> str | None:
        """Why the model cannot take an image of this CHW shape (after the eval preprocessing), or None. An ONNX
        graph's fixed dims are checked here, before it runs, for predict and serve alike: `export` fixes H and W
        at its example's size, so a run whose eval spec keeps each file's size gets a graph that takes one size,
        and onnxruntime's refusal of another was a traceback (predict) or its exception text (serve)."""
        fixed = self.graph_input
        if fixed is None or (
            len(fixed) == len(shape) + 1 and all(f is None or f == s for f, s in zip(fixed[1:], shape))
        ):
            return None
        takes = "x".join("N" if f is None else str(f) for f in fixed)
        hw = [f for f in fixed[2:] if f is not None]
        resize = f"resize: [{', '.join(map(str, hw))}]" if len(hw) == 2 else "a resize"
        return (
            f"the model (an ONNX graph) takes {takes}; this image is {'x'.join(map(str, shape))} after the eval "
            f"preprocessing: add {resize} to data.eval.transforms and export again, or run the model in torch (the "
            "run folder or a .safetensors export)"
        )

    @classmethod
    def from_run(
        cls,
        run_dir: str | Path,
        weights: str = "best",
        backend: str = "torch",
        device: str = "cpu",
        batch_size: int = 64,
        tta: str | None = None,
        precision: str = "auto",
    ) -> Predictor:
        """Use a run folder's best/last weights (torch) or export them to ONNX first (onnx).

        `tta`: eval.tta for these predictions (None: the run's own eval.tta); `precision`: commands/inference.py."""
        if backend == "onnx":
            from torchsprint.commands.export import default_out, export
            from torchsprint.config.saved import load_run_config

            tta = tta or load_run_config(run_dir).eval.tta
            path = default_out(run_dir, "onnx", False, tta)  # one file per eval.tta: the graph holds it
            if not path.is_file():
                export(run_dir, "onnx", weights=weights, out=path, tta=tta)
            return cls.from_file(path, device=device, batch_size=batch_size, tta=tta, precision=precision)
        from torchsprint.commands.trained import load_run

        return cls.from_trained(load_run(run_dir, weights, device), device, batch_size, tta=tta, precision=precision)

    @classmethod
    def from_trained(
        cls, trained, device: str = "cpu", batch_size: int = 64, tta: str | None = None, precision: str = "auto"
    ) -> Predictor:
        """`tta`: eval.tta for these predictions (None: the config's eval.tta); `precision`: auto, fp32 or bf16
        (commands/inference.py: auto is bf16 where the run validated in bf16 and this CPU computes it natively)."""
        from torchsprint.commands.inference import choose, forward_of

        dev, c = torch.device(device), trained.cfg
        how = choose(
            precision,
            c.precision.mode,
            c.speed.channels_last,
            dev,
            conv2d=any(isinstance(m, torch.nn.Conv2d) for m in trained.model.modules()),
        )
        p = cls(
            forward_of(trained.model.to(dev).eval(), dev, how),
            trained.classes,
            trained.in_channels,
            c.data.eval.transforms,
            c.data,
            dev,
            batch_size,
            task=c.task,
            threshold=c.eval.threshold,
            tta=tta or c.eval.tta,
        )
        p.inference = how
        return p

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        device: str = "cpu",
        batch_size: int = 64,
        tta: str | None = None,
        precision: str = "auto",
    ) -> Predictor:
        """An exported .onnx (onnxruntime) or .safetensors (torch) file with torchsprint metadata.

        `tta`: eval.tta (None: the file's own). An ONNX graph holds its eval.tta (export --tta): another is refused."""

        path = Path(path)
        if path.suffix == ".safetensors":
            from torchsprint.commands.trained import load_weights_file

            return cls.from_trained(load_weights_file(path, device), device, batch_size, tta=tta, precision=precision)
        if path.suffix != ".onnx":
            raise UsageError(f"{path}: predict takes a run folder, a .onnx or a .safetensors file.")
        if precision == "bf16":
            raise UsageError(
                f"precision=bf16: {path.name} runs in onnxruntime in float32; use precision fp32 or auto "
                "(or the run folder / a .safetensors export for bf16)."
            )
        if not path.is_file():
            raise UsageError(f"model file not found: {path}")
        import onnxruntime as ort

        providers = (
            ["CUDAExecutionProvider", "CPUExecutionProvider"] if device.startswith("cuda") else ["CPUExecutionProvider"]
        )
        sess = ort.InferenceSession(str(path), providers=[p for p in providers if p in ort.get_available_providers()])
        meta = sess.get_modelmeta().custom_metadata_map
        if "classes" not in meta:
            raise UsageError(f"{path} has no torchsprint metadata; export it with `torchsprint export`.")
        from torchsprint.config.saved import file_config, metadata_entry

        cfg = file_config(metadata_entry(meta, "config", path), path)
        uint8 = meta.get("input_dtype") == "uint8"
        in_graph = meta.get("tta", "none")  # files exported before eval.tta existed hold none
        if tta is not None and tta != in_graph:
            raise UsageError(
                f"{path} holds eval.tta={in_graph} in its graph, not {tta}: export the run again with "
                f"`torchsprint export --tta {tta}`, or leave --tta out."
            )
        name = sess.get_inputs()[0].name

        def forward(x):
            return torch.from_numpy(sess.run(None, {name: x.cpu().numpy()})[0])

        forward.session = sess  # which providers ran (benchmarks/serve/predict_throughput.py)

        p = cls(
            forward,
            metadata_entry(meta, "classes", path),
            metadata_entry(meta, "in_channels", path),
            metadata_entry(meta, "eval_transforms", path),
            cfg.data,
            torch.device("cpu"),
            batch_size,
            uint8_input=uint8,
            task=cfg.task,
            threshold=cfg.eval.threshold,
            tta=in_graph,
            tta_in_forward=True,
        )
        p.graph_input = tuple(d if isinstance(d, int) and d > 0 else None for d in sess.get_inputs()[0].shape)
        if "quantization" in meta:  # an int8 graph (export --int8): it runs as quantized, never in fp32
            from torchsprint.commands.int8_file import int8_inference

            p.inference = int8_inference(meta, path, precision)
        return p

    # Files are read (and on the CPU path decoded) this many batches ahead of the model, by READERS threads.
    AHEAD = 3
    READERS = min(8, os.cpu_count() or 1)

    def _stream(self, paths: list[str]):
        """Yield (index into paths, image on self.device or an error message) in order, batch_size files at a time,
        with reading and decoding overlapped with the caller's model calls.

        Reader threads (a pool of READERS) read each file ahead: on the nvJPEG path its bytes and header, on the
        CPU path the whole decode + eval spec (_load_cpu, the same function as before, so the same pixels). One
        decoder thread turns each batch's reads into images in order (nvJPEG batch decode + the eval spec on the
        GPU, CPU decoding for the files nvJPEG does not take). At most AHEAD batches are in flight (a bounded
        queue: memory does not grow with the number of files), and the calling thread does no per-file work:
        it waits for a batch's future and, on CUDA, makes its stream wait for the batch's event.
        """
        chunks = [range(s, min(s + self.batch_size, len(paths))) for s in range(0, len(paths), self.batch_size)]
        with (
            ThreadPoolExecutor(self.READERS, thread_name_prefix="torchsprint-predict-read") as readers,
            ThreadPoolExecutor(1, thread_name_prefix="torchsprint-predict-decode") as decoder,
        ):

            def submit(chunk: range) -> Future:
                reads = [readers.submit(self._read_one, paths[j]) for j in chunk]
                return decoder.submit(self._finish_batch, [paths[j] for j in chunk], reads)

            pending = deque(submit(c) for c in chunks[: self.AHEAD])
            upcoming = iter(chunks[self.AHEAD :])
            for chunk in chunks:
                images, ready = pending.popleft().result()
                nxt = next(upcoming, None)
                if nxt is not None:
                    pending.append(submit(nxt))
                if ready is not None:  # the decoder thread's GPU work is ordered before what this thread runs next
                    torch.cuda.current_stream(self.device).wait_event(ready)
                yield from zip(chunk, images)

    def _read_one(self, path: str):
        """A reader thread's work for one file: ("bytes", uint8 tensor) for a JPEG nvJPEG takes, ("image", decoded
        and preprocessed CPU tensor), ("error", message), or ("cpu", None) to decode on the CPU in the decoder."""
        if self.gpu_pipeline is not None:
            from torchsprint.data.preprocess.decode import BadImage, read_bytes, read_header
            from torchsprint.data.preprocess.on_device import nvjpeg_ok

            try:
                blob = read_bytes(path)
                if nvjpeg_ok(read_header(blob)):
                    return "bytes", torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            except (BadImage, OSError):
                pass  # the CPU path reports it
            return "cpu", None
        try:
            return "image", self._load_cpu(path)
        except Exception as e:  # noqa: BLE001 - every bad file becomes an error entry, others go on
            return "error", str(e) or type(e).__name__

    def _finish_batch(self, paths: list[str], reads: list[Future]):
        """The decoder thread's work for one batch: its images on self.device (or error messages), and a CUDA event
        recorded after the GPU work (None on CPU)."""
        got = [f.result() for f in reads]
        out: list[torch.Tensor | str | None] = [
            img.to(self.device) if kind == "image" else img if kind == "error" else None for kind, img in got
        ]
        jpegs = [j for j, (kind, _) in enumerate(got) if kind == "bytes"]
        if jpegs:
            for j, img in zip(jpegs, self._decode_gpu([paths[j] for j in jpegs], [got[j][1] for j in jpegs])):
                out[j] = img
        for j, img in enumerate(out):
            if img is None:
                try:
                    out[j] = self._load_cpu(paths[j]).to(self.device)
                except Exception as e:  # noqa: BLE001 - every bad file becomes an error entry, others go on
                    out[j] = str(e) or type(e).__name__
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        return out, ready

    def _decode_gpu(self, paths: list[str], data: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """nvJPEG batch decode of `data` (the bytes of `paths`) + the eval spec on the GPU; None where nvJPEG failed."""
        from torchsprint.data.preprocess.on_device import decode_on_device, preprocess_on_device

        take = list(range(len(paths)))
        decoded = decode_on_device(data, self.device)
        good = [(j, img) for j, img in zip(take, decoded) if img is not None]
        if len(good) < len(take):  # nvJPEG rejected them: the CPU path decodes them (counted, reported once)
            if self.cpu_fallbacks == 0:
                import warnings

                warnings.warn(
                    f"nvJPEG could not decode {paths[next(j for j, x in zip(take, decoded) if x is None)]}; "
                    "decoding such files on the CPU (reported once).",
                    stacklevel=2,
                )
            self.cpu_fallbacks += len(take) - len(good)
        out: list[torch.Tensor | None] = [None] * len(paths)
        if good:
            p = self.gpu_pipeline
            u = p.draw(torch.zeros(len(good), dtype=torch.int64))  # eval steps draw nothing; the seed is irrelevant
            batch = preprocess_on_device(p, [img for _, img in good], u, self.device)
            for (j, _), img in zip(good, batch):
                out[j] = img
        return out

    def _load_cpu(self, path: str) -> torch.Tensor:
        from torchsprint.data.sources.folders import ImageFiles
        from torchsprint.runtime.files import MB

        files = ImageFiles(
            [(path, 0)],
            "GRAY" if self.in_channels == 1 else "RGB",
            decoder=self.data_cfg.decoder,
            max_pixels=self.data_cfg.max_image_pixels,
            max_bytes=self.data_cfg.max_file_mb * MB,
        )
        image, _, reason = files[0]
        if image is None:
            raise ValueError(reason.split(": ", 1)[-1] if reason else "unreadable image")
        return self.pipeline.cpu(image) if self.pipeline.cpu is not None else image

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW batch (after the eval spec's geometry) -> logits (float32, CPU)."""
        x = images.to(self.device)
        if self.normalize is not None:
            x = self.normalize(x)
        return self.forward(x).cpu()

    def predict(self, inputs: list, topk: int = 5, threshold: float | None = None) -> list[dict]:
        """One result per input (a path or a uint8 CHW tensor); bad inputs get an "error" entry.

        classification: "top" (the top-k classes and probabilities); multilabel: "labels" (those with
        probability >= threshold, default the run's eval.threshold) and "probs"; image_to_image: "image"
        (uint8 CHW output pixels, see tasks.to_pixels).
        """
        options = {"topk": topk, "threshold": self.threshold if threshold is None else threshold}
        results: list[dict] = []
        ready: list[tuple[int, torch.Tensor]] = []
        entries: list[tuple[str, object]] = []
        for item in inputs:
            if torch.is_tensor(item):
                entries.append(("<tensor>", item))
            else:
                entries += expand_inputs([item])
        files: list[int] = []
        for i, (name, payload) in enumerate(entries):
            results.append({"input": name})
            if torch.is_tensor(payload):
                img = self.pipeline.cpu(payload.cpu()) if self.pipeline.cpu is not None else payload
                ready.append((i, img.to(self.device)))  # every image on one device: tensors and files batch together
            elif payload is not None:
                results[i]["error"] = payload
            else:
                files.append(i)
        # Images are batched by shape, batch_size at a time in input order (tensors first, then files): a batch
        # runs as soon as its shape has batch_size images, while the next files are read and decoded (_stream).
        by_shape: dict[tuple, list[tuple[int, torch.Tensor]]] = {}

        def run(chunk: list[tuple[int, torch.Tensor]]) -> None:
            outputs = self.logits(torch.stack([img for _, img in chunk]))
            for (i, _), r in zip(chunk, self.task.postprocess(outputs, self.classes, options)):
                results[i].update(r)

        def add(i: int, img: torch.Tensor) -> None:
            refused = self.input_refusal(tuple(img.shape))  # checked before running: one row, the others go on
            if refused is not None:
                results[i]["error"] = refused
                return
            group = by_shape.setdefault(tuple(img.shape), [])
            group.append((i, img))
            if len(group) == self.batch_size:
                run(group[:])
                group.clear()

        for i, img in ready:
            add(i, img)
        for j, img in self._stream([entries[i][0] for i in files]):
            if isinstance(img, str):
                results[files[j]]["error"] = img
            else:
                add(files[j], img)
        for group in by_shape.values():  # each shape's last, partial batch
            if group:
                run(group)
        return results


def write_images(results: list[dict], folder: Path) -> None:
    """Save each result's output "image" as <folder>/<input stem>.png and replace it by that path (inputs that
    share a stem get an index suffix, so no output overwrites another)."""
    from PIL import Image

    if not any("image" in r for r in results):
        return  # nothing to save (a classifier): no empty ./predictions folder left behind
    folder.mkdir(parents=True, exist_ok=True)
    used: set[str] = set()
    for i, r in enumerate(results):
        if "image" not in r:
            continue
        stem = Path(r["input"]).stem if r["input"] != "<tensor>" else f"tensor_{i}"
        name = stem if stem not in used else f"{stem}_{i}"
        used.add(name)
        img = r.pop("image")
        arr = img.permute(1, 2, 0).numpy()
        out = folder / f"{name}.png"
        Image.fromarray(arr[..., 0] if arr.shape[2] == 1 else arr).save(out)
        r["output"] = str(out)


def describe(r: dict) -> str:
    """One line of text for a result of any task."""
    if "error" in r:
        return f"[red]error: {r['error']}[/]"
    if "top" in r:
        return "  ".join(f"{t['class']} {t['prob']:.3f}" for t in r["top"])
    if "labels" in r:
        return "  ".join(f"{t['class']} {t['prob']:.3f}" for t in r["labels"]) or "(no label above the threshold)"
    return f"wrote {r.get('output', '?')}"


OUT_SUFFIXES = (".jsonl", ".json", ".csv")  # .json is written as JSON lines too, one result per line


def write_results(results: list[dict], path: Path) -> None:
    if path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["input", "class", "prob", "error"])
            for r in results:
                top = r.get("top") or r.get("labels") or [{"class": r.get("output", ""), "prob": ""}]
                if "labels" in r:  # every label above the threshold, ';'-separated like the training CSV
                    top = [
                        {"class": ";".join(t["class"] for t in top), "prob": ";".join(f"{t['prob']:.4f}" for t in top)}
                    ]
                w.writerow([r["input"], top[0]["class"], top[0]["prob"], r.get("error", "")])
    else:
        with open(path, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")


def predict_cli(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from torchsprint.state.rundir import writable_file

    if args.out:  # checked before any prediction is computed
        writable_file(args.out, "--out", overwrite=args.overwrite)
        if Path(args.out).suffix.lower() not in OUT_SUFFIXES:
            raise UsageError(
                f"--out {args.out}: unknown format '{Path(args.out).suffix}'; use a file ending in "
                f"{', '.join(OUT_SUFFIXES)} (JSON lines or CSV)."
            )
    out_dir = Path(args.out_dir or "predictions")
    target = Path(args.run)
    tta = getattr(args, "tta", None)
    if target.is_dir():
        predictor = Predictor.from_run(
            target, args.weights, args.backend, args.device, args.batch_size, tta=tta, precision=args.precision
        )
    else:
        predictor = Predictor.from_file(target, args.device, args.batch_size, tta=tta, precision=args.precision)
    print(predictor.inference.note, file=sys.stderr)
    if predictor.task.name == "image_to_image":
        writable_file(out_dir, "--out-dir", folder=True)
    results = predictor.predict(args.inputs, topk=args.topk, threshold=getattr(args, "threshold", None))
    write_images(results, out_dir)
    table = Table(show_header=True)
    table.add_column("input", overflow="fold")
    k = min(args.topk, len(predictor.classes))
    table.add_column(
        {"multilabel": "labels above threshold", "image_to_image": "output"}.get(predictor.task.name, f"top-{k}")
    )
    for r in results:
        table.add_row(r["input"], describe(r))
    Console(soft_wrap=True).print(table)
    if args.out:
        write_results(results, Path(args.out))
    ok = sum("error" not in r for r in results)
    failed = len(results) - ok
    print(f"{ok} predicted, {failed} failed")
    return 1 if ok == 0 or (args.strict and failed) else 0
