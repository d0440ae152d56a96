"""Issue 12, cloud side: prefills apart from verify batches, tenants that cannot evict each other, a KV
budget that never evicts what it just admitted, dead peers that release what they hold, safe defaults,
and Generate's finish reason. Real CloudServer on loopback, real gRPC clients.

`ForwardSpy` wraps the real `cloud.packed_forward.forward_packed` (it still runs): it records what every
target forward carried and can hold the forward worker, so a test can queue work behind it.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest

import cloud.packed_forward
from cloud.server import CloudSettings
from cloud_harness import ServerThread, SessionStream
from sprinter.v1 import decoding_pb2 as pb
from sprinter.v1 import decoding_pb2_grpc as pb_grpc

S = grpc.StatusCode
GOOD = 5
TIMEOUT = 20.0
TINY_KV_TOKENS_PER_MB = (1 << 20) // 512  # tiny-random: 512 bytes of KV per token


class ForwardSpy:
    """The real forward_packed, recording each forward's rows (the new tokens of each session) and able to hold."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real = cloud.packed_forward.forward_packed
        self.calls: list[list[list[int]]] = []
        self.released = threading.Event()
        self.released.set()
        self.entered = threading.Event()
        monkeypatch.setattr(cloud.packed_forward, "forward_packed", self)

    def hold(self) -> None:
        """The next forward waits in the worker until `release()`."""
        self.entered.clear()
        self.released.clear()

    def release(self) -> None:
        self.released.set()

    def __call__(self, model, caches, new_tokens, *rest):
        self.calls.append([list(tokens) for tokens in new_tokens])
        self.entered.set()
        self.released.wait(TIMEOUT)
        return self.real(model, caches, new_tokens, *rest)


def in_thread(function, *args) -> tuple[threading.Thread, dict]:
    """Run `function(*args)` in a daemon thread; its result or error lands in the returned dict."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = function(*args)
        except BaseException as err:  # noqa: BLE001 - the test reads it
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def metadata_of(edge: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer token-{edge}"),)


@pytest.fixture()
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.txt"
    path.write_text("alpha token-alpha\nbeta token-beta\n")
    return path


def retry_hint(err: grpc.RpcError) -> int:
    hints = [int(v) for k, v in err.trailing_metadata() or () if k == "retry-after-ms"]
    assert hints, f"no retry-after-ms trailing metadata on {err.code().name}: {err.details()!r}"
    return hints[0]


# ----------------------------------------------------------------------------- item 2: prefill apart


def test_a_long_prefill_runs_in_chunks_while_verifies_go_on(tiny_target, monkeypatch):
    spy = ForwardSpy(monkeypatch)
    settings = CloudSettings(max_context=4096, batch_window_ms=20, max_batch=8)
    chunk = getattr(settings, "max_prefill_chunk", 256)
    with ServerThread(settings, tiny_target) as server, grpc.insecure_channel(server.address) as channel:
        busy = SessionStream(channel)
        length = busy.open([1, 2, 3]).opened.context_length
        opener = SessionStream(channel)
        spy.calls.clear()
        thread, outcome = in_thread(opener.open, [GOOD] * 4000)
        verifies = 0
        while thread.is_alive() or verifies < 3:
            verdict = busy.verify(length, [GOOD]).verdict
            length, verifies = verdict.context_length, verifies + 1
        thread.join()
        assert outcome["result"].opened.context_length == 4000
        busy.close()
        opener.close()
    chunks = [[len(row) for row in rows if len(row) > 32] for rows in spy.calls]
    assert all(len(c) <= 1 for c in chunks), "a forward carried more than one prefill chunk"
    assert all(n <= chunk for c in chunks for n in c), f"a prefill chunk carried more than {chunk} tokens"
    with_chunk = [i for i, c in enumerate(chunks) if c]
    during = spy.calls[with_chunk[0]:with_chunk[-1] + 1]
    verifies_during = sum(len(rows) for rows in during) - len(with_chunk)
    assert verifies_during > 0, "no verify ran while the prompt was prefilled"


# ------------------------------------------------------------------------ item 6: callers that left


def test_a_queued_verify_of_a_caller_that_left_never_runs(tiny_target, monkeypatch):
    spy = ForwardSpy(monkeypatch)
    with ServerThread(CloudSettings(batch_window_ms=1), tiny_target) as server, \
            grpc.insecure_channel(server.address) as channel:
        holder, leaver = SessionStream(channel), SessionStream(channel)
        holder.open([1, 2, 3])
        leaver_id = leaver.open([4, 5, 6]).opened.session_id
        spy.hold()
        held, outcome = in_thread(holder.verify, 3, [7])
        assert spy.entered.wait(TIMEOUT)
        leaver._requests.put(pb.EdgeFrame(verify=pb.VerifyBlock(start_position=3, draft_tokens=[200, 201, 202],
                                                                method=pb.METHOD_BLOCK)))
        time.sleep(0.3)  # the verify is queued behind the held forward
        leaver.call.cancel()
        deadline = time.monotonic() + TIMEOUT
        while server.server.servicer.open_streams > 1:  # the server has seen the cancellation
            assert time.monotonic() < deadline
            time.sleep(0.02)
        spy.release()
        held.join(TIMEOUT)
        assert outcome["result"].WhichOneof("frame") == "verdict"
        ran = [row for rows in spy.calls for row in rows]
        assert [6, 200, 201, 202] not in ran, "the verify of a caller that left still ran"
        back = SessionStream(channel)  # the session is intact: the dropped verify left no trace
        assert back.open([], resume_session_id=leaver_id).opened.context_length == 3
        assert back.verify(3, [7]).WhichOneof("frame") == "verdict"
        back.close()
        holder.close()


def test_streams_beyond_max_streams_are_refused_with_a_retry_hint(tiny_target):
    with ServerThread(CloudSettings(max_streams=2, batch_window_ms=1), tiny_target) as server, \
            grpc.insecure_channel(server.address) as channel:
        streams = [SessionStream(channel) for _ in range(2)]
        for stream in streams:
            assert stream.open([1, 2]).WhichOneof("frame") == "opened"
        extra = SessionStream(channel)
        with pytest.raises(grpc.RpcError) as caught:
            extra.open([1, 2])
        assert caught.value.code() == S.RESOURCE_EXHAUSTED and "--max-streams" in caught.value.details()
        assert retry_hint(caught.value) > 0
        with pytest.raises(grpc.RpcError) as caught:
            list(pb_grpc.TargetServiceStub(channel).Generate(pb.GenerateRequest(prompt_ids=[1], max_new_tokens=1),
                                                             timeout=TIMEOUT))
        assert caught.value.code() == S.RESOURCE_EXHAUSTED and retry_hint(caught.value) > 0
        streams[0].close()
        again = SessionStream(channel)  # a slot is free again
        assert again.open([1, 2]).WhichOneof("frame") == "opened"
        again.close()
        streams[1].close()


FROZEN_CLIENT = textwrap.dedent("""
    import sys, time, grpc
    from sprinter.v1 import decoding_pb2 as pb, decoding_pb2_grpc as pb_grpc
    channel = grpc.insecure_channel(sys.argv[1])
    def requests():
        yield pb.EdgeFrame(open=pb.OpenSession(prompt_ids=[1, 2, 3]))
        time.sleep(3600)
    call = pb_grpc.TargetServiceStub(channel).Session(requests())
    print(next(iter(call)).WhichOneof("frame"), flush=True)
    time.sleep(3600)
""")


@pytest.mark.slow
def test_a_frozen_peer_is_dropped_by_keepalive(tiny_target):
    settings = CloudSettings(keepalive_s=1.0, keepalive_timeout_s=1.0, batch_window_ms=1)
    with ServerThread(settings, tiny_target) as server:
        client = subprocess.Popen([sys.executable, "-c", FROZEN_CLIENT, server.address], stdout=subprocess.PIPE, text=True)
        try:
            assert client.stdout.readline().strip() == "opened"
            assert server.server.servicer.open_streams == 1
            client.send_signal(signal.SIGSTOP)  # alive to the kernel, silent to HTTP/2 pings
            deadline = time.monotonic() + 10
            while server.server.servicer.open_streams:
                assert time.monotonic() < deadline, "the frozen peer's stream is still open"
                time.sleep(0.1)
        finally:
            client.kill()
            client.wait()


# ----------------------------------------------------------------------------- item 3: tenants


def test_one_tenant_opening_sessions_in_a_loop_cannot_evict_another(tiny_target, tokens_file):
    settings = CloudSettings(evict_grace_s=0, evict_older_idle_s=0, auth_tokens=tokens_file, max_sessions=4, batch_window_ms=1)
    with ServerThread(settings, tiny_target) as server, grpc.insecure_channel(server.address) as channel:
        beta = SessionStream(channel, metadata_of("beta"))
        beta.open([1, 2, 3])
        alphas = []
        for i in range(12):  # each on a stream of its own, left behind without a close
            stream = SessionStream(channel, metadata_of("alpha"))
            assert stream.open([1, 2, 3, i]).WhichOneof("frame") == "opened"
            alphas.append(stream)
        assert beta.verify(3, [4]).WhichOneof("frame") == "verdict"
        for stream in [beta, *alphas]:
            stream.close()


def test_one_tenant_filling_the_kv_budget_cannot_evict_another(tiny_target, tokens_file):
    settings = CloudSettings(evict_grace_s=0, evict_older_idle_s=0, auth_tokens=tokens_file, kv_budget_mb=1, max_context=TINY_KV_TOKENS_PER_MB,
                             batch_window_ms=1)
    with ServerThread(settings, tiny_target) as server, grpc.insecure_channel(server.address) as channel:
        beta = SessionStream(channel, metadata_of("beta"))
        beta.open([GOOD] * 500)
        alphas = [SessionStream(channel, metadata_of("alpha")) for _ in range(5)]
        for stream in alphas:  # 5 x 600 tokens: far more than the 2048 the budget holds
            assert stream.open([GOOD] * 600).WhichOneof("frame") == "opened"
        assert server.server.servicer.host.store.kv_bytes <= 1 << 20
        assert beta.verify(500, [GOOD]).WhichOneof("frame") == "verdict"
        for stream in [beta, *alphas]:
            stream.close()


def test_a_second_open_on_a_stream_closes_the_first_session(tiny_target):
    with ServerThread(CloudSettings(batch_window_ms=1), tiny_target) as server, \
            grpc.insecure_channel(server.address) as channel:
        stream = SessionStream(channel)
        first = stream.open([1, 2, 3]).opened.session_id
        again = stream.open([], resume_session_id=first).opened  # resuming the same session keeps it
        assert again.resumed and again.session_id == first
        second = stream.open([4, 5]).opened.session_id
        assert second != first and len(server.server.servicer.host.store) == 1
        other = SessionStream(channel)
        assert other.open([], resume_session_id=first).error.code == S.NOT_FOUND.value[0]
        other.close()
        assert stream.verify(2, [6]).WhichOneof("frame") == "verdict"
        stream.close()


def test_concurrent_generates_beyond_the_edge_quota_are_refused_with_a_retry_hint(tiny_target, monkeypatch):
    spy = ForwardSpy(monkeypatch)
    quota = getattr(CloudSettings(), "edge_max_generate", 4)
    with ServerThread(CloudSettings(batch_window_ms=1), tiny_target) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TargetServiceStub(channel)
        request = pb.GenerateRequest(prompt_ids=[1, 2, 3], max_new_tokens=2)
        spy.hold()
        running = [in_thread(lambda: list(stub.Generate(request, timeout=TIMEOUT))) for _ in range(quota)]
        assert spy.entered.wait(TIMEOUT)
        time.sleep(0.3)  # every admitted Generate is queued behind the held forward
        try:
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(request, timeout=3))
            assert caught.value.code() == S.RESOURCE_EXHAUSTED, caught.value
            assert "concurrent Generate" in caught.value.details() and retry_hint(caught.value) > 0
        finally:
            spy.release()
        for thread, outcome in running:
            thread.join(TIMEOUT)
            assert outcome["result"][-1].finished
        assert list(stub.Generate(request, timeout=TIMEOUT))[-1].finished  # slots are given back


def test_generate_counts_against_the_kv_budget(tiny_target):
    settings = CloudSettings(evict_grace_s=0, evict_older_idle_s=0, kv_budget_mb=1, max_context=TINY_KV_TOKENS_PER_MB, batch_window_ms=1)
    with ServerThread(settings, tiny_target) as server, grpc.insecure_channel(server.address) as channel:
        idle = SessionStream(channel)
        idle.open([GOOD] * 1500)
        chunks = list(pb_grpc.TargetServiceStub(channel).Generate(
            pb.GenerateRequest(prompt_ids=[GOOD] * 1000, max_new_tokens=8), timeout=TIMEOUT))
        assert chunks[-1].finished
        # 1500 + 1008 tokens do not fit 2048: the idle session made room for the Generate
        assert idle.verify(1500, [GOOD]).error.code == S.NOT_FOUND.value[0]
        idle.close()


# ----------------------------------------------------------------------------- item 4: the budget


def test_an_open_that_cannot_fit_beside_busy_sessions_is_refused_with_a_retry_hint(tiny_target, monkeypatch):
    spy = ForwardSpy(monkeypatch)
    settings = CloudSettings(evict_grace_s=0, evict_older_idle_s=0, kv_budget_mb=1, max_context=TINY_KV_TOKENS_PER_MB, batch_window_ms=1)
    with ServerThread(settings, tiny_target) as server, grpc.insecure_channel(server.address) as channel:
        busy = SessionStream(channel)
        busy.open([GOOD] * 1500)
        spy.hold()
        held, verified = in_thread(busy.verify, 1500, [GOOD])
        assert spy.entered.wait(TIMEOUT)
        newcomer = SessionStream(channel)
        thread, outcome = in_thread(newcomer.open, [GOOD] * 1000)
        thread.join(3)
        spy.release()
        thread.join(TIMEOUT)
        held.join(TIMEOUT)
        frame = outcome["result"]
        assert frame.WhichOneof("frame") == "error", frame
        assert frame.error.code == S.RESOURCE_EXHAUSTED.value[0] and frame.error.retry_after_ms > 0
        assert "KV" in frame.error.message
        assert len(server.server.servicer.host.store) == 1  # nothing half-built is left behind
        length = verified["result"].verdict.context_length
        assert busy.verify(length, [GOOD]).WhichOneof("frame") == "verdict"
        busy.close()
        newcomer.close()


def test_a_verify_whose_growth_cannot_fit_beside_busy_sessions_is_refused_and_the_budget_holds(tiny_target, monkeypatch):
    # 1 MiB = 2048 tiny tokens in 64-token pages. The first session is granted its prompt's pages and two spare
    # (1152); the second only the pages the budget has left (896 of its 880-token prompt's 960 with spares).
    spy = ForwardSpy(monkeypatch)
    settings = CloudSettings(evict_grace_s=0, evict_older_idle_s=0, kv_budget_mb=1, max_context=TINY_KV_TOKENS_PER_MB, batch_window_ms=1)
    with ServerThread(settings, tiny_target) as server, grpc.insecure_channel(server.address) as channel:
        store = server.server.servicer.host.store
        busy, grower = SessionStream(channel), SessionStream(channel)
        busy.open([GOOD] * 1000)
        grower.open([GOOD] * 880)
        assert store.kv_bytes == 1 << 20
        spy.hold()
        held, verified = in_thread(busy.verify, 1000, [GOOD])
        assert spy.entered.wait(TIMEOUT)
        refused = grower.verify(880, [GOOD] * 20)  # 900 entries need a 15th page, and the busy session holds the rest
        assert store.kv_bytes <= 1 << 20
        spy.release()
        held.join(TIMEOUT)
        assert refused.WhichOneof("frame") == "error", refused
        assert refused.error.code == S.RESOURCE_EXHAUSTED.value[0] and refused.error.retry_after_ms > 0
        assert "KV" in refused.error.message
        assert verified["result"].WhichOneof("frame") == "verdict"
        # Nothing was computed for the refused block: the same frame goes through once the other session is idle
        # (and is evicted for it), and the budget still holds.
        assert grower.verify(880, [GOOD] * 20).WhichOneof("frame") == "verdict"
        assert store.kv_bytes <= 1 << 20 and len(store) == 1
        grower.close()
        busy.close()


@pytest.mark.parametrize("settings, flag", [
    (dict(kv_budget_mb=0), "--kv-budget-mb"),
    (dict(kv_budget_mb=-5), "--kv-budget-mb"),
    (dict(max_sessions=0), "--max-sessions"),
    (dict(max_block=0), "--max-block"),
    (dict(max_context=8, max_block=32), "--max-context"),
    (dict(max_batch=0), "--max-batch"),
    (dict(idle_timeout_s=0), "--idle-timeout-s"),
    (dict(batch_window_ms=-1), "--batch-window-ms"),
    (dict(engine="tensorrt"), "--engine"),
    (dict(engine="vllm", max_logprobs=0), "--max-logprobs"),
    (dict(engine="vllm", gpu_memory_utilization=1.5), "--gpu-memory-utilization"),
    # a flag one engine does not have is refused with the other, never ignored
    (dict(engine="vllm", batch_window_ms=5), "--batch-window-ms"),
    (dict(engine="vllm", edge_kv_budget_mb=64), "--edge-kv-budget-mb"),
    (dict(tensor_parallel_size=2), "--tensor-parallel-size"),
    (dict(quantization="fp8"), "--quantization"),
    (dict(max_logprobs=128), "--max-logprobs"),
])
def test_nonsense_flags_are_refused(settings, flag):
    with pytest.raises(ValueError, match=flag):
        CloudSettings(**settings)


def test_a_kv_budget_that_cannot_hold_one_full_context_is_refused_at_start(tiny_target):
    # tiny-random: 4096 tokens of context need 2 MB of KV
    with pytest.raises(RuntimeError, match="--kv-budget-mb"):
        with ServerThread(CloudSettings(kv_budget_mb=1, max_context=4096), tiny_target):
            pass


# ----------------------------------------------------------------------------- item 7: defaults


def test_a_non_loopback_address_without_tokens_is_refused(tokens_file):
    with pytest.raises(ValueError, match="--allow-unauthenticated"):
        CloudSettings(host="0.0.0.0")
    CloudSettings(host="0.0.0.0", auth_tokens=tokens_file)
    CloudSettings(host="0.0.0.0", allow_unauthenticated=True)
    CloudSettings(host="localhost")
    CloudSettings(host="::1")


def test_the_metrics_endpoint_drops_a_silent_connection(tiny_target):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = CloudSettings(metrics_port=port, metrics_read_timeout_s=0.5, batch_window_ms=1)
    with ServerThread(settings, tiny_target):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as silent:
            silent.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the end of the headers
            started = time.monotonic()
            assert silent.recv(1) == b""  # the server hangs up
            assert time.monotonic() - started < 3


# ----------------------------------------------------------------------------- item 1: finish reason


def test_generate_says_why_it_finished(tiny_target):
    with ServerThread(CloudSettings(max_context=64, batch_window_ms=1), tiny_target) as server, \
            grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TargetServiceStub(channel)

        def last(prompt: list[int], max_new_tokens: int) -> pb.GenerateChunk:
            chunks = list(stub.Generate(pb.GenerateRequest(prompt_ids=prompt, max_new_tokens=max_new_tokens),
                                        timeout=TIMEOUT))
            assert chunks[-1].finished and not any(c.finished or c.finish_reason for c in chunks[:-1])
            return chunks[-1]

        eos = last([3, 5], 40)  # tiny-random's greedy continuation of [3, 5] ends with EOS after 20 tokens
        assert eos.finish_reason == "stop" and list(eos.token_ids) == [256]
        assert last([3, 5], 4).finish_reason == "length"
        assert last([GOOD] * 61, 100).finish_reason == "length"  # the context limit
