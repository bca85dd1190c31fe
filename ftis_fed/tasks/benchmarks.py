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
solution). Task ids: ``gsm8k/{split}/{row}`` and ``math500/{unique_id}``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..prompt import Prompt
from ..answers import extract_boxed, gsm8k_reference

GSM8K_INSTRUCTION = "Solve the problem step by step. End your reply with the final answer as '#### <number>'."
MATH500_INSTRUCTION = "Solve the problem. Put your final answer within \\boxed{}."


def read_rows(path: str | Path) -> list[dict]:
    """The records of one ``.jsonl`` / ``.json`` / ``.parquet`` file."""
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
    raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl, .json or .parquet")


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


def load_math500(source: str | Path, limit: int | None = None,
                 instruction: str = MATH500_INSTRUCTION) -> list[Prompt]:
    """MATH-500 from ``source`` (file, directory or hub id ``HuggingFaceH4/MATH-500``)."""
    rows = _limit(_rows(source, ["test.jsonl", "test-*.parquet", "data/test-*.parquet"], None, "test"), limit)
    out = []
    for i, row in enumerate(rows):
        problem = _need(row, i, "problem", "math500")
        answer = row.get("answer")
        if not isinstance(answer, str) or not answer.strip():
            answer = extract_boxed(_need(row, i, "solution", "math500"))
            if answer is None:
                raise ValueError(f"math500 row {i}: no 'answer' field and no \\boxed{{}} in 'solution'")
        uid = row.get("unique_id") or str(i)
        text = f"{problem.strip()}\n{instruction}" if instruction else problem.strip()
        out.append(Prompt(f"math500/{uid}", text, answer.strip()))
    return out
