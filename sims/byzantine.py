"""The Byzantine experiment: the default federation with one participant replaced by a validly
signing attacker, against the same federation without it (same seeds, prompts and budgets).

    python -m sims.byzantine                       # both runs (~2 x 8 min on 2 cores), then the report
    python -m sims.byzantine --kinds forge,inflate --num-rounds 3 --out outputs/byzantine

The attacker (participant ``p3``, SmolLM2 full fine-tuning, ``byzantine = <kinds>``) generates
honestly, then sends what ``ftis_fed.trust.attacks`` makes of its batch: forged references + rewards 1,
inflated rewards, implausible log-probs, and a flood of re-signed copies. The honest participants
are the default federation's ``smol-full``, ``smol-lora`` and ``smol-qlora``.

Writes ``<out>/report.json`` and ``<out>/report.md``: each honest participant's final held-out ID
and OOD pass@1 in both runs and the difference, and what each honest receiver counted against the
attacker (``trust/<sender>/...`` metrics: accepted, rejected by reason, rewards corrected).
A run already finished (``<out>/<run>/done.json``) is not repeated.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from ftis_fed.grid.records import final_eval, read_rows

ATTACKER = "mallory"


def runs(kinds: str, rounds: int) -> dict[str, list[str]]:
    base = [f"num-rounds={rounds}", f"eval-every={rounds}"]
    return {
        "clean": base + ['p3-model=""'],
        "attacked": base + [f'p3-participant="{ATTACKER}"', 'p3-model="smollm2"', 'p3-adapter="full"',
                            'p3-quant="none"', f'p3-byzantine="{kinds}"'],
    }


def run(app: Path, out: Path, name: str, items: list[str]) -> None:
    folder = out / name
    if (folder / "done.json").exists():
        print(f"[byzantine] {name}: done earlier, kept", flush=True)
        return
    cmd = [sys.executable, "-m", "ftis_fed.commands.cli", "sim", "--app", str(app), "--run-config",
           f'output-dir="{folder}"']
    for item in items:
        cmd += ["--run-config", item]
    print(f"[byzantine] {name}: " + " ".join(cmd), flush=True)
    status = subprocess.run(cmd, cwd=app, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    if status != 0:
        raise SystemExit(f"[byzantine] the {name} run failed (exit {status}); its log is above")
    (folder / "done.json").write_text(json.dumps({"run": name, "items": items}))


def trust_counters(rows: list[dict], sender: str) -> dict[str, dict[str, float]]:
    """receiver -> {counter: total over rounds} of what it recorded about ``sender``."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    prefix = f"trust/{sender}/"
    for r in rows:
        for k, v in r.items():
            if k.startswith(prefix) and isinstance(v, (int, float)):
                out[r["participant"]][k[len(prefix):]] += float(v)
    return {k: dict(v) for k, v in out.items()}


def report(out: Path) -> dict:
    clean = final_eval(read_rows(out / "clean" / "metrics.jsonl"))
    attacked_rows = read_rows(out / "attacked" / "metrics.jsonl")
    attacked = final_eval(attacked_rows)
    honest = sorted(p for p in clean if p in attacked and p != ATTACKER)
    table = []
    for p in honest:
        row = {"participant": p}
        for split in ("id", "ood"):
            c, a = float(clean[p][f"eval/{split}/accuracy"]), float(attacked[p][f"eval/{split}/accuracy"])
            row.update({f"{split}_clean": c, f"{split}_attacked": a, f"{split}_diff": a - c})
        table.append(row)
    result = {"honest": table, "trust": trust_counters(attacked_rows, ATTACKER),
              "fed_rejected": {k: v for r in attacked_rows if r.get("participant") == "_federation"
                               for k, v in r.items() if k.startswith("fed/rejected")},
              "max_id_drop": max((-r["id_diff"] for r in table), default=float("nan"))}
    (out / "report.json").write_text(json.dumps(result, indent=1))
    lines = ["| participant | ID clean | ID attacked | diff | OOD clean | OOD attacked | diff |",
             "|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['participant']} | {r['id_clean']:.3f} | {r['id_attacked']:.3f} | {r['id_diff']:+.3f} | "
                     f"{r['ood_clean']:.3f} | {r['ood_attacked']:.3f} | {r['ood_diff']:+.3f} |")
    lines += ["", f"What the honest receivers counted against `{ATTACKER}` (summed over rounds):", ""]
    for receiver, counters in sorted(result["trust"].items()):
        lines.append(f"- {receiver}: " + ", ".join(f"{k} {v:g}" for k, v in sorted(counters.items())))
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="all", help="attacks (ftis_fed.trust.attacks.KINDS, comma-separated, or all)")
    ap.add_argument("--num-rounds", type=int, default=3)
    ap.add_argument("--out", default="outputs/byzantine")
    ap.add_argument("--app", default=".")
    a = ap.parse_args(argv)
    app, out = Path(a.app).resolve(), Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name, items in runs(a.kinds, a.num_rounds).items():
        run(app, out, name, items)
    result = report(out)
    print(f"[byzantine] largest honest ID drop: {result['max_id_drop']:+.3f}; report in {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
