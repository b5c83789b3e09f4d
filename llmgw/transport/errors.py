"""How an exchange with an engine fails, as the gateway must tell the cases apart: no
connection (``ConnectError``), a request the engine never took (``Undelivered``), silence
(``UpstreamTimeout``), or anything else after the request was written (``UpstreamError``).
"""

from __future__ import annotations


class UpstreamError(Exception):
    """The exchange with the engine failed. ``answered`` is False when the engine sent no
    status line; the request may still have reached it, and it may have been working on
    it (only ``ConnectError`` and ``Undelivered`` say that it did not)."""

    def __init__(self, message: str, *, answered: bool):
        super().__init__(message)
        self.answered = answered


class ConnectError(UpstreamError):
    """No connection could be made (refused, unreachable, or not within the limit)."""

    def __init__(self, message: str, *, timed_out: bool = False):
        super().__init__(message, answered=False)
        self.timed_out = timed_out


class Undelivered(UpstreamError):
    """The connection broke, with no byte of an answer, before the engine's end had taken
    the whole request: its TCP acknowledged less than was sent. The engine had closed the
    connection before the request reached it (a kept-alive one it let go as it was
    picked), or went away before it had all of it; either way no engine read the request
    whole, so it may be sent again (see ``Pool.post``)."""

    def __init__(self) -> None:
        super().__init__("the engine had closed the connection before the request "
                         "reached it", answered=False)


class UpstreamTimeout(UpstreamError):
    """The engine sent nothing for too long: ``phase`` is "first_byte" or "idle"."""

    def __init__(self, phase: str, answered: bool):
        super().__init__(f"no data ({phase})", answered=answered)
        self.phase = phase


