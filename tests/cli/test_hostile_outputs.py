"""Output flags pointed at things that are not regular files: a character device (/dev/null,
/dev/full), a FIFO, a socket. Each command refuses before any work (exit 2, one `error:` line
naming the flag) and the node is still there, unreplaced, afterwards.

The device is made with mknod inside the test's folder when the tests run as root (renaming
over it could then never harm the system's /dev/null); otherwise /dev/null itself, which a
non-root process cannot replace."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest
from hostile import refused
from repo import ROOT

from nanosched.errors import ConfigError
from nanosched.fileio import check_output_file, write_json_atomic

PROFILE = str(ROOT / "nanosched" / "profiler" / "profiles" / "llama3-8b-tp1-h200.json")
SCHEDULE = str(ROOT / "tests" / "data" / "llama3-8b-tp1-h200-b2048-single.json")
SET = str(ROOT / "nanosched" / "schedules" / "shipped"
          / "llama3-8b-tp1-h200-in1024-out512-b2048.set.json")


def char_device(folder: Path) -> Path:
    if os.geteuid() != 0:
        return Path("/dev/null")
    node = folder / "null"
    try:
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:  # root without CAP_MKNOD (a container): never risk /dev/null
        pytest.skip("root here cannot make a device node, and /dev/null is not risked")
    return node


@pytest.fixture(params=["device", "fifo", "socket"])
def special(request, tmp_path):
    """(path, kind in the message, a check that it is still what it was)."""
    if request.param == "device":
        node = char_device(tmp_path)
        return node, "character device", stat.S_ISCHR
    if request.param == "fifo":
        node = tmp_path / "pipe.png"
        os.mkfifo(node)
        return node, "FIFO", stat.S_ISFIFO
    node = tmp_path / "sock.png"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(node))
    request.addfinalizer(s.close)
    return node, "socket", stat.S_ISSOCK


COMMANDS = [
    (["search", "--model", "llama3-8b", "--buckets", "dense", "--out"], "--out"),
    (["bench", "--model", "stories15m", "--num-prompts", "1", "--input-len", "4",
      "--output-len", "2", "--json"], "--json"),
    (["verify", SET, "--device", "cpu", "--out"], "--out"),
    (["profile", "--fake-gpu", "--model", "llama3-8b", "--quick", "--out"], "--out"),
    (["profile", "rederive", PROFILE, "--out"], "--out"),
    (["profile", "forward", PROFILE, "--fake-gpu", "--out"], "--out"),
    (["show", SCHEDULE, "--plot"], "--plot"),
    (["profile", "show", PROFILE, "--plot"], "--plot"),
]


@pytest.mark.parametrize("args, flag", COMMANDS, ids=[" ".join(c[0][:2]) for c in COMMANDS])
def test_output_flags_refuse_devices_fifos_and_sockets(args, flag, special):
    node, kind, is_kind = special
    line = refused([*args, str(node)], flag, str(node), kind, "not a regular file")
    assert "replace" in line
    assert is_kind(os.stat(node).st_mode), f"{node} was replaced"


def test_the_atomic_writer_refuses_a_node_that_appeared_after_the_check(tmp_path):
    """A path checked while it was free, then made a FIFO before the write: the rename would
    replace the FIFO, so the writer checks again right before it."""
    target = tmp_path / "out.json"
    check_output_file(target, "--out")
    os.mkfifo(target)
    with pytest.raises(ConfigError, match="FIFO"):
        write_json_atomic(target, {"a": 1})
    assert stat.S_ISFIFO(os.stat(target).st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left


def test_a_link_to_a_device_is_refused_and_a_link_to_a_file_is_written(tmp_path):
    dev = char_device(tmp_path)
    link = tmp_path / "link.json"
    link.symlink_to(dev)
    with pytest.raises(ConfigError, match="character device"):
        check_output_file(link, "--out")
    regular = tmp_path / "real.json"
    regular.write_text("{}")
    other = tmp_path / "other.json"
    other.symlink_to(regular)
    write_json_atomic(other, {"b": 2})
    assert other.read_text() == '{\n "b": 2\n}\n'


@pytest.mark.parametrize("cmd", [["show"], ["profile", "show"], ["profile", "rederive"]])
def test_an_input_fifo_is_refused_not_waited_on(cmd, tmp_path):
    fifo = tmp_path / "in.json"
    os.mkfifo(fifo)
    refused([*cmd, str(fifo)], str(fifo), "FIFO")
