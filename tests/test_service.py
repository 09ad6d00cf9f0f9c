"""The on-device generation service (gRPC, ``omnidraft device serve|ask|health``) with tiny
models: greedy output equals the target alone, streaming, bad input, a full queue,
cancellation freeing the engine, and learning between requests."""

from __future__ import annotations

import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnidraft.benchmarks.tiny_models import build_pair, corpus
from omnidraft.client.online_learner import OnlineConfig
from omnidraft.client.service import GenerationService, ServiceLimits, serve
from omnidraft.client.session import DeviceSession
from omnidraft.proto import generation_pb2 as pb
from omnidraft.proto import generation_pb2_grpc as pb_grpc
from omnidraft.shared.engine import profiling
from omnidraft.shared.engine.generation import GenerationConfig
from omnidraft.shared.engine.pair import Engine
from omnidraft.shared.engine.profiling import CostProfile

PROMPTS = [t[:30] for t in corpus(12, seed=21)]


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("svc_pair")
    build_pair(d)
    return d


@pytest.fixture
def running(pair_dir, tmp_path):
    """A service on an ephemeral loopback port; yields (service, stub, port)."""
    engine = Engine.load(
        str(pair_dir / "drafter"), str(pair_dir / "target"), "fp64", drafter_weights="fp32", progress=False
    )
    session = DeviceSession(
        engine, target_name="t", state_dir=tmp_path / "state", online=OnlineConfig(interval=2, lr=1e-2)
    )
    service = GenerationService(
        session,
        ServiceLimits(max_prompt_tokens=64, max_new_tokens=200, max_queue=2),
        base=GenerationConfig(draft_stop="confidence"),
        precision="fp64",
    )
    server, port = serve(service, "127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield service, pb_grpc.GenerationStub(channel), port
    finally:
        channel.close()
        server.stop(grace=None).wait()
        service.close()


def test_generate_equals_the_target_alone_and_stream_matches(running):
    service, stub, _ = running
    engine = service.session.engine
    for prompt in PROMPTS[:3]:
        reply = stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=24), timeout=60)
        alone = engine.generate(prompt, GenerationConfig(max_new_tokens=24), method="ar")
        assert reply.text == alone.text
        s = reply.stats
        assert s.new_tokens == 24 and s.target_calls >= 1 and s.finish_reason == "length"
        assert 0 <= s.acceptance_rate <= 1 and s.tokens_per_target_call >= 1 and s.decode_s > 0
        chunks = list(stub.GenerateStream(pb.GenerateRequest(prompt=prompt, max_new_tokens=24), timeout=60))
        assert chunks[-1].done and chunks[-1].stats.new_tokens == 24 and not any(c.done for c in chunks[:-1])
        assert "".join(c.text for c in chunks) == reply.text and len(chunks) > 2


@pytest.mark.parametrize(
    "request_kw, reason",
    [
        ({"prompt": ""}, "empty"),
        ({"prompt": "def f(x):", "max_new_tokens": 500}, "limit of 200"),
        ({"prompt": "def f(x):", "temperature": -1.0}, "temperature"),
        ({"prompt": "def f(x):", "temperature": float("nan")}, "temperature"),
        ({"prompt": "def f(x):", "temperature": float("inf")}, "temperature"),
        ({"prompt": "def f(x):", "stop": ["x"] * 17}, "at most 16 stop strings"),
        ({"prompt": "def f(x):", "stop": ["x" * 257]}, "at most 16 stop strings"),
        ({"prompt": "def f(x):", "top_p": 2.0}, "top_p"),
        ({"prompt": "def alpha(beta, gamma): " * 20}, "at most 64"),
    ],
)
def test_bad_requests_are_invalid_argument(running, request_kw, reason):
    _, stub, _ = running
    for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            call(pb.GenerateRequest(**request_kw), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in err.value.details()


def test_full_queue_is_resource_exhausted(running):
    service, stub, _ = running
    for _ in range(service.limits.max_queue):  # every slot taken
        service._slots.acquire()
    try:
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=4), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        for _ in range(service.limits.max_queue):
            service._slots.release()


def test_cancelled_stream_frees_the_engine(running, monkeypatch):
    """A client that goes away mid-stream: its decode stops at the next verification step and
    the next request runs at once."""
    service, stub, _ = running
    session = service.session
    generate = session.generate
    seen = []

    def slow_generate(*args, on_tokens=None, **kw):
        def slow(ids):
            seen.append(len(ids))
            time.sleep(0.05)
            on_tokens(ids)

        return generate(*args, on_tokens=slow, **kw)

    monkeypatch.setattr(session, "generate", slow_generate)
    call = stub.GenerateStream(pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=200), timeout=60)
    first = next(call)
    assert first.text and not first.done
    call.cancel()
    deadline = time.monotonic() + 10
    while service.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert service.in_flight == 0 and sum(seen) < 200  # stopped early
    monkeypatch.setattr(session, "generate", generate)
    reply = stub.Generate(pb.GenerateRequest(prompt=PROMPTS[2], max_new_tokens=8), timeout=30)
    assert reply.stats.new_tokens == 8 and reply.stats.queue_s < 5
    assert service.requests == 1  # the cancelled request is not counted as answered


def test_learning_between_requests_and_state_saved(running):
    service, stub, _ = running
    for prompt in PROMPTS[:4]:
        stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=16), timeout=60)
    assert service.wait_learned(timeout=120)
    health = stub.Health(pb.HealthRequest(), timeout=10)
    assert health.status == "SERVING" and health.requests == 4 and health.updates == 2
    assert health.precision == "fp64" and health.pending_samples == 0
    saved = json.loads((service.session.state.dir / "state.json").read_text())
    assert saved["updates"] == 2 and saved["prompts_seen"] == 4


def test_every_job_on_the_models_runs_on_the_engine_thread(running, monkeypatch):
    """Requests arrive on gRPC's threads and samples are learned on the learner's, yet every
    decode, adapter update and lent fleet round runs on the service's one engine thread (a second
    thread's forwards are ~3x slower with libgomp: ``shared/runtime/engine_thread``)."""
    import threading

    service, stub, _ = running
    session = service.session
    threads: dict[str, set[int]] = {"generate": set(), "_sample_loss": set(), "save": set()}
    for owner in (session, session.learner):
        for name in threads:
            if hasattr(owner, name):
                method = getattr(owner, name)
                monkeypatch.setattr(
                    owner,
                    name,
                    lambda *a, _m=method, _n=name, **kw: threads[_n].add(threading.get_ident()) or _m(*a, **kw),
                )
    stub.Generate(pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=8), timeout=60)
    list(stub.GenerateStream(pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=8), timeout=60))
    assert service.wait_learned(timeout=60)  # interval 2: one update, its steps' losses
    lent = service.lend_engine(threading.get_ident)
    assert threads == {name: {service.engine_thread.ident} for name in threads}
    assert lent == service.engine_thread.ident != threading.get_ident()


def test_a_request_runs_between_the_steps_of_an_update(running, monkeypatch):
    """Learning is a background job per optimizer step: a request that arrives during an update
    waits for the step running, not for the whole update."""
    import threading
    import time

    service, stub, _ = running
    session, order, updating = service.session, [], threading.Event()
    sample_loss, generate = session.learner._sample_loss, session.generate

    def slow_loss(*args, **kwargs):
        updating.set()
        time.sleep(1.0)  # a step long enough for the request to arrive during it
        order.append("step")
        return sample_loss(*args, **kwargs)

    monkeypatch.setattr(session.learner, "_sample_loss", slow_loss)
    monkeypatch.setattr(session, "generate", lambda *a, **kw: order.append("request") or generate(*a, **kw))
    for prompt in PROMPTS[:2]:  # interval 2: the second reply starts an update of 2 steps
        stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=8), timeout=60)
    order.clear()
    assert updating.wait(timeout=60)
    stub.Generate(pb.GenerateRequest(prompt=PROMPTS[2], max_new_tokens=8), timeout=60)
    assert service.wait_learned(timeout=60)
    assert order[:3] == ["step", "request", "step"], order


def test_a_service_warns_when_the_models_were_loaded_on_another_thread(pair_dir, tmp_path, caplog):
    """The engine remembers the thread that loaded it; a service whose engine thread is another
    one says so (its forwards would pay for a second OpenMP team), one given the loading thread
    does not."""
    from omnidraft.shared.runtime.engine_thread import EngineThread

    engine_thread = EngineThread()
    engine = engine_thread.run(
        Engine.load, str(pair_dir / "drafter"), str(pair_dir / "target"), "fp64", drafter_weights="fp32", progress=False
    )
    assert engine.loaded_on == engine_thread.ident
    session = engine_thread.run(DeviceSession, engine, target_name="t", learn=False)
    with caplog.at_level("WARNING", logger="omnidraft.service"):
        # a thread of its own, first: once the loading thread has exited, a new thread may get
        # its ident (the service's own engine thread would then pass for it)
        GenerationService(session).close()
        assert len(caplog.records) == 1 and "loaded on another thread" in caplog.records[0].getMessage()
        GenerationService(session, engine_thread=engine_thread).close()
    assert len(caplog.records) == 1


def test_a_profile_contradicted_while_serving_is_dropped_once_with_a_warning(pair_dir, tmp_path, monkeypatch, caplog):
    """A long-running service decides from the cost profile it started with. The forwards it
    times while serving are checked against that profile every ``profile_check_every`` decodes:
    a profile 50x off (a board that throttles, a VM that changed speed) is dropped from the cache
    (the pair's and the round overhead's keys), so the next start measures it again, with one
    warning however long the service runs. (That a profile which holds is kept is
    ``StepTimings.check``'s, tested in test_cost_profile.py.)"""
    engine = Engine.load(
        str(pair_dir / "drafter"), str(pair_dir / "target"), "fp64", drafter_weights="fp32", progress=False
    )
    session = DeviceSession(engine, target_name="t", state_dir=tmp_path / "state")
    service = GenerationService(
        session, ServiceLimits(max_new_tokens=64, profile_check_every=2), base=GenerationConfig(draft_stop="confidence")
    )
    measured = engine.cost_profile()
    engine._profile = CostProfile(
        {b: 50 * ms for b, ms in measured.target_ms.items()},
        50 * measured.drafter_ms_per_token,
        {b: 50 * ms for b, ms in measured.drafter_block_ms.items()},
    )
    checks, forgotten = [], []
    check = engine.check_profile
    monkeypatch.setattr(engine, "check_profile", lambda: checks.append(service.decodes) or check())
    monkeypatch.setattr(profiling, "forget", lambda key: forgotten.append(key) or True)
    server, port = serve(service, "127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.GenerationStub(channel)
    try:
        with caplog.at_level("WARNING", logger="omnidraft.service"):
            stub.Generate(pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=24), timeout=60)
            assert checks == [] and not service.profile_stale  # not checked before the second decode
            for prompt in PROMPTS[1:7]:
                stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=24), timeout=60)
        assert checks == [2] and service.profile_stale  # found off at the first check; not checked again
        assert [k["role"] for k in forgotten] == ["pair", "round-overhead"]
        warnings = [
            r.getMessage() for r in caplog.records if r.name == "omnidraft.service" and "profile" in r.getMessage()
        ]
        assert len(warnings) == 1 and "measured again at the next start" in warnings[0]
    finally:
        channel.close()
        server.stop(grace=None).wait()
        service.close()
    assert len(forgotten) == 2 and checks == [2]  # shutdown adds nothing once it was dropped


def test_cli_ask_and_health_against_a_running_service(running, capsys):
    from omnidraft.cli import main

    service, stub, port = running
    assert main(["device", "ask", PROMPTS[0], "--server", f"127.0.0.1:{port}", "--max-new-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["new_tokens"] == 12 and out["text"]
    assert (
        main(["device", "ask", PROMPTS[0], "--server", f"127.0.0.1:{port}", "--max-new-tokens", "12", "--stream"]) == 0
    )
    streamed = capsys.readouterr().out.rstrip("\n")
    assert streamed == out["text"]
    assert main(["device", "health", "--server", f"127.0.0.1:{port}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "SERVING"
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # the standard grpc.health.v1 check
        check = health_pb2_grpc.HealthStub(channel).Check
        for name in ("", "omnidraft.v1.Generation"):
            assert (
                check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
                == health_pb2.HealthCheckResponse.SERVING
            )
        with pytest.raises(grpc.RpcError) as unknown:
            check(health_pb2.HealthCheckRequest(service="omnidraft.v1.Nothing"), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert main(["device", "ask", "x", "--server", f"127.0.0.1:{port}", "--max-new-tokens", "999"]) == 2
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    assert main(["device", "health", "--server", "127.0.0.1:1", "--timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "UNAVAILABLE" in err and "Traceback" not in err


def test_only_the_owner_teaches_the_device(pair_dir, tmp_path, capsys):
    """With an owner token, a loopback caller without it (or with a wrong one) is served but
    teaches nothing (no learning, no request log for the device's rounds); the owner's requests
    do. Where strangers are not served (any non-loopback address), they get UNAUTHENTICATED,
    and such an address refuses plain text or a service that serves strangers."""
    from omnidraft.cli import main
    from omnidraft.client import owner_token
    from omnidraft.client.request_log import RequestLog

    engine = Engine.load(
        str(pair_dir / "drafter"), str(pair_dir / "target"), "fp64", drafter_weights="fp32", progress=False
    )
    session = DeviceSession(
        engine, target_name="t", state_dir=tmp_path / "state", online=OnlineConfig(interval=100, lr=1e-2)
    )
    token_file = tmp_path / "state" / owner_token.TOKEN_FILE
    token = owner_token.load_or_create(token_file)
    assert token_file.stat().st_mode & 0o777 == 0o600 and owner_token.load_or_create(token_file) == token
    log = RequestLog(tmp_path / "state")
    service = GenerationService(session, ServiceLimits(max_new_tokens=32), request_log=log, owner=token)
    server, port = serve(service, "127.0.0.1:0")
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    try:
        stranger = stub.Generate(pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=8), timeout=60)
        forged = stub.Generate(
            pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=8), timeout=60, metadata=owner_token.metadata("0" * 64)
        )
        assert stranger.text and forged.text  # served
        assert (
            main(
                [
                    "device",
                    "ask",
                    PROMPTS[2],
                    "--server",
                    f"127.0.0.1:{port}",
                    "--max-new-tokens",
                    "8",
                    "--owner-token",
                    str(token_file),
                ]
            )
            == 0
        )
        assert service.wait_learned(timeout=60)
        assert [p for _, p in log.since(0)] == [PROMPTS[2]]  # only the owner's prompt teaches
        assert session.learner.prompts_seen == 1
        capsys.readouterr()
        bad = tmp_path / "bad.token"
        bad.write_text("not a token")
        assert main(["device", "ask", "x", "--server", f"127.0.0.1:{port}", "--owner-token", str(bad)]) == 2
        assert "is not a token" in capsys.readouterr().err
    finally:
        server.stop(grace=None).wait()
        service.close()
    closed = GenerationService(session, ServiceLimits(max_new_tokens=32), owner=token, serve_strangers=False)
    server, port = serve(closed, "127.0.0.1:0")
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    try:
        for call in (
            lambda **kw: stub.Generate(pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=4), timeout=60, **kw),
            lambda **kw: stub.Health(pb.HealthRequest(), timeout=10, **kw),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert call(metadata=owner_token.metadata(token))  # the owner is served
    finally:
        server.stop(grace=None).wait()
        closed.close()
    with pytest.raises(ValueError, match="needs TLS"):
        serve(closed, "0.0.0.0:0")
    with pytest.raises(ValueError, match="serves the owner only"):
        serve(GenerationService(session, owner=None), "0.0.0.0:0", tls=(b"cert", b"key"))
    for host in ("127.0.0.1:1", "localhost:1", "[::1]:1"):
        assert owner_token.is_loopback(host)
    assert not any(owner_token.is_loopback(h) for h in ("0.0.0.0:1", "10.0.0.5:1", "board.local:1"))


def test_a_strangers_request_neither_finds_nor_leaves_the_owners_prompt_in_the_runners_caches(pair_dir, tmp_path):
    """On the native int8 target a prompt that begins like the request before keeps the positions
    it shares (a shorter prefill), and so does the drafter: from one owner request to the next,
    never from the owner's to a stranger's nor back, where the prefill's time would tell one of
    the other's text."""
    from omnidraft.client import owner_token

    engine = Engine.load(
        str(pair_dir / "drafter"), str(pair_dir / "target"), "int8", drafter_weights="fp32", progress=False
    )
    runner = engine.target_runner
    if getattr(runner, "row_kind", lambda m: None)(64) is None:
        pytest.skip("no native int8 kernels on this machine: no positions are kept")
    session = DeviceSession(engine, target_name="t", state_dir=tmp_path / "state", learn=False)
    token = owner_token.load_or_create(tmp_path / "state" / owner_token.TOKEN_FILE)
    service = GenerationService(
        session, ServiceLimits(max_new_tokens=32), base=GenerationConfig(draft_stop="confidence"), owner=token
    )
    server, port = serve(service, "127.0.0.1:0")
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    header = "def items_9(count, result):\n    items = count // result\n    total = items * count\n"
    kept, drafter_kept = [], []
    drafter = session.drafting_runner()
    first_forwards = []  # where each forward of the drafter started (positions it kept)
    forward = drafter.forward
    drafter.forward = lambda ids, logits_to_keep=0: (
        first_forwards.append(drafter.length),
        forward(ids, logits_to_keep),
    )[1]
    try:
        tails = ["    return total\n", "    delta = result", "    return items\n", "    total = count", "    x = 1\n"]
        for tail, owner in zip(tails + ["    return count\n"], (True, True, False, False, True, True)):
            metadata = owner_token.metadata(token) if owner else None
            first_forwards.clear()
            stub.Generate(pb.GenerateRequest(prompt=header + tail, max_new_tokens=4), timeout=60, metadata=metadata)
            kept.append(runner.prefilled.cached)
            drafter_kept.append(first_forwards[0])
    finally:
        server.stop(grace=None).wait()
        service.close()
    # owner after owner keeps the header; a stranger after the owner, a stranger after a
    # stranger (they may be two apps) and the owner after a stranger start from nothing
    assert kept[0] == 0 and kept[1] > 20 and kept[2:5] == [0, 0, 0] and kept[5] > 20
    assert drafter_kept[0] == 0 and drafter_kept[1] > 20 and drafter_kept[2:5] == [0, 0, 0] and drafter_kept[5] > 20


def test_serve_refuses_bad_settings(tmp_path, capsys):
    from omnidraft.cli import main

    assert main(["device", "serve", "--drafter", "x", "--target", "y"]) == 2
    assert "--state-dir is required" in capsys.readouterr().err
    assert (
        main(["device", "serve", "--drafter", "x", "--target", "y", "--state-dir", str(tmp_path), "--max-queue", "0"])
        == 2
    )
    assert "--max-queue" in capsys.readouterr().err
    for extra, message in (
        (["--listen", "0.0.0.0:50051"], "is not loopback: give --tls-cert"),
        (["--tls-cert", "c.pem"], "give both --tls-cert and --tls-key"),
        (["--tls-cert", "/nonexistent/c.pem", "--tls-key", "k.pem"], "No such file"),
    ):
        assert main(["device", "serve", "--drafter", "x", "--target", "y", "--state-dir", str(tmp_path), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_service_bench_reports_overhead_with_identical_texts(pair_dir, tmp_path, capsys):
    from omnidraft.benchmarks import service_bench

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    pair = ["--drafter", str(pair_dir / "drafter"), "--target", str(pair_dir / "target")]
    args = [*pair, "--dataset", str(data), *"--dtype fp64 --max-new-tokens 12".split()]
    assert service_bench.main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["texts_equal"] and report["prompts"] == 2 and report["grpc-unary-mean-s"] > 0
    assert service_bench.main([*args, "--learn-interval", "1", "--json"]) == 0  # learning, against ar
    report = json.loads(capsys.readouterr().out)
    # greedy: as ar; one update per reply, the warm-up request's included
    assert report["texts_equal"] and report["adapter-updates"] == 3 and report["ar-tok-s"] > 0
    assert report["speedup-vs-ar"] == report["grpc-unary-tok-s"] / report["ar-tok-s"]
    assert service_bench.main([*args, "--learn-interval", "-1"]) == 2
    assert "--learn-interval" in capsys.readouterr().err
