"""TRL's names -> ftis-fed keys: every mapped key exists, and a TRL name given as a run-config key
is an error that names the ftis-fed key (no aliases: docs/configuration.md, TRL names)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ftis_fed.commands.sim import layered_overrides
from ftis_fed.config.federation import PER_PARTICIPANT_KEYS
from ftis_fed.config.keys import declared_keys
from ftis_fed.config.validation import validate_run_config
from ftis_fed.config.trl_names import TRL_NAMES, trl_hint

ROOT = Path(__file__).resolve().parent.parent
TRL_FIELDS = {"learning_rate", "num_generations", "max_completion_length", "epsilon", "loss_type",
              "importance_sampling_level", "vllm_importance_sampling_cap", "off_policy_mask_threshold",
              "beta", "temperature", "reward_weights", "scale_rewards"}


def test_every_mapped_key_is_declared():
    keys = declared_keys() | set(PER_PARTICIPANT_KEYS)
    for t in TRL_NAMES:
        for k in filter(None, (s.strip() for s in t.ours.split(","))):
            assert k in keys, f"{t.trl} -> {k!r}: not a run-config key"


def test_the_names_are_trls():
    """Every GRPOConfig / ModelConfig name in the table is a field of the installed TRL's classes."""
    trl = pytest.importorskip("trl")
    fields = {f.name for cls in (trl.GRPOConfig, trl.ModelConfig) for f in dataclasses.fields(cls)}
    trainer_args = {"train_dataset", "reward_funcs"}
    assert TRL_FIELDS <= fields
    assert [t.trl for t in TRL_NAMES if t.trl not in fields | trainer_args] == []


@pytest.mark.parametrize("key, ours", [("num-generations", "group-size"), ("num_generations", "group-size"),
                                       ("max_completion_length", "max-new-tokens"), ("epsilon", "clip-eps"),
                                       ("loss-type", "length-norm"), ("vllm_importance_sampling_cap", "trunc-c"),
                                       ("off_policy_mask_threshold", "filter-g"), ("use_peft", "adapter"),
                                       ("load_in_4bit", "quant")])
def test_a_trl_name_is_an_error_naming_our_key(key, ours):
    with pytest.raises(ValueError, match=rf"{key}: not a run-config key; TRL's {key.replace('-', '_')} is {ours}"):
        validate_run_config({key: 8})
    with pytest.raises(ValueError, match=rf"TRL's {key.replace('-', '_')} is {ours}"):
        layered_overrides(ROOT, [f"{key}=8"])


def test_names_without_a_counterpart_say_so():
    assert trl_hint("beta").startswith("; TRL's beta has no ftis-fed key (no reference-model KL term")
    assert trl_hint("no-such-thing") == ""


def test_trl_s_defaults_in_the_table_are_the_installed_trl_s():
    """docs/configuration.md's TRL column is TRL 1.16's own defaults (GRPOConfig with its
    TrainingArguments, ModelConfig), read from the installed classes' fields."""
    trl = pytest.importorskip("trl")
    fields = {f.name: f for cls in (trl.ModelConfig, trl.GRPOConfig) for f in dataclasses.fields(cls)}
    checked = 0
    for t in TRL_NAMES:
        if not t.trl_default:
            continue
        f = fields[t.trl]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert t.trl_default == repr(default), f"{t.trl}: the table says {t.trl_default}, TRL {trl.__version__} {default!r}"
        checked += 1
    assert checked == len(TRL_NAMES) - 2                   # all but the trainer arguments train_dataset, reward_funcs


def test_the_table_shows_our_default_beside_trl_s():
    """docs/configuration.md's TRL table: each mapped key's own default in the ftis-fed column (it
    showed '—' for every row), e.g. temperature 1.0 (TRL) beside 0.7 (ours)."""
    from ftis_fed.config.federation import FederationConfig, ParticipantSpec
    from ftis_fed.config.trl_names import _literal
    from ftis_fed.knobs import knobs
    from ftis_fed.policies.config import PolicyConfig

    defaults = {k.key: k.default for cls in (FederationConfig, ParticipantSpec, PolicyConfig) for k in knobs(cls)}
    doc = (ROOT / "docs" / "configuration.md").read_text()
    rows = {line.split(" | ")[0].strip("| `"): line.split(" | ") for line in doc.split("## TRL names", 1)[1].splitlines()
            if line.startswith("| `")}
    for t in TRL_NAMES:
        keys = [k.strip() for k in t.ours.split(",") if k.strip()]
        want = ", ".join(f"`{_literal(defaults[k])}`" for k in keys) or "—"
        assert rows[t.trl][3] == want, (t.trl, rows[t.trl][3], want)
    assert rows["temperature"][1:4] == ["`1.0`", "`temperature`", "`0.7`"]
    assert rows["lora_dropout"][1:4] == ["`0.05`", "`lora-dropout`", "`0.0`"]
