"""Who takes part in each round: sampling, late joiners, rejoiners and retirement (server side).

The engine admits the nodes connected at the start (``Engine.admit``); from then on, at every round
boundary, :meth:`Membership.begin_round`:

1. **retires** a participant absent ``retire-after-rounds`` rounds in a row (asked and no usable reply,
   or no longer connected): it is no longer asked, nor is its node while that stays connected; it
   may come back with a new hello from a new node (or from the same one after it went away);
2. sends **hello** to every connected node not admitted yet (``join-timeout-s``), with the same
   proof of possession as at the start (``Engine._admit_one``): a **late joiner** (a participant not
   seen in this run) or a **rejoiner** (a participant seen before: retired, or restarted with a new
   node id while its old node is gone) is admitted for this round; a node claiming a participant
   whose node is still connected is refused (``duplicate_participant``) and asked again at the next
   boundary; a node refused for its key (unknown, mismatching, revoked, bad proof) is not asked again.
   A node that gives **no usable hello** (time-out, error, a bad reply) is refused (counted in
   ``fed/refused_at_boundary``) and not said hello again while it stays connected: it costs its own
   admission (one ``join-timeout-s`` at most) and no later round; when it goes away and connects
   again (a new process) it is asked again, with back-off: after its f-th silent hello not before
   2^(f-1) rounds have passed.
   An admitted node that **went away** (not connected at a boundary, or a phase failed because the
   transport reported the node itself gone: ``transport.NODE_GONE``) and is connected again is
   admitted anew the same way before it is asked anything: with SuperNode authentication Flower
   binds the node id to the SuperNode's key, so a SuperNode killed and restarted comes back with
   the *same* node id, as a new process that must prove its key again (a rejoiner);
3. **samples** the round's participants (``fraction-train``, ``min-train-participants``): the ones
   with the largest lag (fair share minus asks), ties in the round's committed draw
   (:mod:`ftis_fed.engine.sampling`, :mod:`ftis_fed.engine.draw`); the lags are saved in
   ``server_state.json``.

A rejoiner continues from its own saved state (``ftis_fed.participant_state``: its sequence number,
replay guard and last trained round survive the restart), so it is neither trained twice on a round
nor able to reuse a sequence number (the server's replay guard would refuse it anyway). Every event
is counted in the federation row (``fed/joined``, ``fed/rejoined``, ``fed/retired``, ``fed/sampled``,
...) and logged in one line per kind.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from logging import INFO, WARNING
from typing import Any, Hashable

from ftis_fed.engine.progress import name_list
from ftis_fed.engine.sampling import credit, sample_participants
from ftis_fed.engine.transport import NODE_GONE

Address = Hashable

#: refusals for the key itself: such a node is not asked again in this run
PERMANENT = frozenset({"unknown_participant", "key_mismatch", "revoked_key", "bad_proof"})


def _order(addr: Address) -> tuple[str, Any]:
    return (type(addr).__name__, addr)


class Roster(dict):
    """The admitted nodes: address -> hello info, with an index participant -> address, so that an
    admission looks up a name in O(1) instead of scanning every admitted node (O(N) per hello)."""

    def __init__(self, items: Mapping[Address, dict] | None = None):
        super().__init__()
        self.by_name: dict[str, Address] = {}
        for a, info in (items or {}).items():
            self[a] = info

    def __setitem__(self, addr: Address, info: dict) -> None:
        if addr in self:
            self.by_name.pop(self[addr]["participant"], None)
        super().__setitem__(addr, info)
        self.by_name[info["participant"]] = addr

    def __delitem__(self, addr: Address) -> None:
        self.by_name.pop(self[addr]["participant"], None)
        super().__delitem__(addr)

    _MISSING = object()

    def pop(self, addr: Address, default: Any = _MISSING) -> Any:
        if addr in self:
            self.by_name.pop(self[addr]["participant"], None)
            return super().pop(addr)
        if default is Roster._MISSING:
            raise KeyError(addr)
        return default

    def clear(self) -> None:
        self.by_name.clear()
        super().clear()

    def address_of(self, name: str) -> Address | None:
        """The admitted node of participant ``name`` (None: not admitted)."""
        return self.by_name.get(name)


class Membership:
    def __init__(self, engine):                          # engine.core.Engine (not imported: core imports this)
        self.engine = engine
        self.misses: dict[str, int] = {}                 # participant -> rounds absent in a row
        self.seen: set[str] = set()                      # participants admitted at some point of this run
        self.round_nodes: list[Address] = []             # this round's sample
        self.asked: set[Address] = set()
        self.failed: set[Address] = set()                # asked this round and dropped in a phase
        self.gone: set[Address] = set()                  # admitted but not connected at this round's boundary
        self.away: set[Address] = set()                  # admitted nodes that went away: hello again when back
        self.retired: dict[str, int] = {}                # participant -> round it was retired before
        self.retired_nodes: set[Address] = set()         # their nodes, not asked again while they stay connected
        self.lags: dict[str, float] = {}                 # participant -> fair share minus asks (sampling)
        self.silent: dict[Address, int] = {}             # node -> hellos it gave no usable answer to
        self.muted: set[Address] = set()                 # silent nodes still connected: not asked again
        self.not_before: dict[Address, int] = {}         # silent node reconnected: first round to ask it

    def start(self) -> None:
        """After the admission at the start."""
        self.seen = {i["participant"] for i in self.engine.nodes.values()}
        self.round_nodes = sorted(self.engine.nodes, key=_order)
        for a in self.engine.silent_at_start:            # no usable hello at the start: costs no round
            self.silent[a] = 1
            self.muted.add(a)

    # ------------------------------------------------------------------ per round
    def begin_round(self, rnd: int, boundary: bool, draw: bytes = b"") -> dict[str, float]:
        """Retire, admit newcomers (when ``boundary``: not the first round of this process), sample
        with the round's ``draw``. Returns the federation row's membership metrics."""
        e, fed = self.engine, self.engine.fed
        events: Counter = Counter()
        self.gone = set()
        if boundary:
            self._boundary(rnd, events)
        names = {e.name(a): a for a in e.nodes if a not in self.gone}       # sampled from the connected ones
        chosen = sample_participants(list(names), fed.fraction_train, fed.min_train_participants, self.lags, draw)
        if len(chosen) < len(names):                     # sampling: the lags move (all asked: nothing to track)
            self.lags = credit(self.lags, list(names), chosen)
        self.round_nodes = sorted((names[n] for n in chosen), key=_order)
        self.asked, self.failed = set(self.round_nodes), set()
        if len(self.round_nodes) < len(names):
            e.log(INFO, "round %d: %d of %d participants sampled (fraction-train=%g, min-train-participants=%d)",
                  rnd, len(self.round_nodes), len(names), fed.fraction_train, fed.min_train_participants)
        return {"fed/sampled": float(len(self.round_nodes)), "fed/joined": float(events["joined"]),
                "fed/rejoined": float(events["rejoined"]), "fed/retired": float(events["retired"]),
                "fed/refused_at_boundary": float(events["refused"])}

    def record(self, dropped) -> None:
        """Addresses dropped from a phase of this round (``Engine.ask``): {address: Failure}. A node
        the transport reports gone (``NODE_GONE``) is said hello again when it is back."""
        self.failed |= set(dropped)
        self.away |= {a for a, why in dropped.items() if getattr(why, "reason", "") in NODE_GONE}

    def end_round(self) -> None:
        """A round absent (not connected, or asked and no usable reply) adds one to a participant's
        count; a round it answered sets it back to 0."""
        for addr in self.engine.nodes:
            name = self.engine.name(addr)
            if addr in self.gone or addr in self.failed:
                self.misses[name] = self.misses.get(name, 0) + 1
            elif addr in self.asked:
                self.misses[name] = 0

    # ------------------------------------------------------------------ the boundary
    def _boundary(self, rnd: int, events: Counter) -> None:
        e, fed = self.engine, self.engine.fed
        try:
            connected = set(e.transport.addresses())
        except Exception as err:                         # noqa: BLE001 - the round goes on with who it has
            e.log(WARNING, "round %d: listing connected nodes failed: %s", rnd, err)
            return
        due = [a for a in e.nodes if fed.retire_after_rounds > 0
               and self.misses.get(e.name(a), 0) >= fed.retire_after_rounds]
        self.gone = {a for a in e.nodes if a not in connected}      # not asked this round; absent
        self.away = (self.away | self.gone) & set(e.nodes)
        back = [a for a in self.away if a in connected]  # went away, connected again: a new process
        for addr in back:                                # admitted anew (hello), like any new node
            e.nodes.pop(addr)
            self.away.discard(addr)
        self.retired_nodes &= connected                  # a retired node that went away may come back later
        for a in self.muted - connected:                 # a silent node went away: back-off when it is back
            self.not_before[a] = rnd + 2 ** (self.silent[a] - 1)
        self.muted &= connected
        new = sorted((a for a in connected if a not in e.nodes and a not in self.retired_nodes
                      and e.refused.get(a) not in PERMANENT and a not in self.muted
                      and self.not_before.get(a, 0) <= rnd), key=_order)
        if new:                                          # before retiring: a participant restarted on a new
            self._hello(rnd, new, connected, events, set(due))   # node is a rejoiner, not retired and rejoined
        names = []
        for addr in due:
            if addr not in e.nodes or self.misses.get(e.name(addr), 0) < fed.retire_after_rounds:
                continue                                 # came back in this boundary's hello
            name = e.nodes.pop(addr)["participant"]
            self.retired[name] = rnd
            self.retired_nodes.add(addr)
            self.misses.pop(name, None)
            self.gone.discard(addr)
            events["retired"] += 1
            names.append(name)
        if names:
            e.log(INFO, "round %d: retired %d (absent %d rounds in a row): %s", rnd, len(names),
                  fed.retire_after_rounds, name_list(sorted(names)))
        if events["retired"] or new:
            e.roster_changed()

    def _hello(self, rnd: int, addrs: list[Address], connected: set, events: Counter, due: set = frozenset()) -> None:
        """``due``: admitted nodes absent long enough to be retired: a new node of the same participant
        replaces one (a restart) even while it is still connected, instead of being refused as a duplicate."""
        e, fed = self.engine, self.engine.fed
        challenges, requests = e.hello_requests(addrs)
        e.refresh_node_names()                           # who runs the new nodes, for refusals' lines
        replies, dropped = e.io.send("hello", requests, fed.join_timeout_s)
        for a, why in dropped.items():                   # refused; not asked again while connected
            e._refuse(a, why.reason, f"round {rnd}: no usable hello ({why.detail}); not asked again while it "
                                     "stays connected")
            self.silent[a] = self.silent.get(a, 0) + 1
            self.muted.add(a)
            events["refused"] += 1
        joined, rejoined = [], []
        for a in sorted(replies, key=_order):
            info = replies[a].info
            name = info.get("participant")
            old = e.nodes.address_of(name) if isinstance(name, str) else None
            if old is not None and old in connected and old not in due:
                e._refuse(a, "duplicate_participant", f"participant {name!r} is still connected at node {old}; "
                                                      "asked again at the next round boundary")
                events["refused"] += 1
                continue
            kept = e.nodes.pop(old) if old is not None else None      # a restart: its old node is gone (or due)
            e._admit_one(a, info, challenges[a])
            if a not in e.nodes:
                if kept is not None:
                    e.nodes[old] = kept
                events["refused"] += 1
                continue
            if old is not None and old in connected:     # the replaced node, still connected: not asked again
                self.retired_nodes.add(old)
                self.gone.discard(old)
            e.refused.pop(a, None)
            self.silent.pop(a, None)
            self.not_before.pop(a, None)
            self.misses[name] = 0
            self.retired.pop(name, None)
            trained = info.get("completed_round")
            if name in self.seen:
                events["rejoined"] += 1
                rejoined.append(f"{name} (node {a}, last trained round {trained})")
            else:
                events["joined"] += 1
                joined.append(f"{name} (node {a})")
            self.seen.add(name)
        if joined:
            e.log(INFO, "round %d: %d late joiner(s) admitted: %s", rnd, len(joined), name_list(joined))
        if rejoined:
            e.log(INFO, "round %d: %d participant(s) rejoined: %s", rnd, len(rejoined), name_list(rejoined))
