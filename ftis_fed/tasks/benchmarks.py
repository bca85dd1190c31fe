"""GSM8K and MATH-500 as ``Prompt`` lists, from local files first.

Accepted sources, in the order they are tried:

1. a file: ``.jsonl`` (one JSON object per line), ``.json`` (a list of objects) or ``.parquet``;
2. a directory in a known layout:
   - GSM8K: ``{split}.jsonl``, ``grade_school_math/data/{split}.jsonl`` (openai/grade-school-math),
     ``main/{split}-*.parquet`` (the Hugging Face repo ``openai/gsm8k``), ``{split}-*.parquet``;
   - MATH-500: ``test.jsonl`` (the Hugging Face repo ``HuggingFaceH4/MATH-500``), ``test-*.parquet``;
3. otherwise a hub id (``openai/gsm8k``), loaded with ``datasets.load_dataset``: only when the caller
   passes one and a hub is reachable. Nothing here downloads by default.

GSM8K rows have ``question`` and ``answer`` (a worked solution ending ``#### 42``); the reference is
the text after ``####`` without commas. MATH-500 rows have ``problem``, ``solution``, ``answer``,
``subject``, ``level``, ``unique_id``; the reference is ``answer`` (else the last ``\\boxed{}`` of the
solution). Task ids: ``gsm8k/{split}/{row}`` and ``math500/{unique_id}`` (the whole set, evaluation
only), or ``math500/{train|eval}/{unique_id}`` when MATH-500 is split for training
(``load_math500(..., split=...)``).

Training on a benchmark (``task-source = gsm8k | math500``, ``train_pool``): GSM8K trains on its
``train`` file and evaluates on ``test`` (disjoint by construction); MATH-500 has one file, split
by content: a problem is held out (``eval``) when a hash of its text falls below
``math500-eval-percent`` (``math500_split_of``), so the two splits never share a problem whatever
the file order. A receiver rebuilds every train item from its own copy of the file
(``known_tasks``); nothing is downloaded.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from functools import lru_cache
from pathlib import Path

from ftis_fed.tasks.prompt import Prompt
from ftis_fed.tasks.answers import extract_boxed, gsm8k_reference

GSM8K_INSTRUCTION = "Solve the problem step by step. End your reply with the final answer as '#### <number>'."
MATH500_INSTRUCTION = "Solve the problem. Put your final answer within \\boxed{}."


def read_rows(path: str | Path) -> list[dict]:
    """The records of one ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file (CSV cells are strings,
    as the standard ``csv`` module reads them: the same on every node, whatever else is installed)."""
    path = Path(path)
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:  # pragma: no cover - pyarrow ships with `datasets`
            raise ImportError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from e
        return pq.read_table(path).to_pylist()
    if path.suffix == ".json":
        rows = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(rows, list):
            raise ValueError(f"{path}: a .json dataset must hold a list of objects")
        return rows
    if path.suffix == ".jsonl":
        rows = []
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        return rows
    if path.suffix == ".csv":
        return [dict(r) for r in csv.DictReader(io.StringIO(path.read_text(encoding="utf-8"), newline=""))]
    raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl, .json, .csv or .parquet")


def _find_in_dir(root: Path, patterns: list[str]) -> list[Path]:
    for pat in patterns:
        hits = sorted(root.glob(pat))
        if hits:
            return hits
    raise FileNotFoundError(f"{root}: no dataset file found; looked for {patterns}")


def _rows(source: str | Path, patterns: list[str], hub_config: str | None, split: str) -> list[dict]:
    path = Path(source).expanduser()
    if path.is_file():
        return read_rows(path)
    if path.is_dir():
        return [row for f in _find_in_dir(path, patterns) for row in read_rows(f)]
    src = str(source)
    if src.count("/") == 1 and not src.startswith((".", "/", "~")):
        return _hub_rows(src, hub_config, split)
    raise FileNotFoundError(f"dataset source {src!r}: no such file or directory (and not a hub id 'owner/name')")


def _hub_rows(hub_id: str, config: str | None, split: str) -> list[dict]:
    """Rows of a hub dataset through ``datasets.load_dataset`` (needs a reachable hub or its cache)."""
    try:
        from datasets import load_dataset
    except ImportError as e:
        raise ImportError(f"loading {hub_id!r} from the hub needs `datasets` (pip install 'ftis-fed[data]')") from e
    try:
        ds = load_dataset(hub_id, config, split=split) if config else load_dataset(hub_id, split=split)
    except Exception as e:  # network, auth, offline mode: say what was attempted
        raise RuntimeError(f"could not load {hub_id!r} (config {config!r}, split {split!r}) with datasets: "
                           f"{type(e).__name__}: {e}. Pass a local file or directory instead.") from e
    return [dict(r) for r in ds]


def _need(row: dict, i: int, name: str, where: str) -> str:
    v = row.get(name)
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"{where} row {i}: field {name!r} is missing or empty")
    return v


def _limit(rows: list, limit: int | None) -> list:
    if limit is None:
        return rows
    if isinstance(limit, bool) or int(limit) != limit or limit < 0:
        raise ValueError(f"limit={limit!r}: must be an integer >= 0 or None")
    return rows[: int(limit)]


def load_gsm8k(source: str | Path, split: str = "test", limit: int | None = None,
               instruction: str = GSM8K_INSTRUCTION) -> list[Prompt]:
    """GSM8K ``split`` (``train`` / ``test``) from ``source`` (file, directory or hub id ``openai/gsm8k``)."""
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}: GSM8K has 'train' and 'test'")
    patterns = [f"{split}.jsonl", f"grade_school_math/data/{split}.jsonl", f"main/{split}-*.parquet",
                f"{split}-*.parquet"]
    rows = _limit(_rows(source, patterns, "main", split), limit)
    out = []
    for i, row in enumerate(rows):
        question = _need(row, i, "question", "gsm8k")
        reference = gsm8k_reference(_need(row, i, "answer", "gsm8k"))
        text = f"{question.strip()}\n{instruction}" if instruction else question.strip()
        out.append(Prompt(f"gsm8k/{split}/{i}", text, reference))
    return out


def math500_split_of(problem: str, eval_percent: int) -> str:
    """``eval`` or ``train``: the MATH-500 split of a problem, from a hash of its text (stable
    everywhere, independent of the file's order)."""
    h = int.from_bytes(hashlib.sha256(("math500-split\0" + problem.strip()).encode()).digest()[:8], "big")
    return "eval" if h % 100 < eval_percent else "train"


def load_math500(source: str | Path, limit: int | None = None,
                 instruction: str = MATH500_INSTRUCTION, split: str | None = None,
                 eval_percent: int = 20) -> list[Prompt]:
    """MATH-500 from ``source`` (file, directory or hub id ``HuggingFaceH4/MATH-500``).

    split: None (every problem, ids ``math500/{unique_id}``) or ``train`` / ``eval`` (the problems of
    that split, ``math500_split_of`` with ``eval_percent``; ids ``math500/{split}/{unique_id}``);
    ``limit`` applies after the split."""
    if split not in (None, "train", "eval"):
        raise ValueError(f"split={split!r}: MATH-500 splits are None (all), 'train' and 'eval'")
    if not 1 <= int(eval_percent) <= 99:
        raise ValueError(f"eval_percent={eval_percent!r}: must be in [1, 99]")
    rows = list(enumerate(_rows(source, ["test.jsonl", "test-*.parquet", "data/test-*.parquet"], None, "test")))
    if split is not None:                           # row numbers stay those of the file (ids, errors)
        rows = [(i, r) for i, r in rows
                if math500_split_of(_need(r, i, "problem", "math500"), int(eval_percent)) == split]
    rows = _limit(rows, limit)
    prefix = "math500/" if split is None else f"math500/{split}/"
    out = []
    for i, row in rows:
        problem = _need(row, i, "problem", "math500")
        answer = row.get("answer")
        if not isinstance(answer, str) or not answer.strip():
            answer = extract_boxed(_need(row, i, "solution", "math500"))
            if answer is None:
                raise ValueError(f"math500 row {i}: no 'answer' field and no \\boxed{{}} in 'solution'")
        uid = row.get("unique_id") or str(i)
        text = f"{problem.strip()}\n{instruction}" if instruction else problem.strip()
        out.append(Prompt(f"{prefix}{uid}", text, answer.strip()))
    return out


#: ``task-source`` values that train on a benchmark file (``procedural`` is the built-in families).
BENCHMARKS = ("gsm8k", "math500")


def local_source(path: str, key: str) -> Path:
    """``path`` as an existing local file or folder, else a ValueError naming the run-config ``key``
    (training never downloads: a hub id is not accepted here)."""
    if not str(path).strip():
        raise ValueError(f"{key}='': needs the dataset's local file or folder")
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"{key}={str(path)!r}: no such file or folder (training reads local files only; "
                         "nothing is downloaded)")
    return p


@lru_cache(maxsize=16)
def train_pool(source: str, path: str, eval_percent: int = 20) -> tuple[Prompt, ...]:
    """The train items of benchmark ``source`` (``gsm8k``: its train file; ``math500``: its train split)
    at local ``path``, in file order; cached per process. ValueError when the path is missing or
    the split is empty."""
    if source == "gsm8k":
        pool = load_gsm8k(local_source(path, "gsm8k-data"), split="train")
    elif source == "math500":
        pool = load_math500(local_source(path, "math500-data"), split="train", eval_percent=eval_percent)
    else:
        raise ValueError(f"task-source={source!r}: a benchmark is one of {BENCHMARKS}")
    if not pool:
        raise ValueError(f"{source}-data={path!r}: no train items")
    return tuple(pool)


@lru_cache(maxsize=16)
def eval_pool(source: str, path: str, eval_percent: int = 20, heldout_only: bool = True) -> tuple[Prompt, ...]:
    """Held-out items of benchmark ``source`` at ``path``: GSM8K ``test``; MATH-500 its ``eval`` split
    (``heldout_only``: a run that trains on it) or all of it (a run that does not). Cached."""
    if source == "gsm8k":
        return tuple(load_gsm8k(local_source(path, "gsm8k-data"), split="test"))
    if source == "math500":
        split = "eval" if heldout_only else None
        return tuple(load_math500(local_source(path, "math500-data"), split=split, eval_percent=eval_percent))
    raise ValueError(f"task-source={source!r}: a benchmark is one of {BENCHMARKS}")
