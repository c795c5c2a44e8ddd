"""Only the runner and its own ranks talk on the bus.

A foreign process connects to the runner's sockets and sends forged, replayed and
garbage messages, some of them carrying a pickle whose load would create a file.
The file never appears, the runner stays healthy and keeps answering correctly.

Why a legit-looking *reply* cannot be replayed or forged: replies travel from each
rank's PUSH socket to the runner's PULL socket, point to point.  A stranger can
connect to the PULL socket and send, but cannot receive what the ranks send (a PULL
socket does not fan out; only the runner binds it), so it never holds an authentic
reply to replay, and producing one means computing keyed BLAKE2b under the
per-runner secret, which it does not have.  What it *can* capture is a command, by
subscribing to the PUB socket like a rank does; replayed to the runner, that
message authenticates, but it is a command: the runner's loop drops every kind
that is not a reply before it decodes anything (and an authentic reply to an older
call would only release segments, never be taken for the current call's answer).
Commands cannot be replayed to the ranks either: the ranks connect only to the
runner's PUB socket, and ignore a call whose sequence number is not newer than the
last one they ran.  (The 0700 directory keeps other users off the sockets; the
foreigner here runs as the same user, who could do worse, ptrace for one: what the
test proves is that the bus itself never unpickles what it cannot authenticate.)
"""

from __future__ import annotations

import base64
import os
import pickle
import queue
import stat
import subprocess
import sys
import textwrap
import threading
import time

import msgpack
import numpy as np
import pytest
from probe import Probe
from sample_workers import Echo, FullArray, SharedArray, Sleep

from reactor_dist import DistributedRunner
from reactor_dist.caller.bus import Bus
from reactor_dist.shm import segments
from reactor_dist.wire import framing
from reactor_dist.wire.protocol import KIND_CODES, PREFIX, WIRE_VERSION, Field, Kind, Status

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)

FOREIGNER = textwrap.dedent("""
    import hashlib, os, pickle, random, sys, time
    import zmq
    from reactor_dist.wire import framing  # the layout of a header is no secret

    LAYOUT = framing.Channel(bytes(32))  # lays headers out; its MACs are not the runner's

    ipc_dir, evil_path = sys.argv[1], sys.argv[2]

    class Evil:
        def __reduce__(self):
            return (open, (evil_path, "w"))  # unpickling this creates the file

    EVIL = pickle.dumps(Evil(), protocol=5)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{ipc_dir}/cmd")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 5000)
    push.connect(f"ipc://{ipc_dir}/reply")
    time.sleep(0.3)  # let the subscription reach the runner
    print("connected", flush=True)

    captured = None
    while captured is None:  # a real command, captured off the PUB socket
        parts = sub.recv_multipart()
        header = framing.decode(parts[0][32:])  # readable: authenticated, not encrypted
        if header.get("k") == "call":
            captured, seq = parts, header["s"]
    print("captured", seq, flush=True)

    def forged(header, body, key=None):
        head = LAYOUT.head(header)
        if key is None:
            mac = os.urandom(32)
        else:  # the runner's own MAC construction, under a guessed key
            digest = hashlib.blake2b(digest_size=32, key=key, person=b"reactor-dist/n")
            for frame in [head, *body]:
                digest.update(len(frame).to_bytes(8, "little"))
                digest.update(frame)
            mac = digest.digest()
        return [mac + head, *body]

    rng = random.Random(4)
    for line in sys.stdin:
        messages = [captured, list(captured)]             # replayed, verbatim
        as_reply = framing.decode(captured[0][32:])
        as_reply.update(k="reply", r=0, st="ok")          # the command, relabelled
        messages.append([captured[0][:32] + LAYOUT.head(as_reply), *captured[1:]])
        for s in range(max(0, seq - 5), seq + 30):        # old, current and future calls
            for r in (0, 1):
                for key in (None, b"", b"\\0" * 32):
                    ok = {"k": "reply", "s": s, "r": r, "st": "ok", "d": []}
                    raised = {"k": "reply", "s": s, "r": r, "st": "raised",
                              "e": ["X", "m", "t"]}
                    messages.append(forged(ok, [EVIL], key))
                    messages.append(forged(raised, [EVIL], key))
                    messages.append(forged({"k": "ready", "s": 0, "r": r, "st": "raised",
                                            "e": ["X", "", ""]},
                                           [EVIL], key))
        messages += [[b""], [b"x" * 32], [EVIL], [b"\\0" * 32 + EVIL], [os.urandom(1 << 20)],
                     [os.urandom(rng.randrange(64)) for _ in range(10)]]
        messages += [[os.urandom(rng.randrange(200)) for _ in range(rng.randrange(1, 5))]
                     for _ in range(300)]
        for m in messages:
            push.send_multipart(m)
        print("sent", len(messages), flush=True)
""")


class Foreigner:
    """A foreign process on the runner's sockets, driven line by line."""

    def __init__(self, tmp_path, ipc_dir: str, evil_path: str) -> None:
        script = tmp_path / "foreigner.py"
        script.write_text(FOREIGNER)
        self.proc = subprocess.Popen([sys.executable, str(script), ipc_dir, evil_path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PYTHONPATH=REPO))
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def expect(self, word: str, timeout: float = 30.0) -> str:
        line = self.lines.get(timeout=timeout)
        assert line.startswith(word), line
        return line

    def attack(self) -> int:
        self.proc.stdin.write("attack\n")
        self.proc.stdin.flush()
        return int(self.expect("sent").split()[1])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)


class Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_the_bait_is_armed(tmp_path):
    """The pickle the foreigner sends really writes its file when loaded."""
    path = tmp_path / "pwned"
    pickle.loads(pickle.dumps(Evil(str(path)), protocol=5)).close()
    assert path.exists()


def test_forged_replayed_and_garbage_messages_are_never_unpickled(tmp_path, monkeypatch):
    evil_path = str(tmp_path / "pwned")
    rejected, dropped = [], []
    unpack = framing.Channel.unpack

    def counting_unpack(channel, parts):  # the runner side only: the ranks are other processes
        try:
            return unpack(channel, parts)
        except framing.ProtocolError as exc:
            rejected.append(str(exc))
            raise

    admitted = Bus.admitted

    def counting_admitted(bus, message, acks):  # every authentic message, decoded either way
        if len(message) == 2 and message[0][Field.KIND] not in Kind.REPLIES:
            dropped.append(message[0][Field.KIND])
        return admitted(bus, message, acks)

    monkeypatch.setattr(framing.Channel, "unpack", counting_unpack)
    monkeypatch.setattr(Bus, "admitted", counting_admitted)
    with DistributedRunner(Echo, world_size=2, init_process_group=False,
                           device="cpu", call_timeout=10) as runner:
        foreigner = Foreigner(tmp_path, Probe(runner).ipc_dir, evil_path)
        try:
            foreigner.expect("connected")
            deadline = time.monotonic() + 10
            while foreigner.lines.empty() and time.monotonic() < deadline:
                assert runner.generate("capture me") == "capture me"
                time.sleep(0.02)
            foreigner.expect("captured")

            # 1. while a call is in flight
            big = np.arange(1 << 20, dtype=np.float32)
            out: dict = {}
            call = threading.Thread(target=lambda: out.update(r=runner.generate(
                Sleep(0.5, value=big))))
            call.start()
            sent = foreigner.attack()
            call.join(15)
            np.testing.assert_array_equal(out["r"], big)
            assert runner.healthy

            # 2. while idle: the messages wait in the socket for the next call's loop
            sent += foreigner.attack()
            time.sleep(0.3)
            for i in range(5):
                assert runner.generate(FullArray([1 << 20], fill=i))[-1] == i
            runner.reset()
            deadline = time.monotonic() + 10  # until the loop has read all that was sent
            while len(rejected) + len(dropped) < sent and time.monotonic() < deadline:
                assert runner.generate(("still", "answering")) == ("still", "answering")
                time.sleep(0.05)
            assert runner.healthy
        finally:
            foreigner.close()
    assert not os.path.exists(evil_path), "a stranger's pickle was loaded"
    # Everything the stranger sent was read and refused (so the test is not vacuous):
    # the replays authenticate but are commands, all the rest fails the MAC check.
    assert dropped.count(Kind.CALL) == 2 * 2
    assert len(rejected) == sent - 4, (len(rejected), sent)
    assert all("MAC" in r or "empty" in r or "no room" in r for r in rejected), set(rejected)


def secret_forms(secret: bytes) -> list[bytes]:
    return [secret, secret.hex().encode(), secret.hex().upper().encode(),
            base64.b64encode(secret), base64.urlsafe_b64encode(secret),
            base64.b64encode(secret).rstrip(b"=")]


def test_secret_never_in_a_command_line_or_environment():
    with DistributedRunner(Echo, world_size=2, init_process_group=False,
                           device="cpu") as runner:
        secret = Probe(runner).secret
        assert len(secret) == framing.SECRET_SIZE
        pids = Probe(runner).rank_pids + [os.getpid()]
        for pid in pids:
            for what in ("cmdline", "environ"):
                with open(f"/proc/{pid}/{what}", "rb") as f:
                    data = f.read()
                assert data, f"/proc/{pid}/{what} is empty: nothing was checked"
                for form in secret_forms(secret):
                    assert form not in data, f"the secret is in /proc/{pid}/{what}"
        assert runner.generate(1) == 1  # the ranks did receive it (they answer)


def test_shm_entries_are_0600_and_the_ipc_directory_0700():
    with DistributedRunner(Echo, world_size=2, init_process_group=False,
                           device="cpu") as runner:
        group = Probe(runner)
        held = [runner.generate(np.ones(4 << 20, np.uint8)),                     # input+result
                runner.generate(SharedArray([4 << 20], fill=3))]  # shared_empty
        entries = [n for n in os.listdir(segments.DEFAULT_DIR)
                   if n.startswith(group.shm_prefix + ".")]
        assert len(entries) >= 3, entries  # the input, a copied result, a shared_empty one
        for name in entries:
            mode = stat.S_IMODE(os.stat(os.path.join(segments.DEFAULT_DIR, name)).st_mode)
            assert mode == 0o600, f"{name} is {mode:o}"
        assert stat.S_IMODE(os.stat(group.ipc_dir).st_mode) == 0o700
        assert os.stat(group.ipc_dir).st_uid == os.getuid()
        assert sorted(os.listdir(group.ipc_dir)) == ["cmd", "lock", "reply"]
        del held


@pytest.mark.parametrize("stream", [b"stream", b"s" * (framing.EMBED_LIMIT + 1)],
                         ids=["stream_in_header", "stream_in_own_frame"])
@pytest.mark.parametrize("tamper", ["flip_mac", "flip_header", "flip_body", "drop_body",
                                    "add_frame", "swap_key"])
def test_an_authentic_message_altered_in_any_way_is_rejected(tamper, stream):
    secret = os.urandom(framing.SECRET_SIZE)
    header = {Field.KIND: Kind.REPLY, Field.SEQ: 7, Field.RANK: 0, Field.STATUS: Status.OK,
              Field.DESCRIPTORS: []}
    parts = framing.Channel(secret).pack(header, [stream, b"buffer"])
    header, body = framing.Channel(secret).unpack(parts)
    assert header[Field.SEQ] == 7 and body == [stream, b"buffer"]
    assert len(parts) == (2 if len(stream) <= framing.EMBED_LIMIT else 3)
    parts = [bytearray(p) for p in parts]
    if tamper == "flip_mac":
        parts[0][3] ^= 1
    elif tamper == "flip_header":
        parts[0][-1] ^= 1
    elif tamper == "flip_body":
        parts[-1][0] ^= 1
    elif tamper == "drop_body":
        parts.pop()
    elif tamper == "add_frame":
        parts.append(bytearray(b"more"))
    else:
        secret = os.urandom(framing.SECRET_SIZE)
    with pytest.raises(framing.ProtocolError, match="MAC"):
        framing.Channel(secret).unpack([bytes(p) for p in parts])


def test_a_one_frame_message_and_its_split_form_have_different_macs():
    """The MAC of a lone header frame and of length-prefixed frames are personalized
    differently, so no frame split can turn one authentic message into another."""
    channel = framing.Channel(os.urandom(framing.SECRET_SIZE))
    (frame,) = channel.pack({Field.KIND: Kind.REPLY, Field.SEQ: 7, Field.RANK: 0}, [b"tiny"])
    head = frame[framing.MAC_SIZE:]
    assert channel.mac([head]) != channel.mac([head[:5], head[5:]])
    assert channel.mac([head]) != channel.mac([head, b""])


def test_an_embedded_body_that_is_not_bytes_is_rejected():
    """(A hot kind's embedded frame is the header's last bytes: only a map can hold
    another type.)"""
    channel = framing.Channel(os.urandom(framing.SECRET_SIZE))
    head = PREFIX.pack(WIRE_VERSION, KIND_CODES[Kind.READY]) + msgpack.packb(
        {Field.SEQ: 7, Field.RANK: 0, Field.EMBEDDED: "text"}, use_bin_type=True)
    with pytest.raises(framing.ProtocolError, match="embedded body frame is str"):
        channel.unpack([channel.mac([head]) + head])
