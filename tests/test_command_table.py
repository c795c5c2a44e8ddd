"""A command's delivery is decided once, in ``protocol.COMMANDS`` (issue 30, item 3), and
a new command kind touches the three places docs/design/wire.md names: protocol.py, the
runner module that sends it, the rank module that acts on it."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import shutil

import pytest

from reactor_dist.caller.bus import Bus, private_dir
from reactor_dist.wire import protocol
from reactor_dist.wire.protocol import COMMANDS, Delivery, Field, Kind

PACKAGE = pathlib.Path(protocol.__file__).parent.parent
RANK_SIDE = {"server.py", "memory.py"}  # where a rank acts on a command (rank/)
WIRE_PAGE = PACKAGE.parent / "docs" / "design" / "wire.md"


def kind_names() -> dict[str, str]:
    """Each command kind's constant name in Kind (PING, ...), by its value."""
    return {value: name for name, value in vars(Kind).items()
            if isinstance(value, str) and value in COMMANDS}


def test_every_command_kind_has_one_row_and_the_kinds_derive_from_it():
    assert Kind.COMMANDS == frozenset(COMMANDS)
    assert Kind.READ_AHEAD == {k for k, c in COMMANDS.items() if c.read_ahead}
    assert Kind.ALL == Kind.COMMANDS | Kind.REPLIES | {Kind.DEATH}
    assert not Kind.COMMANDS & Kind.TO_RUNNER
    assert all(isinstance(c.delivery, Delivery) for c in COMMANDS.values())
    assert set(kind_names()) == set(COMMANDS)


def test_no_module_decides_a_delivery_of_its_own():
    """One way to publish, Bus.publish, which reads the table: a one-try kind given a
    deadline is refused (its retry belongs to its sender's next wait or beat)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        assert "try_publish" not in path.read_text(), path.name
    ipc, lock = private_dir()
    bus = Bus(b"k" * 32, ipc, world_size=1)
    try:
        for kind, command in COMMANDS.items():
            if command.delivery is not Delivery.DEADLINE:
                with pytest.raises(ValueError, match="is tried once"):
                    bus.publish({Field.KIND: kind, Field.SEQ: 0}, deadline=0.0)
    finally:
        bus.close()
        shutil.rmtree(ipc, ignore_errors=True)
        os.close(lock)


@pytest.mark.parametrize("kind", sorted(COMMANDS))
def test_a_command_kind_is_named_on_each_side(kind):
    """The three places: protocol.py (its row, its line of the message table), a
    runner module that sends it, a rank module that acts on it."""
    name = kind_names()[kind]
    assert re.search(rf"^    {kind:<9} ->", protocol.__doc__ or "", re.M), \
        f"{kind}: no line in protocol.py's message table"
    senders, actors = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "protocol.py":
            continue
        tree = ast.parse(path.read_text())
        named = any(isinstance(node, ast.Attribute) and node.attr == name and
                    isinstance(node.value, ast.Name) and node.value.id == "Kind"
                    for node in ast.walk(tree))
        if named:
            rank_side = path.parent.name == "rank" and path.name in RANK_SIDE
            (actors if rank_side else senders).append(path.name)
    assert senders, f"Kind.{name}: no runner module sends it"
    assert actors, f"Kind.{name}: no rank module acts on it"


def test_the_wire_page_tells_every_row():
    """docs/design/wire.md's table has one row per command kind, with its delivery."""
    page = WIRE_PAGE.read_text()
    for kind, command in COMMANDS.items():
        row = re.search(rf"^\| {kind.upper()}\b[^|]*\| ([^|]+)\|", page, re.M)
        assert row, f"{kind}: no row in docs/design/wire.md"
        assert command.delivery.value in row.group(1), (kind, row.group(1))


def test_the_start_up_exchange_sends_only_beat_commands():
    """Supervisor.exchange re-sends on a beat: a kind the table does not give that
    delivery is refused before anything is sent."""
    from reactor_dist.caller.supervisor import Ask, Supervisor

    supervisor = Supervisor.__new__(Supervisor)
    supervisor.bus = object()  # never reached: the check comes first
    supervisor.ranks = object()
    call = Ask({Field.KIND: Kind.CALL, Field.SEQ: 1}, Kind.REPLY, frozenset({0}))
    with pytest.raises(ValueError, match="call command is not sent on a beat"):
        supervisor.exchange([call], 1.0, 1.0, "a test")
