"""CUDA end streams (pipeline.distributed.comm._EndStreams), with fake streams and events so CPU CI runs them.

The defect they fix: end events and the expert counts' host copy went to 4 streams in turn, so with more ops in
flight than streams, the counts' copy queued behind an unrelated receive posted early (which may wait for this
rank's next output): the host's read of the counts then waited for that receive. Here every in-flight op has a
stream of its own, a stream is reused only once its op completed, and what the op reads stays referenced until
then."""
from __future__ import annotations

import weakref

from pipeline.distributed.comm import _EndStreams


class _Event:
    def __init__(self):
        self.complete = False

    def query(self) -> bool:
        return self.complete


class _Buffer:  # stands in for a tensor: weakly referenceable
    pass


def test_no_stream_is_shared_by_two_ops_in_flight():
    made = []
    streams = _EndStreams(lambda: made.append(object()) or made[-1])
    events = []
    held = []
    for _ in range(9):  # more ops in flight than the old round-robin's 4 streams
        s = streams.acquire()
        assert all(s is not other for other in held), "a stream handed out twice while its op is in flight"
        held.append(s)
        events.append(_Event())
        streams.release(s, events[-1])
    assert streams.created == 9 and streams.in_flight == 9

    events[4].complete = True  # one op ends: its stream, and only it, is free again
    again = streams.acquire()
    assert again is held[4] and streams.created == 9 and streams.in_flight == 8


def test_an_ops_tensors_live_until_its_end_event_completed():
    streams = _EndStreams(object)
    buf = _Buffer()
    ref = weakref.ref(buf)
    ev = _Event()
    streams.release(streams.acquire(), ev, (buf,))
    del buf
    streams.reap()
    assert ref() is not None, "the tensor an in-flight op reads was let go before the op completed"
    ev.complete = True
    streams.reap()
    assert ref() is None and streams.in_flight == 0
