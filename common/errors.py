"""Failures, each meaning one thing, raised by the reward engine and the wire helpers alike; the server maps them to
gRPC status codes in one place (server/status.py)."""


class RewardError(Exception):
    """Base of every error the engine reports about one sample or request."""


class InvalidInput(RewardError, ValueError):
    """The caller sent something malformed; the message names the field (a ValueError too, for plain callers)."""


class UnknownReward(RewardError):
    """No pipeline, rule or tool of that name."""


class QueueFull(RewardError):
    """The batcher's queue is at max_queue_size; retry later or elsewhere."""


class DeadlineExceeded(RewardError):
    """The sample's deadline passed before compute, or a source call timed out."""


class SourceFailed(RewardError):
    """A reward source raised; the sample gets no score."""


class Unavailable(RewardError):
    """The engine is shutting down or a remote dependency cannot be reached."""


class Cancelled(RewardError):
    """The caller cancelled the sample, or a retry of it on another stream superseded it."""


class ResourceExhausted(RewardError):
    """A sample went over a budget (memory while scoring it) or a size limit the server enforces."""


class DependencyFailed(RewardError):
    """A dependency the sample needs (a judge endpoint) is failing; another reward server would fail it
    the same way, so clients must not re-route it (UNAVAILABLE means only "try another server")."""


def describe_exception(exc: BaseException) -> str:
    """'ValueError: message' (message shortened) for error texts that name what a function raised."""
    text = str(exc)
    if len(text) > 500:
        text = text[:500] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
