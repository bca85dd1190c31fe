"""The action table (``ftis_fed.actions``) read by both sides: a real participant (tiny random
model, real keys) answers every action through its one entry point ``handle``, each reply passes
the server's check of the same table's reply fields, and the Flower message types round-trip."""

from __future__ import annotations

import clients.client_app as client_app
import pytest

from ftis_fed.actions import ACTIONS, action, action_of, message_type, reply_fields, request_args, requested_variants
from ftis_fed.config.churn import PROBE
from ftis_fed.config.federation import FederationConfig, ParticipantSpec
from ftis_fed.engine.validation import BadReply, check_reply
from ftis_fed.participant import Participant
from ftis_fed.policies.config import PolicyConfig
from ftis_fed.tasks.suite import TaskSpec
from ftis_fed.trust.signing import generate_keypair, load_key_directory, verify_challenge
from ftis_fed.wire.codec import parse_header

RUN = "actions-test"


@pytest.fixture(scope="module")
def participants(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("actions")
    fed = FederationConfig(num_rounds=2, group_size=2, max_new_tokens=3, run_name=RUN, output_dir=str(tmp),
                           eval_every=1, eval_size=2, eval_ood_size=1, eval_max_new_tokens=2,
                           task=TaskSpec(families=("add1",), prompts_per_round=1))
    out = {}
    for name in ("alice", "bob"):
        generate_keypair(name, tmp / "keys")
    for i, name in enumerate(("alice", "bob")):
        spec = ParticipantSpec(name, PolicyConfig(model="tiny-llama", adapter="full", lr=1e-3), i, 2,
                               str(tmp / "keys"), str(tmp / "participants" / name))
        out[name] = Participant(spec, fed)
    return out, load_key_directory(tmp / "keys" / "public")


def test_a_participant_answers_every_action_with_the_fields_the_server_accepts(participants):
    parts, keys = participants
    alice, bob = parts["alice"], parts["bob"]
    challenge = b"c" * 32
    replies = {"hello": alice.handle("hello", {"run": RUN, "node": "7", "challenge": challenge})}
    assert verify_challenge(keys["alice"], RUN, "7", "alice", challenge, replies["hello"]["info"]["proof"])
    replies["generate"] = alice.handle("generate", {"round": 1, "texts": [False, True]})
    heads = [parse_header(f) for f in replies["generate"]["frames"]]
    assert [h.has_texts for h in heads] == [False, True] and heads[0].sender == "alice"
    peer = bob.handle("generate", {"round": 1, "texts": False})["frames"]
    replies["learn"] = alice.handle("learn", {"round": 1, "frames": peer})
    assert replies["learn"]["metrics"]["offpolicy/accepted"] == 1
    replies["exchange"] = alice.handle("exchange", {"round": 2, "frames": [], "texts": True})
    assert parse_header(replies["exchange"]["frames"][0]).round == 2
    replies["evaluate"] = alice.handle("evaluate", {"round": 2})
    assert "eval/id/accuracy" in replies["evaluate"]["metrics"]
    replies["finish"] = alice.handle("finish", {})
    assert set(replies) == set(ACTIONS)
    for name, reply in replies.items():
        assert tuple(reply) == ACTIONS[name].reply
        request = {"texts": [False, True]} if name == "generate" else {}
        check_reply(name, reply, variants=requested_variants(request))         # the server's check


def test_the_server_refuses_a_reply_without_a_field_of_the_table():
    for name, row in ACTIONS.items():
        for missing in row.reply:
            with pytest.raises(BadReply, match="missing_record"):
                check_reply(name, {f: [] if f == "frames" else {} for f in row.reply if f != missing})
        with pytest.raises(BadReply, match="extra_record"):
            check_reply(name, {**{f: [] if f == "frames" else {} for f in row.reply}, "extra": {}})


def test_an_unknown_action_or_a_missing_request_field_is_an_error(participants):
    alice = participants[0]["alice"]
    with pytest.raises(ValueError, match="unknown action 'save'"):
        alice.handle("save", {})                      # a method of the participant, not an action
    with pytest.raises(ValueError, match=r"learn request lacks \['frames'\]"):
        alice.handle("learn", {"round": 1})


def test_request_fields_are_read_in_the_table_order():
    assert request_args("exchange", {"texts": [0, 1], "round": "3", "frames": (b"a",)}) == [3, [b"a"], (False, True)]
    assert request_args("hello", {"run": "r", "node": 7, "challenge": bytearray(b"x")}) == ["r", "7", b"x"]
    assert reply_fields("generate", ([b"f"], {"m": 1.0})) == {"frames": [b"f"], "metrics": {"m": 1.0}}
    with pytest.raises(TypeError, match="frames, metrics"):
        reply_fields("generate", {"m": 1.0})


def test_every_action_has_one_flower_message_type_and_a_clientapp_handler():
    types = [message_type(name) for name in ACTIONS]
    assert len(set(types)) == len(types)
    assert all(action_of(message_type(name)) == name for name in ACTIONS)
    assert {"learn": "train", "exchange": "train.exchange", "evaluate": "evaluate",
            "hello": "query.hello"}.items() <= {n: message_type(n) for n in ACTIONS}.items()
    registered = set(client_app.app._registered_funcs)
    # and the simulated-churn probe (strategies.churn), which the ClientApp answers itself
    assert registered == {".".join(action(n).route) for n in ACTIONS} | {f"query.{PROBE}"}
    with pytest.raises(ValueError):
        action_of("query.save")
