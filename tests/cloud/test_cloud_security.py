"""The cloud service as operators see it: TLS, bearer tokens, health checking, reflection, draining.

Everything goes through standard clients (grpc TLS credentials, grpc_health's HealthStub,
grpc_reflection's descriptor database), so any off-the-shelf tool that speaks them works too.
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

import cloud.server
from cloud.server import SERVICE_NAME, CloudServer, CloudSettings
from cloud_harness import ServerThread, SessionStream
from sprinter.v1 import decoding_pb2 as pb
from sprinter.v1 import decoding_pb2_grpc as pb_grpc

S = grpc.StatusCode
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TIMEOUT = 20.0
HOW_TO_AUTHENTICATE = "authorization: Bearer <token>"


def health_status(channel: grpc.Channel, service: str = "") -> int:
    request = health_pb2.HealthCheckRequest(service=service)
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=TIMEOUT).status


def wait_for_health(channel: grpc.Channel, status: int, deadline_s: float = 10.0) -> None:
    deadline = time.monotonic() + deadline_s
    while health_status(channel, SERVICE_NAME) != status:
        assert time.monotonic() < deadline, f"health never became {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"
        time.sleep(0.02)


def one_verify(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] | None = None) -> pb.Verdict:
    stream = SessionStream(channel, metadata)
    opened = stream.open([1, 2, 3]).opened
    assert opened.session_id and opened.context_length == 3
    frame = stream.verify(3, [4, 5])
    assert frame.WhichOneof("frame") == "verdict", frame
    stream.close()
    return frame.verdict


def generated_tokens(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] | None = None) -> list[int]:
    chunks = list(pb_grpc.TargetServiceStub(channel).Generate(
        pb.GenerateRequest(prompt_ids=[1, 2, 3], max_new_tokens=4), metadata=metadata, timeout=TIMEOUT))
    assert chunks and chunks[-1].finished
    return [t for c in chunks for t in c.token_ids]


def assert_call_fails(err: grpc.RpcError, code: grpc.StatusCode, *phrases: str) -> None:
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {err.details()!r}"
    for phrase in phrases:
        assert phrase in (err.details() or ""), f"{phrase!r} not in {err.details()!r}"


# ------------------------------------------------------------------------------------------------- TLS


def _self_signed(directory: Path) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.fixture(scope="module")
def tls_cloud(tiny_target, tmp_path_factory):
    cert, key = _self_signed(tmp_path_factory.mktemp("tls"))
    with ServerThread(CloudSettings(tls_cert=cert, tls_key=key, batch_window_ms=1), tiny_target) as server:
        yield server, cert.read_bytes()


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
def test_tls_serves_info_sessions_and_generate(tls_cloud, host):
    server, cert = tls_cloud
    credentials = grpc.ssl_channel_credentials(root_certificates=cert)
    with grpc.secure_channel(f"{host}:{server.server.port}", credentials) as channel:
        info = pb_grpc.TargetServiceStub(channel).GetInfo(pb.GetInfoRequest(), timeout=TIMEOUT)
        assert info.model_id == "tiny-random" and info.vocab_size == 259
        verdict = one_verify(channel)
        assert verdict.context_length == 3 + verdict.n_accepted + 1
        assert 1 <= len(generated_tokens(channel)) <= 4
        assert health_status(channel) == SERVING


def test_tls_port_refuses_plaintext(tls_cloud):
    server, _ = tls_cloud
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.TargetServiceStub(channel).GetInfo(pb.GetInfoRequest(), timeout=5)
    assert caught.value.code() == S.UNAVAILABLE, caught.value


def test_tls_client_refuses_an_untrusted_certificate(tls_cloud, tmp_path):
    server, _ = tls_cloud
    other_cert, _ = _self_signed(tmp_path / "other")  # a CA the server's certificate does not chain to
    credentials = grpc.ssl_channel_credentials(root_certificates=other_cert.read_bytes())
    with grpc.secure_channel(f"localhost:{server.server.port}", credentials) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.TargetServiceStub(channel).GetInfo(pb.GetInfoRequest(), timeout=5)
    assert caught.value.code() == S.UNAVAILABLE, caught.value


def test_tls_needs_both_certificate_and_key(tiny_target, tmp_path):
    cert, _ = _self_signed(tmp_path)
    with pytest.raises(RuntimeError, match="TLS needs both"):
        with ServerThread(CloudSettings(tls_cert=cert), tiny_target):
            pass


# -------------------------------------------------------------------------------------- bearer tokens

EDGE_A = (("authorization", "Bearer tokenA"),)
EDGE_B = (("authorization", "Bearer tokenB"),)


@pytest.fixture(scope="module")
def auth_cloud(tiny_target, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text("edge-a tokenA\nedge-b tokenB")
    with ServerThread(CloudSettings(auth_tokens=tokens, batch_window_ms=1), tiny_target) as server:
        yield server


@pytest.fixture()
def auth_channel(auth_cloud):
    with grpc.insecure_channel(auth_cloud.address) as channel:
        yield channel


BAD_CREDENTIALS = {
    "no metadata": None,
    "wrong token": (("authorization", "Bearer tokenC"),),
    "token without Bearer": (("authorization", "tokenA"),),
    "other scheme": (("authorization", "Basic tokenA"),),
    "token with a suffix": (("authorization", "Bearer tokenA2"),),
    "empty token": (("authorization", "Bearer "),),
    "token in another header": (("x-token", "tokenA"),),
}


@pytest.mark.parametrize("name", BAD_CREDENTIALS)
def test_unauthenticated_calls_are_refused_with_instructions(auth_channel, name):
    metadata = BAD_CREDENTIALS[name]
    stub = pb_grpc.TargetServiceStub(auth_channel)
    with pytest.raises(grpc.RpcError) as caught:
        stub.GetInfo(pb.GetInfoRequest(), metadata=metadata, timeout=TIMEOUT)
    assert_call_fails(caught.value, S.UNAUTHENTICATED, HOW_TO_AUTHENTICATE)

    stream = SessionStream(auth_channel, metadata)
    with pytest.raises(grpc.RpcError) as caught:
        stream.open([1, 2, 3])
    assert_call_fails(caught.value, S.UNAUTHENTICATED, HOW_TO_AUTHENTICATE)
    stream.abandon()

    with pytest.raises(grpc.RpcError) as caught:
        generated_tokens(auth_channel, metadata)
    assert_call_fails(caught.value, S.UNAUTHENTICATED, HOW_TO_AUTHENTICATE)


@pytest.mark.parametrize("metadata", [EDGE_A, EDGE_B], ids=["edge-a", "edge-b"])
def test_a_known_bearer_token_is_admitted(auth_channel, metadata):
    info = pb_grpc.TargetServiceStub(auth_channel).GetInfo(pb.GetInfoRequest(), metadata=metadata, timeout=TIMEOUT)
    assert info.model_id == "tiny-random"
    one_verify(auth_channel, metadata)
    assert 1 <= len(generated_tokens(auth_channel, metadata)) <= 4


def test_sessions_belong_to_the_edge_that_opened_them(auth_channel):
    first = SessionStream(auth_channel, EDGE_A)
    session_id = first.open([1, 2, 3]).opened.session_id
    first.abandon()
    thief = SessionStream(auth_channel, EDGE_B)
    error = thief.open([], resume_session_id=session_id).error
    assert error.code == S.PERMISSION_DENIED.value[0] and "another edge" in error.message
    thief.close()
    owner = SessionStream(auth_channel, EDGE_A)
    resumed = owner.open([], resume_session_id=session_id).opened
    assert resumed.resumed and resumed.context_length == 3
    owner.close()


def test_auth_tokens_file_must_not_be_empty_or_malformed(tiny_target, tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("# nobody\n\n")
    with pytest.raises(ValueError, match="no tokens"):
        CloudServer(CloudSettings(auth_tokens=empty), tiny_target)
    malformed = tmp_path / "malformed"
    malformed.write_text("edge-a tokenA\nedge-b\n")
    with pytest.raises(ValueError, match=r"malformed:2: expected 'EDGE_ID TOKEN'"):
        CloudServer(CloudSettings(auth_tokens=malformed), tiny_target)


# ------------------------------------------------------------------------------------ health checking


@pytest.fixture(scope="module")
def plain_cloud(tiny_target):
    with ServerThread(CloudSettings(batch_window_ms=1), tiny_target) as server:
        yield server


@pytest.fixture()
def plain_channel(plain_cloud):
    with grpc.insecure_channel(plain_cloud.address) as channel:
        yield channel


@pytest.mark.parametrize("service", ["", "sprinter.v1.TargetService"])
def test_health_is_serving_once_ready(plain_channel, service):
    assert health_status(plain_channel, service) == SERVING


def test_health_of_an_unknown_service_is_not_found(plain_channel):
    with pytest.raises(grpc.RpcError) as caught:
        health_status(plain_channel, "no.such.Service")
    assert caught.value.code() == S.NOT_FOUND


def test_not_serving_and_unavailable_while_the_model_loads(tiny_target, monkeypatch):
    release = threading.Event()
    loads: list[str] = []

    def slow_load(spec, dtype, device):  # the real CLI path, with a load that finishes when the test says so
        loads.append(spec)
        assert release.wait(30), "the test never released the model load"
        return tiny_target

    monkeypatch.setattr(cloud.server, "load_model", slow_load)
    settings = CloudSettings(target="tiny-random", port=0, batch_window_ms=1)
    with ServerThread(settings, None, wait_ready=False) as background:
        try:
            with grpc.insecure_channel(background.address) as channel:
                for service in ("", SERVICE_NAME):
                    assert health_status(channel, service) == NOT_SERVING
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                                  timeout=TIMEOUT)
                assert next(watch).status == NOT_SERVING

                stub = pb_grpc.TargetServiceStub(channel)
                with pytest.raises(grpc.RpcError) as caught:
                    stub.GetInfo(pb.GetInfoRequest(), timeout=TIMEOUT)
                assert_call_fails(caught.value, S.UNAVAILABLE, "still loading", "retry")
                stream = SessionStream(channel)
                with pytest.raises(grpc.RpcError) as caught:
                    stream.open([1, 2, 3])
                assert_call_fails(caught.value, S.UNAVAILABLE, "still loading")
                stream.abandon()
                with pytest.raises(grpc.RpcError) as caught:
                    generated_tokens(channel)
                assert_call_fails(caught.value, S.UNAVAILABLE, "still loading")
                deadline = time.monotonic() + 10
                while not loads and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert loads == ["tiny-random"]

                release.set()
                assert next(watch).status == SERVING  # the standard Watch sees the switch
                watch.cancel()
                assert health_status(channel, "") == SERVING
                assert stub.GetInfo(pb.GetInfoRequest(), timeout=TIMEOUT).model_id == "tiny-random"
                one_verify(channel)
        finally:
            release.set()  # never leave the load thread waiting


# ------------------------------------------------------------------------------------------ reflection


def test_reflection_lists_and_describes_the_services(plain_channel):
    database = ProtoReflectionDescriptorDatabase(plain_channel)
    services = set(database.get_services())
    assert {"sprinter.v1.TargetService", "grpc.health.v1.Health"} <= services
    pool = DescriptorPool(database)
    target = pool.FindServiceByName("sprinter.v1.TargetService")
    methods = {m.name: m for m in target.methods}
    assert set(methods) == {"GetInfo", "Session", "Generate"}
    assert methods["Session"].input_type.full_name == "sprinter.v1.EdgeFrame"
    assert methods["Session"].output_type.full_name == "sprinter.v1.CloudFrame"
    assert methods["Generate"].output_type.full_name == "sprinter.v1.GenerateChunk"
    assert methods["GetInfo"].output_type.full_name == "sprinter.v1.ServiceInfo"
    edge_frame = pool.FindMessageTypeByName("sprinter.v1.EdgeFrame")
    assert [f.name for f in edge_frame.oneofs_by_name["frame"].fields] == ["open", "verify", "close", "residual_answer"]
    health = pool.FindServiceByName("grpc.health.v1.Health")
    assert {"Check", "Watch"} <= {m.name for m in health.methods}


# -------------------------------------------------------------------------------------------- draining


def _trigger_stop(server: ServerThread) -> None:
    server._loop.call_soon_threadsafe(server.server.stop)  # what ServerThread.__exit__ does, minus the join


def test_drain_refuses_new_sessions_and_lets_open_streams_finish(tiny_target):
    drain_s = 5.0
    server = ServerThread(CloudSettings(drain_s=drain_s, batch_window_ms=1), tiny_target).__enter__()
    try:
        with grpc.insecure_channel(server.address) as channel:
            busy = SessionStream(channel)  # an edge in the middle of a generation
            assert busy.open([1, 2, 3]).WhichOneof("frame") == "opened"
            context = 3
            verdict = busy.verify(context, [4, 5]).verdict
            context = verdict.context_length
            idle = SessionStream(channel)  # a stream admitted before the drain, with no session yet
            assert idle.send(pb.EdgeFrame()).WhichOneof("frame") == "error"

            _trigger_stop(server)
            wait_for_health(channel, NOT_SERVING, deadline_s=drain_s)
            assert health_status(channel, "") == NOT_SERVING

            late = SessionStream(channel)  # a new call is refused outright
            with pytest.raises(grpc.RpcError) as caught:
                late.open([1, 2, 3])
            assert_call_fails(caught.value, S.UNAVAILABLE, "shutting down", "another replica")
            late.abandon()
            with pytest.raises(grpc.RpcError) as caught:
                pb_grpc.TargetServiceStub(channel).GetInfo(pb.GetInfoRequest(), timeout=TIMEOUT)
            assert_call_fails(caught.value, S.UNAVAILABLE, "shutting down")

            # The admitted stream cannot open a session any more, but it is told so with a frame.
            error = idle.open([1, 2, 3]).error
            assert error.code == S.UNAVAILABLE.value[0] and "shutting down" in error.message
            idle.close()

            for _ in range(3):  # the open session keeps verifying through the drain
                frame = busy.verify(context, [6, 7])
                assert frame.WhichOneof("frame") == "verdict", frame
                context = frame.verdict.context_length
            assert server._thread.is_alive(), "the server stopped under an open stream"
            closed_at = time.monotonic()
            busy.close()

            server._thread.join(drain_s + 5)
            assert not server._thread.is_alive(), "the server did not stop after the last stream closed"
            assert time.monotonic() - closed_at < drain_s, "the server waited out drain_s despite no open streams"
            with pytest.raises(grpc.RpcError) as caught:
                pb_grpc.TargetServiceStub(channel).GetInfo(pb.GetInfoRequest(), timeout=5)
            assert caught.value.code() == S.UNAVAILABLE
    finally:
        server.__exit__(None, None, None)


def test_drain_gives_up_on_lingering_streams_after_drain_s(tiny_target):
    drain_s = 0.5
    server = ServerThread(CloudSettings(drain_s=drain_s, batch_window_ms=1), tiny_target).__enter__()
    try:
        with grpc.insecure_channel(server.address) as channel:
            lingering = SessionStream(channel)
            assert lingering.open([1, 2, 3]).WhichOneof("frame") == "opened"
            stopped_at = time.monotonic()
            _trigger_stop(server)
            server._thread.join(drain_s + 10)
            assert not server._thread.is_alive(), "the server waited forever for a stream that never closed"
            assert time.monotonic() - stopped_at >= drain_s
            with pytest.raises(grpc.RpcError) as caught:
                lingering.verify(3, [4])
            assert caught.value.code() in (S.UNAVAILABLE, S.CANCELLED), caught.value
            lingering.abandon()
    finally:
        server.__exit__(None, None, None)
