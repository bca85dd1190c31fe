"""The round engine: schedules, admission, validation of replies, metrics and resume, with no
knowledge of Flower. Transports: ``strategies.grid_transport.GridTransport`` (Flower) and
:class:`InProcessTransport` (tests, debugging). See ``docs/architecture.md``."""

from .core import AdmissionError, Engine, RoundStats, TooFewSupernodes, too_few_supernodes_message
from .inprocess import InProcessTransport
from .relay import VerifiedFrame, is_eval_round, select_for_receiver, texts_needed
from .schedules import SCHEDULES, get_schedule, register_schedule
from .transport import ACTIONS, Delivered, Failure, Transport
from .validation import BadReply, Reply, ReplyLimits, check_reply, max_frame_bytes_for

__all__ = ["ACTIONS", "AdmissionError", "BadReply", "Delivered", "Engine", "Failure", "InProcessTransport", "Reply",
           "ReplyLimits", "RoundStats", "SCHEDULES", "TooFewSupernodes", "Transport", "VerifiedFrame", "check_reply",
           "get_schedule", "is_eval_round", "max_frame_bytes_for", "register_schedule", "select_for_receiver",
           "texts_needed", "too_few_supernodes_message"]
