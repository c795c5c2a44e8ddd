"""Every format that crosses a process boundary, named in one place.

The runner and its ranks talk over two ZeroMQ sockets (framing and MAC in
:mod:`reactor_dist.wire.framing`); each message is a short header plus body frames:
the hot kinds (a call, its replies and items, ANSWERED) a fixed binary part
(:data:`HOT_HEAD`) and a msgpack map of the rarer fields, the others a msgpack map.
The message table (``->`` runner to every rank on PUB, ``<-`` one rank to
the runner on PUSH/PULL; kinds are :class:`Kind`'s, fields :class:`Field`'s)::

    kind      dir  when                       header fields beyond KIND, SEQ, RANK
    --------  ---  -------------------------  ---------------------------------------
    ping      ->   handshake: one per 20 ms   -
                   (a fixed pace) until every
                   rank ponged
    pong      <-   answer to each ping        PID (the rank's own pid), PORT (rank 0's
                                              rendezvous store, else 0)
    progress  <-   a phase of start() begins  PHASE ("importing", "forming the torch group",
                   (import, group, load), or  "loading"); for load()'s own reports DONE,
                   load() reported progress   TOTAL (numbers; TOTAL may be absent), UNIT
    init      ->   once every rank ponged;    PORT (rank 0's store port), EPOCH (the
                   again at the ping pace     group's: 0 at start, +1 per restart),
                   until every rank sent a    RANKS (who acts on it; absent: every rank)
                   progress or ready after
                   it (a repeat gets the same
                   ready, load() runs once)
    ready     <-   load() returned or raised  STATUS, ERROR, DEVICE (the rank's device,
                                              e.g. "cpu" or "cuda:0", once chosen),
                                              LOAD_SECONDS (load()'s duration, a float),
                                              GROUP_SECONDS (forming the group's)
    ready     <-   a spare's load() returned  to the spare socket (SPARES_SOCKET), unasked:
    (spare)        or raised                  RANK (its slot), STATUS, ERROR, DEVICE,
                                              LOAD_SECONDS, PID
    call      ->   generate() / reset()       METHOD, DESCRIPTORS (input buffers;
                   / snapshot() / restore()   a named method's: its (args, kwargs)),
                   (sessions: session.py) /   ALL (true: every rank sends its result,
                   a method by name           runner.call_all), RELEASED (result and
                   (runner.call)              snapshot segments
                                              the caller let go), RETIRED (input
                                              segments unlinked), BEHIND (true: sent
                                              while other calls were in flight; the
                                              rank reads ahead for a DROP before it
                                              starts it), DIGEST (true: rank 0 sends
                                              its result's digest), STATES (restore:
                                              per rank [first body frame, frames,
                                              descriptors] of its snapshot)
    item      <-   rank 0's generate() yielded INDEX (0, 1, ...), DESCRIPTORS (the
                   (a generator worker)       item's buffers), RELEASED, RETIRED
    reply     <-   the method returned/raised STATUS, ERROR, DESCRIPTORS (rank 0's
                   (a generator: ran out)     result), ITEMS (how many items rank 0
                                              sent, for a generator), RELEASED (input
                                              segments the rank let go), RETIRED
                                              (result segments rank 0 unlinked), COMPUTE
                                              (seconds inside the worker method, a float
                                              duration on the rank's monotonic clock),
                                              COLLECTIVE_WAIT (of those, the seconds in
                                              torch.distributed collectives; only from
                                              ranks in a group, collective_wait.py);
                                              DIGEST (rank 0, asked: bytes, see
                                              transfer.Digest); LOGGED (true: it wrote
                                              log records meanwhile); a snapshot's: every
                                              rank's DESCRIPTORS and payload
    release   ->   the caller let go of rank  RELEASED (rank 0's result segments),
                   0's segments, or input     RETIRED (input segments unlinked); ROUND
                   segments were retired,     when it answers a STARVED (the same round)
                   also during a call
    reclaim   ->   an input would not fit in  ROUND, RELEASED, RETIRED: every rank unmaps
                   /dev/shm: every pool gives the retired inputs, rank 0 retires all its
                   back its idle segments     idle result segments; each answers
    reclaimed <-   answer to reclaim          ROUND, RETIRED (rank 0's, unlinked)
    starved   <-   rank 0 cannot allocate a   SEQ (the call), ROUND (rank 0's count),
                   result segment (during a   NBYTES, RETIRED (its own idle ones); the
                   call)                      runner answers with a release of the round
    trimmed   <-   rank 0 retired its idle    RETIRED
                   segments after IDLE_RETURN
                   seconds without a command
    drop      ->   restart(): calls that      SEQ: the last call to skip (a rank skips
                   failed are never run       every CALL up to it; read as it arrives)
    answered  ->   every rank answered a      SEQ: that call (a rank that raised in it
                   call in which a rank       holds the next CALL until this, or a DROP,
                   raised (the runner stays   arrives: its peers may still be inside the
                   healthy)                   collectives it left; read as it arrives)
    rejoin    ->   restart(), to the ranks    EPOCH (the new group's), PORT (its store's,
                   that keep their model:     0 on one machine), RANKS (who acts on it),
                   leave the old group, join  TAKERS ([slot, rank] pairs: that spare is
                   the new one, rejoin()      that rank from now on), ADDRESS (across
                                              nodes: rank 0's node, new when a spare took
                                              its place); again at the ping
                                              pace until each acked (progress) or answered
    rejoined  <-   answer to rejoin           EPOCH, STATUS, ERROR, GROUP_SECONDS,
                                              LOAD_SECONDS (rejoin()'s duration)
    shutdown  ->   graceful shutdown          -
    death     (inproc, the runner's death watch to its own PULL socket) RANK = who died,
              EPOCH = the ranks' generation it watched (a notice of replaced ranks is stale)

SEQ is the call's sequence number (0 for ping/init/ready), RANK the sender (-1 for
commands).  RELEASED always names segments owned by the *receiver*, RETIRED
segments owned by the *sender*: one pair of fields in both directions.  Empty
fields are left out.  The pickle stream of a payload is the first body frame;
when small it rides in the header as EMBEDDED, so that the common message is one
frame.  Decoded, a header is a plain dict keyed by these constants.  STATUS is one
of :class:`Status`, METHOD one of :class:`Method`,
DESCRIPTORS a list of :class:`Descriptor`, ERROR an :class:`ErrorRecord`.

Besides messages: the :class:`Bootstrap` a rank reads from its stdin, the
torchrun environment variables, the process mark (:data:`MARK_ENV`), the log record
lines of a rank's output (:data:`RECORD_MARK`), and the names
of /dev/shm entries and ipc directories (:func:`segment_prefix`, :data:`IPC_DIR_PREFIX`),
which later runners parse to reclaim what a killed runner left.
"""

from __future__ import annotations

import enum
import io
import json
import pickle
import signal
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO, NamedTuple

# -- framing (reactor_dist.wire.framing): [MAC + header | body frames...] ------------------
MAC_SIZE = 32      # keyed BLAKE2b-256
SECRET_SIZE = 32   # the per-runner key
EMBED_LIMIT = 4096  # a first body frame up to this size travels inside the header
# The largest frame any bus socket accepts (ZMQ_MAXMSGSIZE; a bigger one drops its
# sender's connection before it is read).  Headers and inline buffers are under 64 KiB;
# what can be large is a payload's pickle stream, which carries in-band data (bytes,
# str, lists: arrays and tensors go out of band), and, for a rank on another node, each
# array's own frame.  Senders refuse a bigger frame.
MAX_FRAME_ENV = "REACTOR_DIST_MAX_FRAME"
MAX_FRAME_DEFAULT = 256 << 20
# The most one message may carry in all: a receiver drops the frames of a bigger one
# as they come (never holding more), and senders refuse to send one.
MAX_MESSAGE_ENV = "REACTOR_DIST_MAX_MESSAGE"
MAX_MESSAGE_DEFAULT = 1 << 30
MAC_ONE_FRAME, MAC_FRAMES = b"reactor-dist/1", b"reactor-dist/n"  # MAC personalizations
# How many commands the runner's command socket holds for one rank that has not taken
# them up (ZMQ_SNDHWM of its XPUB socket).  At the bound a command is never dropped: the
# runner waits, re-sends or reports (reactor_dist.caller.bus).  Settable for tests.
SEND_BOUND_ENV = "REACTOR_DIST_SEND_BOUND"
SEND_BOUND_DEFAULT = 1000
# Set (to anything but "" or "0"): framing's pure-Python path even where its compiled half
# (reactor_dist/wire/_framing.c) is built; both speak the same wire.
PURE_PYTHON_ENV = "REACTOR_DIST_PURE_PYTHON"

# -- header fields ------------------------------------------------------------------------
class Field:
    """The keys of a message header (short: the header is packed on every message)."""

    KIND = "k"
    SEQ = "s"
    RANK = "r"
    STATUS = "st"
    METHOD = "m"
    DESCRIPTORS = "d"
    ERROR = "e"
    EMBEDDED = "p"
    RELEASED = "rel"
    RETIRED = "ret"
    PID = "pid"
    PORT = "port"
    INDEX = "i"
    ITEMS = "n"
    DEVICE = "dev"
    COMPUTE = "c"
    COLLECTIVE_WAIT = "cw"
    LOAD_SECONDS = "ls"
    GROUP_SECONDS = "gs"
    PHASE = "ph"
    DONE = "dn"
    TOTAL = "tt"
    UNIT = "u"
    ROUND = "rd"
    NBYTES = "nb"
    EPOCH = "ep"
    BEHIND = "bh"
    RANKS = "rks"
    TAKERS = "tk"  # REJOIN: [[spare slot, rank], ...]: each spare takes that rank's place
    ADDRESS = "ad"  # REJOIN across nodes: rank 0's node address (its store's), maybe new
    DIGEST = "dg"  # CALL: true, rank 0 digests its result; REPLY: rank 0's digest (bytes)
    ALL = "all"  # CALL: true, every rank sends its result (runner.call_all), not rank 0 alone
    LOGGED = "lg"  # REPLY: true, the rank wrote log records during the call (log_records.py)
    BROKEN = "bk"  # REPLY of a raise: true, the rank's CUDA context broke (device.py)
    STATES = "sts"  # CALL of restore: per rank [first body frame, frame count, descriptors]


class Kind:
    """The value of ``Field.KIND``."""

    PING, INIT, CALL, SHUTDOWN = "ping", "init", "call", "shutdown"  # runner -> every rank
    RELEASE, RECLAIM = "release", "reclaim"  # runner -> every rank: shared memory back
    DROP, REJOIN = "drop", "rejoin"  # runner -> every rank: restart()
    ANSWERED = "answered"  # runner -> every rank: a call in which a rank raised is over
    REJOINED = "rejoined"  # one rank -> runner: answer to REJOIN
    PONG, READY, REPLY, ITEM = "pong", "ready", "reply", "item"  # one rank -> runner
    RECLAIMED, STARVED, TRIMMED = "reclaimed", "starved", "trimmed"  # one rank -> runner
    PROGRESS = "progress"  # one rank -> runner, during start()
    DEATH = "death"  # the runner's death watch -> its own PULL socket
    REPLIES = frozenset({PONG, READY, REPLY, ITEM, PROGRESS, RECLAIMED, STARVED, TRIMMED,
                         REJOINED})
    TO_RUNNER = REPLIES | {DEATH}  # what the runner's PULL socket accepts
    COMMANDS: frozenset[str]  # the keys of COMMANDS (below)
    READ_AHEAD: frozenset[str]  # the commands a rank applies as it reads them
    ALL: frozenset[str]


class Delivery(enum.Enum):
    """What the runner does when a command meets a rank's pipe at its bound (the
    command then reaches no rank: XPUB_NODROP); :meth:`reactor_dist.caller.bus.Bus.publish`
    reads it from :data:`COMMANDS`, and so does the start-up exchange."""

    BEAT = "on a beat until answered"  # one try; the exchange sends it again PING_EVERY
    DEADLINE = "until a deadline"  # tried again until the sender's deadline, then
    #                                CommandBlocked (the sender's error, or its fallback)
    REQUEUED = "re-queued"  # one try; what it carries goes back to its sender, and a
    #                         later try (the sender's next wait, or next message) takes it


class CommandRule(NamedTuple):
    """How one command kind travels: its delivery at the bound, and whether a rank
    applies it as it reads it (also in the middle of a call: ``read_ahead``) or in the
    order of its loop."""

    delivery: Delivery
    read_ahead: bool = False


# Every command kind and how it travels; a new kind is a row here (see
# docs/design/wire.md, "A new command kind").
COMMANDS: dict[str, CommandRule] = {
    Kind.PING: CommandRule(Delivery.BEAT),
    Kind.INIT: CommandRule(Delivery.BEAT),  # a repeat gets the same READY, load() runs once
    Kind.REJOIN: CommandRule(Delivery.BEAT),  # likewise, the same REJOINED
    Kind.CALL: CommandRule(Delivery.DEADLINE),  # the call's timeout: WorkerTimeout
    Kind.SHUTDOWN: CommandRule(Delivery.DEADLINE),  # shutdown_grace: then SIGTERM, SIGKILL
    Kind.DROP: CommandRule(Delivery.DEADLINE, read_ahead=True),  # restart(): one try
    Kind.RECLAIM: CommandRule(Delivery.DEADLINE, read_ahead=True),  # the allocation fails
    Kind.RELEASE: CommandRule(Delivery.REQUEUED, read_ahead=True),
    Kind.ANSWERED: CommandRule(Delivery.REQUEUED, read_ahead=True),
}
Kind.COMMANDS = frozenset(COMMANDS)
Kind.READ_AHEAD = frozenset(kind for kind, command in COMMANDS.items() if command.read_ahead)
Kind.ALL = Kind.COMMANDS | Kind.REPLIES | {Kind.DEATH}



class Status:
    """The value of ``Field.STATUS`` in READY and REPLY."""

    OK = "ok"                        # the method returned
    RAISED = "raised"                # the method (or decoding its input) raised
    UNDELIVERABLE = "undeliverable"  # rank 0 returned, but its result could not be sent


class Method:
    """The value of ``Field.METHOD`` in CALL: one of these, or the name of a public method
    of the worker (``runner.call``), whose payload is its ``(args, kwargs)``."""

    GENERATE, RESET = "generate", "reset"
    # Sessions (reactor_dist.caller.session): every rank returns its state / is given it back.
    SNAPSHOT, RESTORE = "snapshot", "restore"
    BUILT_IN = frozenset({GENERATE, RESET, SNAPSHOT, RESTORE})

    @staticmethod
    def takes_input(method: str) -> bool:
        """Whether a CALL of ``method`` carries a payload: generate's input, or a named
        method's ``(args, kwargs)``."""
        return method == Method.GENERATE or method not in Method.BUILT_IN


# -- the header's bytes (reactor_dist.wire.framing) ---------------------------------------
# After the MAC, every header begins with the wire version and its kind's code.  The hot
# kinds (HOT: a call, its replies and items, ANSWERED) have a fixed binary part
# (HOT_HEAD) that holds every field the caller reads on every call; what else a header
# holds (descriptors, an error, the ledger fields) follows as a msgpack map (Hot.EXTRAS,
# its length first), and a small first body frame as the last bytes (Hot.EMBEDDED).  The
# other kinds are a msgpack map after the two bytes.  A reply that is only HOT_HEAD (one
# frame of MAC_SIZE + HOT_HEAD.size bytes: no extras, no payload) is an acknowledgement,
# counted by the caller without a header map (framing.Channel.take).
WIRE_VERSION = 2  # the first format (version "1") was a bare msgpack map
KIND_CODES: dict[str, int] = {kind: code for code, kind in enumerate((
    Kind.PING, Kind.INIT, Kind.CALL, Kind.SHUTDOWN, Kind.RELEASE, Kind.RECLAIM, Kind.DROP,
    Kind.REJOIN, Kind.ANSWERED, Kind.REJOINED, Kind.PONG, Kind.READY, Kind.REPLY, Kind.ITEM,
    Kind.RECLAIMED, Kind.STARVED, Kind.TRIMMED, Kind.PROGRESS, Kind.DEATH), start=1)}
KINDS_BY_CODE: dict[int, str] = {code: kind for kind, code in KIND_CODES.items()}
HOT = frozenset({Kind.CALL, Kind.REPLY, Kind.ITEM, Kind.ANSWERED})
PREFIX = struct.Struct("<BB")  # version, kind code: every header
# version, kind code, flags (Hot), code (CALL: Method's, REPLY: Status's; 0: in the
# extras), rank, seq, compute, collective wait, count (REPLY: ITEMS, ITEM: INDEX)
HOT_HEAD = struct.Struct("<BBBBiQddI")
ACK_SIZE = MAC_SIZE + HOT_HEAD.size  # an acknowledgement's one frame
EXTRAS_SIZE = struct.Struct("<I")  # the extras map's length, before it


class Hot:
    """The bits of HOT_HEAD's flags byte: the per-kind booleans, then what is present."""

    # The booleans, per kind: field -> bit (absent or not True: not set).
    BOOLEANS: dict[str, dict[str, int]] = {
        Kind.CALL: {Field.BEHIND: 1, Field.DIGEST: 2, Field.ALL: 4},
        Kind.REPLY: {Field.LOGGED: 1},
        Kind.ITEM: {},
        Kind.ANSWERED: {},
    }
    COUNT = 0x08     # the count field holds ITEMS (REPLY) or INDEX (ITEM)
    COMPUTE = 0x10   # the compute field holds Field.COMPUTE
    WAIT = 0x20      # the wait field holds Field.COLLECTIVE_WAIT
    EMBEDDED = 0x40  # the header's last bytes are the first body frame (Field.EMBEDDED)
    EXTRAS = 0x80    # a msgpack map of the other fields follows HOT_HEAD
    LOGGED = 1       # REPLY: Field.LOGGED (BOOLEANS)
    # The field the count holds, per kind; the field the code holds and its values.
    COUNTS: dict[str, str] = {Kind.REPLY: Field.ITEMS, Kind.ITEM: Field.INDEX}
    CODED: dict[str, str] = {Kind.CALL: Field.METHOD, Kind.REPLY: Field.STATUS}
    CODES: dict[str, dict[str, int]] = {
        Field.METHOD: {Method.GENERATE: 1, Method.RESET: 2, Method.SNAPSHOT: 3,
                       Method.RESTORE: 4},
        Field.STATUS: {Status.OK: 1, Status.RAISED: 2, Status.UNDELIVERABLE: 3},
    }
    VALUES: dict[str, dict[int, str]] = {
        f: {c: v for v, c in codes.items()} for f, codes in CODES.items()}
    OK = 1  # Status.OK's code


class Place:
    """Where a payload buffer lies (``Descriptor.place``)."""

    INLINE, SEGMENT = 0, 1


class Descriptor(NamedTuple):
    """Where one out-of-band buffer of a payload lies (packs as a 5-item array)."""

    place: int        # Place.INLINE: a body frame; Place.SEGMENT: a /dev/shm segment
    where: int | str  # the body frame's index, or the segment's name
    offset: int
    nbytes: int
    readonly: bool


def segments_of(descriptors: Any) -> set[str]:
    """The segment names a (possibly malformed) list of wire descriptors references."""
    return {d[1] for d in descriptors or () if isinstance(d, (list, tuple)) and len(d) == 5
            and d[0] == Place.SEGMENT and isinstance(d[1], str)}


class ErrorRecord(NamedTuple):
    """What a rank sends about an exception beside its pickle (packs as an array):
    enough to stand in for it when the pickle does not load in the caller."""

    type: str
    message: str
    traceback: str

    @classmethod
    def parse(cls, raw: Any) -> ErrorRecord:
        if isinstance(raw, (list, tuple)) and len(raw) == 3 and all(isinstance(x, str)
                                                                    for x in raw):
            return cls(*raw)
        return cls("<unknown>", f"malformed error record {raw!r}", "")


# -- a rank's start ------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerRef:
    """Where a fresh interpreter finds the worker class."""

    module: str
    qualname: str
    main_module: str | None = None  # __main__ run as ``python -m main_module``
    main_path: str | None = None    # __main__ run as ``python main_path``


PINNED_LIMIT = 2 << 30  # DistributedRunner(pinned_limit=...)'s default: 2 GiB


@dataclass(frozen=True)
class Bootstrap:
    """Everything a rank needs, written to its stdin (length-prefixed pickle): the
    secret never appears in argv or the environment."""

    rank: int
    world_size: int
    secret: bytes
    cmd_addr: str
    reply_addr: str
    runner_pid: int
    shm_dir: str
    shm_prefix: str
    worker: WorkerRef
    load_kwargs: bytes  # pickled apart, so that the bootstrap itself always loads
    init_process_group: bool
    device: str
    start_timeout: float
    keep_free: int
    # Bytes of shared memory the rank keeps registered with CUDA at most (host_pinning).
    pinned_limit: int = PINNED_LIMIT
    sys_path: list[str] = field(default_factory=list)
    # Placed by Ray (reactor_dist.placement.ray_group): a rank on another node than the runner has
    # no shared memory with it (payloads in-band), meets the group in rank 0's TCPStore
    # at ``master_addr``, and speaks CurveZMQ (server public, client public, client secret).
    shared_memory: bool = True
    master_addr: str = ""
    curve: tuple[bytes, bytes, bytes] | None = None
    device_index: int | None = None  # its GPU among the visible ones (Ray's: 0)
    # The group's timeout once load() is done (timeouts.for_group); start_timeout before.
    group_timeout: float = 1800.0
    # A spare (reactor_dist.caller.spares): ``rank`` is its slot (world_size and up, never a
    # rank's), it loads with no rank and no group, tells ``spare_addr`` when loaded, and
    # waits for a REJOIN whose TAKERS give it a rank's place.
    spare: bool = False
    spare_addr: str = ""
    # The application's logging levels at start (reactor_dist.wire.log_records: the root's under
    # ""): the rank sends its log records, as lines of its output, to the caller's
    # logging; None (placed by Ray): plain lines.
    log_levels: dict[str, int] | None = None

    def to_bytes(self) -> bytes:
        data = pickle.dumps(self, protocol=5)
        return len(data).to_bytes(8, "little") + data

    @classmethod
    def read_bytes(cls, data: bytes) -> Bootstrap:
        return cls.read(io.BytesIO(data))

    @classmethod
    def read(cls, stream: BinaryIO) -> Bootstrap:
        size = int.from_bytes(stream.read(8), "little")
        data = stream.read(size)
        if size == 0 or len(data) != size:
            raise SystemExit("reactor-dist-rank: no bootstrap on stdin (it is started by "
                             "DistributedRunner, not by hand)")
        boot = pickle.loads(data)
        if not isinstance(boot, cls):
            raise SystemExit(f"reactor-dist-rank: stdin holds a {type(boot).__name__}, "
                             f"not a bootstrap")
        return boot


def torchrun_env(rank: int, world_size: int, master_port: int,
                 master_addr: str = "127.0.0.1",
                 local: tuple[int, int] | None = None) -> dict[str, str]:
    """The environment a ``torchrun`` launch gives a rank (set in the child only);
    ``local`` is (local rank, ranks on this node) where the group spans nodes."""
    local_rank, local_size = local or (rank, world_size)
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(local_size), "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port)}


# -- a rank another launcher started (placement.joiner <-> placement.external) ---
# ``reactor-dist-rank --join ADDRESS`` connects a DEALER, CurveZMQ as a client, to the
# runner's join socket (a ROUTER; the bus's server key, only the join key admitted);
# each message is one msgpack map whose JOIN_KIND is a :class:`Join`::
#
#     joiner                                  runner (placement.external.ExternalGroup)
#     hello   {version, wire, rank, world_size, local_rank, worker, host, pid, address,
#              port, probe: [name, content] (a /dev/shm file: do we share memory?)}
#                        <- welcome {bootstrap (protocol.Bootstrap.to_bytes), torch_env,
#                                    private_dir (the runner's, to a joiner that shares
#                                    its memory: removed if the runner dies)}
#                        <- refused {why}: the joiner says why and exits 2
#     started {pid}   its rank process runs
#     beat    {}      every JOIN_BEAT_EVERY s both ways: a joiner silent JOIN_SILENCE s is
#                     gone; a runner silent RUNNER_SILENCE s (its end closed: at once)
#                        <- signal {sig, group}   <- stacks {}   <- stopped {}
#     stacks  {text}  stopped {value}
#                        <- end {grace, term_grace, code}: end the rank, exit ``code``
#     ended   {}      died {report, returncode, lines}: its rank died; the joiner exits 1
JOIN_KIND = "j"
JOIN_SECRET_ENV = "REACTOR_DIST_JOIN_SECRET"  # the join secret, where no file holds it
JOIN_BEAT_EVERY = 0.1  # seconds between two beats, each way
JOIN_SILENCE = 0.8  # seconds without a message after which a joiner counts as gone
# ... after which a joiner counts its runner as gone.  Longer: the runner's process is the
# application's, whose own work may hold the GIL a while (a big pickle, a C call), and a
# runner that died closed its end of the connection, which the joiner sees at once.
RUNNER_SILENCE = 10.0


class Join:
    """The kinds of the join socket's messages (the table above)."""

    HELLO = "hello"
    WELCOME = "welcome"
    REFUSED = "refused"
    STARTED = "started"
    BEAT = "beat"
    SIGNAL = "signal"
    STACKS = "stacks"
    STOPPED = "stopped"
    END = "end"
    ENDED = "ended"
    DIED = "died"


def join_secret(server_key: bytes, client_secret: bytes) -> str:
    """The one string a joiner needs besides the address: the runner's public key and
    the join key's secret half (CurveZMQ, z85: 40 characters each), joined by a ``_``
    (not a z85 character)."""
    return f"{server_key.decode()}_{client_secret.decode()}"


def split_join_secret(text: str) -> tuple[bytes, bytes]:
    """(server public key, client secret key) of :func:`join_secret`'s string."""
    text = text.strip()
    if len(text) != 81 or text[40] != "_":
        raise ValueError("a join secret is two 40-character CurveZMQ keys joined by '_' "
                         "(the runner writes it to its secret file)")
    return text[:40].encode(), text[41:].encode()


# -- the rank template (reactor_dist.placement.template): one datagram each way on a socket pair ---
# Its socket's fd, in the environment the runner starts the template with.
TEMPLATE_FD_ENV = "REACTOR_DIST_TEMPLATE_FD"
# The template's process name (/proc/<pid>/comm): what tells it from the ranks it forks,
# which carry its command line and its environment as /proc shows them.
TEMPLATE_NAME = "rank-template"


class ForkRequest(NamedTuple):
    """Runner -> template: fork a rank with this environment, working directory and CPU
    affinity; its stdin (read end) and its output (write end) travel as SCM_RIGHTS fds
    beside it.  ``seq`` numbers the requests: the reply carries it."""

    seq: int
    env: dict[str, str]
    cwd: str
    cpus: list[int]

    def to_bytes(self) -> bytes:
        return json.dumps({"seq": self.seq, "env": self.env, "cwd": self.cwd,
                           "cpus": self.cpus}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> ForkRequest:
        fields = json.loads(data)
        return cls(fields["seq"], fields["env"], fields["cwd"], fields["cpus"])


class ForkReply(NamedTuple):
    """Template -> runner: the pid of the rank it forked for request ``seq``, or 0 and
    why it could not; seq 0, pid 0 once it is ready (its imports done)."""

    seq: int
    pid: int
    error: str = ""

    def to_bytes(self) -> bytes:
        return json.dumps([self.seq, self.pid, self.error]).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> ForkReply:
        seq, pid, error = json.loads(data)
        return cls(int(seq), int(pid), str(error))


# -- names other processes parse ----------------------------------------------------------
# Inherited by every process a rank starts: finds them when the process tree no longer
# does (their rank died and they left its process group, or a daemon double-forked).
MARK_ENV = "REACTOR_DIST_RANK_MARK"
# torch's flight recorder's size in a rank's environment (reactor_dist.rank.flight_recorder;
# the second is its older name): 0 with record_collectives=False, unless the application
# sized it
RECORDER_SIZE_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
# Signals the runner sends a rank's own process (never its process group): SIGUSR1 asks
# for every thread's stack (faulthandler, reactor_dist.placement.stacks); GROUP_ABORT_SIGNAL, at a
# restart, makes a survivor close its torch group's connections, so that it gets out of
# whatever collective it waits in (reactor_dist.rank.group); RECORDER_SIGNAL, at a
# timeout, has a rank write its torch group's flight recorder into its collective ring
# (reactor_dist.rank.flight_recorder).  Real-time signals: no library's own, and
# blocked in every thread of a rank (RANK_SIGNALS) but the one that waits for each.
STACKS_SIGNAL = signal.SIGUSR1
GROUP_ABORT_SIGNAL = signal.SIGRTMIN + 2
RECORDER_SIGNAL = signal.SIGRTMIN + 3
RANK_SIGNALS = (int(GROUP_ABORT_SIGNAL), int(RECORDER_SIGNAL))
# /dev/shm entries: rdist.<owner pid>.<owner start time, hex>.<runner token>.<tag><token>
# (tag: "in" for inputs, "r0-" for results, "s<rank>-" for snapshots; token: 16 random
# hex digits per segment)
SEGMENT_PREFIX = "rdist"
# <runner prefix>.lock: flock'ed by the live runner (its entries are not a dead owner's)
OWNER_LOCK = "lock"
# The runner's private ipc directory: reactor-dist-<owner pid>-<random>
IPC_DIR_PREFIX = "reactor-dist-"
# In it, the socket where spares say they have loaded (reactor_dist.caller.spares)
SPARES_SOCKET = "spares"
# A line of a rank's output that holds one of its log records: this mark, then the
# record as one JSON object (reactor_dist.wire.log_records.encode; an ASCII record separator
# cannot start a line a program prints by chance).
RECORD_MARK = "\x1ereactor-dist-record "


def store_file(epoch: int) -> str:
    """The torch group's FileStore of generation ``epoch``, in the private directory (the
    ranks of one machine meet there; a restart's new group has a file of its own, and
    the runner removes the old generation's once the new group is formed)."""
    return "store" if not epoch else f"store.{epoch}"



def snapshot_tag(rank: int) -> str:
    """The tag of rank ``rank``'s snapshot segments (reactor_dist.caller.session): the rank
    creates them, the caller keeps them past the rank's death and unlinks those of a
    replaced rank's process."""
    return f"s{rank}-"


def segment_prefix(pid: int, started: int, token: str) -> str:
    return f"{SEGMENT_PREFIX}.{pid}.{started:x}.{token}"


def result_tag(rank: int) -> str:
    """The tag of rank ``rank``'s result segments: ``<runner prefix>.<tag><token>``
    (rank 0's alone are used; a restart that replaces rank 0 removes its ones)."""
    return f"r{rank}-"


def segment_owner(name: str) -> tuple[int, str] | None:
    """``(pid, start time hex)`` of a /dev/shm entry of ours, else None."""
    parts = name.split(".")
    if len(parts) < 4 or parts[0] != SEGMENT_PREFIX or not parts[1].isdigit():
        return None
    return int(parts[1]), parts[2]


def ipc_dir_owner(name: str) -> int | None:
    """The owner pid of one of our ipc directories, else None."""
    parts = name.split("-")
    if len(parts) == 4 and name.startswith(IPC_DIR_PREFIX) and parts[2].isdigit():
        return int(parts[2])
    return None
