"""The participant worker's fault injection, used by the end-to-end tests only (an environment
variable, not a run-config key): which request of which participant fails, and how."""

from __future__ import annotations

import pytest

from clients.worker import FAULT_ENV, inject_fault


def test_only_the_named_participant_action_and_round_fail():
    env = {FAULT_ENV: "carol=exit:learn:1,bob=raise:generate:2"}
    with pytest.raises(RuntimeError, match="bob: injected fault at generate round 2"):
        inject_fault("bob", "generate", 2, env)
    for who, action, rnd in (("bob", "generate", 1), ("bob", "learn", 2), ("alice", "generate", 2)):
        inject_fault(who, action, rnd, env)                       # nothing happens
    inject_fault("bob", "generate", 2, {})                         # not set: never
