"""A federation declared as a population (ftis_fed/config/population.py): groups, defaults and
per-participant overrides; TOML, JSON, YAML and inline JSON read alike; no cap; one-line errors
naming the source, the entry and the field; the numbered p<i>-* keys still work beside it."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from ftis_fed.config.keys import federation_from_run_config
from ftis_fed.config.participants import participant_names, participant_spec
from ftis_fed.config.validation import validate_run_config

ROOT = Path(__file__).resolve().parents[1]
RUN_CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]

TABLE = {
    "defaults": {"quant": "none", "lr": 2e-4},
    "participants": [
        {"name": "micro-s", "count": 3, "model": "tiny-llama", "adapter": "full"},
        {"name": "micro-m", "count": 2, "model": "tiny-llama-b", "adapter": "lora",
         "overrides": {"1": {"lr": 1e-3, "peer-budget": 8, "micro-batch": 2}}},
        {"name": "solo", "model": "tiny-arith"},
    ],
}


def _specs(cfg):
    fed = federation_from_run_config(cfg)
    names = participant_names(cfg)
    return [participant_spec(cfg, {"partition-id": i, "num-partitions": len(names)}, fed) for i in range(len(names))]


def test_groups_defaults_and_overrides(tmp_path):
    (tmp_path / "pop.json").write_text(json.dumps(TABLE))
    cfg = {**RUN_CONFIG, "population": str(tmp_path / "pop.json"), "lr": 5e-5}
    assert participant_names(cfg) == ["micro-s-0", "micro-s-1", "micro-s-2", "micro-m-0", "micro-m-1", "solo"]
    specs = _specs(cfg)
    assert [s.policy.model for s in specs] == ["tiny-llama"] * 3 + ["tiny-llama-b"] * 2 + ["tiny-arith"]
    assert [s.policy.adapter for s in specs] == ["full"] * 3 + ["lora"] * 2 + [RUN_CONFIG["adapter"]]
    assert [s.policy.lr for s in specs] == [2e-4] * 4 + [1e-3, 2e-4]          # defaults beat the run-wide 5e-5
    assert specs[4].peer_budget == 8 and specs[4].policy.micro_batch == 2 and specs[3].policy.micro_batch == 8
    assert [s.partition_id for s in specs] == list(range(6)) and {s.num_partitions for s in specs} == {6}
    assert specs[5].state_dir.endswith("participants/solo")
    fed = validate_run_config(cfg)
    assert fed.population == str(tmp_path / "pop.json")


def test_toml_json_yaml_and_inline_json_are_the_same_population(tmp_path):
    yaml = pytest.importorskip("yaml")
    import tomli_w

    (tmp_path / "p.toml").write_text(tomli_w.dumps(TABLE))
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(TABLE))
    (tmp_path / "p.json").write_text(json.dumps(TABLE))
    got = []
    for value in (str(tmp_path / "p.toml"), str(tmp_path / "p.yaml"), str(tmp_path / "p.json"), json.dumps(TABLE)):
        cfg = {**RUN_CONFIG, "population": value}
        got.append([(s.name, s.policy.model, s.policy.adapter, s.policy.lr, s.peer_budget) for s in _specs(cfg)])
    assert got[0] == got[1] == got[2] == got[3]


def test_the_shipped_populations_validate_and_resolve_against_the_app_folder():
    cfg = {**RUN_CONFIG, "population": "sims/populations/swarm.toml"}          # relative: the app folder
    names = participant_names(cfg)
    assert len(names) == 50 and names[0] == "micro-s-0" and names[-1] == "smol-1"
    validate_run_config(cfg)
    preset = tomllib.loads((ROOT / "sims" / "presets" / "tiny64.toml").read_text())
    assert len(participant_names({**RUN_CONFIG, **preset})) == 64
    validate_run_config({**RUN_CONFIG, **preset})
    lora = {**RUN_CONFIG, "population": "sims/populations/lora256.toml"}
    assert len(participant_names(lora)) == 256
    validate_run_config(lora)


def test_no_participant_cap_but_memory():
    table = {"participants": [{"name": "n", "count": 1500, "model": "tiny-llama", "adapter": "full"}]}
    cfg = {**RUN_CONFIG, "population": json.dumps(table)}
    names = participant_names(cfg)
    assert len(names) == 1500 and len(set(names)) == 1500
    assert participant_spec(cfg, {"partition-id": 1499, "num-partitions": 1500},
                            federation_from_run_config(cfg)).name == "n-1499"


def test_a_deployment_node_starts_from_its_row_and_its_node_config_wins():
    cfg = {**RUN_CONFIG, "population": json.dumps(TABLE)}
    fed = federation_from_run_config(cfg)
    s = participant_spec(cfg, {"participant": "micro-m-1", "adapter": "full"}, fed)
    assert (s.name, s.policy.model, s.policy.adapter, s.policy.lr, s.peer_budget) == \
        ("micro-m-1", "tiny-llama-b", "full", 1e-3, 8)
    assert (s.partition_id, s.num_partitions) == (4, 6)                       # its row's index
    other = participant_spec(cfg, {"participant": "elsewhere", "model": "tiny-arith"}, fed)
    assert other.policy.model == "tiny-arith" and other.policy.adapter == RUN_CONFIG["adapter"]


def _entry(**over):
    e = {"name": "g", "count": 2, "model": "tiny-llama", "adapter": "full"}
    e.update(over)
    return e


@pytest.mark.parametrize("table,message", [
    ({"participants": [_entry(count=0)]}, "participants[0].count=0: must be an integer >= 1"),
    ({"participants": [_entry(count=10**9)]}, "participants[0].count=1000000000: the population would have "
                                              "1000000000 participants, limit 16384"),
    ({"participants": [_entry(count=16000), _entry(name="h", count=385)]},
     "participants[1].count=385: the population would have 16385 participants, limit 16384"),
    ({"participants": [_entry(), _entry(name="h", lrr=1.0)]}, "participants[1].lrr: not a participant key"),
    ({"participants": [_entry(), _entry(name="h", lr="fast")]},
     "participants[1].lr='fast' (participant h-0): must be a number"),
    ({"participants": [_entry(), _entry(name="h", lr=-2.0)]}, "participants[1].lr=-2.0 (participant h-0): must be >= 0"),
    ({"participants": [_entry(overrides={"1": {"adapter": "lora", "quant": "4bit", "lora-r": 0}})]},
     "participants[0].overrides.1.lora-r=0 (participant g-1): must be >= 1"),
    ({"participants": [_entry(overrides={"2": {"lr": 1.0}})]}, "participants[0].overrides.2: not an index of this entry"),
    ({"participants": [_entry(), _entry(count=1, name="g-1")]},
     "participants[1].name='g-1': participant 'g-1' is also declared by participants[0]"),
    ({"participants": [_entry(name="../x")]}, "participants[0].name='../x': must match"),
    ({"participants": [_entry(participant="x")]}, "participants[0].participant: use 'name'"),
    ({"participants": [_entry(model="no-such-model")]},
     "participants[0].model='no-such-model' (participant g-0): unknown model"),
    ({"defaults": {"model": "./nowhere"}, "participants": [{"name": "d", "count": 2}]},
     "defaults.model='./nowhere' (participant d-0): no such model folder"),
    ({"participants": []}, "participants: must be a non-empty list"),
    ({"participants": [_entry(draw={"lora-r": []})]}, "participants[0].draw.lora-r=[]: must be a non-empty list"),
    ({"participants": [_entry(draw={"rank": [4]})]}, "participants[0].draw.rank: not a participant key"),
    ({"participants": [_entry(adapter="lora", draw={"lora-r": [4, 0]})]}, "participants[0].draw.lora-r=0 (participant g-"),
    ({"participants": [_entry(adapter="full", **{"share-base": True})]},
     "participants[0].share-base=True (participant g-0): shares a base model between LoRA adapters"),
    ({"participants": [_entry()], "groups": []}, "'groups': unknown top-level field"),
])
def test_errors_name_the_source_the_entry_and_the_field(tmp_path, table, message):
    path = tmp_path / "pop.json"
    path.write_text(json.dumps(table))
    with pytest.raises(ValueError) as e:
        validate_run_config({**RUN_CONFIG, "population": str(path)})
    msg = str(e.value)
    assert msg.startswith(f"population {path}: ") and message in msg and "\n" not in msg, msg


def test_file_errors_and_p_keys_beside_a_population(tmp_path):
    with pytest.raises(ValueError, match=r"population='nope\.toml': no such file"):
        validate_run_config({**RUN_CONFIG, "population": "nope.toml"})
    (tmp_path / "p.txt").write_text("{}")
    with pytest.raises(ValueError, match=r"must be a \.toml, \.json or \.yaml file"):
        validate_run_config({**RUN_CONFIG, "population": str(tmp_path / "p.txt")})
    (tmp_path / "bad.toml").write_text("[[participants]\nname=")
    with pytest.raises(ValueError, match=r"bad\.toml: not valid TOML"):
        validate_run_config({**RUN_CONFIG, "population": str(tmp_path / "bad.toml")})
    cfg = {**RUN_CONFIG, "population": json.dumps(TABLE), "p1-model": "tiny-llama"}
    with pytest.raises(ValueError, match=r"^p1-model: the run config declares its participants in population"):
        validate_run_config(cfg, explicit={"p1-model"})
    validate_run_config(cfg)                                   # pyproject's default p<i>-* keys are ignored
    with pytest.raises(ValueError, match=r"min-participants=7: more than the 6 participants of population"):
        validate_run_config({**RUN_CONFIG, "population": json.dumps(TABLE), "min-participants": 7})


def test_the_numbered_keys_are_unchanged_without_a_population():
    assert participant_names(RUN_CONFIG) == participant_names({**RUN_CONFIG, "population": ""})
    assert [s.policy for s in _specs(RUN_CONFIG)] == [s.policy for s in _specs({**RUN_CONFIG, "population": ""})]


def test_ranks_and_rates_drawn_per_participant_on_a_shared_base():
    """``draw``: each of 256 LoRA participants on one base draws its rank and rate from the lists, by its
    name (the same name, the same draw, in any population); an override still wins."""
    entry = {"name": "lora", "count": 256, "model": "tiny-llama", "adapter": "lora", "share-base": True,
             "draw": {"lora-r": [4, 8, 16], "lr": [5e-4, 1e-3]}, "overrides": {"7": {"lora-r": 2}}}
    cfg = {**RUN_CONFIG, "population": json.dumps({"participants": [entry]})}
    specs = _specs(cfg)
    assert len(specs) == 256 and all(s.policy.share_base and s.policy.adapter == "lora" for s in specs)
    ranks = [s.policy.lora_r for s in specs]
    assert ranks[7] == 2 and set(ranks) == {2, 4, 8, 16}
    counts = {r: ranks.count(r) for r in (4, 8, 16)}
    assert all(60 <= c <= 110 for c in counts.values()), counts          # ~85 each of 255: drawn, not one value
    assert {s.policy.lr for s in specs} == {5e-4, 1e-3}
    few = _specs({**RUN_CONFIG, "population": json.dumps({"participants": [{**entry, "count": 20}]})})
    assert [s.policy.lora_r for s in few] == ranks[:20]                   # by name, not by count
