"""The `logs` fixture: the records of the MaxText loggers during a test, with helpers to read
the messages (the trainer's "MaxText" logger does not propagate to the root logger)."""

from __future__ import annotations

import logging

import pytest


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def messages(self, min_level: int = logging.INFO) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= min_level]

    def resumes(self) -> list[str]:
        return [m for m in self.messages() if m.startswith("resuming run")]

    def clear(self):
        self.records.clear()


@pytest.fixture
def logs():
    """The MaxText loggers' records (the trainer's "MaxText" logger does not propagate)."""
    logger = logging.getLogger("MaxText")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)
