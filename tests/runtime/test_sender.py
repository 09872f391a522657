"""The sender's lanes: jobs of one kind queued together travel in one frame, in order, and every job
gets its own answer; a job of another kind is never overtaken."""

from __future__ import annotations

import threading
import time

from kvlc.runtime.pump import Combine, Sender


class _Ticket:
    def __init__(self, reply=None, error=None):
        self.reply, self.error, self.rest = reply, error, b""


class _Client:
    """A connection whose first frame blocks until released (so later jobs queue behind it); each
    frame is recorded (with whether its writer could wait) and answered with itself."""

    def __init__(self, fail: bytes = b""):
        self.frames: list[bytes] = []
        self.blocking: list[bool] = []
        self.release = threading.Event()
        self.fail = fail

    def post(self, frame: bytes, block: bool = True):
        if not self.frames:
            if not block:
                return None  # the first frame's writer is still writing
            self.release.wait(5)
        self.frames.append(frame)
        self.blocking.append(block)
        return _Ticket(error=ConnectionError("the connection broke")) if frame == self.fail else _Ticket(frame)

    def wait(self, ticket):
        if ticket.error is not None:
            raise ticket.error
        return ticket.reply


WORDS = Combine(3, lambda w: w.encode(), lambda ws: "+".join(ws).encode(),
                lambda reply, n: reply.decode().split("+") if reply.count(b"+") == n - 1 else ["?"] * n)


def _run(jobs, fail: bytes = b"") -> tuple[_Client, list]:
    stop = threading.Event()
    sender = Sender(lambda b: b, stop, "test-sender")
    client = _Client(fail)
    for payload, context, combine in jobs:
        sender.send(client, lambda p=payload: p, context, combine)
        if context == "first":
            time.sleep(0.2)  # the lane thread takes it alone and blocks in request()
    client.release.set()
    deadline = time.monotonic() + 5
    while len(sender.replies) < len(jobs) and time.monotonic() < deadline:
        time.sleep(0.01)
    sender.close()
    stop.set()
    return client, list(sender.replies)


def test_queued_jobs_of_one_kind_share_a_frame_in_order():
    jobs = [("a", "first", WORDS), ("b", "b", WORDS), ("c", "c", WORDS), ("d", "d", WORDS), ("e", "e", WORDS),
            (b"cancel", "cancel", None), ("f", "f", WORDS), ("g", "g", WORDS)]
    client, replies = _run(jobs)
    # at most 3 per frame (Combine.most); the cancel ends the group and goes before f and g
    assert client.frames == [b"a", b"b+c+d", b"e", b"cancel", b"f+g"]
    # a job alone is framed by Combine.one and answered as it is; a group's answer is split per job
    assert replies == [("first", b"a"), ("b", "b"), ("c", "c"), ("d", "d"), ("e", b"e"), ("cancel", b"cancel"),
                       ("f", "f"), ("g", "g")]


def test_a_frame_that_fails_fails_every_job_in_it():
    jobs = [("a", "first", WORDS), ("b", "b", WORDS), ("c", "c", WORDS), (b"d", "d", None)]
    client, replies = _run(jobs, fail=b"b+c")
    assert client.frames == [b"a", b"b+c", b"d"]
    assert [c for c, _ in replies] == ["first", "b", "c", "d"]
    assert isinstance(replies[1][1], ConnectionError) and isinstance(replies[2][1], ConnectionError)
    assert replies[3][1] == b"d"


def test_a_frame_sent_now_never_passes_one_queued_before_it():
    """send_now writes on the caller's thread only when nothing of its connection waits unwritten; else it
    queues behind, and the lane keeps the order."""
    stop = threading.Event()
    sender = Sender(lambda b: b, stop, "test-sender")
    client = _Client()
    sender.send(client, lambda: b"queued", "queued")
    time.sleep(0.2)  # the lane takes it and blocks writing it
    sender.send_now(client, lambda: b"now", "now")
    client.release.set()
    deadline = time.monotonic() + 5
    while len(sender.replies) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    sender.send_now(client, lambda: b"idle", "idle")  # the lane has nothing unwritten: written here
    while len(sender.replies) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    sender.close()
    stop.set()
    assert client.frames == [b"queued", b"now", b"idle"]
    assert client.blocking == [True, True, False]
    assert list(sender.replies) == [("queued", b"queued"), ("now", b"now"), ("idle", b"idle")]
