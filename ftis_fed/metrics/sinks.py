"""The run's metrics rows, optionally also to TensorBoard and/or Weights & Biases (``report-to``).

``report-to`` is what TRL users know: ``none`` (default), ``tensorboard``, ``wandb``, or both
comma-separated (``tensorboard,wandb``). The packages are optional extras
(``pip install 'ftis-fed[tensorboard]'`` / ``'ftis-fed[wandb]'``) and never needed offline:
TensorBoard writes event files under ``<output-dir>/tensorboard``; W&B runs in offline mode
(``WANDB_MODE=offline``, files under ``<output-dir>/wandb``) unless ``WANDB_MODE`` is set or a
``WANDB_API_KEY`` is present. A missing package is a clear error when the run starts.

    sinks = open_sinks(parse_report_to("tensorboard"), out_dir, run_name, config)
    MetricsWriter(out_dir, sinks=sinks)     # every written row also goes to each sink
    for s in sinks: s.close()

A row ``{round, participant, phase, <metric>: value, ...}`` becomes one scalar per metric, tagged
``<participant>/<metric>`` (the federation row: ``_federation/fed/...``) at step ``round``.
"""

from __future__ import annotations

import importlib
import math
import os
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

REPORT_TARGETS = ("tensorboard", "wandb")
_IDENTITY = frozenset({"round", "participant", "phase", "model_id", "model_weights"})
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


class Sink(Protocol):
    def log(self, rows: Sequence[Mapping[str, Any]]) -> None: ...

    def close(self) -> None: ...


def parse_report_to(value: str, key: str = "report-to") -> tuple[str, ...]:
    """``none`` / ``""`` -> (); ``tensorboard,wandb`` -> ("tensorboard", "wandb"); anything else:
    ValueError naming the key and the accepted values."""
    parts = [p.strip().lower() for p in str(value).split(",") if p.strip()]
    if not parts or parts == ["none"]:
        return ()
    bad = [p for p in parts if p not in REPORT_TARGETS]
    if bad:
        raise ValueError(f"{key}={value!r}: unknown {', '.join(bad)} (accepted: none, or a comma-separated "
                         f"list of {', '.join(REPORT_TARGETS)})")
    return tuple(dict.fromkeys(parts))


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric metrics of a row as ``<participant>/<metric>`` tags."""
    who = str(row.get("participant", "?"))
    out = {}
    for k, v in row.items():
        if k in _IDENTITY or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        out[f"{who}/{k}"] = float(v)
    return out


def _require(target: str):
    try:
        return importlib.import_module(_PACKAGES[target])
    except ImportError as e:
        raise RuntimeError(f"report-to={target}: the {_PACKAGES[target]!r} package is not installed ({e}); "
                           f"install it with `pip install 'ftis-fed[{target}]'` or set report-to = \"none\"") from None


class TensorBoardSink:
    """Event files under ``<out_dir>/tensorboard`` (``tensorboard --logdir <out_dir>/tensorboard``)."""

    def __init__(self, out_dir: str | Path):
        _require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(out_dir) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def log(self, rows: Sequence[Mapping[str, Any]]) -> None:
        for row in rows:
            step = int(row.get("round", 0))
            for tag, v in scalars(row).items():
                self.writer.add_scalar(tag, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run; offline unless ``WANDB_MODE`` says otherwise or ``WANDB_API_KEY`` is set."""

    def __init__(self, out_dir: str | Path, run_name: str, config: Mapping[str, Any]):
        wandb = _require("wandb")
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "ftis-fed"), name=run_name, dir=str(out_dir),
                              config=dict(config), mode=mode)

    def log(self, rows: Sequence[Mapping[str, Any]]) -> None:
        for row in rows:
            data = scalars(row)
            if data:
                self.run.log({**data, "round": int(row.get("round", 0))})

    def close(self) -> None:
        self.run.finish()


def open_sinks(targets: Sequence[str], out_dir: str | Path, run_name: str,
               config: Mapping[str, Any] | None = None) -> list[Sink]:
    """One sink per target (``parse_report_to``); RuntimeError at once if a package is missing."""
    for t in targets:                                    # every missing package named before anything opens
        _require(t)
    sinks: list[Sink] = []
    for t in targets:
        sinks.append(TensorBoardSink(out_dir) if t == "tensorboard" else WandbSink(out_dir, run_name, config or {}))
    return sinks
