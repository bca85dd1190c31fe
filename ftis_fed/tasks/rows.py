"""A user task's data source read into canonical rows: the same rows, and so the same task digest,
whether ``datasets`` reads them or the standard library does (docs/own-task.md, "The data set").

Two readers of local files (``.jsonl``, ``.json`` = a list of objects, ``.csv``, ``.parquet``, or a
folder of them):

- ``datasets`` installed (the ``data`` extra): ``datasets.load_dataset("json" | "csv" | "parquet",
  data_files=...)`` per file, into a temporary cache (nothing is left in ``~/.cache``; no network);
- otherwise the standard library (``json``, ``csv``; ``pyarrow`` for Parquet).

A folder written by ``Dataset.save_to_disk`` and a hub id (``owner/name``) need ``datasets``
(``load_from_disk`` / ``load_dataset``); a hub id that cannot be reached and is not in the local
cache is a config error that says so.

Both readers' rows pass through ``canonical``, which fixes what readers are free to differ on, so a
file gives the same rows everywhere, whatever is installed, at whichever version:

- columns: the union over the rows, in first-seen order; a row without a column has ``None`` there
  (as Arrow gives it);
- inside nested objects (a chat message, a struct cell) a ``None`` value is left out (Arrow fills a
  missing struct field with ``None``, JSON has no field);
- numbers: an integral float is an int (``2.0`` -> ``2``; Arrow turns a column of ``1`` and ``1.5``
  into floats, JSON does not), NaN is ``None``;
- CSV: every cell a string, as written (no type inference, an empty cell is ``''``); a row with
  another number of fields than the header, or a header naming a column twice, is an error.

Folders: every data file under it (hidden ones and those in hidden folders skipped), in the order of
their paths. When file or folder names carry split words as ``datasets`` names them (``train`` /
``training``; ``validation`` / ``valid`` / ``dev`` / ``val``; ``test`` / ``testing`` / ``eval`` /
``evaluation``, e.g. ``data/train-00000-of-00001.parquet``), only the files of ``task-data-split``
are read. Which files is decided here, the same for both readers.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import math
import re
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

from ftis_fed.tasks.benchmarks import read_rows as read_rows_stdlib

#: Suffixes of the local data files.
LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
#: ``datasets``' packaged builder per suffix.
BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
#: Split words in file and folder names, as ``datasets.data_files.SPLIT_KEYWORDS`` has them.
SPLIT_WORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
               "test": ("test", "testing", "eval", "evaluation")}
_WORD_SEPARATORS = re.compile(r"[-._ 0-9]+")


def have_datasets() -> bool:
    try:
        import datasets  # noqa: F401
    except ImportError:
        return False
    return True


def reader_name() -> str:
    """Which reader local files go through on this machine: ``datasets <version>`` or ``stdlib``."""
    if not have_datasets():
        return "stdlib"
    import datasets
    return f"datasets {datasets.__version__}"


# ----------------------------------------------------------------------------- canonical rows

def _value(v: Any) -> Any:
    if isinstance(v, bool) or v is None or isinstance(v, (str, int)):
        return v
    if isinstance(v, float):
        if math.isnan(v):
            return None
        return int(v) if v.is_integer() and abs(v) < 2 ** 53 else v
    if isinstance(v, dict):
        return {str(k): _value(x) for k, x in v.items() if x is not None}
    if isinstance(v, (list, tuple)):
        return [_value(x) for x in v]
    if hasattr(v, "tolist"):                    # a numpy array or scalar
        return _value(v.tolist())
    return v                                    # bytes, datetime, Decimal: as the reader gave them


def canonical(rows: Sequence[Any], where: str) -> tuple[dict, ...]:
    """The rows in the canonical form the module docstring defines (ValueError naming ``where``
    when a row is not an object)."""
    columns: dict[str, None] = {}
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ValueError(f"{where}: every row must be an object (column -> value); row {i} is "
                             f"{type(r).__name__}")
        columns.update(dict.fromkeys(map(str, r)))
    out = []
    for r in rows:
        r = {str(k): v for k, v in r.items()}
        out.append({c: _value(r.get(c)) for c in columns})
    return tuple(out)


def rows_sha256(rows: Sequence[dict]) -> str:
    """sha256 of canonical rows: canonical JSON of each (keys sorted), one line each."""
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps(r, sort_keys=True, ensure_ascii=False, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()


# ----------------------------------------------------------------------------- which files

def _split_of(rel: Path) -> str | None:
    words = {w for part in (*rel.parent.parts, rel.stem) for w in _WORD_SEPARATORS.split(part.lower()) if w}
    return next((s for s, names in SPLIT_WORDS.items() if words & set(names)), None)


def folder_files(path: Path, split: str, where: str) -> list[Path]:
    """The data files of a folder, for ``split`` (see the module docstring)."""
    files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in LOCAL_SUFFIXES
                   and not any(p.startswith((".", "__")) for p in f.relative_to(path).parts))
    if not files:
        raise ValueError(f"{where}: the folder has no {'/'.join(LOCAL_SUFFIXES)} file and is not a "
                         "datasets save_to_disk folder")
    splits = {f: _split_of(f.relative_to(path)) for f in files}
    if not any(splits.values()):
        return files
    chosen = [f for f in files if splits[f] == split]
    if not chosen:
        named = sorted({s for s in splits.values() if s})
        raise ValueError(f"task-data-split={split!r}: the folder {str(path)!r} has files of the splits "
                         f"{', '.join(named)} (by their names), none of {split!r}")
    return chosen


# ----------------------------------------------------------------------------- the two readers

def _csv_records(path: Path, where: str) -> tuple[list[str], list[list[str]]]:
    """A CSV file's header and its non-empty records, after checking every record has as many fields
    (both readers check this; one read of the file)."""
    reader = csv.reader(io.StringIO(path.read_text(encoding="utf-8-sig"), newline=""))
    header = next(reader, None)
    if not header:
        raise ValueError(f"{where}: {path.name} has no header row")
    dup = sorted({c for c in header if header.count(c) > 1})
    if dup:
        raise ValueError(f"{where}: {path.name}'s header names {', '.join(map(repr, dup))} more than once")
    records = []
    for n, fields in enumerate(reader, 2):
        if fields and len(fields) != len(header):
            raise ValueError(f"{where}: {path.name} record {n} has {len(fields)} fields, the header "
                             f"{len(header)}")
        if fields:
            records.append(fields)
    return header, records


def read_file_stdlib(path: Path, where: str) -> list[dict]:
    if path.suffix == ".csv":
        header, records = _csv_records(path, where)
        return [dict(zip(header, fields)) for fields in records]
    if path.suffix in (".json", ".jsonl") and path.read_bytes()[:3] == b"\xef\xbb\xbf":
        text = path.read_text(encoding="utf-8-sig")           # datasets skips a BOM; so do we
        if path.suffix == ".json":
            return json.loads(text)
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return read_rows_stdlib(path)


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[Any]:
    """``datasets`` without its progress bars, caching into a temporary folder removed after."""
    import datasets
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    was_off = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="ftis-fed-datasets-") as cache:
            yield datasets, cache
    finally:
        if not was_off:
            enable_progress_bars()


def read_file_datasets(path: Path, where: str) -> list[dict]:
    """One local file through ``datasets.load_dataset``'s packaged builder for its type."""
    builder = BUILDERS[path.suffix]
    with _quiet_datasets() as (datasets, cache):
        kw: dict[str, Any] = {}
        if builder == "csv":                        # strings as written, the same as the csv module reads
            header, _ = _csv_records(path, where)
            kw = dict(features=datasets.Features({c: datasets.Value("string") for c in header}),
                      keep_default_na=False, na_filter=False, encoding="utf-8-sig")
        elif builder == "json":
            from datasets.packaged_modules.json.json import JsonConfig
            if "parse_agent_traces" in JsonConfig.__dataclass_fields__:
                kw["parse_agent_traces"] = False    # a row is a row, whatever its columns are called
        try:
            ds = datasets.load_dataset(builder, data_files=[str(path)], split="train", cache_dir=cache, **kw)
        except Exception as e:
            raise ValueError(f"{where}: datasets {datasets.__version__} could not read {path.name}: "
                             f"{type(e).__name__}: {str(e)[:300]}") from None
        return ds.to_list()


def read_local(path: Path, split: str, where: str) -> list[dict]:
    """Every row of a local file or folder, by ``datasets`` where installed, else the standard library."""
    files = [path] if path.is_file() else folder_files(path, split, where)
    read = read_file_datasets if have_datasets() else read_file_stdlib
    return [r for f in files for r in read(f, where)]


def read_datasets_source(source: str, split: str, where: str) -> list[dict]:
    """A ``save_to_disk`` folder or a hub id, through ``datasets`` (no fallback)."""
    if not have_datasets():
        raise ValueError(f"{where}: a hub id or datasets save_to_disk folder needs `datasets` "
                         "(pip install 'ftis-fed[data]'); or give a local .jsonl/.json/.csv/.parquet file")
    import datasets
    path = Path(source).expanduser()
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ValueError(f"task-data-split={split!r}: the data set at {source!r} has splits {list(ds)}")
                ds = ds[split]
        else:
            with _quiet_datasets():
                ds = datasets.load_dataset(source, split=split)
    except ValueError:
        raise
    except ConnectionError as e:                 # offline (HF_HUB_OFFLINE) or the hub unreachable
        raise ValueError(f"{where}: not a local file or folder, and datasets could not reach the hub for "
                         f"the hub id {source!r} (offline?) nor find it in its local cache ({str(e)[:200]}); "
                         "give a local file, or save the data set where the hub is reachable "
                         "(load_dataset(...).save_to_disk(folder)) and name that folder") from None
    except Exception as e:                       # unknown id, auth, a bad split: say what was attempted
        raise ValueError(f"{where}: datasets could not load it (split {split!r}): "
                         f"{type(e).__name__}: {str(e)[:300]}") from None
    return ds.to_list()
