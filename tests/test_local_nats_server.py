"""common.nats_server: a server that cannot start says why, and leaves nothing behind."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from common.nats_server import LocalNatsServer, free_port


def _meshserve_tmp_dirs() -> set[Path]:
    import tempfile

    return set(Path(tempfile.gettempdir()).glob("meshserve-nats-*"))


def test_a_rejected_config_is_quoted_in_the_error() -> None:
    before = _meshserve_tmp_dirs()
    with pytest.raises(RuntimeError, match=r"exited with code 1: .*Parse error on line 1"):
        LocalNatsServer.start(config="this is { not valid")
    assert _meshserve_tmp_dirs() == before  # its store and log were removed


def test_a_taken_port_is_named_in_the_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        with pytest.raises(RuntimeError, match=r"exited with code 1: .*address already in use"):
            LocalNatsServer.start(port=port, jetstream=False)


def test_a_started_server_listens_and_stop_removes_its_folder() -> None:
    server = LocalNatsServer.start(port=free_port(), jetstream=False)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=2) as conn:
            assert conn.recv(4).startswith(b"INFO")
        assert (server.store_dir / "nats-server.log").is_file()
    finally:
        server.stop()
    assert not server.store_dir.exists()
