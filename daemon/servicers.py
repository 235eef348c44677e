"""gRPC servicers: deserialise (convert), call the ControlPlane, map domain
errors to status codes. Nothing else lives here."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from hetpilot.planner.errors import ValidationError
from hetpilot.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    cluster_pb2,
    cluster_pb2_grpc,
    common_pb2,
    job_pb2,
    job_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

from . import convert, paging
from .auth import Authenticator
from .controlplane import ControlPlane
from .decode import RateLimitedLog
from .errors import (
    FailedPrecondition,
    NotFound,
    PermissionDenied,
    StorageError,
    StorageFull,
    TooLarge,
)
from .nodes import node_views
from .records import JOB_CANCELLED, JobView

__all__ = ["AgentServicer", "ClusterServicer", "JobServicer", "TrainerServicer", "status_of"]

T = TypeVar("T")


_MAX_DETAILS = 1000
"""Characters of an error message sent back (status details travel in metadata)."""
_internal_log = RateLimitedLog()


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a failed call answers. Bad values are the caller's (INVALID_ARGUMENT),
    with the field named where validation caught them; only a bug is INTERNAL."""
    if isinstance(exc, ValidationError):
        code, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    elif isinstance(exc, (TooLarge, StorageFull)):
        code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    elif isinstance(exc, StorageError):
        code, message = grpc.StatusCode.UNAVAILABLE, str(exc)
    elif isinstance(exc, PermissionDenied):
        code, message = grpc.StatusCode.PERMISSION_DENIED, str(exc)
    elif isinstance(exc, NotFound):
        code, message = grpc.StatusCode.NOT_FOUND, str(exc)
    elif isinstance(exc, FailedPrecondition):
        code, message = grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    elif isinstance(exc, (ValueError, OverflowError, RecursionError, UnicodeError)):
        # a value no check caught by name (a safety net: each is a missing check)
        code, message = grpc.StatusCode.INVALID_ARGUMENT, f"bad value: {type(exc).__name__}: {exc}"
    else:
        code, message = grpc.StatusCode.INTERNAL, "internal error (the daemon logged it)"
    return code, message[:_MAX_DETAILS]


async def _refuse(plane: ControlPlane, context: grpc.aio.ServicerContext, method: str,
                  exc: Exception) -> None:
    code, message = status_of(exc)
    plane.metrics.rejected.labels(code=code.name).inc()
    if code == grpc.StatusCode.INTERNAL and _internal_log.warn(  # a bug: log it, now and then
            f"{method}:{type(exc).__name__}", "%s failed: %r", method, exc):
        logging.getLogger("hetpilot.daemon").error("%s: traceback", method, exc_info=exc)
    await context.abort(code, message)


def _unary(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            return await fn(self, request, context)
        except Exception as exc:  # every error answers a status, never UNKNOWN
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _refuse(self.plane, context, fn.__name__, exc)
            raise  # unreachable: abort raises

    return wrapper


def _stream(fn: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[T]:
        try:
            async for item in fn(self, request, context):
                yield item
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _refuse(self.plane, context, fn.__name__, exc)

    return wrapper


class JobServicer(job_pb2_grpc.JobServiceServicer):
    def __init__(self, plane: ControlPlane, auth: Authenticator) -> None:
        self.plane, self.auth = plane, auth

    def _owner(self, context: grpc.aio.ServicerContext) -> str:
        owner = self.auth.owner(context.invocation_metadata())
        assert owner is not None  # the interceptor refused everyone else
        return owner

    def _info(self, view: JobView) -> job_pb2.JobInfo:
        info = convert.job_to_proto(view.job, view.status, self.plane.emulated_devices(),
                                    view.progress, self.plane.launches.get(view.job.job_id))
        info.trainer_token = self.auth.job_token(view.job.job_id)  # the owner asked
        return info

    @_unary
    async def SubmitJob(self, request: job_pb2.SubmitJobRequest,
                        context: grpc.aio.ServicerContext) -> job_pb2.JobInfo:
        rec = self.plane.submit(self._owner(context), convert.submit_from_proto(request))
        return self._info(self.plane.get(None, rec.job_id))

    @_unary
    async def GetJob(self, request: job_pb2.GetJobRequest,
                     context: grpc.aio.ServicerContext) -> job_pb2.JobInfo:
        return self._info(self.plane.get(self._owner(context), convert.name(request.job_id, "job_id")))

    @_unary
    async def ListJobs(self, request: job_pb2.ListJobsRequest,
                       context: grpc.aio.ServicerContext) -> job_pb2.ListJobsResponse:
        views = self.plane.list_jobs(self._owner(context), include_cancelled=True)
        if request.page_token:
            ids = [v.job.job_id for v in views]
            if request.page_token not in ids:
                raise ValidationError("page_token", "not a job of this listing: pass a "
                                      "next_page_token as it was answered")
            views = views[ids.index(request.page_token) + 1:]
        if not request.include_cancelled:
            views = [v for v in views if v.job.state != JOB_CANCELLED]
        infos = [self._info(v) for v in views]
        n = paging.fitting([i.ByteSize() for i in infos],
                           paging.budget(self.plane.config.max_message_bytes))
        return job_pb2.ListJobsResponse(
            jobs=infos[:n], next_page_token=infos[n - 1].job_id if n < len(infos) else "")

    @_unary
    async def CancelJob(self, request: job_pb2.CancelJobRequest,
                        context: grpc.aio.ServicerContext) -> job_pb2.JobInfo:
        return self._info(await self.plane.cancel(self._owner(context),
                                                     convert.name(request.job_id, "job_id")))

    @_unary
    async def UpdateBudgets(self, request: job_pb2.UpdateBudgetsRequest,
                            context: grpc.aio.ServicerContext) -> job_pb2.JobInfo:
        budgets = convert.budgets_from_proto(request.budgets)
        # v = 0 goes back to the learned default (DEFAULT_V); unset keeps V
        v = convert.number(request.v, "v") if request.HasField("v") else None
        return self._info(self.plane.update_budgets(self._owner(context),
                                                    convert.name(request.job_id, "job_id"),
                                                    budgets, v))

    @_stream
    async def WatchPlans(self, request: job_pb2.WatchPlansRequest,
                         context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[common_pb2.PlanVersion]:
        job_id = convert.name(request.job_id, "job_id")
        async for plan in self.plane.watch(self._owner(context), job_id,
                                           convert.version(request.after_version)):
            yield convert.plan_to_proto(plan)
        if self.plane.stopping and not self.plane.job_ended(job_id):
            # not the job's end: the client reconnects after the restart and resumes
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the daemon is stopping; reconnect (after_version)")

    @_stream
    async def StreamLogs(self, request: job_pb2.StreamLogsRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[job_pb2.LogLines]:
        rank = request.rank if request.HasField("rank") else None
        job_id = convert.name(request.job_id, "job_id")
        resume = convert.resume_from_proto(request)
        owner = self._owner(context)
        # headers at once: a client that reconnected knows it is through before any output
        await context.send_initial_metadata(())
        async for host, data, end in self.plane.stream_logs(
                owner, job_id, rank, request.follow, resume):
            yield job_pb2.LogLines(host=host, data=data, end_offset=end)
        if request.follow and self.plane.stopping:  # not the end: resume after the restart
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the daemon is stopping; reconnect and resume (resume_from)")


def certificate_names(context: grpc.aio.ServicerContext) -> set[str]:
    """The names the caller's client certificate carries (CN and subject alternative
    names); empty without mutual TLS."""
    auth = context.auth_context() or {}
    names = [*auth.get("x509_common_name", ()), *auth.get("x509_subject_alternative_name", ())]
    return {n.decode() if isinstance(n, bytes) else str(n) for n in names}


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, plane: ControlPlane, by_certificate: bool = False,
                 job_token: Callable[[str], str] | None = None,
                 unix_user: Callable[[str], str] | None = None) -> None:
        self.plane = plane
        self.by_certificate = by_certificate
        self.job_token = job_token or (lambda job_id: "")
        """The trainer token of a job, handed to its ranks with each launch order."""
        self.unix_user = unix_user or (lambda owner: "")
        """The unix user an owner's ranks run as, sent with each launch order."""

    def _as(self, host: str, context: grpc.aio.ServicerContext) -> str:
        """``host``, if the caller may speak for it (tls.agents_by_certificate)."""
        if self.by_certificate:
            names = certificate_names(context)
            if host not in names:
                raise PermissionDenied(f"the client certificate names {sorted(names)[:4]}, "
                                       f"not host {host[:64]!r}")
        return host

    @_unary
    async def Register(self, request: agent_pb2.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> agent_pb2.RegisterResponse:
        agent = convert.agent_from_proto(request)
        self._as(agent.host, context)
        peers, registration, made = self.plane.members.register(
            agent, convert.label(request.registration, "registration"), request.host_secret,
            certified=self.by_certificate)
        cfg = self.plane.config
        return agent_pb2.RegisterResponse(
            agent_id=request.host, report_interval_s=cfg.report_interval_s,
            heartbeat_timeout_s=cfg.heartbeat_timeout_s, peers=convert.peers_to_proto(peers),
            registration=registration, host_secret=made)

    @_stream
    async def Report(self, request_iterator: AsyncIterator[agent_pb2.AgentReport],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[agent_pb2.ReportAck]:
        """Each report is acked at once, committed first; or, when it says ``ack_later``
        and there is nothing to send, taken into the tables only, and covered by a later
        ack (the seq is cumulative) after the host's latest report is committed: the
        store keeps one report per host, so that is the state committing each would
        leave, for one commit and one ack message per several reports
        (bench/RESULTS-controlplane-profile.md)."""
        epoch = -1
        unacked = 0  # the seq of the latest report taken and not acked yet (0: none)
        pending: set[str] = set()  # the hosts whose latest report is not committed yet
        opened: set[tuple[str, str]] = set()  # (host, registration) this stream reports
        members, launches = self.plane.members, self.plane.launches

        async def commit_pending() -> None:  # before an ack covers reports only taken
            for pending_host in pending:
                await members.commit_latest(pending_host)
            pending.clear()

        try:
            async for request in request_iterator:
                if self.plane.stopping:  # end the stream now, not after the stop's grace
                    if unacked:
                        await commit_pending()
                        yield agent_pb2.ReportAck(seq=unacked)
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        "the daemon is stopping: register again (this "
                                        f"report, seq {request.seq}, was not taken)")
                report = convert.report_from_proto(request)
                registration = convert.label(request.registration, "registration")
                statuses = convert.launches_from_proto(request)
                chunks = convert.log_chunks_from_proto(request)
                self._as(report.agent_id, context)
                if (request.ack_later and epoch == members.epoch and not statuses
                        and not chunks and not launches.active()):
                    # nothing to answer: the commit before the next ack stores it (or a
                    # later report of the host, which supersedes it)
                    members.report_taken(report, registration)
                    unacked = request.seq
                    pending.add(report.agent_id)
                    continue
                peers = await members.report_committed(report, registration)
                pending.discard(report.agent_id)
                if (report.agent_id, registration) not in opened:
                    opened.add((report.agent_id, registration))
                    members.stream_opened(report.agent_id, registration)
                ack = agent_pb2.ReportAck(seq=request.seq)
                if statuses or chunks or launches.active():
                    starts, stops = await launches.agent_report(
                        report.agent_id, statuses, chunks)
                    ack.start.extend(convert.order_to_proto(
                        o, self.job_token(o.launch.job_id), self.unix_user(o.owner))
                        for o in starts)
                    ack.stop.extend(stops)
                if epoch != members.epoch:
                    epoch = members.epoch
                    ack.peers.extend(convert.peers_to_proto(peers))
                elif request.ack_later and not ack.start and not ack.stop:
                    unacked = request.seq  # committed; acked later
                    continue
                await commit_pending()  # another host's (an agent's stream has one: none)
                unacked = 0
                yield ack
            if unacked:  # the agent closed the stream: cover what it sent
                await commit_pending()
                yield agent_pb2.ReportAck(seq=unacked)
        finally:  # the stream ended, or broke: it no longer speaks for its hosts
            for host, registration in opened:
                members.stream_closed(host, registration)

    @_unary
    async def Heartbeat(self, request: agent_pb2.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> agent_pb2.HeartbeatResponse:
        peers = self.plane.members.heartbeat(
            self._as(convert.name(request.agent_id, "agent_id"), context),
            convert.label(request.registration, "registration"))
        return agent_pb2.HeartbeatResponse(peers=convert.peers_to_proto(peers))


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, plane: ControlPlane, auth: Authenticator) -> None:
        self.plane, self.auth = plane, auth

    def _job(self, job_id: str, context: grpc.aio.ServicerContext) -> str:
        """The request's job id, checked against the caller's trainer token (a token
        of another job is refused; the cluster token, where allowed, reaches any)."""
        job_id = convert.name(job_id, "job_id")
        scope = self.auth.trainer_job(context.invocation_metadata())
        if scope is not None and scope != job_id:
            raise PermissionDenied(f"this trainer token is for job {scope}, not {job_id[:64]}")
        return job_id

    @_unary
    async def Attach(self, request: trainer_pb2.AttachRequest,
                     context: grpc.aio.ServicerContext) -> trainer_pb2.AttachResponse:
        job_id, rank, device, model, measured = convert.attach_from_proto(
            request, int(time.time() * 1000))
        plan, job = self.plane.attach(self._job(job_id, context), rank, device, model, measured,
                                      tensor_parallel=request.tensor_parallel)
        return convert.attach_response(plan, job)

    @_stream
    async def WatchPlans(self, request: trainer_pb2.TrainerWatchRequest,
                         context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[common_pb2.PlanVersion]:
        job_id = self._job(request.job_id, context)
        async for plan in self.plane.watch(None, job_id, convert.version(request.after_version)):
            yield convert.plan_to_proto(plan)

    @_unary
    async def ReportStageTimings(self, request: trainer_pb2.StageTimingsReport,
                                 context: grpc.aio.ServicerContext
                                 ) -> trainer_pb2.StageTimingsAck:
        timings = convert.timings_from_proto(request, int(time.time() * 1000))
        self._job(timings.job_id, context)
        self.plane.stage_timings(timings)
        return trainer_pb2.StageTimingsAck()

    @_unary
    async def FinishJob(self, request: trainer_pb2.FinishJobRequest,
                        context: grpc.aio.ServicerContext) -> trainer_pb2.FinishJobResponse:
        job_id, outcome, reason = convert.finish_from_proto(request)
        rec = await self.plane.finish(self._job(job_id, context), outcome, reason)
        return trainer_pb2.FinishJobResponse(outcome=convert.outcome_to_proto(rec.state))


class ClusterServicer(cluster_pb2_grpc.ClusterServiceServicer):
    """Nodes for owners and the cluster token; drain, resume and forget for the cluster
    token."""

    def __init__(self, plane: ControlPlane, auth: Authenticator) -> None:
        self.plane, self.auth = plane, auth

    def _admin(self, context: grpc.aio.ServicerContext, what: str) -> None:
        if not self.auth.is_cluster(context.invocation_metadata()):
            raise PermissionDenied(f"{what} needs the cluster token (auth.cluster_token); "
                                   "an owner's token may only list the nodes")

    def _node(self, host: str) -> cluster_pb2.NodeInfo:
        nodes, _ = node_views(self.plane, None)
        return convert.node_to_proto(next(n for n in nodes if n.agent.host == host))

    @_unary
    async def ListNodes(self, request: cluster_pb2.ListNodesRequest,
                        context: grpc.aio.ServicerContext) -> cluster_pb2.ListNodesResponse:
        md = context.invocation_metadata()
        owner = None if self.auth.is_cluster(md) else self.auth.owner(md)
        nodes, links = node_views(self.plane, owner, request.links)
        if request.page_token:  # name order; links go with the page of their host
            nodes = [n for n in nodes if n.agent.host > request.page_token]
            listed = {n.agent.host for n in nodes}
            links = [(host, link) for host, link in links if host in listed]
        resp = convert.nodes_to_proto(nodes, links, int(time.time() * 1000))
        by_host: dict[str, list[cluster_pb2.LinkStatus]] = {}
        for link in resp.links:
            by_host.setdefault(link.from_host, []).append(link)
        sizes = [node.ByteSize() + sum(x.ByteSize() + 6 for x in by_host.get(node.host, ()))
                 for node in resp.nodes]
        n = paging.fitting(sizes, paging.budget(self.plane.config.max_message_bytes))
        if n < len(resp.nodes):
            kept = resp.nodes[:n]
            hosts = {node.host for node in kept}
            resp = cluster_pb2.ListNodesResponse(
                nodes=kept, links=[x for x in resp.links if x.from_host in hosts],
                unix_ms=resp.unix_ms, next_page_token=kept[-1].host)
        return resp

    @_unary
    async def DrainHost(self, request: cluster_pb2.DrainHostRequest,
                        context: grpc.aio.ServicerContext) -> cluster_pb2.NodeInfo:
        host, reason = convert.drain_from_proto(request)
        self._admin(context, "draining a host")
        self.plane.members.drain(host, reason)
        return self._node(host)

    @_unary
    async def ResumeHost(self, request: cluster_pb2.ResumeHostRequest,
                         context: grpc.aio.ServicerContext) -> cluster_pb2.NodeInfo:
        host = convert.name(request.host, "host")
        self._admin(context, "resuming a host")
        self.plane.members.resume(host)
        return self._node(host)

    @_unary
    async def ForgetHost(self, request: cluster_pb2.ForgetHostRequest,
                         context: grpc.aio.ServicerContext) -> cluster_pb2.NodeInfo:
        host = convert.name(request.host, "host")
        self._admin(context, "forgetting a host")
        self.plane.members.forget(host)
        await self.plane.launches.forget_host(host)
        return self._node(host)
