"""Your own task (``task-source = user``): a data set from a local file (or ``datasets``), TRL-style
reward functions given by import path, several with weights and None, re-verified by every
receiver; the task digest in hello and in the signed run id, so a peer on another task is refused
by the server and by receivers, by name. Real tiny models, real keys, real TRL functions."""

from __future__ import annotations

import dataclasses

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ftis_fed.commands.sim import checked_run_config, layered_overrides
from ftis_fed.config.federation import FederationConfig, ParticipantSpec
from ftis_fed.config.keys import federation_from_run_config
from ftis_fed.engine.core import AdmissionError, Engine
from ftis_fed.engine.inprocess import InProcessTransport
from ftis_fed.learn.objective import compute_advantages
from ftis_fed.participant import Participant
from ftis_fed.policies.config import PolicyConfig
from ftis_fed.trust.run_id import signed_run_id, split_run_id
from ftis_fed.tasks.resolve import TaskRefused, TaskResolver
from ftis_fed.tasks.reward_funcs import RewardFuncs, combine
from ftis_fed.tasks.user import _load_rows, load_rows
from ftis_fed.trust.inbox import Inbox, InboxConfig
from ftis_fed.trust.reverify import ReverifyConfig, reverify
from ftis_fed.trust.signing import generate_keypair, load_key_directory, load_private_key, run_name_of, sign_batch
from ftis_fed.wire.batch import CompletionBatch, SamplingParams, make_group

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "sims" / "own_task"

REWARDS_PY = '''
import re

def correct(prompts, completions, completion_ids, answer, **kwargs):
    out = []
    for c, gold in zip(completions, answer):
        text = c if isinstance(c, str) else c[0]["content"]
        if not str(gold):
            out.append(None)                      # no gold answer: no opinion
            continue
        nums = re.findall(r"-?\\d+", text)
        out.append(1.0 if nums and nums[-1] == str(gold) else 0.0)
    return out

def short(completions, completion_ids, **kwargs):
    return [1.0 if len(ids) <= 3 else 0.0 for ids in completion_ids]
'''


def write_task(tmp: Path, rows: list[dict], name: str = "data.jsonl", rewards: str = REWARDS_PY) -> tuple[Path, Path]:
    data = tmp / name
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    module = tmp / "my_rewards.py"
    module.write_text(rewards)
    return data, module


def add_rows(n: int = 81) -> list[dict]:
    return [{"prompt": f"What is {a} + {b}? Reply with just the number.", "answer": str(a + b), "op": "add"}
            for a in range(1, 10) for b in range(1, 10)][:n]


def user_rc(data: Path, module: Path, **kw) -> dict:
    return {"task-source": "user", "task-data": str(data), "task-answer-column": "answer",
            "task-rewards": f"{module}:correct,{module}:short", "task-reward-weights": "1.0,0.5",
            "eval-every": 0, **{k.replace("_", "-"): v for k, v in kw.items()}}


# ----------------------------------------------------------------------------- TRL's semantics

def test_weighted_sum_none_and_unscorable_as_trl():
    # TRL: None -> NaN per function, nansum(w * r) over functions, NaN when every function said None
    per = [[1.0, math.nan, math.nan, 0.0], [1.0, 1.0, math.nan, math.nan]]
    got = combine(per, [1.0, 0.5])
    assert got[:2] == [1.5, 0.5] and math.isnan(got[2]) and got[3] == 0.0


def test_advantages_leave_out_unscorable_samples_like_trl():
    from trl.trainer.utils import nanstd                      # TRL's own reduction

    rewards = torch.tensor([1.0, 0.0, float("nan"), 0.5, 2.0, float("nan"), 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    ours = compute_advantages(rewards, groups, "group")
    g = rewards.view(2, 4)
    mean = torch.nanmean(g, dim=1, keepdim=True)
    trl = ((g - mean) / (nanstd(g, dim=1).unsqueeze(1) + 1e-4)).nan_to_num(0.0).view(-1)
    assert torch.allclose(ours, trl, atol=1e-6)
    assert ours[2] == 0 and ours[5] == 0


def test_a_trl_reward_function_works_unchanged(tmp_path):
    """TRL's own accuracy_reward (math-verify; None for an unparsable gold answer) on a
    conversational data set, given by import path, exactly as GRPOTrainer would call it."""
    pytest.importorskip("math_verify")
    rows = [{"prompt": [{"role": "user", "content": "What is 1/2 + 1/4?"}], "solution": r"\frac{3}{4}"},
            {"prompt": [{"role": "user", "content": "Say hi."}], "solution": "hello there"}]
    data = tmp_path / "conv.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fed = federation_from_run_config({"task-source": "user", "task-data": str(data), "task-eval-percent": 0,
                                      "task-rewards": "trl.rewards:accuracy_reward", "eval-every": 0})
    task = fed.task.user
    assert [p.text for p in fed.task.train_pool()] == ["What is 1/2 + 1/4?", "Say hi."]
    got = task.group_rewards("user/train/0", [r"It is \boxed{\frac{3}{4}}", r"\boxed{1}"])
    assert got == [1.0, 0.0]
    assert all(math.isnan(r) for r in task.group_rewards("user/train/1", ["hi", "hello"]))   # TRL's None


def test_reward_function_errors_are_named():
    funcs = RewardFuncs.from_config(f"{EXAMPLE / 'rewards.py'}:just_the_number")
    bad = [("x:", r"not 'module:function'"), ("no_such_module_xyz:f", r"cannot import module 'no_such_module_xyz'"),
           (f"{EXAMPLE / 'rewards.py'}:nope", r"has no function 'nope'"),
           ("/nonexistent/r.py:f", r"does not exist")]
    for spec, match in bad:
        with pytest.raises(ValueError, match=match):
            RewardFuncs.from_config(spec)
    with pytest.raises(ValueError, match=r"task-reward-weights='1,2': 2 weights for 1 reward functions"):
        RewardFuncs.from_config(funcs.funcs[0].spec, "1,2")
    liar = RewardFuncs((funcs.funcs[0].__class__("x:f", lambda **kw: [1.0], 1.0, "", ""),))
    with pytest.raises(ValueError, match=r"returned 1 rewards, but 2 were expected"):
        liar.rewards(["p", "p"], ["a", "b"], [[], []], {})


# ----------------------------------------------------------------------------- data, splits, digest

def test_data_from_jsonl_csv_parquet_and_datasets_folder_give_the_same_task(tmp_path):
    pytest.importorskip("datasets")
    import datasets

    rows = add_rows(20)
    data, module = write_task(tmp_path, rows)
    (tmp_path / "data.csv").write_text("prompt,answer,op\n" + "".join(f'"{r["prompt"]}",{r["answer"]},{r["op"]}\n'
                                                                     for r in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "data.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    pools = {}
    for source in (data, tmp_path / "data.csv", tmp_path / "data.parquet", tmp_path / "saved"):
        fed = federation_from_run_config(user_rc(source, module))
        pools[source.name] = [(p.task_id, p.text, p.reference) for p in fed.task.train_pool()]
    assert len({json.dumps(v) for v in pools.values()}) == 1 and len(pools["data.jsonl"]) > 10


def _odd_files(tmp: Path) -> dict[str, Path]:
    """Files where readers are free to differ: missing columns, ints beside floats, chat messages with
    an extra key, nested objects, nulls, CSV's empty cells, quoted commas and newlines, leading
    zeros, a BOM; a folder laid out as a hub data set (split words in the names, formats mixed)."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    rows = [{"prompt": "What is 1 + 1?", "answer": "2", "score": 1, "meta": {"src": "a", "k": 1}},
            {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4", "score": 1.5},
            {"prompt": [{"role": "user", "content": "Était-ce 3?", "name": "x"}], "score": 2.0,
             "meta": {"src": "b"}, "ok": True, "tags": [1, 2.5], "none": None}]
    d = tmp / "files"
    d.mkdir()
    (d / "odd.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    (d / "odd.json").write_text(json.dumps(rows), encoding="utf-8")
    (d / "odd.csv").write_text('\ufeffprompt,answer,n\n"1 + 1, or 2?",007,\n"two\nlines",4, 3 \n\n',
                               encoding="utf-8")
    pq.write_table(pa.Table.from_pylist([{"prompt": f"p{i}", "answer": str(i), "x": i / 2} for i in range(5)]),
                   d / "odd.parquet")
    hub = tmp / "hub-layout"
    (hub / "data").mkdir(parents=True)
    (hub / "data" / "train-00000-of-00002.jsonl").write_text("".join(json.dumps({"prompt": f"t{i}", "answer": i})
                                                                    + "\n" for i in range(3)))
    (hub / "data" / "train-00001-of-00002.csv").write_text("prompt,answer\nt3,3\n")
    (hub / "data" / "test-00000-of-00001.jsonl").write_text(json.dumps({"prompt": "e0", "answer": 0}) + "\n")
    (hub / ".cache").mkdir()
    (hub / ".cache" / "train-stale.jsonl").write_text('{"prompt": "never read"}\n')
    return {**{f.suffix: f for f in d.iterdir()}, "hub": hub}


def test_datasets_and_the_standard_library_give_the_same_rows_and_digest(tmp_path, monkeypatch):
    """Where ``datasets`` is installed it reads local files (``load_dataset`` is called); without it
    the standard library does; both give the same canonical rows and so the same task digest."""
    import sys

    from ftis_fed.tasks import rows as rows_mod
    from ftis_fed.tasks.user import UserTask

    datasets = pytest.importorskip("datasets")
    files = _odd_files(tmp_path)
    module = tmp_path / "my_rewards.py"
    module.write_text(REWARDS_PY)
    calls = []
    real = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: calls.append(a[0]) or real(*a, **kw))

    def read_all(split="train"):
        _load_rows.cache_clear()
        got = {k: load_rows(str(f), split) for k, f in files.items()}
        got["hub/test"] = load_rows(str(files["hub"]), "test")
        digest = UserTask(data=str(files[".jsonl"]), rewards=f"{module}:correct", answer_column="answer",
                          eval_percent=0).digest()
        return got, digest

    assert rows_mod.reader_name().startswith("datasets ")
    with_ds, digest_ds = read_all()
    assert set(calls) == {"json", "csv", "parquet"}                 # datasets really read them
    monkeypatch.setitem(sys.modules, "datasets", None)              # `import datasets` fails: the fallback
    assert rows_mod.reader_name() == "stdlib"
    without, digest_std = read_all()
    assert with_ds == without and digest_ds == digest_std
    jl = with_ds[".jsonl"]
    assert [list(r) for r in jl] == [["prompt", "answer", "score", "meta", "ok", "tags", "none"]] * 3
    assert jl[1]["meta"] is None and jl[0]["ok"] is None and jl[2]["answer"] is None     # missing: None
    assert [r["score"] for r in jl] == [1, 1.5, 2] and jl[2]["tags"] == [1, 2.5]         # 2.0 -> 2
    assert jl[2]["prompt"] == [{"role": "user", "content": "Était-ce 3?", "name": "x"}]
    assert jl[1]["prompt"] == [{"role": "user", "content": "What is 2 + 2?"}]            # no name: None
    assert with_ds[".json"] == jl
    assert with_ds[".csv"] == ({"prompt": "1 + 1, or 2?", "answer": "007", "n": ""},
                               {"prompt": "two\nlines", "answer": "4", "n": " 3 "})     # strings as written
    assert [r["x"] for r in with_ds[".parquet"]] == [0, 0.5, 1, 1.5, 2]
    assert [r["prompt"] for r in with_ds["hub"]] == ["t0", "t1", "t2", "t3"]             # train files only
    assert [r["answer"] for r in with_ds["hub"]] == [0, 1, 2, "3"]                       # CSV: a string
    assert [r["prompt"] for r in with_ds["hub/test"]] == ["e0"]


@pytest.mark.parametrize("reader", ["datasets", "stdlib"])
@pytest.mark.parametrize("text, match", [
    ("prompt,answer\na,1,2\n", r"odd.csv record 2 has 3 fields, the header 2"),
    ("prompt,answer\na\n", r"odd.csv record 2 has 1 fields, the header 2"),
    ("prompt,prompt\na,b\n", r"odd.csv's header names 'prompt' more than once"),
])
def test_a_ragged_csv_is_refused_by_both_readers(tmp_path, monkeypatch, reader, text, match):
    """pandas (under ``datasets``) would read the extra field as an index, and the csv module would
    put it under the key None: both readers refuse the file, by record."""
    import sys

    if reader == "datasets":
        pytest.importorskip("datasets")
    else:
        monkeypatch.setitem(sys.modules, "datasets", None)
    (tmp_path / "odd.csv").write_text(text)
    _load_rows.cache_clear()
    with pytest.raises(ValueError, match="task-data=.*" + match):
        load_rows(str(tmp_path / "odd.csv"))


def test_a_folder_without_the_asked_split_and_an_unreachable_hub_id_are_config_errors(tmp_path, monkeypatch):
    import sys

    datasets = pytest.importorskip("datasets")
    hub = _odd_files(tmp_path)["hub"]
    _load_rows.cache_clear()
    with pytest.raises(ValueError, match=r"task-data-split='validation': the folder .* has files of the "
                                         r"splits test, train \(by their names\), none of 'validation'"):
        load_rows(str(hub), "validation")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)   # as HF_HUB_OFFLINE=1 sets it: no network
    with pytest.raises(ValueError, match=r"task-data='someone/arith': not a local file or folder, and datasets "
                                         r"could not reach the hub .* \(offline\?\) nor find it in its local cache"):
        load_rows("someone/arith")
    monkeypatch.setitem(sys.modules, "datasets", None)
    _load_rows.cache_clear()
    with pytest.raises(ValueError, match=r"task-data='someone/arith': a hub id .* needs `datasets`"):
        load_rows("someone/arith")


def test_hub_ids_go_through_datasets(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    seen = {}

    def fake_load(name, split=None, **kw):
        seen["args"] = (name, split)
        return datasets.Dataset.from_list(add_rows(5))

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    _load_rows.cache_clear()
    assert len(load_rows("someone/arith", "validation")) == 5 and seen["args"] == ("someone/arith", "validation")


def test_splits_families_and_resolver(tmp_path):
    rows = add_rows() + [{"prompt": f"What is {a} - 1?", "answer": str(a - 1), "op": "sub"} for a in range(2, 10)]
    data, module = write_task(tmp_path, rows)
    fed = federation_from_run_config(user_rc(data, module, task_family_column="op", task_ood_families="sub",
                                             task_eval_percent=20, eval_every=1, eval_size=5, eval_ood_size=3))
    pool = fed.task.train_pool()
    sets = fed.eval_sets()
    assert set(sets) == {"id", "ood/sub"} and len(sets["id"]) == 5 and len(sets["ood/sub"]) == 3
    held = [p for s in sets.values() for p in s]
    assert {p.text for p in pool}.isdisjoint({p.text for p in held})
    assert all("-" not in p.text for p in pool)                   # the OOD family never trains
    resolver = TaskResolver((), 0, fed.task.known_tasks(), "user")
    assert resolver.resolve(pool[0].task_id) == pool[0]
    with pytest.raises(TaskRefused) as e:
        resolver.resolve(held[0].task_id)
    assert e.value.reason == "eval_task"
    with pytest.raises(TaskRefused) as e:
        resolver.resolve("user/train/100000")
    assert e.value.reason == "unknown_task"


@pytest.mark.parametrize("kw, match", [
    (dict(task_prompt_column="question"), r"task-prompt-column='question': task-data=.* has no such column"),
    (dict(task_rewards=""), r"task-rewards='': task-source=user needs task-rewards"),
    (dict(task_data="/nonexistent/x.jsonl"), r"task-data='/nonexistent/x.jsonl': no such file"),
    (dict(task_ood_families="sub"), r"task-ood-families='sub': needs task-family-column"),
    (dict(eval_every=1, eval_size=500), r"eval-size=500 .* held-out set has \d+ rows, fewer than 500"),
])
def test_config_errors_name_the_key(tmp_path, kw, match):
    """Declared errors when the config is parsed, data errors when its data is checked (``check_data``,
    which ``validate_run_config`` calls before a run): both name the key."""
    data, module = write_task(tmp_path, add_rows())
    with pytest.raises(ValueError, match=match):
        federation_from_run_config(user_rc(data, module, **kw)).check_data()


def test_digest_covers_data_functions_and_weights_not_paths(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    da, ma = write_task(a, add_rows())
    db, mb = write_task(b, add_rows())                          # the same files elsewhere: same task
    digest = federation_from_run_config(user_rc(da, ma)).task.digest()
    assert federation_from_run_config(user_rc(db, mb)).task.digest() == digest
    assert federation_from_run_config(user_rc(da, ma, task_reward_weights="1.0,0.25")).task.digest() != digest
    mb.write_text(REWARDS_PY.replace("<= 3", "<= 4"))            # another version of a function
    assert federation_from_run_config(user_rc(db, mb)).task.digest() != digest
    db.write_text(db.read_text().replace('"3"', '"4"', 1))      # one answer differs
    _load_rows.cache_clear()
    assert federation_from_run_config(user_rc(db, ma)).task.digest() != digest
    assert split_run_id(signed_run_id("run", digest)) == ("run", digest[:16])
    assert signed_run_id("run", "") == "run"                      # procedural: the run config alone


# ----------------------------------------------------------------------------- a federation on it

def _participants(tmp: Path, rcs: dict[str, dict], run_name: str) -> tuple[FederationConfig, dict]:
    parts, fed = {}, None
    for i, (name, rc) in enumerate(rcs.items()):
        generate_keypair(name, tmp / "keys")
    for i, (name, rc) in enumerate(rcs.items()):
        f = federation_from_run_config({**rc, "num-rounds": 1, "group-size": 4, "prompts-per-round": 2,
                                        "max-new-tokens": 4, "run-name": run_name, "output-dir": str(tmp),
                                        "min-participants": len(rcs)})
        fed = fed or f
        spec = ParticipantSpec(name, PolicyConfig(model="tiny-arith", adapter="full", lr=1e-3), i, len(rcs),
                               str(tmp / "keys"), str(tmp / "participants" / name))
        parts[name] = Participant(spec, f)
    return fed, parts


def test_a_federation_trains_on_a_user_task_and_receivers_reverify(tmp_path, monkeypatch):
    """Engine + in-process transport, two tiny-arith participants on a JSONL task; one reward
    function by module path (on sys.path), one by file path; every peer batch re-scored."""
    data, module = write_task(tmp_path, add_rows())
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = {**user_rc(data, module), "task-rewards": f"my_rewards:correct,{module}:short", "eval-every": 1,
          "eval-size": 4}
    fed, parts = _participants(tmp_path, {"alice": rc, "bob": rc}, "own")
    eng = Engine(fed, load_key_directory(tmp_path / "keys"), tmp_path, InProcessTransport(parts), plots=False)
    assert eng.run() == 1
    assert run_name_of(parts["alice"].run_id) == f"own@task:{fed.task.digest()[:16]}"    # + this run's nonce
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    r1 = {r["participant"]: r for r in rows if r["round"] == 1 and r["phase"] == "train"}
    assert r1["_federation"]["fed/frames_verified"] == 2 and r1["_federation"]["fed/rejected"] == 0
    for me, peer in (("alice", "bob"), ("bob", "alice")):
        assert r1[me][f"trust/{peer}/accepted"] == 1
        assert r1[me]["reward/peer_checked"] == 8 and r1[me]["reward/peer_disagreements"] == 0
        assert r1[me]["train/peer_samples"] == 8
    # alice's export: a whole model (tiny-arith is on no hub) with a card naming the run and bob
    card = (tmp_path / "participants" / "alice" / "export" / "README.md").read_text()
    for text in (f"`{parts['alice'].run_id}`", "| bob | `tiny-arith` |", "task-source: `user`", "| round |",
                 "eval/id/accuracy", "| 1 |"):
        assert text in card, text
    # what the receivers recomputed is what the functions say: score bob's round-1 prompts again
    task = fed.task.user
    prompt = fed.task.prompts_for_round(1, 2, 1)[0]
    assert task.group_rewards(prompt.task_id, [prompt.reference, "no", "12345678"], [[1], [1, 2], [1, 2, 3, 4]]) \
        == [1.5, 0.5, 0.0]


def test_a_peer_on_another_task_is_refused_by_receiver_and_server(tmp_path):
    data, module = write_task(tmp_path, add_rows())
    other = {**user_rc(data, module), "task-reward-weights": "1.0,2.0"}    # another task definition
    fed, parts = _participants(tmp_path, {"alice": user_rc(data, module), "mallory": other}, "mix")
    fed = dataclasses.replace(fed, wait_for_participants_s=2.0)   # mallory is refused: no need to wait for others
    assert parts["alice"].task_digest != parts["mallory"].task_digest
    # the receiver: mallory's signed batch is refused by name, whatever the relay does
    frames, _ = parts["mallory"].generate(1, False)
    m = parts["alice"].learn(1, frames)
    assert m["offpolicy/rejected/task_mismatch"] == 1 and m["trust/mallory/rejected/task_mismatch"] == 1
    assert m["offpolicy/accepted"] == 0 and m["train/peer_samples"] == 0
    # the server: mallory's hello announces another digest; the run cannot start with both
    eng = Engine(fed, load_key_directory(tmp_path / "keys"), tmp_path / "srv", InProcessTransport(parts), plots=False)
    with pytest.raises(AdmissionError, match="task_mismatch|refused"):
        eng.run()
    assert list(eng.refused.values()) == ["task_mismatch"]


@pytest.mark.slow
def test_flwr_run_on_the_example_task(tmp_path):
    """The sims/ example through the real ``flwr run`` (``ftis-fed sim``): two tiny-arith
    participants on sims/own_task/data.jsonl, scored by sims/own_task/rewards.py, re-verified."""
    from test_flower_e2e import rows, run_sim

    proc = run_sim(tmp_path, {"p2-model": "", "num-rounds": 2, "prompts-per-round": 4, "task-source": "user",
                              "task-data": str(EXAMPLE / "data.jsonl"), "task-answer-column": "answer",
                              "task-family-column": "op", "task-ood-families": "sub", "task-eval-percent": 20,
                              "task-rewards": f"{EXAMPLE / 'rewards.py'}:correct_answer,"
                                              f"{EXAMPLE / 'rewards.py'}:just_the_number",
                              "task-reward-weights": "1.0,0.2", "eval-ood-size": 8})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    got = rows(tmp_path / "out")
    train = {(r["round"], r["participant"]): r for r in got if r["phase"] == "train"}
    for rnd in (1, 2):
        assert train[(rnd, "_federation")]["fed/frames_verified"] == 2
        for me, peer in (("alice", "bob"), ("bob", "alice")):
            assert train[(rnd, me)][f"trust/{peer}/accepted"] == 1
            assert train[(rnd, me)]["reward/peer_checked"] == 16
            assert train[(rnd, me)]["reward/peer_disagreements"] == 0
    evals = [r for r in got if r["phase"] == "eval" and r["participant"] == "alice"]
    assert evals and all("eval/id/accuracy" in r and "eval/ood/sub/accuracy" in r for r in evals)


def test_the_example_preset_validates_offline(monkeypatch):
    """``ftis-fed sim --preset own-task`` from the repository root: the whole run config checks
    (models offline, data and reward functions load), paths made absolute for the workers."""
    monkeypatch.chdir(ROOT)
    overrides, n, _ = checked_run_config(ROOT, layered_overrides(ROOT, [], preset="own-task"))
    assert n == 2 and overrides["task-data"] == str(EXAMPLE / "data.jsonl")
    assert overrides["task-rewards"].split(",")[0] == f"{EXAMPLE / 'rewards.py'}:correct_answer"


def test_no_reward_travels_as_nan_and_receivers_agree_on_it(tmp_path):
    """A completion no function scored is NaN in the signed batch; a receiver re-scoring it with
    the same functions agrees (NaN = NaN), a sender claiming a number there disagrees, and a
    receiver's replaced batch keeps its own NaN."""
    rows = add_rows(5) + [{"prompt": "Pick a number. Reply with just the number.", "answer": "", "op": "add"}]
    data, module = write_task(tmp_path, rows)
    fed = federation_from_run_config(user_rc(data, module, task_eval_percent=0))
    verifier = fed.task.verifier()
    open_row = next(p for p in fed.task.train_pool() if p.reference == "")
    texts = ["7", "seven and more"]
    ids = [list(t.encode()) for t in texts]
    truth = verifier.group_rewards(open_row.task_id, texts, "", open_row.text, ids)
    assert truth == [0.5, 0.0]                      # correct: None for both; short: 1 (3 ids or fewer), 0
    rc = {**user_rc(data, module, task_eval_percent=0), "task-rewards": f"{module}:correct", "task-reward-weights": ""}
    only_correct = federation_from_run_config(rc).task.verifier()
    nan = only_correct.group_rewards(open_row.task_id, texts, "", open_row.text, ids)
    assert all(math.isnan(r) for r in nan)

    def batch(claimed):
        g = make_group(list(open_row.text.encode()), ids, [np.full(len(c), -0.5) for c in ids], claimed,
                       open_row.task_id, open_row.reference, open_row.text, texts)
        return CompletionBatch("alice", "run", 1, 1 << 16, "m", "tok", 256, SamplingParams(max_new_tokens=64),
                               (g,)).validate()

    generate_keypair("alice", tmp_path / "keys")
    key = load_private_key(tmp_path / "keys" / "private" / "alice.key")
    inbox = Inbox(load_key_directory(tmp_path / "keys" / "public"), InboxConfig(run_id="run"))
    got = inbox.accept(sign_batch(batch(nan), key), expected_round=1).batch      # NaN crosses the wire
    assert np.isnan(got.groups[0].rewards).all()
    honest = reverify(got, only_correct, ReverifyConfig())
    assert honest.metrics["reward/disagreements"] == 0 and np.isnan(honest.batch.groups[0].rewards).all()
    liar = reverify(batch([1.0, 1.0]), only_correct, ReverifyConfig())
    assert liar.metrics["reward/disagreements"] == 2 and np.isnan(liar.batch.groups[0].rewards).all()
