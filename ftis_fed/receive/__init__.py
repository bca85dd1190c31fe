"""The receiver room: what a participant does with peers' frames before it trains on them.

``frames.py`` receives (signature, bounds, task truth, re-scoring: the batches); ``checks.py`` is the
registry of the checks on the update's samples, one file per check with its knobs' dataclass
(``reverified.py``, ``phrase.py``, ``surprisal.py``, ``source_adapt.py``). Torch-free at import: the run
config's parser reads the checks' knobs from here. ``Participant.learn`` reads: receive -> checks -> train.
"""
