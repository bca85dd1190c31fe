"""Which weights a participant started from: the fingerprint of its model folder, reported with its
hello, written into every train row (``model_weights``), and checked by ``ftis-fed grid`` across the
cells of a grid (ftis_fed/policies/weights_fp.py)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import pytest

from ftis_fed.engine.validation import BadReply, check_info
from ftis_fed.grid.records import MixedWeights, check_weights
from ftis_fed.policies import weights_fp as W
from tests.grid_cells import rewrite_metrics

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "research-grid"


def _folder(tmp: Path, name: str, payload: bytes) -> Path:
    d = tmp / name
    d.mkdir()
    (d / "model.safetensors").write_bytes(payload)
    (d / "config.json").write_text("{}")
    return d


def test_equal_bytes_equal_fingerprints_and_one_changed_byte_another(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "_MEMO", {})
    a = _folder(tmp_path, "a", b"\x01" * 5000)
    b = _folder(tmp_path, "b", b"\x01" * 5000)
    c = _folder(tmp_path, "c", b"\x01" * 4999 + b"\x02")
    fa, fb, fc = W.weights_fingerprint(a), W.weights_fingerprint(b), W.weights_fingerprint(c)
    assert W.FINGERPRINT_RE.fullmatch(fa) and fa == fb != fc
    (a / "config.json").write_text('{"x": 1}')                   # only the weight files count
    monkeypatch.setattr(W, "_MEMO", {})
    assert W.weights_fingerprint(a) == fa
    assert W.weights_fingerprint(tmp_path / "none") == "" and W.weights_fingerprint(_folder(tmp_path, "d", b"")) != ""
    (tmp_path / "e").mkdir()
    assert W.weights_fingerprint(tmp_path / "e") == ""            # no weight file: not known


def test_the_record_beside_the_weights_is_reused_only_while_the_files_are_unchanged(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "_MEMO", {})
    monkeypatch.setenv("FTIS_FED_CACHE", str(tmp_path))          # the project's model cache: a record is kept
    a = _folder(tmp_path, "a", b"\x01" * 5000)
    fp = W.weights_fingerprint(a)
    rec = json.loads((a / W.RECORD).read_text())
    assert rec["fingerprint"] == fp and [f[0] for f in rec["files"]] == ["model.safetensors"]
    (a / W.RECORD).write_text(json.dumps({**rec, "fingerprint": "w-" + "0" * 16}))
    monkeypatch.setattr(W, "_MEMO", {})
    assert W.weights_fingerprint(a) == "w-" + "0" * 16            # read, not hashed again
    (a / "model.safetensors").write_bytes(b"\x03" * 5000)         # rewritten: size or mtime differ
    os.utime(a / "model.safetensors", ns=(1, 1))
    monkeypatch.setattr(W, "_MEMO", {})
    assert W.weights_fingerprint(a) not in (fp, "w-" + "0" * 16)


def test_a_folder_outside_the_model_cache_is_not_written_to(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "_MEMO", {})
    monkeypatch.setenv("FTIS_FED_CACHE", str(tmp_path / "cache"))
    a = _folder(tmp_path, "mine", b"\x01" * 5000)
    assert W.weights_fingerprint(a).startswith("w-") and sorted(p.name for p in a.iterdir()) == \
        ["config.json", "model.safetensors"]


def test_large_weights_are_fingerprinted_from_sampled_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "_MEMO", {})
    a = _folder(tmp_path, "a", bytes(range(256)) * 40_000)     # ~10 MB
    full = W.weights_fingerprint(a)
    monkeypatch.setattr(W, "_MEMO", {})
    monkeypatch.setattr(W, "FULL_HASH_BYTES", 1 << 20)
    sampled = W.weights_fingerprint(a)
    assert W.FINGERPRINT_RE.fullmatch(sampled) and sampled != full
    monkeypatch.setattr(W, "_MEMO", {})
    assert W.weights_fingerprint(a) == sampled                  # stable
    with (a / "model.safetensors").open("r+b") as fh:           # a byte inside the first piece
        fh.write(b"\xff")
    monkeypatch.setattr(W, "_MEMO", {})
    assert W.weights_fingerprint(a) != sampled


def test_a_read_only_folder_is_fingerprinted_without_a_record(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "_MEMO", {})
    monkeypatch.setenv("FTIS_FED_CACHE", str(tmp_path))
    a = _folder(tmp_path, "a", b"\x05" * 100)
    a.chmod(0o555)
    try:
        fp = W.weights_fingerprint(a)
        assert fp.startswith("w-") and (os.geteuid() == 0 or not (a / W.RECORD).exists())
        assert not list(a.glob("*.tmp"))
    finally:
        a.chmod(0o755)


@pytest.mark.parametrize("bad", ["w-123", "x" * 10_000, 7, "w-" + "G" * 16])
def test_a_hello_with_a_malformed_weights_fingerprint_is_refused(bad):
    info = {"participant": "p", "key_fp": "k", "model_id": "m", "tokenizer_fp": "t", "proof": b"x"}
    assert check_info(info, hello=True)["participant"] == "p"                # optional
    assert check_info({**info, "weights_fp": "w-" + "a" * 16}, hello=True)
    with pytest.raises(BadReply, match="weights_fp"):
        check_info({**info, "weights_fp": bad}, hello=True)


def _set_weights(cell: Path, fp: str) -> None:
    rewrite_metrics(cell, lambda rows: [{**r, "model_weights": fp} if r.get("phase") == "train"
                                        and not r["participant"].startswith("_") else r for r in rows])


def test_a_grid_refuses_cells_that_started_from_other_weights(tmp_path, capsys):
    from ftis_fed.commands.experiment import summary_only

    work = tmp_path / "grid"
    shutil.copytree(FIXTURE, work)
    cells = sorted(p.parent.name for p in (work / "cells").glob("*/done.json"))
    assert len(cells) >= 3
    check_weights(cells, work)                                    # none recorded (older cells): not compared
    for c in cells:
        _set_weights(work / "cells" / c, "w-" + "a" * 16)
    check_weights(cells, work)
    _set_weights(work / "cells" / cells[1], "w-" + "b" * 16)
    with pytest.raises(MixedWeights, match=f"w-b+ in {cells[1]}"):
        check_weights(cells, work)
    before = (work / "summary.md").read_bytes()
    assert summary_only(work) == 2
    assert "different model weights" in capsys.readouterr().err
    assert (work / "summary.md").read_bytes() == before           # nothing rewritten


def _a_participant(cell: Path) -> str:
    """A participant that trained in ``cell`` (not the ``_federation`` rows)."""
    text = gzip.decompress((cell / "run" / "metrics.jsonl.gz").read_bytes()).decode()
    rows = [json.loads(x) for x in text.splitlines()]
    return next(r["participant"] for r in rows if r.get("phase") == "train" and not r["participant"].startswith("_"))


def _set_round1(cell: Path, participant: str, reward: float) -> None:
    rewrite_metrics(cell, lambda rows: [{**r, "reward/mean": reward} if r.get("phase") == "train"
                                        and r["participant"] == participant and r["round"] == 1 else r
                                        for r in rows])


def test_a_grid_refuses_cells_of_one_seed_whose_first_samples_differ(tmp_path, capsys):
    """Without fingerprints (cells made before them), cells of one seed that started from other weights
    still show it: a participant's round-1 samples differ between methods, which they cannot when the
    weights are the same (two committed research-w cells ran so; docs/RESULTS.md)."""
    from ftis_fed.commands.experiment import summary_only
    from ftis_fed.grid.plan import discover_cells
    from ftis_fed.grid.records import MixedStarts, check_starts

    work = tmp_path / "grid"
    shutil.copytree(FIXTURE, work)
    cells = discover_cells(work)
    check_starts(cells, work)                                     # the fixture's cells agree
    p = _a_participant(work / "cells" / "alone__vertical__s1")
    _set_round1(work / "cells" / "F-TIS__vertical__s1", p, 0.999)
    with pytest.raises(MixedStarts, match=f"seed 1, {p}: .* in alone__vertical__s1, reward 0.999, .* in F-TIS__vertical__s1"):
        check_starts(cells, work)
    check_starts([c for c in cells if c.seed == 0], work)         # another seed's cells are not compared
    before = (work / "summary.md").read_bytes()
    assert summary_only(work) == 2
    assert "different first samples" in capsys.readouterr().err
    assert (work / "summary.md").read_bytes() == before           # nothing rewritten


def test_variant_cells_that_change_only_training_are_compared_too(tmp_path):
    """A variant setting only objective or source-adaptation knobs (``filter-sign``, ``source-adapt``)
    samples its first round as its method does, so it is held to the same first samples; one that
    changes the sampling (``prompts-per-round``: alone+2G) is not compared."""
    from ftis_fed.grid.plan import Cell
    from ftis_fed.grid.records import MixedStarts, check_starts

    work = tmp_path / "grid"
    shutil.copytree(FIXTURE, work)
    any_sign = Cell("F-TIS", "vertical", 1, "any", (("filter-sign", "any"),))
    double = Cell("alone", "vertical", 1, "2G", (("prompts-per-round", 64),))
    for c in (any_sign, double):
        shutil.copytree(work / "cells" / "F-TIS__vertical__s1", work / "cells" / c.name)
    base = [Cell("alone", "vertical", 1), Cell("F-TIS", "vertical", 1)]
    check_starts([*base, any_sign, double], work)                 # the same samples: agree
    p = _a_participant(work / "cells" / any_sign.name)
    _set_round1(work / "cells" / double.name, p, 0.999)
    check_starts([*base, any_sign, double], work)                 # 2G samples otherwise: not compared
    _set_round1(work / "cells" / any_sign.name, p, 0.999)
    with pytest.raises(MixedStarts, match=f"seed 1, {p}: .* in F-TIS\\+any__vertical__s1"):
        check_starts([*base, any_sign, double], work)
    # --summary-only's cells name their variant only (discover_cells): its keys come from grid.json
    named = [Cell("F-TIS", "vertical", 1, "any"), Cell("alone", "vertical", 1, "2G")]
    check_starts([*base, *named], work)                           # undeclared variants: not compared
    grid = json.loads((work / "grid.json").read_text())
    (work / "grid.json").write_text(json.dumps({**grid, "variants": {"any": {"filter-sign": "any"},
                                                                     "2G": {"prompts-per-round": 64}}}))
    with pytest.raises(MixedStarts, match=r"in F-TIS\+any__vertical__s1"):
        check_starts([*base, *named], work)
