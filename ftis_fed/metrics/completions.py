"""The completions log (``log-completions``, TRL's ``log_completions``): a few prompts of every
round with all their completions, what each reward function gave them, and ``solved``; a JSONL
file for programs and a Markdown table for people, both in the participant's state folder. Local
only: nothing of it travels (the batch carries what receivers need)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from ftis_fed.tasks.scores import GroupScores

#: Characters of a prompt or completion shown in the Markdown table (the JSONL keeps them whole).
TABLE_CHARS = 500


def completion_records(round: int, participant: str, prompts: Sequence[tuple[str, str]],
                       completions: Sequence[Sequence[str]], scores: Sequence[GroupScores]) -> list[dict]:
    """One record per completion: round, participant, task id, prompt, completion, reward (None for
    NaN: no function scored it), each function's reward, solved. ``prompts``: (task id, text) per group."""
    out = []
    for (task_id, prompt), texts, s in zip(prompts, completions, scores):
        for i, text in enumerate(texts):
            out.append({"round": round, "participant": participant, "task_id": task_id, "prompt": prompt,
                        "completion": text, "reward": _num(s.rewards[i]), "solved": bool(s.solved[i]),
                        "rewards": {n: _num(v[i]) for n, v in s.per_function.items()}})
    return out


def append_log(state_dir: str | Path, records: Sequence[dict]) -> None:
    """Append ``records`` to ``completions.jsonl`` and a table of them to ``completions.md``."""
    if not records:
        return
    d = Path(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    with (d / "completions.jsonl").open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    names = list(records[0]["rewards"])
    head = ["prompt", "completion", "reward", *names, "solved"]
    lines = [f"## round {records[0]['round']}, {records[0]['participant']}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        cells = [_cell(r["prompt"]), _cell(r["completion"]), _fmt(r["reward"]),
                 *(_fmt(r["rewards"].get(n)) for n in names), "yes" if r["solved"] else "no"]
        lines.append("| " + " | ".join(cells) + " |")
    with (d / "completions.md").open("a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n\n")


def _num(x: float) -> float | None:
    return None if x is None or math.isnan(float(x)) else float(x)


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


def _cell(text: str) -> str:
    text = text if len(text) <= TABLE_CHARS else text[:TABLE_CHARS] + "…"
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>") or "(empty)"
