"""Reward functions given by import path, called the way TRL's ``GRPOTrainer`` calls them.

A spec is ``module:function`` (a module on ``sys.path``, e.g. ``trl.rewards:accuracy_reward``) or
``path/to/file.py:function`` (a file, imported by path under a name derived from its content, so two
files both called ``rewards.py`` never collide). Several specs are comma-separated, with optional
weights (TRL's ``reward_weights``; default 1.0 each).

Semantics, as in TRL 1.x ``GRPOTrainer._calculate_rewards`` / ``_generate_and_score_completions``:

- each function is called with keywords ``prompts``, ``completions``, ``completion_ids`` (one entry
  per completion), every other data set column as a list (one value per completion), and
  ``trainer_state`` (None here: there is no Trainer), ``log_extra`` / ``log_metric`` (accepted and
  ignored);
- it returns one value per completion: a number, or None ("no reward for this sample"), which
  becomes NaN; NaN itself means the same; a list of another length is an error, as in TRL;
- an ``async def`` function is awaited (TRL 1.16 runs them on an event loop; here one call at a
  time, each to its end);
- ``task-reward-kwargs`` gives a factory's keyword arguments (a TOML table per function name, e.g.
  ``get_soft_overlong_punishment = {max_completion_len = 24, soft_punish_cache = 8}``): the spec
  names the factory, its result is the reward function (named by its ``__name__``, as TRL names
  it); the arguments are part of the digest;
- any error of a function (it raises, returns a wrong length or a non-number) is a
  :class:`RewardFunctionError` whose message starts with ``REWARD_ERROR`` and names the function:
  the engine stops the run on it by default (``task-reward-errors``);
- the reward of a completion is the weighted sum over the functions that scored it
  (``nansum(w_k * r_k)``); a completion no function scored is *unscorable*: NaN, left out of its
  group's mean and standard deviation, advantage 0 (``learn.objective.compute_advantages``).

``digest()`` covers what the rewards depend on that a run config does not say: the source file of
each function's module (sha256 of its bytes) and, for modules of an installed distribution, its
version; a receiver with another copy refuses the sender (``tasks.user``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
import sys
import tomllib
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any


#: The start of every reward function error's message: what the engine looks for in a failed
#: participant's reply (``engine.core``), whatever transport carried it.
REWARD_ERROR = "ftis-fed reward function error:"


class RewardFunctionError(ValueError):
    """A reward function raised or returned something TRL would refuse; ``str()`` starts with
    ``REWARD_ERROR`` and is one line."""

    def __init__(self, message: str):
        super().__init__(f"{REWARD_ERROR} " + " ".join(str(message).split()))


def parse_specs(value: str, key: str = "task-rewards") -> tuple[str, ...]:
    """``"a:f, b.py:g"`` -> ``("a:f", "b.py:g")``; a ValueError naming ``key`` for a malformed entry."""
    specs = tuple(s.strip() for s in str(value).split(",") if s.strip())
    for s in specs:
        mod, sep, fn = s.rpartition(":")
        if not sep or not mod or not fn.isidentifier():
            raise ValueError(f"{key}={value!r}: {s!r} is not 'module:function' or 'path/to/file.py:function'")
    return specs


def parse_weights(value: str, n: int, key: str = "task-reward-weights") -> tuple[float, ...]:
    """TRL's ``reward_weights``: '' = 1.0 each, else one finite number per function."""
    if not str(value).strip():
        return (1.0,) * n
    try:
        weights = tuple(float(w) for w in str(value).split(","))
    except ValueError:
        raise ValueError(f"{key}={value!r}: must be comma-separated numbers") from None
    if len(weights) != n:
        raise ValueError(f"{key}={value!r}: {len(weights)} weights for {n} reward functions (task-rewards)")
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"{key}={value!r}: weights must be finite")
    return weights


def parse_kwargs(value: str, names: Sequence[str], key: str = "task-reward-kwargs") -> dict[str, dict]:
    """``'f = {a = 1}'`` -> ``{"f": {"a": 1}}``: one TOML table of keyword arguments per factory, by
    the function name its spec gives; ValueError naming ``key`` for bad TOML or an unknown name."""
    if not str(value).strip():
        return {}
    try:
        table = tomllib.loads(str(value))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{key}={value!r}: not a TOML table of tables (e.g. 'factory = {{arg = 1}}'): {e}") from None
    for name, kwargs in table.items():
        if name not in names:
            raise ValueError(f"{key}: {name!r} is not a function of task-rewards ({', '.join(names)})")
        if not isinstance(kwargs, dict):
            raise ValueError(f"{key}: {name} = {kwargs!r} must be a table of keyword arguments ({{arg = value}})")
    return table


def is_file_spec(spec: str) -> bool:
    return spec.rpartition(":")[0].endswith(".py")


def absolute_spec(spec: str) -> str:
    """A file spec with its path made absolute against this process's directory (module specs unchanged)."""
    if not is_file_spec(spec):
        return spec
    path, _, fn = spec.rpartition(":")
    return f"{Path(path).expanduser().resolve()}:{fn}"


@dataclass(frozen=True)
class RewardFunc:
    """One loaded function: its spec, callable, weight, and what its result depends on."""

    spec: str
    fn: Callable[..., Any]
    weight: float
    source_sha256: str
    version: str
    kwargs: tuple[tuple[str, Any], ...] = ()       # a factory's keyword arguments (task-reward-kwargs)

    @property
    def name(self) -> str:
        """TRL's name for it (``reward_func.__name__``): its metrics are ``rewards/<name>/mean|std``."""
        return str(getattr(self.fn, "__name__", self.spec.rpartition(":")[2]))

    def identity(self) -> dict:
        """What the task digest records of it (a file's path is node-local: only its name is kept)."""
        where = Path(self.spec.rpartition(":")[0]).name if is_file_spec(self.spec) else self.spec.rpartition(":")[0]
        out = {"module": where, "function": self.name, "weight": self.weight, "source_sha256": self.source_sha256,
               "version": self.version}
        return {**out, "kwargs": dict(self.kwargs)} if self.kwargs else out


def _file_module(path: Path, key: str) -> Any:
    if not path.is_file():
        raise ValueError(f"{key}: reward module file {str(path)!r} does not exist")
    data = path.read_bytes()
    name = f"ftis_fed_user_rewards_{hashlib.sha256(data).hexdigest()[:16]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module                  # dataclasses / pickling inside the module look it up
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(f"{key}: importing {str(path)!r} failed: {type(e).__name__}: {e}") from None
    return module


@lru_cache(maxsize=1)
def _distributions() -> Mapping[str, list[str]]:
    """importlib.metadata.packages_distributions(), read once per process: it walks every installed
    distribution's files (~0.1-0.2 s of CPU a call; a test run made 49 calls). A distribution installed
    later in the process is not seen: its module's version comes from ``__version__`` then."""
    return importlib.metadata.packages_distributions()


def _module_version(module: Any) -> str:
    top = module.__name__.partition(".")[0]
    dists = _distributions().get(top, [])
    for d in dists:
        try:
            return f"{d}=={importlib.metadata.version(d)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return str(getattr(sys.modules.get(top), "__version__", ""))


def _source_sha256(module: Any) -> str:
    try:
        src = inspect.getsourcefile(module)
    except TypeError:                           # built-in module: no file
        src = None
    return hashlib.sha256(Path(src).read_bytes()).hexdigest() if src and Path(src).is_file() else ""


def file_stamp(path: str | Path) -> tuple[int, int]:
    """(mtime ns, size) of a file, (0, 0) if absent: part of a cache key, so an edited file reloads."""
    try:
        st = Path(path).expanduser().stat()
    except OSError:
        return (0, 0)
    return (st.st_mtime_ns, st.st_size)


def load_reward_func(spec: str, weight: float = 1.0, key: str = "task-rewards",
                     kwargs: Mapping[str, Any] | None = None) -> RewardFunc:
    """The function named by ``spec`` (see module docstring); with ``kwargs`` the spec names a
    factory and the function is ``factory(**kwargs)``. ValueError naming ``key`` otherwise.
    Cached per process while a file spec's file is unchanged."""
    stamp = file_stamp(spec.rpartition(":")[0]) if is_file_spec(spec) else (0, 0)
    frozen = tuple(sorted((kwargs or {}).items()))
    try:
        hash(frozen)
    except TypeError:                               # a list or table value: cache by its JSON text
        return _load_reward_func.__wrapped__(spec, float(weight), key, stamp, frozen)
    return _load_reward_func(spec, float(weight), key, stamp, frozen)


@lru_cache(maxsize=64)
def _load_reward_func(spec: str, weight: float, key: str, stamp: tuple[int, int],
                      kwargs: tuple[tuple[str, Any], ...] = ()) -> RewardFunc:
    where, _, fn_name = spec.rpartition(":")
    if is_file_spec(spec):
        module = _file_module(Path(where).expanduser(), key)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ValueError(f"{key}: cannot import module {where!r} ({e}); give a module on sys.path or a "
                             "file path 'path/to/file.py:function'") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{key}: {where!r} has no function {fn_name!r}")
    if kwargs:
        try:
            fn = fn(**dict(kwargs))
        except Exception as e:                      # noqa: BLE001 - the factory's own error, named
            raise ValueError(f"task-reward-kwargs: {fn_name}(**{dict(kwargs)!r}) raised {type(e).__name__}: {e}") \
                from None
        if not callable(fn):
            raise ValueError(f"task-reward-kwargs: {fn_name}(...) returned {type(fn).__name__}, not a reward "
                             "function (give arguments only to a factory)")
    return RewardFunc(spec, fn, float(weight), _source_sha256(module), _module_version(module), tuple(kwargs))


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _await(awaitable: Any) -> Any:
    """The result of an ``async def`` reward function's call: run to its end on a fresh event loop
    (on a helper thread when this thread already runs one)."""
    async def wait() -> Any:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, wait()).result()


def call_reward(f: RewardFunc, prompts: Sequence, completions: Sequence, completion_ids: Sequence,
                columns: Mapping[str, Sequence]) -> list[float]:
    """``f``'s rewards of ``len(completions)`` completions, None -> NaN (TRL's call and checks);
    every failure is a :class:`RewardFunctionError` naming the function."""
    try:
        out = f.fn(prompts=list(prompts), completions=list(completions), completion_ids=list(completion_ids),
                   trainer_state=None, log_extra=_noop, log_metric=_noop, **{k: list(v) for k, v in columns.items()})
        if inspect.isawaitable(out):
            out = _await(out)
    except Exception as e:                          # noqa: BLE001 - the user's function: named, one line
        frames = traceback.extract_tb(e.__traceback__)
        at = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if len(frames) > 1 else ""
        raise RewardFunctionError(f"reward function {f.name!r} ({f.spec}) raised {type(e).__name__}{at}: {e}") from e
    try:
        out = list(out)
    except TypeError:
        raise RewardFunctionError(f"reward function {f.name!r} ({f.spec}) returned {type(out).__name__}, "
                                  "not a list") from None
    if len(out) != len(completions):
        raise RewardFunctionError(f"reward function {f.name!r} ({f.spec}) returned {len(out)} rewards, but "
                                  f"{len(completions)} were expected (one per completion)")
    values = []
    for v in out:
        if v is None:
            values.append(math.nan)
            continue
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise RewardFunctionError(f"reward function {f.name!r} ({f.spec}) returned {v!r}: a number or None "
                                      "expected") from None
        if math.isinf(x):
            raise RewardFunctionError(f"reward function {f.name!r} ({f.spec}) returned {x}: rewards must be "
                                      "finite (or None)")
        values.append(x)
    return values


def combine(per_func: Sequence[Sequence[float]], weights: Sequence[float]) -> list[float]:
    """TRL's ``nansum(w_k * r_k)`` over the functions, NaN where every function gave None."""
    out = []
    for rs in zip(*per_func):
        scored = [w * r for w, r in zip(weights, rs) if not math.isnan(r)]
        out.append(math.fsum(scored) if scored else math.nan)
    return out


@dataclass(frozen=True)
class RewardFuncs:
    """The run's reward functions (``task-rewards`` with ``task-reward-weights``)."""

    funcs: tuple[RewardFunc, ...]

    @classmethod
    def from_config(cls, specs: str, weights: str = "", kwargs: str = "") -> "RewardFuncs":
        names = parse_specs(specs)
        if not names:
            raise ValueError("task-rewards='': task-source=user needs at least one reward function "
                             "('module:function' or 'path/to/file.py:function')")
        ws = parse_weights(weights, len(names))
        args = parse_kwargs(kwargs, [s.rpartition(":")[2] for s in names])
        return cls(tuple(load_reward_func(s, w, kwargs=args.get(s.rpartition(":")[2])) for s, w in zip(names, ws)))

    @property
    def names(self) -> tuple[str, ...]:
        """Each function's metric name (TRL's ``__name__``; a repeated name gets ``_2``, ``_3``, ...)."""
        out: list[str] = []
        for f in self.funcs:
            n, k = f.name, 2
            while n in out:
                n, k = f"{f.name}_{k}", k + 1
            out.append(n)
        return tuple(out)

    def per_function(self, prompts: Sequence, completions: Sequence, completion_ids: Sequence,
                     columns: Mapping[str, Sequence]) -> list[list[float]]:
        """Each function's own (unweighted) rewards, NaN for None: one list per function."""
        return [call_reward(f, prompts, completions, completion_ids, columns) for f in self.funcs]

    def rewards(self, prompts: Sequence, completions: Sequence, completion_ids: Sequence,
                columns: Mapping[str, Sequence]) -> list[float]:
        """One combined reward per completion (NaN: unscorable)."""
        per = self.per_function(prompts, completions, completion_ids, columns)
        return combine(per, [f.weight for f in self.funcs])

    def identity(self) -> list[dict]:
        return [f.identity() for f in self.funcs]

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()
