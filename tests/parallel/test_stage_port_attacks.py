"""Attacks on the ports of a real `shoal stage` server and of a tensor-parallel rank 0: random
bytes, truncated handshakes, a pickle payload whose unpickling would create a file, typed frames
from peers without the cluster secret or with another one, a replayed recording of an authentic
connection, and malformed frames from a peer that does hold the secret. The stage answers none of
them, executes nothing, and still answers an authentic Probe afterwards; rank 0 gives its batches
to its followers only."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import random
import socket
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from shoal.config.engine import EngineConfig
from shoal.engine.sampling_params import SamplingParams
from shoal.llm import LLM
from shoal.parallel.cluster_sockets import ClusterContext
from shoal.processes import free_port
from shoal.protocol.cluster_secret import SECRET_ENV
from shoal.protocol.frames import TensorSpec
from shoal.protocol.stage_frames import (
    HEAD_INBOX,
    Ping,
    Pong,
    Probe,
    Profiled,
    Setup,
    Step,
    encode,
)
from shoal.protocol.step_batch import StepBatchFrame
from tests.support.waiting import wait_for

SECRET = "the-stage-port-attacks-secret"
REFUSED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH)
ZMTP_GREETING_BYTES = 64


class CreatesFile:
    """Unpickling this opens (creates) `path`: what an attacker would send a pickle-reading port."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


class Stage:
    """A `shoal stage` server process on loopback, with the secret, logging to `log`."""

    def __init__(self, directory: Path, cache_dir: Path):
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.log = directory / "stage.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "shoal.cli", "stage", "--bind", self.address],
                env={**os.environ, SECRET_ENV: SECRET, "SHOAL_CACHE_DIR": str(cache_dir)},
                stderr=log,
            )

    def log_count(self, text: str) -> int:
        return self.log.read_text().count(text)


class Head:
    """An authentic head's end of the links: an inbox where answers arrive, and a link to the stage."""

    def __init__(self, stage: Stage, config: EngineConfig):
        self.engine_config, self.config = config, config.to_json()
        self.links = ClusterContext(SECRET)
        self.inbox, self.address = self.links.bind_to_random_port(zmq.PULL, "127.0.0.1")
        self.control = self.links.connect(zmq.PUSH, stage.address)
        self.answers: list = []

    def probe(self, ident: int) -> Probe:
        return Probe(ident, self.config, self.address)

    def answered(self, ident: int) -> bool:
        """Whether a Profiled for `ident` has arrived (every answer is kept in `answers`)."""
        while self.inbox.poll(0):
            self.answers.append(HEAD_INBOX.decode(self.inbox.recv()).message)
        return any(isinstance(a, Profiled) and a.ident == ident for a in self.answers)

    def check_still_served(self, ident: int, timeout_s: float = 120) -> None:
        """An authentic Probe sent now is answered, and nothing else has arrived."""
        self.control.send(encode(self.probe(ident)))
        wait_for(lambda: self.answered(ident), timeout_s=timeout_s)
        assert [(type(a).__name__, a.ident) for a in self.answers] == [("Profiled", ident)]
        self.answers.clear()

    def close(self) -> None:
        self.links.close()


@pytest.fixture(scope="module")
def stage(tmp_path_factory, shoal_cache_dir):
    stage = Stage(tmp_path_factory.mktemp("stage"), shoal_cache_dir)
    yield stage
    stage.process.kill()
    stage.process.wait()


@pytest.fixture
def head(stage, tiny_model_dir, shoal_cache_dir):
    head = Head(
        stage, EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", cache_dir=str(shoal_cache_dir))
    )
    head.check_still_served(ident=1, timeout_s=600)  # the stage is up (it may build kernels first) and answers
    yield head
    assert head.answers == [] and stage.process.poll() is None
    head.close()


def pickle_payload(marker: Path, control: Path) -> bytes:
    """A pickle that creates `marker` when loaded; proven on `control`, loaded here."""
    pickle.loads(pickle.dumps(CreatesFile(control)))
    assert control.exists()
    return pickle.dumps(CreatesFile(marker))


def handshake_refused(sock: zmq.Socket) -> callable:
    """A condition: the socket's peer refused its handshake (none succeeded before)."""
    events = sock.get_monitor_socket()

    def refused() -> bool:
        while events.poll(0):
            event = recv_monitor_message(events)["event"]
            assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED, "the stage accepted a peer without the secret"
            if event in REFUSED:
                return True
        return False

    return refused


def read_until_closed(conn: socket.socket) -> bytes:
    """What the stage sends on a raw connection before it closes (or resets) it."""
    conn.settimeout(60)
    received = b""
    try:
        while chunk := conn.recv(4096):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def test_random_bytes_and_truncated_handshakes_get_no_answer(stage, head):
    garbage = random.Random(15).randbytes(8192)
    with socket.create_connection(("127.0.0.1", stage.port)) as conn:
        conn.sendall(garbage)
        assert len(read_until_closed(conn)) <= ZMTP_GREETING_BYTES  # at most the stage's own greeting
    # A greeting cut short, and one announcing the NULL mechanism followed by a cut-off frame.
    null_greeting = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
    for prefix in (null_greeting[:7], null_greeting + b"\x04\x29\x05READY", null_greeting + b"\x00\x40abc"):
        with socket.create_connection(("127.0.0.1", stage.port)) as conn:
            conn.sendall(prefix)
    head.check_still_served(ident=2)


def test_peers_without_the_secret_cannot_connect_and_nothing_is_executed(stage, head, tmp_path):
    marker = tmp_path / "created-by-the-stage"
    payload = pickle_payload(marker, tmp_path / "created-by-this-test")
    plain, wrong = zmq.Context(), ClusterContext("another-secret")
    attackers = [plain.socket(zmq.PUSH), wrong.connect(zmq.PUSH, stage.address)]
    refusals = [handshake_refused(sock) for sock in attackers]
    attackers[0].connect(stage.address)
    try:
        for sock in attackers:
            sock.setsockopt(zmq.LINGER, 0)
            # Without blocking: once its handshake is refused a PUSH socket has no peer left, and a
            # blocking send would wait for one forever (nothing can be sent then, which is the point).
            with contextlib.suppress(zmq.Again):
                sock.send(encode(head.probe(ident=66)), zmq.NOBLOCK)  # typed, well formed, to the head's inbox
                sock.send(payload, zmq.NOBLOCK)
                sock.send_multipart([payload, pickle.dumps(((1,), "float32")), b"\x00" * 4], zmq.NOBLOCK)  # old layout
        for refused in refusals:
            wait_for(refused, timeout_s=30)
        head.check_still_served(ident=3)
        assert not marker.exists()
        wait_for(lambda: stage.log_count("refused a connection") > 0)
    finally:
        plain.destroy(linger=0)
        wrong.close()


def test_malformed_frames_from_a_peer_with_the_secret_are_dropped(stage, head, tmp_path):
    """Each is dropped with a warning and answered by nothing; the Probe after them, on the same
    connection (so handled after them), is answered."""
    marker = tmp_path / "created-by-the-stage"
    payload = pickle_payload(marker, tmp_path / "created-by-this-test")
    batch = StepBatchFrame([5, 6], [0, 1], [2], [0], [[[0]]], [1])
    step = encode(Step(1, batch, 0), TensorSpec((2, 64), "float32"))
    bad = [
        [random.Random(1).randbytes(300)],
        [payload],
        [payload, pickle.dumps(((2, 64), "float32")), bytes(512)],
        [encode(head.probe(ident=70))[:-3]],  # truncated
        [encode(head.probe(ident=71)), b"extra"],  # a frame too many
        [step],  # its tensor frame missing
        [step, bytes(511)],  # a byte short of its shape
        [encode(Step(1, batch, 0), TensorSpec((2, 64), "int64")), bytes(1024)],  # a dtype off the list
        [encode(Step(1, batch, 0))],  # no tensor spec at all
        [encode(Pong(1, 1, 0.0))],  # a message for the head, not for a stage
        [encode(Ping(7))],  # valid, but before any Setup
        [encode(Probe(72, '{"block_size": "many"}', head.address))],
        [encode(Probe(75, dataclasses.replace(head.engine_config, model="/no/such/model").to_json(), head.address))],
        [encode(Probe(73, head.config, "not-an-address"))],
        [encode(Setup(1, 74, head.config, 2, 1, 16, None, None, head.address, "auto"))],  # no layers
        [encode(Setup(1, 76, head.config, 0, 1, 16, None, None, head.address, "load"))],  # torch.load?
    ]
    dropped_before = stage.log_count("dropped a message")
    for frames in bad:
        head.control.send_multipart(frames)
    head.check_still_served(ident=4)
    assert stage.log_count("dropped a message") - dropped_before == len(bad)
    assert not marker.exists()


class RecordingProxy:
    """Forwards one TCP connection to the stage, recording every byte the client sent."""

    def __init__(self, stage: Stage):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.stage_port = stage.port
        self.recorded = bytearray()
        self.done = threading.Event()
        threading.Thread(target=self._forward, daemon=True).start()

    def _forward(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self.stage_port))
        back = threading.Thread(target=self._pump, args=(upstream, client, None), daemon=True)
        back.start()
        self._pump(client, upstream, self.recorded)
        back.join()
        self.done.set()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, record: bytearray | None) -> None:
        try:
            while chunk := source.recv(65536):
                if record is not None:
                    record += chunk
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for conn in (source, sink):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def test_a_recorded_authentic_connection_replayed_is_refused(stage, head):
    """CURVE's handshake takes a fresh key from the stage: the recording's cannot complete it."""
    proxy = RecordingProxy(stage)
    client = ClusterContext(SECRET)
    try:
        sock = client.connect(zmq.PUSH, proxy.address)
        sock.send(encode(head.probe(ident=80)))
        wait_for(lambda: head.answered(80), timeout_s=120)  # the recording holds an authentic Probe
        head.answers.clear()
    finally:
        client.close()
    wait_for(proxy.done.is_set)
    with socket.create_connection(("127.0.0.1", stage.port)) as conn:
        conn.sendall(bytes(proxy.recorded))
        read_until_closed(conn)  # the stage ends the connection
    head.check_still_served(ident=5)  # and Profiled 80 did not come a second time


@pytest.mark.parametrize("bind", ["tcp://127.0.0.1", "tcp://0.0.0.0"])
def test_a_stage_server_without_the_secret_refuses_to_start(bind):
    environment = {key: value for key, value in os.environ.items() if key != SECRET_ENV}
    result = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "stage", "--bind", f"{bind}:{free_port()}"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0 and f"${SECRET_ENV}" in result.stderr


def test_tensor_parallel_rank_zero_gives_its_batches_to_its_followers_only(
    tiny_model_dir, shoal_cache_dir, monkeypatch
):
    """No secret configured: rank 0 draws one for the run and hands it to its follower. Peers
    connecting to rank 0's step socket without it get none of the batches (a PUSH socket would
    otherwise deal them out round robin), and the tokens are the single process's. The ranks'
    gathers use no socket at all: the follower listens on nothing and connects only to rank 0's
    step socket, and their shared-memory file has no name left for another process to open."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    options = {"dtype": "float32", "kv_cache_bytes": 16 << 20, "cache_dir": str(shoal_cache_dir)}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[3, 17, 29, 41, 5], [9, 8, 7]]
    single = LLM(str(tiny_model_dir), **options)
    try:
        expected = [o.outputs[0].token_ids for o in single.generate(prompts, params)]
    finally:
        single.shutdown()
    group = LLM(str(tiny_model_dir), tensor_parallel_size=2, **options)
    plain, wrong = zmq.Context(), ClusterContext("a-guessed-secret")
    try:
        address = group.engine.tensor_group._sockets[0].last_endpoint.decode()
        with socket.create_connection(("127.0.0.1", int(address.rsplit(":", 1)[1]))) as conn:
            conn.sendall(random.Random(2).randbytes(4096))
            assert len(read_until_closed(conn)) <= ZMTP_GREETING_BYTES
        thieves = [plain.socket(zmq.PULL), wrong.connect(zmq.PULL, address)]
        refusals = [handshake_refused(sock) for sock in thieves]
        thieves[0].connect(address)
        for refused in refusals:
            wait_for(refused, timeout_s=30)
        assert [o.outputs[0].token_ids for o in group.generate(prompts, params)] == expected
        assert not any(sock.poll(0) for sock in thieves)
        follower = psutil.Process(group.engine.tensor_group.followers[0].pid)
        connections = follower.net_connections("inet")
        assert not [c for c in connections if c.status == psutil.CONN_LISTEN]
        assert {c.raddr.port for c in connections if c.raddr} == {int(address.rsplit(":", 1)[1])}
        assert not os.path.exists(group.engine.tensor_group.links.path)
    finally:
        group.shutdown()
        plain.destroy(linger=0)
        wrong.close()
