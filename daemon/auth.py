"""Bearer-token authentication, checked in one server interceptor.

JobService needs an owner's token; AgentService needs the cluster token;
TrainerService needs a job's trainer token (:meth:`Authenticator.job_token`,
given to the job's owner in JobInfo.trainer_token), which the servicer then
holds to that one job, or the cluster token where
``auth.cluster_token_for_trainers`` still allows it; health and reflection are
open (probes and grpcurl). ClusterService takes an owner's token or the cluster
token: any owner may list the nodes, and the servicer holds draining and
resuming hosts to the cluster token (there is no separate admin role: the
cluster token's holder already decides what the daemon believes about every
host). The servicers ask :meth:`Authenticator.owner` /
:meth:`Authenticator.trainer_job` / :meth:`Authenticator.is_cluster` who the
caller is; the interceptor has already refused anyone else with UNAUTHENTICATED.

A trainer token is ``hpj_<job_id>_<HMAC-SHA256(key, job_id)>`` with a key the
daemon keeps in its state dir: derived, so nothing per job is stored, and it
names its job, so a token of job A is refused on every call about job B.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

from .config import AuthConfig

__all__ = ["ANONYMOUS", "AuthInterceptor", "Authenticator"]

ANONYMOUS = "anonymous"
_OWNER_PREFIX = "/hetpilot.v1.JobService/"
_AGENT_PREFIX = "/hetpilot.v1.AgentService/"
_TRAINER_PREFIX = "/hetpilot.v1.TrainerService/"
_CLUSTER_PREFIX = "/hetpilot.v1.ClusterService/"
_JOB_TOKEN_PREFIX = "hpj_"
#: Methods whose handlers are not unary-unary (the refusal must match the shape).
_STREAMING = {
    "/hetpilot.v1.AgentService/Report": "stream_stream",
    "/hetpilot.v1.JobService/WatchPlans": "unary_stream",
    "/hetpilot.v1.JobService/StreamLogs": "unary_stream",
    "/hetpilot.v1.TrainerService/WatchPlans": "unary_stream",
}


def _bearer(metadata: Iterable[tuple[str, Any]] | None) -> str:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            if text[:7].lower() == "bearer ":
                return text[7:].strip()
    return ""


class Authenticator:
    def __init__(self, config: AuthConfig, job_key: bytes = b"") -> None:
        self._owners = [(token.encode(), owner) for owner, token in config.owner_tokens.items()]
        self._unix_users = dict(config.owner_unix_users)
        self._cluster = config.cluster_token.encode()
        self.open = config.allow_unauthenticated
        self.cluster_for_trainers = config.cluster_token_for_trainers
        self._job_key = job_key or secrets.token_bytes(32)

    def unix_user(self, owner: str) -> str:
        """The unix user ``owner``'s ranks run as on launching hosts ("" when none is
        set: agents that run ranks as their owners refuse her launches)."""
        return self._unix_users.get(owner, "")

    def job_token(self, job_id: str) -> str:
        """The bearer token of ``job_id``'s trainers."""
        mac = hmac.new(self._job_key, job_id.encode(), hashlib.sha256).hexdigest()[:40]
        return f"{_JOB_TOKEN_PREFIX}{job_id}_{mac}"

    def trainer_job(self, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
        """The job whose trainer token the caller holds; None for any other token."""
        token = _bearer(metadata)
        if not token.startswith(_JOB_TOKEN_PREFIX):
            return None
        job_id = token[len(_JOB_TOKEN_PREFIX):].rpartition("_")[0]
        if job_id and hmac.compare_digest(self.job_token(job_id).encode(), token.encode()):
            return job_id
        return None

    def may_train(self, metadata: Iterable[tuple[str, Any]] | None) -> bool:
        if self.open:
            return True
        return self.trainer_job(metadata) is not None or (
            self.cluster_for_trainers and self.is_cluster(metadata))

    def owner(self, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
        if self.open:
            return ANONYMOUS
        token = _bearer(metadata).encode()
        found = None
        for candidate, owner in self._owners:
            if token and hmac.compare_digest(candidate, token):
                found = owner
        return found

    def is_cluster(self, metadata: Iterable[tuple[str, Any]] | None) -> bool:
        if self.open:
            return True
        token = _bearer(metadata).encode()
        return bool(self._cluster) and hmac.compare_digest(self._cluster, token)


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")


async def _deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
    yield  # pragma: no cover - makes this an async generator


async def _deny_bidi(requests: Any, context: grpc.aio.ServicerContext) -> Any:
    # Read the first request before refusing: a two-way stream ended before its first
    # read races in grpc's core and then answers INTERNAL (about 1 call in 4) instead.
    with contextlib.suppress(Exception):
        await anext(aiter(requests), None)
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
    yield  # pragma: no cover - makes this an async generator


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, auth: Authenticator, on_reject: Callable[[], None] | None = None) -> None:
        self._auth = auth
        self._on_reject = on_reject

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method
        metadata = details.invocation_metadata
        if method.startswith(_OWNER_PREFIX):
            ok = self._auth.owner(metadata) is not None
        elif method.startswith(_AGENT_PREFIX):
            ok = self._auth.is_cluster(metadata)
        elif method.startswith(_TRAINER_PREFIX):
            ok = self._auth.may_train(metadata)
        elif method.startswith(_CLUSTER_PREFIX):
            ok = self._auth.owner(metadata) is not None or self._auth.is_cluster(metadata)
        else:
            ok = True
        if ok:
            return await continuation(details)
        if self._on_reject is not None:
            self._on_reject()
        shape = _STREAMING.get(method)
        if shape == "stream_stream":
            return grpc.stream_stream_rpc_method_handler(_deny_bidi)
        if shape == "unary_stream":
            return grpc.unary_stream_rpc_method_handler(_deny_stream)
        return grpc.unary_unary_rpc_method_handler(_deny)
