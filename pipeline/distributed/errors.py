"""Failures of the distributed runtime as one-line, user-facing errors, and the sleeping poll every bounded host
wait uses."""
from __future__ import annotations



class PipelineError(RuntimeError):
    """A distributed failure with a one-line, user-facing message (rank, op, peer, cause)."""

    hang_related = True  # Flight Recorder's dumps may say more (pipeline.launch.entry reports them)


def describe(err: BaseException) -> str:
    text = str(err)
    if "Connection closed by peer" in text or "Connection reset" in text or "Broken pipe" in text:
        return "the peer closed its connection (it probably died)"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return "the backend timed out"
    return text.splitlines()[0][:200] if text else type(err).__name__
