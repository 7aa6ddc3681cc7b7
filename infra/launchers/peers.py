"""Which peer a surviving rank lost: read from what gloo, NCCL, the c10d store and torchrun print.

When one node of a job dies, the others fail too, and torchrun's failure summary on a survivor
names the survivor's own rank as the "root cause" (exit code 1). The peer that died is only in
the error lines, in a different form for each transport:

    gloo      ... pair.cc:537] Read error [10.0.0.2]:56041: Connection reset by peer ...
    gloo      ... pair.cc:553] Connection closed by peer [10.0.0.2]:45735 ...
    NCCL      NET/Socket : socketProgress: Connection closed by remote peer node-3<45122>
    NCCL      NET/IB : Got completion from peer 10.0.0.2<39874> with error 12, opcode ...
    c10d      [c10d] recvValueWithTimeout failed on SocketImpl(fd=3, addr=[...]:35704,
              remote=[::ffff:10.0.0.1]:29500): Failed to recv, got 0 bytes ...
    torchrun  RendezvousConnectionError: The connection to the C10d store has failed ...

`LostPeer` remembers the first peer a line names and whether the rendezvous store (on the first
node: the rendezvous endpoint, `[launch] ... rendezvous HOST:PORT` in the job's own banner) went
away; `describe()` is the phrase FailureFacts puts in the cause.
"""

from __future__ import annotations

import re

_PEER = [
    re.compile(r"Connection (?:closed|reset) by peer \[([^\]]+)\]:(\d+)"),
    re.compile(r"(?:Read|Write) error \[([^\]]+)\]:(\d+): Connection (?:reset|closed) by peer"),
    re.compile(r"Connection closed by remote peer ([\w.:\-]+)<(\d+)>"),
    re.compile(r"Got completion from peer ([\w.:\-]+)<(\d+)> with (?:error|status)"),
]
_STORE = re.compile(r"\[c10d\].*remote=\[(?:::ffff:)?([^\]]+)\]:(\d+)\)?: (?:Failed to recv|Broken pipe|Connection)")
_STORE_GONE = ("RendezvousConnectionError", "The connection to the C10d store has failed")
_BANNER = re.compile(r"^\[launch\] .*rendezvous ([\w.\-:]+):(\d+)")


class LostPeer:
    """Fed every output line of a launch; names the peer or the store a survivor lost."""

    def __init__(self, endpoint: str | None = None) -> None:
        self.endpoint = endpoint  # "host:port" of the rendezvous, when the launcher knows it
        self.peer: str | None = None  # "10.0.0.2:45735": the first peer a transport error names
        self.store: str | None = None  # "10.0.0.1:29500": the c10d store a survivor lost
        self.store_lost = False

    def feed(self, line: str) -> None:
        if self.endpoint is None and (m := _BANNER.match(line)):
            self.endpoint = f"{m.group(1)}:{m.group(2)}"
        if self.peer is None:
            for pattern in _PEER:
                if m := pattern.search(line):
                    self.peer = f"{m.group(1)}:{m.group(2)}"
                    break
        if self.store is None and (m := _STORE.search(line)):
            self.store = f"{m.group(1)}:{m.group(2)}"
        if any(s in line for s in _STORE_GONE):
            self.store_lost = True

    def describe(self) -> str | None:
        """'the rendezvous store at node-0:29500 (the first node)' or 'peer 10.0.0.2:45735', or None."""
        if self.store_lost or self.store is not None:
            where = self.store or self.endpoint or "the first node"
            named = f" = {self.endpoint}" if self.endpoint and self.store and self.endpoint != self.store else ""
            return f"the rendezvous store at {where}{named} (hosted by the first node's torchrun)"
        if self.peer is not None:
            return f"peer {self.peer}"
        return None
