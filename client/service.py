"""The on-device generation service: ``omnidraft.v1.Generation`` over gRPC (``proto/generation.proto``).

Apps on a device call ``Generate`` (one reply) or ``GenerateStream`` (text chunks as tokens are
verified). Every request decodes with the device's ``DeviceSession`` (cross-vocabulary
speculative decoding with the device's adapter, head and n-gram cache). The engine runs one
decode at a time, every job on the models on one thread (``EngineThread``: a second thread's
forwards would slow every step; give the service the thread that loaded the models): requests
wait their turn (at most ``max_queue`` waiting or running; more get
``RESOURCE_EXHAUSTED``). Learning never blocks a running request: a generation's training
sample is queued, and a learner thread feeds it to the online learner (which updates the adapter
every ``interval`` samples) between requests, then saves the device state atomically. Learning
runs in the engine thread's background lane, one optimizer step per job
(``DeviceSession.learn_steps``), so a request waits for at most the step running when it
arrives (1.1-1.5 s for SmolLM2-135M on a 2-core Zen 4 EPYC), not for a whole update (8 steps). A client
that cancels or disconnects mid-request stops its decode at the next verification step and
frees the engine. Bad requests get ``INVALID_ARGUMENT`` with a one-line reason.

Only the owner teaches the device (``client.owner_token``): with an owner token set, a request
that does not present it is served without learning or logging on loopback, and refused
(``UNAUTHENTICATED``) where strangers are not served (any other address). A stranger's request
reads nothing the owner's requests left and leaves nothing for them (``DeviceSession.generate``
with ``owner=False``): the runners keep the positions a prompt shares with the request before
(``model_runner.prefill``, the drafter's) only from one owner request to the next, and model-free
drafts come from the device's lookup history only for the owner, since how fast a prompt is read
or a draft accepted would tell one of the other's text.

The state directory may be shared with the device's SuperNode (``omnidraft device join``): each
served prompt goes to the device's ``RequestLog`` (its federated rounds train on them), and when
a federated round saved a new state, the service loads it before the next request; its own
saves never overwrite a state saved by the round.

The draft rule decides from the machine's cached cost profile; a board that throttles or a VM
that changed speed makes it wrong. Every ``profile_check_every`` decodes (and at shutdown) the
service checks it against the forwards it timed while serving (``Engine.check_profile``); one
they contradict is dropped from the cache, with one warning, and the next start measures it
again (the running service keeps deciding with the one it has: measuring takes about a minute,
which no request should wait for).
"""

from __future__ import annotations

import codecs
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from omnidraft.client import owner_token
from omnidraft.client.request_log import RequestLog
from omnidraft.client.session import DeviceSession
from omnidraft.proto import generation_pb2 as pb
from omnidraft.proto import generation_pb2_grpc as pb_grpc
from omnidraft.shared.engine.generation import GenerationConfig, GenerationResult
from omnidraft.shared.engine.profiling import describe_check
from omnidraft.shared.runtime.engine_thread import EngineThread
from omnidraft.shared.util.steps import advance

if TYPE_CHECKING:  # fleet_service imports this module
    from omnidraft.client.fleet_service import DeviceFleetService

log = logging.getLogger("omnidraft.service")
T = TypeVar("T")
DEFAULT_LISTEN = "127.0.0.1:50051"


@dataclass
class ServiceLimits:
    """What one request may ask for, and how many may wait (counts of tokens and requests)."""

    max_prompt_tokens: int = 4096  # target tokens
    max_new_tokens: int = 1024
    default_new_tokens: int = 128
    max_queue: int = 8  # requests waiting or running
    save_every: int = 1  # save the device state after this many learned samples
    profile_check_every: int = 32  # decodes between checks of the cost profile against use


class Cancelled(Exception):
    """The client went away: stop decoding."""


def _stats(result: GenerationResult, queue_s: float) -> pb.GenerationStats:
    st = result.stats
    return pb.GenerationStats(
        prompt_tokens=st.prompt_tokens,
        new_tokens=st.new_tokens,
        target_calls=st.target_calls,
        acceptance_rate=st.acceptance_rate or 0.0,
        tokens_per_target_call=st.tokens_per_target_call or 0.0,
        decode_s=st.wall_s,
        queue_s=queue_s,
        tokens_per_s=st.tokens_per_s or 0.0,
        finish_reason=result.finish_reason,
    )


class GenerationService(pb_grpc.GenerationServicer):
    """The servicer (see the module docstring). ``close()`` stops the learner after it has
    learned from what is queued, and saves the state."""

    def __init__(
        self,
        session: DeviceSession,
        limits: ServiceLimits | None = None,
        *,
        base: GenerationConfig | None = None,
        precision: str = "",
        learn: bool = True,
        request_log: RequestLog | None = None,
        owner: str | None = None,
        serve_strangers: bool = True,
        engine_thread: EngineThread | None = None,
    ) -> None:
        self.session = session
        # every job on the models runs here, one at a time (``engine_thread``): a decode, an
        # update, a lent round; pass the thread that loaded the models
        self.engine_thread = engine_thread or EngineThread()
        if session.engine.loaded_on != self.engine_thread.ident:
            log.warning(
                "the models were loaded on another thread than the service's engine thread: their forwards "
                "may run ~3x slower (load them with the EngineThread given as engine_thread)"
            )
        self.owner = owner  # the owner's token; None: every caller is the owner
        self.serve_strangers = serve_strangers
        self.request_log = request_log
        self.limits = limits or ServiceLimits()
        self.base = base or GenerationConfig()  # drafting settings; requests set the sampling ones
        self.precision = precision
        self.learn = learn
        self._slots = threading.BoundedSemaphore(self.limits.max_queue)
        self._count = threading.Lock()
        self.in_flight = 0
        self.requests = 0
        self.decodes = 0  # decodes run (the profile check counts them; engine thread only)
        self.profile_stale = False  # the cost profile was found off and dropped from the cache
        self._samples: queue.Queue = queue.Queue()
        self._learning = threading.Lock()  # held while a sample is learned from, step by step
        self._learner = threading.Thread(target=self._learn_loop, name="omnidraft-learner", daemon=True)
        self._learner.start()

    # -- requests -----------------------------------------------------------------------------
    def _config(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> GenerationConfig:
        """The request's decoding settings; aborts with INVALID_ARGUMENT."""
        lim = self.limits
        reason = None
        if not request.prompt:
            reason = "the prompt is empty"
        elif request.max_new_tokens > lim.max_new_tokens:
            reason = f"max_new_tokens {request.max_new_tokens} exceeds this device's limit of {lim.max_new_tokens}"
        config = replace(
            self.base,
            max_new_tokens=request.max_new_tokens or min(lim.default_new_tokens, lim.max_new_tokens),
            temperature=request.temperature,
            top_p=request.top_p or 1.0,
            seed=request.seed if request.HasField("seed") else None,
            stop_strings=tuple(request.stop),
        )
        if reason is None:
            try:
                config.validate()
            except ValueError as exc:
                reason = str(exc)
        if reason is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, reason)
        return config

    def _is_owner(self, context: grpc.ServicerContext) -> bool:
        return self.owner is None or owner_token.presented_by(context.invocation_metadata(), self.owner)

    def _run(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext, on_text=None
    ) -> tuple[GenerationResult, float]:
        """Decode one request in its turn; returns (result, seconds queued)."""
        teaches = self._is_owner(context)
        if not teaches and not self.serve_strangers:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "this device serves its owner only: present the owner token")
        config = self._config(request, context)
        if not self._slots.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.limits.max_queue} requests are already waiting or running; retry later",
            )
        try:
            with self._count:
                self.in_flight += 1
            t0 = time.perf_counter()

            def decode() -> tuple[GenerationResult, float]:
                queued = time.perf_counter() - t0
                if not context.is_active():
                    raise Cancelled()
                self._adopt_saved_state()
                _, ids = self.session.engine.prompt_ids(request.prompt, request.chat)
                if len(ids) > self.limits.max_prompt_tokens:
                    context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"the prompt has {len(ids)} tokens; this "
                        f"device accepts at most {self.limits.max_prompt_tokens}",
                    )
                decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
                token_bytes = self.session.engine.bridge.target_bytes

                def on_tokens(ids: list[int]) -> None:
                    if not context.is_active():
                        raise Cancelled()
                    if on_text is not None:
                        text = decoder.decode(b"".join(token_bytes[i] or b"" for i in ids))
                        if text:
                            on_text(text)

                result = self.session.generate(
                    request.prompt,
                    config,
                    chat=request.chat,
                    learn=self.learn,
                    owner=teaches,
                    observe=False,
                    on_tokens=on_tokens,
                )
                self.decodes += 1
                if self.decodes % self.limits.profile_check_every == 0:
                    self._check_profile()
                if on_text is not None:
                    tail = decoder.decode(b"", final=True)
                    if tail:
                        on_text(tail)
                return result, queued

            result, queued = self.engine_thread.run(decode)
            if teaches and (self.request_log is not None or (self.learn and result.training_sample is not None)):
                self._samples.put((request.prompt, result))
            with self._count:
                self.requests += 1
            return result, queued
        finally:
            with self._count:
                self.in_flight -= 1
            self._slots.release()

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateReply:
        try:
            result, queued = self._run(request, context)
        except Cancelled:
            context.abort(grpc.StatusCode.CANCELLED, "the client cancelled the request")
        return pb.GenerateReply(text=result.text, stats=_stats(result, queued))

    def GenerateStream(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateChunk]:
        chunks: queue.Queue = queue.Queue()
        done = object()
        outcome: dict = {}

        def work() -> None:
            try:
                outcome["result"] = self._run(request, context, on_text=chunks.put)
            except Exception as exc:  # Cancelled, an abort, or a failure: reported below
                outcome["error"] = exc
            finally:
                chunks.put(done)

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        while (item := chunks.get()) is not done:
            yield pb.GenerateChunk(text=item)
        worker.join()
        error = outcome.get("error")
        if isinstance(error, Cancelled):
            return
        if error is not None:
            if context.code() is not None:  # aborted with a status (bad input, queue full)
                return
            raise error
        result, queued = outcome["result"]
        yield pb.GenerateChunk(stats=_stats(result, queued), done=True)

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthReply:
        if not self.serve_strangers and not self._is_owner(context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "this device serves its owner only: present the owner token")
        s = self.session
        return pb.HealthReply(
            status="SERVING",
            drafter=s.drafter_name,
            target=s.target,
            precision=self.precision,
            queued=self.in_flight,
            requests=self.requests,
            updates=s.learner.updates,
            pending_samples=self._samples.qsize(),
        )

    # -- the device's fleet rounds (``client.fleet_service``) ----------------------------------------
    def lend_engine(self, operation: Callable[[], T]) -> T:
        """Run ``operation()``, a federated round's work in this process, on the engine
        thread (no decode or update runs meanwhile): the served state is saved first, so the
        round starts from it, and loaded again after, whatever the round left in the shared
        models (a trained adapter it saved, a global adapter an evaluation loaded)."""

        def lent() -> T:
            self._save()
            spec = self.session.adapters.spec
            try:
                return operation()
            finally:
                if self.session.adapters.spec != spec:  # the round adopted the fleet's LoRA settings
                    self.session.learner.new_optimizer()
                self.session.load()
                self.session.drafter_changed()

        with self._learning:  # never between an update's steps: the round saves and reloads the adapter
            return self.engine_thread.run(lent)

    def replace_session(self, session: DeviceSession) -> None:
        """Serve with ``session`` from the next request on (a rollout switched the target; call
        inside ``lend_engine``)."""
        self.session = session

    # -- learning between requests ----------------------------------------------------------------
    def _adopt_saved_state(self) -> None:
        """Load the device state if another process (a federated round) saved it (engine thread)."""
        try:
            if self.session.refresh():
                log.info("the device state was updated on disk (a federated round): loaded")
        except Exception:  # a state that cannot be read now is read at the next request
            log.exception("reloading the device state failed; serving with the one in memory")

    def _save(self) -> None:
        """Save the learned state unless a federated round saved a newer one (then adopt it)."""
        if self.session.state is not None and not self.session.save(if_unchanged=True):
            self._adopt_saved_state()

    def _learn_loop(self) -> None:
        learned = 0
        while True:
            item = self._samples.get()
            if item is None:
                break
            prompt, result = item
            try:
                if self.request_log is not None:
                    self.request_log.append(prompt)
                if self.learn and result.training_sample is not None:
                    learned += 1
                    with self._learning:
                        self._learn_one(result, learned)
            except Exception:  # learning must never take the service down
                log.exception("learning from a request failed; the service goes on")
            self._samples.task_done()

    def _learn_one(self, result: GenerationResult, learned: int) -> None:
        """Learn from one generation, each step a background job on the engine thread (requests
        go first); save after an update and every ``save_every`` samples."""
        steps = self.session.learn_steps(result)  # a generator: nothing runs until its first step
        done, report = False, None
        while not done:
            done, report = self.engine_thread.run(advance, steps, background=True)
        if report is not None or learned % self.limits.save_every == 0:
            self.engine_thread.run(self._save, background=True)

    def wait_learned(self, timeout: float | None = None) -> bool:
        """Block until every queued sample was learned from (tests, shutdown)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._samples.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _check_profile(self) -> None:
        """The cached cost profile against the forwards timed while serving (engine thread): once
        they contradict it, it is dropped from the cache (the next start measures it again) and
        a warning says so, once."""
        if self.profile_stale:
            return
        report = self.session.engine.check_profile()
        if report["stale"]:
            self.profile_stale = True
            log.warning(
                "the cost profile the draft rule decides from is off from the steps timed while serving "
                "(in use / cached ms: %s%s): dropped from the cache, measured again at the next start "
                "(or now: omnidraft profile --refresh)",
                describe_check(report),
                f"; drafter against target {report['drafter_vs_target']}x" if "drafter_vs_target" in report else "",
            )

    def close(self) -> None:
        self._samples.put(None)
        self._learner.join()

        def finish() -> None:
            self._save()
            self._check_profile()

        self.engine_thread.run(finish)
        self.engine_thread.close()


def serve(
    service: GenerationService,
    listen: str = DEFAULT_LISTEN,
    *,
    workers: int | None = None,
    tls: tuple[bytes, bytes] | None = None,
    fleet: DeviceFleetService | None = None,
) -> tuple[grpc.Server, int]:
    """Start a gRPC server for ``service`` on ``listen`` (host:port; port 0 picks one); returns
    (server, bound port). The standard ``grpc.health.v1.Health`` service answers beside it
    (``SERVING`` for ``""`` and each served service's full name), so load balancers, Kubernetes
    probes and ``grpc_health_probe`` check the device the usual way; ``Generation.Health`` adds
    what they do not know (drafter, target, precision, queue).
    ``tls``: (certificate chain PEM, private key PEM). Plain text only on
    loopback: ValueError for another address without ``tls``, or for one where the service
    would serve strangers (it must hold an owner token and refuse the rest). ``fleet``: a
    ``client.fleet_service.DeviceFleetService`` served beside it (the device's SuperNode rounds
    run on these models; messages up to ``served_device.MAX_MESSAGE_BYTES`` then)."""
    if not owner_token.is_loopback(listen):
        if tls is None:
            raise ValueError("an address other than loopback needs TLS (a certificate and its key)")
        if service.owner is None or service.serve_strangers:
            raise ValueError("an address other than loopback serves the owner only (an owner token, strangers refused)")
    options = []
    if fleet is not None:
        from omnidraft.client.served_device import CHANNEL_OPTIONS as options
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers or service.limits.max_queue + 2), options=options
    )
    pb_grpc.add_GenerationServicer_to_server(service, server)
    served = [pb.DESCRIPTOR.services_by_name["Generation"].full_name]
    if fleet is not None:
        from omnidraft.client.fleet_service import add_to_server
        from omnidraft.proto import device_fleet_pb2

        add_to_server(fleet, server)
        served.append(device_fleet_pb2.DESCRIPTOR.services_by_name["DeviceFleet"].full_name)
    checks = health.HealthServicer()
    for name in ["", *served]:
        checks.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    if tls is not None:
        port = server.add_secure_port(listen, grpc.ssl_server_credentials([(tls[1], tls[0])]))
    else:
        port = server.add_insecure_port(listen)
    if port == 0:
        raise ValueError(f"cannot listen on {listen!r}")
    server.start()
    return server, port
