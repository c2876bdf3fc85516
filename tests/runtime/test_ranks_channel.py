"""The shared-memory channel rank 0 sends iterations through: every reader gets every message,
whole and in order (messages larger than a slot, the ring wrapping many times), and a writer a
whole ring ahead of a reader waits for it."""

from __future__ import annotations

import multiprocessing as mp
import time
import zlib

import pytest

from nanosched.runtime.ranks.channel import ChannelReader, ChannelWriter

HOLD_S = 0.3  # how long each reader holds message 0


def echo(handle, reader: int, out) -> None:
    """Read until None; report (reader, [(index, crc32 of the payload)], read times)."""
    r = ChannelReader(handle, reader)
    got, times = [], []
    while (msg := r.recv()) is not None:
        times.append(time.monotonic())
        got.append((msg[0], zlib.crc32(msg[1])))
        if msg[0] == 0:
            time.sleep(HOLD_S)  # hold the ring: the writer must wait for this reader
    r.close()
    out.put((reader, got, times))


def payloads() -> list[bytes]:
    sizes = [0, 1, 63, 64, 65, 200, 1000, 5] * 4  # a slot holds 64 bytes: up to 16 slots each
    return [bytes((i * 7 + j) % 251 for j in range(n)) for i, n in enumerate(sizes)]


def test_every_reader_gets_every_message_in_order():
    ctx = mp.get_context("spawn")
    writer = ChannelWriter(2, num_slots=3, slot_bytes=64)
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=echo, args=(writer.handle, i, out)) for i in range(2)]
    for p in procs:
        p.start()
    try:
        data = payloads()
        t0 = time.monotonic()
        writer.send((0, b"first"))
        for i, d in enumerate(data, start=1):
            writer.send((i, d))
        sent_at = time.monotonic()
        writer.send(None)
        results = sorted(out.get() for _ in procs)
    finally:
        for p in procs:
            p.join(10)
        writer.close()
    want = [(0, zlib.crc32(b"first"))] + [(i, zlib.crc32(d)) for i, d in enumerate(data, 1)]
    for reader, got, times in results:
        assert got == want, reader
        assert times[1] - times[0] >= 0.9 * HOLD_S  # each reader slept on message 0
    # three slots: the writer could not run more than a ring ahead of the sleeping readers
    assert sent_at - t0 >= 0.9 * HOLD_S


def test_a_writer_blocked_on_a_gone_reader_is_told_by_its_check():
    writer = ChannelWriter(1, num_slots=2, slot_bytes=16)
    calls = []

    def check() -> None:
        calls.append(1)
        raise RuntimeError("reader gone")

    writer.check = check
    try:
        writer.send(b"a")
        writer.send(b"b")  # the ring is full now: nobody reads
        with pytest.raises(RuntimeError, match="reader gone"):
            writer.send(b"c")
        assert calls == [1]
    finally:
        writer.close()
