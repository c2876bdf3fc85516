"""Test helpers for the runtime: a device that reorders streams the way a GPU may."""

import random


class ShuffledDevice:
    """Queues each stream's launches; `join()` runs them in a random interleaving that
    respects only stream order and event waits. A result that differs from a serial run
    means a missing event."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.queues = {}
        self.done_events = set()
        self.num_events = 0

    def stream(self, name):
        self.queues.setdefault(name, [])
        return name

    def launch(self, stream, fn):
        self.queues[stream].append(("run", fn))

    def record(self, stream):
        self.num_events += 1
        ev = self.num_events
        self.queues[stream].append(("record", ev))
        return ev

    def wait(self, stream, event):
        self.queues[stream].append(("wait", event))

    def join(self):
        while any(self.queues.values()):
            runnable = [s for s, q in self.queues.items()
                        if q and (q[0][0] != "wait" or q[0][1] in self.done_events)]
            assert runnable, "deadlock: every stream waits for an event never recorded"
            kind, item = self.queues[self.rng.choice(runnable)].pop(0)
            if kind == "run":
                item()
            elif kind == "record":
                self.done_events.add(item)
