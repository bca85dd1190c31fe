"""The round engine: schedules, admission, validation of replies, metrics and resume, with no
knowledge of Flower. Import from its modules: ``core`` (``Engine``), ``schedules``, ``boundary``,
``validation``, ``relay``, ``transport``, ``inprocess`` (``InProcessTransport``), ``progress``.
Transports: ``strategies.grid_transport.GridTransport`` (Flower) and ``InProcessTransport``
(tests, debugging). See ``docs/architecture.md``."""
