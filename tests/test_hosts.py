"""The multi-host harness itself (tests/support/hosts.py, listeners.py): hosts reach each other
on their own link and nothing else, teardown leaves nothing behind, and the network rule's
reading of `ss`. Network namespaces need root (CI runs as root: there a missing capability
fails the test)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import listeners
from tests.support.hosts import hosts_for_test, namespace_pids
from tests.support.procs import list_processes

SERVE = (
    "import socket, sys; s = socket.create_server((sys.argv[1], 7000)); print('up', flush=True);"
    "c, _ = s.accept(); c.sendall(b'hello from ' + sys.argv[1].encode()); c.close()"
)
FETCH = (
    "import socket, sys; c = socket.create_connection((sys.argv[1], 7000), timeout=5);"
    "print(c.recv(100).decode())"
)


@pytest.fixture
def hosts(tmp_path):
    made = hosts_for_test(2)
    yield made
    made.stop()


def test_a_host_reaches_another_on_the_test_link_and_the_machine_has_no_address_there(
    hosts, tmp_path
):
    server = hosts.spawn(
        hosts[0], [sys.executable, "-c", SERVE, hosts[0].address], log=tmp_path / "s"
    )
    for _ in range(100):
        if (tmp_path / "s").read_text().startswith("up"):
            break
        subprocess.run(["sleep", "0.05"], check=True)
    # the machine's own namespace has no address on the test link (nothing is sent there)
    subnet = hosts[0].address.rsplit(".", 1)[0] + "."
    assert (
        subnet not in subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
    )
    there = hosts.run(hosts[1], [sys.executable, "-c", FETCH, hosts[0].address])
    assert there.stdout.strip() == f"hello from {hosts[0].address}"
    server.wait(timeout=10)
    assert hosts.run(hosts[1], ["ip", "-br", "addr"]).stdout.count(hosts[1].address) == 1


def test_stop_ends_every_process_inside_and_deletes_the_namespaces(hosts, tmp_path):
    hosts.spawn(hosts[1], ["sleep", "600"], log=tmp_path / "sleep")
    # a daemon: leaves its process group and closes the output pipe `run` waits on
    daemon = "import os, time; os.fork() or (os.setsid(), os.closerange(0, 3), time.sleep(600))"
    hosts.run(hosts[0], [sys.executable, "-c", daemon])
    inside = hosts.pids()
    assert len(inside) >= 2
    names = hosts.names()
    hosts.stop()
    running = {p.pid for p in list_processes() if p.state != "Z"}  # a zombie waits for init
    assert not running & set(inside)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [name for name in names if name in listed]
    assert namespace_pids(names[0]) == []


def test_the_network_rule_reads_ss_and_flags_only_our_sockets_beyond_loopback(monkeypatch):
    lines = "\n".join(
        [
            'tcp LISTEN 0 4096 127.0.0.1:50051 0.0.0.0:* users:(("python",pid=11,fd=7))',
            'tcp LISTEN 0 4096 [::1]:50052 [::]:* users:(("python",pid=11,fd=8))',
            'tcp LISTEN 0 4096 [::ffff:127.0.0.1]:50053 *:* users:(("python",pid=11,fd=9))',
            'tcp LISTEN 0 4096 *:6379 *:* users:(("gcs_server",pid=12,fd=9),("x",pid=13,fd=1))',
            'tcp ESTAB 0 0 192.0.2.2:4000 203.0.113.80:443 users:(("pip",pid=14,fd=3))',
            "tcp TIME-WAIT 0 0 192.0.2.2:4001 203.0.113.80:443",
        ]
    )
    monkeypatch.setattr(
        subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, lines, "")
    )
    found = listeners.sockets()
    assert [s.pids for s in found] == [(11,), (11,), (11,), (12, 13), (14,), ()]
    loopback = [True, True, True, False, False, False]
    assert [listeners.is_loopback(s.local) for s in found] == loopback
    assert [str(s) for s in listeners.stray_sockets({11, 13})] == [
        "tcp LISTEN *:6379 -> *:* pids [12, 13]"
    ]
    assert listeners.stray_sockets({14}) == [found[4]]


def test_our_processes_are_the_descendants_and_their_sessions():
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        ours = listeners.our_processes()
        assert {os.getpid(), child.pid} <= ours
        assert 1 not in ours
    finally:
        child.kill()
        child.wait()
