"""Rank-0 console, progress bar (observe/progress.py), metrics.jsonl, TensorBoard and the optional CSV, MLflow and W&B
sinks.

Other ranks get a silent logger. Every sink receives the same (step, values, kind) records that go to
metrics.jsonl: kind 'train' at log steps, 'epoch' at epoch ends, 'eval' after evaluations.
"""

from __future__ import annotations

import csv
import io
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from torchsprint.errors import UsageError
from torchsprint.observe.progress import Feedback
from torchsprint.observe.tensorboard import open_writer
from torchsprint.runtime.files import check_regular


def numeric(values: dict[str, Any]) -> dict[str, float]:
    """The plain numbers of a record (no booleans, lists or text): what metric stores take."""
    return {k: float(v) for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as 'section.key' -> text, for MLflow parameters."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if not isinstance(v, str) else v
    return out


def replace_file(path: Path, data: bytes | str) -> None:
    """Write `data` to a temp file beside `path`, fsync, rename over it: a crash or a full disk leaves the old file
    or the new one, never a cut or empty one (a confusion matrix PNG was left at 0 bytes). A failed write is
    re-raised as an OSError naming `path` (a write's own error names no file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def still_valid(step: int, kind: str, resumed_step: int) -> bool:
    """Whether a record logged before a crash stays when the run resumes from the checkpoint of `resumed_step`.

    Every record up to a checkpoint's step is written before that checkpoint (engine.fit logs, then saves), so
    they stay; later steps are trained, and logged, again. The test-split record is the exception: it follows
    the last checkpoint, and a resumed run that finishes writes its own.
    """
    return step < resumed_step or (step == resumed_step and kind != "test")


class Covered:
    """Which records of a run's files the checkpoint a run resumes from covers: with `counts` (what the checkpoint
    saved: records of each kind logged before it), the first counts[kind] records of each kind; without (a
    checkpoint from before they were saved), those `still_valid` keeps by step.

    The counts make the cut exact where steps cannot: with a checkpoint at an epoch's last step, that epoch's row
    and its evaluation are logged after the checkpoint at the same step, and a crash before the epoch's own
    checkpoint left them in metrics.jsonl twice once the resumed run logged them again."""

    def __init__(self, resumed_step: int, counts: dict | None = None):
        self.step, self.counts = resumed_step, counts if isinstance(counts, dict) else None
        self.seen: dict[str, int] = {}

    def keeps(self, step: int, kind: str) -> bool:
        """Whether the next record of `kind` (logged at `step`) stays; call once per record, in the file's order."""
        self.seen[kind] = self.seen.get(kind, 0) + 1
        if self.counts is None:
            return still_valid(step, kind, self.step)
        return self.seen[kind] <= int(self.counts.get(kind, 0))


def cut_back_jsonl(
    path: Path, resumed_step: int, counts: dict | None = None, at_step: list | None = None
) -> tuple[int, int, dict]:
    """Cut a metrics.jsonl back to what the checkpoint of `resumed_step` covers (`counts`: its records per kind, see
    Covered), before a resumed run appends.

    Without this a record logged between that checkpoint and a crash is in the file twice after the resume, and a
    line the crash cut off gets the first new record glued onto it. Keeps, in their order, the complete
    records that Covered keeps; drops later ones, a cut-off last line and lines that are not a JSON
    record. The file is replaced atomically (a crash now leaves the old or the new file). Returns (kept, dropped,
    the records kept per kind); `at_step` (a list) receives the values of the kept records at `resumed_step`.
    """
    if not path.is_file():
        return 0, 0, {}
    kept: list[bytes] = []
    per_kind: dict[str, int] = {}
    dropped = 0
    covered = Covered(resumed_step, counts)
    with open(path, "rb") as f:
        for raw in f:
            try:
                row = json.loads(raw)
                kind = str(row.get("kind"))
                ok = raw.endswith(b"\n") and covered.keeps(int(row["step"]), kind)
            except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):  # junk, a cut line, no step
                ok = not raw.strip()  # blank lines are dropped silently
                dropped += not ok
                continue
            if ok:
                kept.append(raw)
                per_kind[kind] = per_kind.get(kind, 0) + 1
                if at_step is not None and int(row["step"]) == resumed_step:
                    at_step.append({k: v for k, v in row.items() if k not in ("kind", "step", "time")})
            else:
                dropped += 1
    if dropped:
        replace_file(path, b"".join(kept))
    return len(kept), dropped, per_kind


def after_earlier_event_files(tb_dir: Path) -> None:
    """Wait (at most about a second) until a new TensorBoard event file sorts after every existing one.

    TensorBoard reads a folder's event files in name order, and a name is events.out.tfevents.<seconds>.<host>.
    <pid>...: a run resumed within the same second as the crash (a quick restart, a test) could sort before the
    file it continues (a smaller pid) and be read first, and then its purge hid the steps before the checkpoint
    (seen: steps 1-3 missing from TensorBoard's view, though both files held them).
    """
    import time

    newest = max(
        (int(f.name.split(".")[3]) for f in tb_dir.glob("events.out.tfevents.*") if f.name.split(".")[3].isdigit()),
        default=None,
    )
    while newest is not None and int(time.time()) <= newest:
        time.sleep(0.05)


class CsvSink:
    """metrics_<kind>.csv in the run folder: one row per record, a column per value (appended; the file is
    rewritten only when a new column appears). Cheap enough to leave on.

    `resumed_step`, `counts`: the step of the checkpoint a resumed run continues from and its records per kind: rows
    it does not cover (and a row cut off by the crash) are removed, as from metrics.jsonl (see Covered)."""

    def __init__(self, run_dir: Path, resumed_step: int | None = None, counts: dict | None = None):
        self.dir = Path(run_dir)
        self.rows: dict[str, list[dict]] = {}
        for path in self.dir.glob("metrics_*.csv"):  # a resumed run continues its files
            check_regular(path, "a run's metric rows")  # a FIFO there would block the read below
            kind = path.stem.removeprefix("metrics_")
            text = path.read_text(encoding="utf-8", errors="replace")
            rows = list(csv.DictReader(text[: text.rfind("\n") + 1].splitlines()))  # without a row the crash cut off
            if resumed_step is not None:
                covered = Covered(resumed_step, counts)
                keep = [r for r in rows if _csv_step(r) is not None and covered.keeps(_csv_step(r), kind)]
                if len(keep) != len(rows) or not text.endswith("\n"):
                    rows = keep
                    self._rewrite(path, rows)
            self.rows[kind] = rows

    def scalars(self, step: int, values: dict[str, Any], kind: str, now: float | None = None) -> None:
        row = {"step": step, "time": now if now is not None else round(time.time(), 3), **numeric(values)}
        rows = self.rows.setdefault(kind, [])
        header = list(dict.fromkeys(k for r in rows for k in r))
        rows.append(row)
        path = self.dir / f"metrics_{kind}.csv"
        if header and set(row) <= set(header):
            try:  # a row cut by a full disk is dropped by the resume (see __init__)
                with open(path, "a", newline="") as f:
                    csv.DictWriter(f, header).writerow(row)
            except OSError as e:
                raise OSError(e.errno, e.strerror, str(path)) from e
            return
        self._rewrite(path, rows)

    @staticmethod
    def _rewrite(path: Path, rows: list[dict]) -> None:
        header = list(dict.fromkeys(k for r in rows for k in r))
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, header)
        w.writeheader()
        w.writerows(rows)
        replace_file(path, buf.getvalue().encode())

    def close(self, finished: bool) -> None:
        pass


def _csv_step(row: dict) -> int | None:
    try:
        return int(float(row.get("step")))
    except (TypeError, ValueError):
        return None


class MlflowSink:
    """MLflow through its client API (no global active run): parameters once, metrics per record. The run id
    is kept in <run>/mlflow.json so a resumed run logs into the same MLflow run."""

    def __init__(self, run_dir: Path, uri: str, experiment: str, params: dict[str, str]):
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps its file store in maintenance mode behind this switch; a local folder needs no server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        state = Path(run_dir) / "mlflow.json"
        saved = json.loads(state.read_text()) if state.is_file() else {}
        if saved.get("uri") == uri:
            self.run_id = saved["run_id"]
        else:
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment)
            run = self.client.create_run(
                exp_id, run_name=Path(run_dir).name, tags={"torchsprint.run_dir": str(run_dir)}
            )
            self.run_id = run.info.run_id
            from mlflow.entities import Param

            items = [Param(k, v[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters per call
                self.client.log_batch(self.run_id, params=items[i : i + 100])
            replace_file(state, json.dumps({"uri": uri, "run_id": self.run_id, "experiment": experiment}))
        self.client.update_run(self.run_id, status="RUNNING")

    def scalars(self, step: int, values: dict[str, Any], kind: str, now: float | None = None) -> None:
        from mlflow.entities import Metric

        ms = int((now if now is not None else time.time()) * 1000)
        metrics = [Metric(k, v, ms, step) for k, v in numeric(values).items() if k != "epoch"]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "KILLED")


class WandbSink:
    """Weights & Biases: one W&B run per torchsprint run (its id kept in <run>/wandb.json, so a resumed run
    continues it), the resolved config as its config, files under <run>/wandb."""

    def __init__(self, run_dir: Path, project: str, mode: str, params: dict):
        import wandb

        state = Path(run_dir) / "wandb.json"
        run_id = json.loads(state.read_text())["id"] if state.is_file() else secrets.token_hex(4)  # W&B ids: [a-z0-9]
        replace_file(state, json.dumps({"id": run_id, "project": project}))
        self.run = wandb.init(
            project=project,
            name=Path(run_dir).name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            mode=mode,
            config=params,
            reinit="create_new",
        )
        self.pending: dict[str, Any] = {}
        self.pending_step: int | None = None

    def scalars(self, step: int, values: dict[str, Any], kind: str, now: float | None = None) -> None:
        # One committed W&B row per step: the records of a step (train, epoch, eval) are merged and sent when
        # a later step arrives or the run closes. W&B's history needs non-decreasing steps.
        data = numeric(values)
        if not data:
            return
        if self.pending_step is not None and step != self.pending_step:
            self.flush()
        self.pending_step = step if self.pending_step is None else self.pending_step
        self.pending.update(data)

    def flush(self) -> None:
        if self.pending:
            self.run.log(self.pending, step=self.pending_step, commit=True)
        self.pending, self.pending_step = {}, None

    def close(self, finished: bool) -> None:
        self.flush()
        self.run.finish(exit_code=0 if finished else 1)


def check_sinks(log_cfg) -> None:
    """Refuse, before anything is created, a sink whose library is not installed."""
    import importlib.util

    for key, needs in (("mlflow_uri", ("mlflow",)), ("wandb_mode", ("wandb",)), ("project", ("mlflow", "wandb"))):
        value = getattr(log_cfg, key)
        if not any(getattr(log_cfg, n) for n in needs) and value != type(log_cfg).model_fields[key].default:
            raise UsageError(
                f"log.{key}={value} applies to {' and '.join('log.' + n for n in needs)}, which "
                f"{'is' if len(needs) == 1 else 'are'} off; set {' or '.join('log.' + n + '=true' for n in needs)}, "
                "or remove it."
            )
    for flag, module, extra in (("mlflow", "mlflow", "mlflow"), ("wandb", "wandb", "wandb")):
        if getattr(log_cfg, flag) and importlib.util.find_spec(module) is None:
            raise UsageError(
                f"log.{flag}=true needs the {module} package: pip install 'torchsprint[{extra}]' (or set "
                f"log.{flag}=false)."
            )


class RunLogger:
    """Writes what a run reports. Construct with `enabled=False` on ranks other than 0.

    Args:
        run_dir: the run folder (metrics.jsonl and tb/ go there); None for console only.
        log_cfg: the `log` section.
        enabled: False makes every method a no-op (non-zero ranks).
        console: False silences the terminal but still writes files.
    """

    def __init__(self, run_dir: Path | None, log_cfg, enabled: bool = True, console: bool = True):
        self.enabled = enabled
        self.console = Console(stderr=False, highlight=False, soft_wrap=True, quiet=not console)
        self.cfg = log_cfg
        self.jsonl = None
        self.tb = None
        self.sinks: list = []  # CSV, MLflow, W&B: each takes scalars(step, values, kind) and close(finished)
        self.counts: dict[str, int] = {}  # metrics.jsonl's records per kind (a checkpoint saves them: Covered)
        self.feedback = Feedback(self.console, self.info)  # the bar, heartbeat and time estimate
        if run_dir is not None:
            self.open_files(run_dir)

    def open_files(
        self,
        run_dir: Path,
        params: dict | None = None,
        out_dir: str | Path = "runs",
        resumed_step: int | None = None,
        resumed_counts: dict | None = None,
    ) -> None:
        """Start writing metrics.jsonl (appended to, so a resumed run continues it), TensorBoard and the optional
        sinks into run_dir. `params`: the resolved config (MLflow parameters, W&B config); `out_dir`: where
        the default local MLflow store goes (<out_dir>/mlruns); `resumed_step`: the step of the checkpoint a
        resumed run continues from (None: a fresh start), `resumed_counts` the records per kind it saved: what was
        logged after it is cut from metrics.jsonl, the CSV files and TensorBoard, so each record is there once (MLflow
        and W&B cannot delete; see docs/checkpoints.md)."""
        if not self.enabled or self.jsonl is not None:
            return
        path = Path(run_dir) / "metrics.jsonl"
        check_regular(path, "the run's metric rows")  # opening a FIFO to append blocks until a reader comes
        at_step: list[dict] = []  # a resumed run: the kept records at the checkpoint's step, for TensorBoard (below)
        if resumed_step is not None:
            kept, dropped, self.counts = cut_back_jsonl(path, resumed_step, resumed_counts, at_step)
            if dropped:
                self.info(
                    f"metrics.jsonl: {dropped} record(s) after the checkpoint of step {resumed_step} (or cut off by "
                    f"the crash) removed; {kept} kept. The resumed run logs those steps again."
                )
        self.jsonl = open(path, "a", buffering=1)
        if self.cfg.tensorboard:
            # purge_step: TensorBoard hides earlier files' events at steps >= it. At the checkpoint's step, records
            # logged before it (kept) and after it (an epoch's row and evaluation after a step checkpoint at its last
            # step, logged again) share the step: all are hidden, and the kept ones written again from metrics.jsonl.
            if resumed_step is not None:
                after_earlier_event_files(Path(run_dir) / "tb")
            self.tb = open_writer(Path(run_dir) / "tb", resumed_step)  # a failed write: one OSError, no empty file
            for row in at_step:
                for k, v in numeric(row).items():
                    self.tb.add_scalar(k, v, resumed_step)
        if self.cfg.csv:
            self.sinks.append(CsvSink(run_dir, resumed_step, resumed_counts))
        if self.cfg.mlflow:
            uri = self.cfg.mlflow_uri or (Path(out_dir) / "mlruns").resolve().as_uri()
            self.sinks.append(MlflowSink(run_dir, uri, self.cfg.project, flatten(params or {})))
            self.info(f"MLflow: experiment {self.cfg.project} at {uri} (`mlflow ui --backend-store-uri {uri}`)")
        if self.cfg.wandb:
            self.sinks.append(WandbSink(run_dir, self.cfg.project, self.cfg.wandb_mode, params or {}))

    def info(self, msg: str) -> None:
        if self.enabled:
            (self.progress.console if self.progress else self.console).print(msg)

    def scalars(self, step: int, values: dict[str, Any], kind: str) -> None:
        """One metrics.jsonl line and TensorBoard scalars for every numeric value."""
        if not self.enabled:
            return
        now = round(time.time(), 3)  # one timestamp for every sink: the CSV row equals the jsonl record
        if self.jsonl:
            try:  # line-buffered: the line reaches the file here, or its OSError (a full disk) names the file
                self.jsonl.write(json.dumps({"kind": kind, "step": step, "time": now, **values}) + "\n")
            except OSError as e:
                raise OSError(e.errno, e.strerror, self.jsonl.name) from e
            self.counts[kind] = self.counts.get(kind, 0) + 1
        if self.tb:
            for k, v in numeric(values).items():
                self.tb.add_scalar(k, v, step)
        for sink in self.sinks:
            sink.scalars(step, values, kind, now)

    # -- progress (progress.Feedback): one bar per epoch on an interactive terminal; elsewhere a heartbeat line; and
    # once, early in the first epoch trained here, the estimate of the epoch's and the run's time
    @property
    def progress(self) -> Progress | None:
        """The epoch's progress bar while one is drawn."""
        return self.feedback.progress

    def expect(self, cfg, decided: dict) -> None:
        """What the run will do, for the time estimate (progress.Feedback.expect)."""
        self.feedback.expect(cfg, decided)

    def start_epoch(self, epoch: int, epochs: int, total: int, done: int = 0) -> None:
        self.feedback.start_epoch(
            epoch, epochs, total, done, on=self.enabled and self.cfg.progress and not self.console.quiet
        )

    def advance(self, n: int = 1, images: int = 0) -> None:
        """Count `n` steps of `images` images (the bar, the heartbeat, the estimate)."""
        self.feedback.advance(n, images)

    def step_stats(self, text: str) -> None:
        self.feedback.step_stats(text)

    def end_epoch(self) -> None:
        self.feedback.end_epoch()

    def phase(self, what: str):
        """A line every HEARTBEAT_SECONDS while `what` (an evaluation) runs (progress.Feedback.phase)."""
        return self.feedback.phase(what, on=self.enabled and self.cfg.progress and not self.console.quiet)

    def summary(self, title: str, rows: list[tuple[str, str]]) -> None:
        if not self.enabled:
            return
        table = Table(title=title, show_header=False)
        table.add_column(style="bold")
        table.add_column()
        for k, v in rows:
            table.add_row(k, v)
        self.console.print(table)

    def flush(self) -> dict[str, int]:
        """Put every record logged so far on disk: TensorBoard's writer otherwise holds events for up to
        flush_secs (120 s), and a crash loses them (Saver calls this before each checkpoint). Returns the records
        per kind in metrics.jsonl, which the checkpoint keeps (a resume from it keeps exactly those: Covered)."""
        if self.jsonl:
            self.jsonl.flush()
        if self.tb:
            self.tb.flush()
        return dict(self.counts)

    def close(self, finished: bool = True) -> None:
        """Flush and close everything; `finished`: the run ended normally (MLflow/W&B mark it so)."""
        self.end_epoch()
        if self.jsonl:
            try:
                self.jsonl.close()
            except OSError:  # the rest of a line a full disk refused: the write that failed has raised already
                pass
            self.jsonl = None
        if self.tb:
            self.tb.close()
            self.tb = None
        for sink in self.sinks:
            sink.close(finished)
        self.sinks = []
