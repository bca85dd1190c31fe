"""Run config -> dataclasses: every key known and documented, bad values named, participants resolved."""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path

import pytest

from ftis_fed.config import (KEYS, PARTICIPANT_KEYS, POLICY_KEYS, config_reference, federation_from_run_config,
                             participant_names, participant_spec)

ROOT = Path(__file__).resolve().parent.parent
RUN_CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def test_every_declared_key_is_used_and_documented():
    for key in RUN_CONFIG:
        base = re.sub(r"^p\d+-", "", key)
        assert key in KEYS or base in POLICY_KEYS or base in PARTICIPANT_KEYS, key
    table = config_reference(RUN_CONFIG)
    for key in RUN_CONFIG:
        if not re.match(r"^p\d+-", key):
            row = next(line for line in table.splitlines() if line.startswith(f"| `{key}` |"))
            assert not row.rstrip().endswith("|  |"), f"{key} has no description"


def test_configuration_doc_is_current():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert config_reference(RUN_CONFIG) in doc, "regenerate: python -m ftis_fed.config > docs/configuration.md"


def test_defaults_build_the_heterogeneous_federation():
    fed = federation_from_run_config(RUN_CONFIG)
    assert fed.objective.mode == "F-TIS" and fed.objective.trunc_c == 2.0 and fed.objective.filter_g == 50.0
    assert fed.objective.norm_constant == fed.max_new_tokens
    names = participant_names(RUN_CONFIG)
    assert len(names) >= 3 and len(set(names)) == len(names)
    specs = [participant_spec(RUN_CONFIG, {"partition-id": i, "num-partitions": len(names)}, fed)
             for i in range(len(names))]
    kinds = {(s.policy.model, s.policy.adapter, s.policy.quant) for s in specs}
    assert len(kinds) == len(specs)                                          # genuinely different
    assert any(s.policy.quant == "4bit" for s in specs) and any(s.policy.adapter == "lora" for s in specs)


def test_participant_keys_inherit_run_wide_values():
    cfg = {**RUN_CONFIG, "lr": 3e-5, "p1-lr": -1.0, "p0-lr": 1e-3, "dtype": "bf16", "p0-dtype": ""}
    fed = federation_from_run_config(cfg)
    s0 = participant_spec(cfg, {"partition-id": 0, "num-partitions": 4}, fed)
    s1 = participant_spec(cfg, {"partition-id": 1, "num-partitions": 4}, fed)
    assert s0.policy.lr == 1e-3 and s1.policy.lr == 3e-5
    assert s0.policy.dtype == "bf16"


def test_deployment_node_config_wins():
    fed = federation_from_run_config(RUN_CONFIG)
    node = {"participant": "alice", "model": "tiny-llama", "adapter": "lora", "keys-dir": "/srv/keys",
            "state-dir": "/srv/state", "partition-id": 1, "num-partitions": 3, "peer-budget": 16}
    s = participant_spec(RUN_CONFIG, node, fed)
    assert (s.name, s.policy.model, s.policy.adapter, s.partition_id, s.num_partitions) == \
        ("alice", "tiny-llama", "lora", 1, 3)
    assert s.keys_dir == "/srv/keys" and s.state_dir == "/srv/state" and s.peer_budget == 16


@pytest.mark.parametrize("key,value,message", [
    ("num-rounds", 0, "num-rounds=0: must be >= 1"),
    ("trunc-c", -1.0, "trunc-c=-1.0: must be > 0"),
    ("loss-mode", "FTIS", "loss-mode='FTIS': must be one of"),
    ("group-size", 1, "group-size=1: must be >= 2"),
    ("top-p", 1.5, "top-p=1.5: must be in (0, 1]"),
    ("scheme", "async", "scheme='async': must be 'sync' or 'pipelined'"),
    ("resume", "maybe", "resume='maybe': must be true or false"),
    ("num-rounds", 2.5, "num-rounds=2.5: must be an integer"),
])
def test_bad_values_name_the_key_and_the_limit(key, value, message):
    with pytest.raises(ValueError) as e:
        federation_from_run_config({**RUN_CONFIG, key: value})
    assert message in str(e.value)


def test_infinite_thresholds_are_accepted():
    fed = federation_from_run_config({**RUN_CONFIG, "trunc-c": "inf", "filter-g": math.inf})
    assert math.isinf(fed.objective.trunc_c) and math.isinf(fed.objective.filter_g)


def test_bad_participant_settings_are_named():
    fed = federation_from_run_config(RUN_CONFIG)
    with pytest.raises(ValueError, match="quantized weights cannot train"):
        participant_spec({**RUN_CONFIG, "p0-quant": "4bit", "p0-adapter": "full"},
                         {"partition-id": 0, "num-partitions": 4}, fed)
    with pytest.raises(ValueError, match="partition-id=7: the run config defines 4 participants"):
        participant_spec(RUN_CONFIG, {"partition-id": 7, "num-partitions": 8}, fed)
    with pytest.raises(ValueError, match="fault='boom'"):
        participant_spec({**RUN_CONFIG, "p0-fault": "boom"}, {"partition-id": 0, "num-partitions": 4}, fed)


# ----------------------------------------------------------------------------- presets (sims/presets)

PRESETS = sorted(p.stem for p in (ROOT / "sims" / "presets").glob("*.toml"))


def test_presets_exist():
    assert {"quick", "alone", "pipelined", "expertise", "tokenizers"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_is_a_valid_federation(name):
    from ftis_fed.launch import expand_run_config, merged_run_config, parse_overrides

    items = expand_run_config(ROOT, [], preset=name)
    cfg = merged_run_config(ROOT, parse_overrides(items))
    assert cfg["output-dir"] == f"outputs/{name}"                     # presets never overwrite each other
    fed = federation_from_run_config(cfg)
    names = participant_names(cfg)
    assert len(names) >= 2 and len(set(names)) == len(names)
    for pid in range(len(names)):
        spec = participant_spec(cfg, {"partition-id": pid, "num-partitions": len(names)}, fed)
        assert spec.name == names[pid]


def test_run_config_layers_later_wins_and_unknown_keys_are_named(tmp_path):
    from ftis_fed.launch import expand_run_config

    f = tmp_path / "mine.toml"
    f.write_text('num-rounds = 7\nscheme = "pipelined"\n')
    items = expand_run_config(ROOT, [str(f), "num-rounds=9 group-size=2"], preset="quick")
    got = dict(i.split("=", 1) for i in items)
    assert got["num-rounds"] == "9" and got["scheme"] == '"pipelined"' and got["group-size"] == "2"
    assert got["p0-model"] == '"tiny-arith"'                          # from the preset
    f.write_text("num-rouns = 7\n")
    with pytest.raises(ValueError, match=r"'num-rouns'.*mine\.toml"):
        expand_run_config(ROOT, [str(f)])
    with pytest.raises(FileNotFoundError, match="presets: .*quick"):
        expand_run_config(ROOT, [], preset="nope")


def test_evaluation_follows_the_trained_families_and_too_large_sets_fail_at_start():
    fed = federation_from_run_config({**RUN_CONFIG, "task-families": "add1", "eval-size": 8})
    sets = fed.eval_sets()
    assert len(sets["id"]) == 8 and all(p.task_id.startswith("add1") for p in sets["id"])
    assert len(sets["mul15"]) == fed.eval_ood_size
    with pytest.raises(ValueError, match=r"eval-size=64 .*task-families=add1.*only 22 distinct"):
        federation_from_run_config({**RUN_CONFIG, "task-families": "add1", "eval-size": 64})
    federation_from_run_config({**RUN_CONFIG, "task-families": "add1", "eval-size": 64, "eval-every": 0})
