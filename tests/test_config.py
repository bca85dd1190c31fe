"""Run config -> dataclasses: every key known and documented, bad values named, participants resolved."""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path

import pytest

from ftis_fed.config.federation import MAX_PARTICIPANTS, PARTICIPANT_KEYS, PER_PARTICIPANT_KEYS, POLICY_KEYS
from ftis_fed.config.keys import federation_from_run_config, run_keys, run_knobs
from ftis_fed.config.participants import participant_names, participant_spec
from ftis_fed.config.validation import pyproject_disagreements, validate_run_config
from ftis_fed.config.models_check import check_model, offline_model_names
from ftis_fed.config.reference import config_reference

ROOT = Path(__file__).resolve().parent.parent
RUN_CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def test_pyproject_declares_every_key_with_its_declared_default():
    assert pyproject_disagreements(RUN_CONFIG) == []
    for key in RUN_CONFIG:
        base = re.sub(r"^p\d+-", "", key)
        assert key in run_keys() or base in POLICY_KEYS or base in PARTICIPANT_KEYS, key


@pytest.mark.parametrize("change,expected", [
    ({"max-new-tokens": 32}, "max-new-tokens: 32 in pyproject.toml, 24 declared by FederationConfig.max_new_tokens"),
    ({"prompts-per-round": 8}, "prompts-per-round: 8 in pyproject.toml, 4 declared by TaskSpec.prompts_per_round"),
    ({"wait-for-participants-s": 300}, "wait-for-participants-s: 300 in pyproject.toml, 300.0 declared"),
    ({"lr": None}, "lr: declared by PolicyConfig.lr (default 0.0) but missing"),
    ({"num-round": 3}, "num-round: in pyproject.toml but not declared"),
    ({"p7-byzantine": None}, "p7-byzantine: missing"),
    ({"p6-lr": 1e-4}, "p6-lr: 0.0001 after the last participant; must be -1.0"),
])
def test_a_disagreement_between_pyproject_and_the_declarations_is_named(change, expected):
    cfg = {**RUN_CONFIG, **{k: v for k, v in change.items() if v is not None}}
    for k in [k for k, v in change.items() if v is None]:
        del cfg[k]
    assert any(expected in d for d in pyproject_disagreements(cfg)), pyproject_disagreements(cfg)


def test_configuration_doc_is_current():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc == config_reference(), "regenerate: python -m ftis_fed.config.reference > docs/configuration.md"
    for key, k in run_knobs().items():
        assert f"| `{key}` |" in doc and k.help, key
    for key in PER_PARTICIPANT_KEYS:
        assert f"- `p<i>-{key}`:" in doc


def test_participant_limit_is_one_number_that_holds():
    assert MAX_PARTICIPANTS == 8
    assert {f"p{i}-model" for i in range(MAX_PARTICIPANTS)} <= set(RUN_CONFIG)
    assert f"p{MAX_PARTICIPANTS}-model" not in RUN_CONFIG
    tiny = {**RUN_CONFIG, **{f"p{i}-participant": f"n{i}" for i in range(MAX_PARTICIPANTS)},
            **{f"p{i}-model": "tiny-llama" for i in range(MAX_PARTICIPANTS)},
            **{f"p{i}-adapter": "full" for i in range(MAX_PARTICIPANTS)},
            **{f"p{i}-quant": "none" for i in range(MAX_PARTICIPANTS)}}
    assert len(participant_names(tiny)) == MAX_PARTICIPANTS
    validate_run_config(tiny)
    with pytest.raises(ValueError, match=rf"p{MAX_PARTICIPANTS}-model: at most {MAX_PARTICIPANTS} participants"):
        validate_run_config({**tiny, f"p{MAX_PARTICIPANTS}-model": "tiny-llama"})
    from ftis_fed.commands.sim import layered_overrides

    with pytest.raises(ValueError, match=rf"p{MAX_PARTICIPANTS}-model .*at most {MAX_PARTICIPANTS} participants"):
        layered_overrides(ROOT, [f'p{MAX_PARTICIPANTS}-model="smollm2"'])


def test_flower_toml_simulates_one_supernode_per_default_participant():
    links = tomllib.loads((ROOT / "flower.toml").read_text())["superlink"]
    opts = links["local-sim"]["options"]
    n = len(participant_names(RUN_CONFIG))
    assert opts["num-supernodes"] == n
    assert opts["backend"]["client-resources"]["num-cpus"] == 1 and opts["backend"]["init-args"]["num-cpus"] == n


def test_flower_toml_lab_entry_works_as_written():
    """The deployment connection: an absolute CA path (a relative one broke the first `flwr`
    command), the layout docs/deployment.md uses, and no comment naming another port than its own."""
    import re

    text = (ROOT / "flower.toml").read_text()
    lab = tomllib.loads(text)["superlink"]["lab"]
    assert Path(lab["root-certificates"]).is_absolute() and lab["root-certificates"] == "/srv/ftis/certs/ca.crt"
    port = lab["address"].rsplit(":", 1)[1]
    comment = text[text.index("# Deployment: a SuperLink"):text.index("[superlink.lab]")]
    assert set(re.findall(r":(\d{4})\b", comment)) == {port}
    assert lab["root-certificates"] in (ROOT / "docs" / "deployment.md").read_text()


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
    ("num-rounds", -1, "num-rounds=-1: must be >= 1"),
    ("trunc-c", -1.0, "trunc-c=-1.0: must be > 0"),
    ("loss-mode", "FTIS", "loss-mode='FTIS': must be one of"),
    ("group-size", 1, "group-size=1: must be >= 2"),
    ("top-p", 1.5, "top-p=1.5: must be in (0, 1]"),
    ("resume", "maybe", "resume='maybe': must be true or false"),
    ("num-rounds", 2.5, "num-rounds=2.5: must be an integer"),
    ("wait-for-participants-s", 0.0, "wait-for-participants-s=0.0: must be > 0"),
    ("prompts-per-round", 0, "prompts-per-round=0: must be an integer >= 1"),
    ("reverify-max-disagreement", 1.0, "reverify-max-disagreement=1.0: must be in [0, 1)"),
    ("min-participants", 5, "min-participants=5: more than the 4 participants declared"),
    ("p1-lr", -3.0, "p1-lr=-3.0 (participant smol-lora): must be >= 0"),
    ("p0-dtype", "fp8", "p0-dtype='fp8' (participant smol-full): must be 'auto', 'fp32' or 'bf16'"),
    ("lora-r", 0, "lora-r=0 (participant smol-full): must be >= 1"),
    ("p1-participant", "smol-full", "p1-participant='smol-full': the same name as p0"),
    ("p2-participant", "../x", "p2-participant='../x': must match"),
    ("num-rouns", 3, "num-rouns: not a run-config key"),
])
def test_bad_values_name_the_key_and_the_limit(key, value, message):
    with pytest.raises(ValueError) as e:
        validate_run_config({**RUN_CONFIG, key: value})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_participant_set_after_the_end_of_the_list_is_named():
    cfg = {**RUN_CONFIG, "p5-model": "smollm2"}
    with pytest.raises(ValueError, match=r"^p5-model='smollm2': ignored, because p4-model is ''"):
        validate_run_config(cfg, explicit={"p5-model"})
    # pyproject's default participants after a shorter list's end (a preset's p2-model = "") are fine
    assert len(participant_names({**RUN_CONFIG, "p2-model": ""})) == 2
    validate_run_config({**RUN_CONFIG, "p2-model": ""}, explicit={"p2-model"})


def test_unknown_model_is_one_line_naming_participant_value_and_offline_names():
    names = offline_model_names()
    assert {"smollm2", "smollm2-bpe8k", "tiny-llama"} <= set(names)
    with pytest.raises(ValueError) as e:
        validate_run_config({**RUN_CONFIG, "p2-model": "smollm3"})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("p2-model='smollm3' (participant smol-qlora): unknown model")
    assert "offline models: " + ", ".join(names) in msg
    with pytest.raises(ValueError, match=r"^p0-model='\./no/such' \(participant smol-full\): no such model folder"):
        validate_run_config({**RUN_CONFIG, "p0-model": "./no/such"})


def test_hub_ids_pass_only_from_the_local_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as e:
        check_model("org/some-model", "p1-model", "bob")
    assert str(e.value).startswith("p1-model='org/some-model' (participant bob): a hub id that is not in the local "
                                   "Hugging Face cache (HF_HUB_OFFLINE is set)")
    snap = tmp_path / "hub" / "models--org--some-model" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--some-model" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--some-model" / "refs" / "main").write_text("abc123")
    check_model("org/some-model", "p1-model", "bob")                  # cached: fine, nothing downloaded


def test_a_local_model_folder_needs_a_config(tmp_path):
    with pytest.raises(ValueError, match="the folder has no config.json"):
        check_model(str(tmp_path), "p0-model")
    (tmp_path / "config.json").write_text("{}")
    check_model(str(tmp_path), "p0-model")


def test_deployment_run_config_does_not_check_models_on_the_server():
    cfg = {**RUN_CONFIG, "keys-dir": "/srv/keys", "p0-model": "/only/on/the/node"}
    assert validate_run_config(cfg).keys_dir == "/srv/keys"
    with pytest.raises(ValueError, match="no such model folder"):
        validate_run_config(cfg, check_models=True)


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
    with pytest.raises(ValueError, match="boom"):
        participant_spec({**RUN_CONFIG, "p0-byzantine": "boom"}, {"partition-id": 0, "num-partitions": 4}, fed)


# ----------------------------------------------------------------------------- presets (sims/presets)

PRESETS = sorted(p.stem for p in (ROOT / "sims" / "presets").glob("*.toml"))


def test_presets_exist():
    assert {"quick", "alone", "pipelined", "expertise", "tokenizers"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_is_a_valid_federation(name):
    from ftis_fed.commands.sim import expand_run_config, merged_run_config, parse_overrides

    items = expand_run_config(ROOT, [], preset=name)
    cfg = merged_run_config(ROOT, parse_overrides(items))
    assert cfg["output-dir"] == f"outputs/{name}"                     # presets never overwrite each other
    hub = any("/" in str(v) and k.endswith("-model") for k, v in cfg.items())
    if hub:                                   # hub-model presets (gpu-qwen) need the models: the check says so
        with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
            validate_run_config(cfg)
    fed = validate_run_config(cfg, check_models=not hub)               # what the launcher checks first
    names = participant_names(cfg)
    assert len(names) >= 2 and len(set(names)) == len(names)
    for pid in range(len(names)):
        spec = participant_spec(cfg, {"partition-id": pid, "num-partitions": len(names)}, fed)
        assert spec.name == names[pid]


def test_run_config_layers_later_wins_and_unknown_keys_are_named(tmp_path):
    from ftis_fed.commands.sim import expand_run_config

    f = tmp_path / "mine.toml"
    f.write_text('num-rounds = 7\nscheme = "pipelined"\n')
    items = expand_run_config(ROOT, [str(f), "num-rounds=9 group-size=2"], preset="quick")
    got = dict(i.split("=", 1) for i in items)
    assert got["num-rounds"] == "9" and got["scheme"] == '"pipelined"' and got["group-size"] == "2"
    assert got["population"] == '"sims/populations/quick.toml"'        # from the preset
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
        federation_from_run_config({**RUN_CONFIG, "task-families": "add1", "eval-size": 64}).check_data()
    federation_from_run_config({**RUN_CONFIG, "task-families": "add1", "eval-size": 64, "eval-every": 0}).check_data()


def test_the_scheme_name_is_checked_by_the_engine():
    """config/ imports nothing of the engine: a registered schedule's name is the engine's check
    (``get_schedule``, at ``Engine`` construction and in the launcher before anything starts)."""
    from ftis_fed.engine.schedules import get_schedule

    assert federation_from_run_config({"scheme": "async"}).scheme == "async"
    with pytest.raises(ValueError, match=r"scheme='async': no such schedule \(registered: pipelined, sync\)"):
        get_schedule("async")
