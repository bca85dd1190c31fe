"""The receiver room: what a participant does with peers' frames before it trains on them.

``frames.py`` receives (signature, bounds, task truth, re-scoring: the batches); ``checks.py`` is the
registry of the checks on the update's samples, one file per check (``reverified.py``, ``phrase.py``,
``surprisal.py``, ``source_adapt.py``). ``Participant.learn`` reads: receive -> checks -> train.
"""
