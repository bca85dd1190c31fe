"""The receiver's checks on peers' samples: one registry, one signature.

After ``frames.receive`` (signature, bounds, task truth, re-scoring) and
``training.samples_from_batches`` (one ``TrainSample`` per completion, advantages computed per group
*before* any check), every registered check runs once per update, in its ``order``, over the update's
samples. A check is one file of this folder::

    @dataclass(frozen=True)
    class MyKnobs:                 # its docstring's first line: its section's heading in docs/configuration.md
        share: float = knob("my-check-share", 0.0, "... 0 = off, in [0, 1].")   # a run-config key

        def __post_init__(self):
            need(self, 0 <= self.share <= 1, "share", "must be in [0, 1]")

    @register_check("my-check")
    class MyCheck(Check):
        order = 50                                     # after the built-in ones (0 … 40)
        knobs = MyKnobs                                # its knobs: ``fed.checks["my-check"]``

        @classmethod
        def build(cls, receiver: Receiver) -> "MyCheck | None":   # None: off in this run
            return cls() if cls.knobs_of(receiver).share > 0 else None
        def __call__(self, samples: list[TrainSample], update: Update) -> dict[str, float]:
            for s in samples: ...  s.reweight(w) / s.drop("my-check") / s.surprisal_limit = nats
            return {"my-check/dropped": ...}                         # metrics of the update's row

A check decides per sample and writes its decision on the sample itself (``TrainSample.reweight``,
``TrainSample.drop``: advantage x w, or 0 with a named reason; ``surprisal_limit``: the objective drops
the sample if a token is more surprising than that under the step's own policy), from what the
receiver holds itself (``Receiver``: its name, run config, policy, verifier). Its knobs are its own
config dataclass (``knobs``, fields made with ``ftis_fed.knobs.knob``): the run config's parser
(``config/keys.py``) reads them from this registry into ``FederationConfig.checks[alias]``, and
docs/configuration.md lists them in a section of their own (the dataclass's first docstring line);
each key must also be declared in ``pyproject.toml``. ``after_step`` sees the trainer after the
optimizer step (what it measured); ``state`` / ``restore`` carry what it learnt across a resume
(``Participant.save``: ``participant.json``'s ``checks``, one entry per alias). Every module of this
folder is imported by ``load_all``, so a new check is one file here (and its test).

Reading a run config imports this folder (the ClientApp imports no torch): a check's module imports
nothing heavy at its top (``TrainSample`` for annotations only, under ``TYPE_CHECKING``); a check that
scores uses the receiver's policy (``Receiver.policy``).

The decisions that need the live log-probs of the optimizer step itself stay in the objective
(``learn/objective.py``, per row inside ``ftis_loss``): the F filter (negative advantage and
KL_i >= g) and the drop of a sample with a token above its ``surprisal_limit`` (set by
``surprisal.py``). ``source-adapt = guard`` replaces the step itself (``learn/guard.py``), and
``shadow`` adds a copy trained alone beside it (``learn/shadow.py``).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence

if TYPE_CHECKING:                                   # annotations only: this folder imports no torch
    from ftis_fed.learn.training import TrainSample

#: alias -> check class, filled by ``register_check`` (every module of this folder, ``build_checks``)
CHECKS: dict[str, type["Check"]] = {}
#: modules of this folder that hold no check
NOT_CHECKS = ("__init__", "checks", "frames")


def register_check(alias: str) -> Callable[[type], type]:
    """Class decorator: register a ``Check`` under ``alias`` (its key in the metrics and the resume
    state). ValueError for an alias taken by another class."""
    def deco(cls: type) -> type:
        if alias in CHECKS and CHECKS[alias] is not cls:
            raise ValueError(f"receiver check {alias!r} is registered twice ({CHECKS[alias].__name__}, {cls.__name__})")
        if cls.knobs is not None and not dataclasses.is_dataclass(cls.knobs):
            raise TypeError(f"receiver check {alias!r}: knobs must be a config dataclass, not {cls.knobs!r}")
        cls.alias = alias
        CHECKS[alias] = cls
        return cls
    return deco


@dataclass
class Receiver:
    """What a check may use, all of it the receiver's own: its participant id, run config
    (``FederationConfig``), policy (tokenizer, scoring) and verifier."""

    name: str
    fed: Any
    policy: Any
    verifier: Any

    def decode(self, ids: Sequence[int]) -> str:
        return self.policy.tokenizer.decode(list(ids), skip_special_tokens=True)

    def texts(self, group) -> list[str]:
        """A group's completion texts: the carried ones (the receiver's own decoding after
        ``frames.receiver_copy``), else its decoding of the ids."""
        return list(group.completion_texts) if group.completion_texts else [self.decode(c.tolist())
                                                                           for c in group.completion_ids]

    def reward(self, group, text: str) -> float:
        """The receiver's own score of ``text`` as a completion of ``group``'s task."""
        return self.verifier.reward(group.task_id, text, group.reference, group.prompt_text)


@dataclass
class Update:
    """One update as the checks see it: the receiver, what ``frames.receive`` kept of the peers'
    frames (``Received``) and the batches trained on (the receiver's own first)."""

    receiver: Receiver
    received: Any = None
    batches: Sequence[Any] = field(default_factory=tuple)


class Check:
    """A registered receiver check (see the module docstring); subclasses set ``order`` and, when
    it has knobs, ``knobs`` (its config dataclass)."""

    alias: ClassVar[str] = ""
    order: ClassVar[float] = 100.0
    knobs: ClassVar[type | None] = None

    @classmethod
    def knobs_of(cls, receiver: Receiver) -> Any:
        """This run's values of the check's knobs (``FederationConfig.checks[alias]``)."""
        return receiver.fed.checks[cls.alias]

    @classmethod
    def build(cls, receiver: Receiver) -> "Check | None":
        """The check for this receiver's run, or None when its knobs turn it off."""
        return cls()

    def __call__(self, samples: list[TrainSample], update: Update) -> dict[str, float]:
        raise NotImplementedError

    def after_step(self, trainer) -> dict[str, float]:
        """After the optimizer step on these samples (``trainer``: the ``Trainer``); metrics."""
        return {}

    def state(self) -> dict | None:
        """What to save for resume (JSON), or None."""
        return None

    def restore(self, state: dict) -> None:
        """Continue from what ``state`` returned before a restart."""


_loaded: list[bool] = []


def load_all() -> None:
    """Import every module of this folder (once per process), so that each registers its checks."""
    if _loaded:
        return
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name not in NOT_CHECKS:
            importlib.import_module(f"{__package__}.{info.name}")
    _loaded.append(True)


def registered() -> list[tuple[str, type[Check]]]:
    """Every registered check (all modules of this folder imported), in ``order`` (then alias)."""
    load_all()
    return sorted(CHECKS.items(), key=lambda kv: (kv[1].order, kv[0]))


def check_knobs() -> dict[str, type]:
    """alias -> knobs dataclass of every registered check that has knobs, in the checks' order."""
    return {alias: cls.knobs for alias, cls in registered() if cls.knobs is not None}


def default_check_knobs() -> dict[str, Any]:
    """alias -> the default values of its knobs (``FederationConfig.checks`` when not given)."""
    return {alias: k() for alias, k in check_knobs().items()}


def checked_knobs(given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` (alias -> knobs) completed with the defaults of every other check with knobs;
    ValueError for an alias that is no check with knobs or a value of another class."""
    known = check_knobs()
    for alias, value in given.items():
        if alias not in known:
            raise ValueError(f"checks[{alias!r}]: no registered receiver check with knobs has that alias "
                             f"({', '.join(known)})")
        if not isinstance(value, known[alias]):
            raise ValueError(f"checks[{alias!r}]: must be a {known[alias].__name__}, not {type(value).__name__}")
    return {alias: given[alias] if alias in given else k() for alias, k in known.items()}


def build_checks(receiver: Receiver) -> list[Check]:
    """This receiver's checks that are on, in ``order`` (then alias)."""
    out = []
    for alias, cls in registered():
        check = cls.build(receiver)
        if check is not None:
            out.append(check)
    return out


def run_checks(checks: Sequence[Check], samples: list[TrainSample], update: Update) -> dict[str, float]:
    """Every check on ``samples``, in order; their metrics."""
    metrics: dict[str, float] = {}
    for check in checks:
        metrics.update(check(samples, update))
    return metrics


def after_step(checks: Sequence[Check], trainer) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for check in checks:
        metrics.update(check.after_step(trainer))
    return metrics


def checks_state(checks: Sequence[Check]) -> dict[str, dict]:
    """{alias: state} of the checks that have one (``participant.json``'s ``checks``)."""
    return {c.alias: s for c in checks if (s := c.state()) is not None}


def restore_checks(checks: Sequence[Check], states: dict[str, dict]) -> None:
    for c in checks:
        if states.get(c.alias) is not None:
            c.restore(states[c.alias])


def groups_of(samples: Sequence[TrainSample]) -> list[tuple[Any, int, list[TrainSample]]]:
    """The samples by the group they came from: (batch, group index, its samples in completion
    order), groups in the order of their first sample."""
    out: dict[tuple[int, int], tuple[Any, int, list[TrainSample]]] = {}
    for s in samples:
        key = (id(s.batch), s.group_index)
        if key not in out:
            out[key] = (s.batch, s.group_index, [])
        out[key][2].append(s)
    return list(out.values())
