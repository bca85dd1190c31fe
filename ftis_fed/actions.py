"""The action table: every message between the round engine and a participant, in one place.

One row per action: its name (one name end to end: engine -> transport -> ``Participant.handle``),
the request fields (in the order of the participant method's parameters, each with the function
that reads it), the reply fields (exactly these, no more: ``engine.validation`` checks them) and
the Flower message type that carries it (``flower_io``, the ClientApp's handlers)::

    hello     {run, node, challenge}    -> {info}             query.hello
    generate  {round, texts}            -> {frames, metrics}  query.generate
    learn     {round, frames}           -> {metrics}          train
    exchange  {round, frames, texts}    -> {frames, metrics}  train.exchange
    evaluate  {round}                   -> {metrics}          evaluate
    finish    {}                        -> {info}             query.finish

Both sides read it: the server (engine, validation, Grid transport) and the client (ClientApp,
participant). It imports nothing of the project and nothing of Flower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping


def variants_of(texts: Any) -> tuple[bool, ...]:
    """A request's ``texts`` -> the frame variants it asks for: a single bool = one variant; a list
    = one frame per entry, in order (``[False, True]``: the batch without and with its texts)."""
    return tuple(bool(x) for x in texts) if isinstance(texts, (list, tuple)) else (bool(texts),)


def requested_variants(request: Mapping[str, Any] | None) -> tuple[bool, ...]:
    """The frame variants a generate/exchange request asks for (:func:`variants_of` of its ``texts``)."""
    return variants_of((request or {}).get("texts", ()))


@dataclass(frozen=True)
class Action:
    """One row of the table. ``request``: field -> reader (the participant method's parameters, in
    order); ``reply``: the reply's fields (one -> the method's return value; two -> its tuple, in
    order); ``message_type``: the Flower message type (``<category>`` or ``<category>.<name>``)."""

    name: str
    request: Mapping[str, Callable[[Any], Any]]
    reply: tuple[str, ...]
    message_type: str
    doc: str

    @property
    def route(self) -> tuple[str, str]:
        """(category, action) as Flower's ClientApp registers it: ``train`` -> (train, default)."""
        category, _, sub = self.message_type.partition(".")
        return category, sub or "default"


def _frames(value: Any) -> list[bytes]:
    return list(value)


ACTIONS: dict[str, Action] = {a.name: a for a in (
    Action("hello", {"run": str, "node": str, "challenge": bytes}, ("info",), "query.hello",
           "who I am (participant, key_fp, model_id, tokenizer_fp, ...) + proof: my signature of the challenge"),
    Action("generate", {"round": int, "texts": variants_of}, ("frames", "metrics"), "query.generate",
           "phase 1: this round's signed batch, one frame per variant asked for"),
    Action("learn", {"round": int, "frames": _frames}, ("metrics",), "train",
           "phase 2: verify and re-check the peers' frames of the round, train"),
    Action("exchange", {"round": int, "frames": _frames, "texts": variants_of}, ("frames", "metrics"),
           "train.exchange", "pipelined: generate this round's batch, learn from peers' of the previous round"),
    Action("evaluate", {"round": int}, ("metrics",), "evaluate", "greedy pass@1 on the held-out sets"),
    Action("finish", {}, ("info",), "query.finish", "end of run: stop"),
)}


def action(name: str) -> Action:
    """The row of ``name``; ValueError for an action the table does not list."""
    if name not in ACTIONS:
        raise ValueError(f"unknown action {name!r} (known: {', '.join(ACTIONS)})")
    return ACTIONS[name]


def message_type(name: str) -> str:
    """The Flower message type that carries action ``name``."""
    return action(name).message_type


def action_of(msg_type: str) -> str:
    """Inverse of :func:`message_type`; ValueError for a type no action uses."""
    for a in ACTIONS.values():
        if a.message_type == msg_type:
            return a.name
    raise ValueError(f"message type {msg_type!r} carries no ftis-fed action")


def request_args(name: str, request: Mapping[str, Any]) -> list[Any]:
    """A request's fields read in the table's order (the participant method's arguments); ValueError
    naming the action and the field for a missing one."""
    row = action(name)
    missing = [f for f in row.request if f not in request]
    if missing:
        raise ValueError(f"{name} request lacks {missing} (has {sorted(request)})")
    return [read(request[f]) for f, read in row.request.items()]


def reply_fields(name: str, result: Any) -> dict[str, Any]:
    """A participant method's return value -> the reply's fields (one field: the value; more: a
    tuple of them, in the table's order)."""
    fields = action(name).reply
    if len(fields) == 1:
        return {fields[0]: result}
    if not isinstance(result, tuple) or len(result) != len(fields):
        raise TypeError(f"{name}: expected a tuple of {len(fields)} values ({', '.join(fields)})")
    return dict(zip(fields, result))
