"""Transport security of the router gRPC services, from :class:`SecurityConfig`.

Three independent layers, each switched on by its keys:

* **TLS** (``tls_cert`` + ``tls_key``): the server proves who it is; the client checks it
  against ``tls_ca`` (or the system roots);
* **mutual TLS** (server: ``tls_ca`` too): the server requires a client certificate signed by
  ``tls_ca``; a client without one, or with one from another CA, fails the handshake;
* **bearer token** (``token`` or ``token_file``): every call must carry
  ``authorization: Bearer <token>``; health checks are exempt so probes need no secret.

Without TLS a token still works on loopback only: gRPC sends call credentials over
``local_channel_credentials``, which refuse any non-loopback peer. A server with neither a
token nor client certificates authenticates nobody; :func:`check_listen` refuses to expose
such a server beyond loopback unless the operator says so explicitly.

Certificates and token files are re-read when they change, without a restart: the server's
TLS credentials are ``dynamic_ssl_server_credentials`` whose fetcher (called by gRPC core
for each new handshake) re-reads ``tls_cert``/``tls_key``/``tls_ca`` when one of their
stat stamps (mtime, size, inode) moved, and a ``token_file`` is re-read the same way on both
sides. On the client, :func:`reloading_channel_credentials` rebuilds the channel credentials
when its certificate, key or CA file changes, and the transport then replaces its channels
(gRPC has no dynamic client credentials). A half-written rotation (unreadable file, a key
that does not match its certificate, an empty CA file or token) is not taken: the previous
material stays in use and a warning is logged. On the server, connections already open keep
the credentials they were made with.

Refusals the server sees are counted in ``pdrouter_auth_refusals_total{reason}`` (reasons
``missing_token``, ``wrong_token``). TLS handshake failures (no client certificate, a
certificate from another CA, plaintext to a TLS port) are refused inside gRPC core before any
Python code runs: they never reach the agent, and the refused client sees ``UNAVAILABLE``.
"""

from __future__ import annotations

import hmac
import logging
import os
import ssl
import threading
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

import grpc
import grpc.aio
from prometheus_client import CollectorRegistry, Counter

from controller.config import SecurityConfig, is_loopback
from controller.errors import ConfigError

AUTHORIZATION = "authorization"
# Probes and service discovery carry no secret; everything else does.
EXEMPT_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
REFUSAL_REASONS = ("missing_token", "wrong_token")

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
_T = TypeVar("_T")

_log = logging.getLogger(__name__)

_refusal_counters: weakref.WeakKeyDictionary[CollectorRegistry, Counter] = (
    weakref.WeakKeyDictionary()
)


def auth_refusals(registry: CollectorRegistry) -> Counter:
    """``pdrouter_auth_refusals_total{reason}`` on ``registry`` (created once per registry)."""
    counter = _refusal_counters.get(registry)
    if counter is None:
        counter = Counter(
            "pdrouter_auth_refusals",
            "Calls refused before reaching the router agent, by reason.",
            ["reason"],
            registry=registry,
        )
        for reason in REFUSAL_REASONS:
            counter.labels(reason)  # export zeros, so a rate() has a series from the start
        _refusal_counters[registry] = counter
    return counter


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"security.{what}: cannot read {path}: {e}") from None


def _token(config: SecurityConfig) -> str | None:
    try:
        token = config.bearer_token()
    except OSError as e:
        raise ConfigError(f"security.token_file: cannot read {config.token_file}: {e}") from None
    if token is not None and not token:
        raise ConfigError("security: the bearer token is empty")
    if token is not None and not all(" " <= c <= "~" for c in token):
        # gRPC refuses such metadata on every call ("Illegal metadata"), which would look
        # like an unreachable router after all the retries: refuse it here, by name.
        key = "token" if config.token is not None else f"token_file {config.token_file}"
        raise ConfigError(f"security.{key}: the bearer token must be printable ASCII "
                          "(gRPC metadata): no accents, tabs or newlines inside it")
    return token


_Stamp = tuple[tuple[int, int, int] | None, ...]


def _stamp(paths: tuple[Path, ...]) -> _Stamp:
    out: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append(None)
        else:
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


class ReloadingFiles(Generic[_T]):
    """A value loaded from files, loaded again when any file's stat stamp changes.

    ``load`` raises :class:`ConfigError` for material that is not usable (yet); the first
    load's error propagates (a bad start is a config error), a later one keeps the previous
    value and is logged once per change.
    """

    def __init__(self, what: str, paths: tuple[Path, ...], load: Callable[[], _T]) -> None:
        self._what = what
        self._paths = paths
        self._load = load
        self._lock = threading.Lock()
        self._stamp = _stamp(paths)
        self._value = load()
        self._refused: _Stamp | None = None
        self.reloads = 0

    def current(self) -> tuple[_T, bool]:
        """The value now and whether it changed since the previous call."""
        stamp = _stamp(self._paths)
        if stamp == self._stamp:
            return self._value, False
        with self._lock:
            if stamp == self._stamp:
                return self._value, False
            try:
                value = self._load()
            except ConfigError as e:
                if stamp != self._refused:
                    self._refused = stamp
                    _log.warning("%s changed but cannot be used, keeping the previous one: %s",
                                 self._what, e)
                return self._value, False
            self._value, self._stamp, self._refused = value, stamp, None
            self.reloads += 1
            _log.info("%s reloaded", self._what)
            return value, True

    @property
    def value(self) -> _T:
        return self.current()[0]


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every non-exempt call without the right ``authorization`` header.

    The comparison is constant-time; a refused call never reaches a servicer. ``token`` is
    the token, or a :class:`ReloadingFiles` over the token file (rotated without a restart).
    """

    def __init__(self, token: str | ReloadingFiles[str], refusals: Counter) -> None:
        self._static = f"Bearer {token}".encode() if isinstance(token, str) else None
        self._reloading = token if isinstance(token, ReloadingFiles) else None
        self._refusals = refusals

        async def deny_missing(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")

        async def deny_wrong(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")

        self._deny_missing: grpc.RpcMethodHandler[Any, Any] = (
            grpc.unary_unary_rpc_method_handler(deny_missing)
        )
        self._deny_wrong: grpc.RpcMethodHandler[Any, Any] = (
            grpc.unary_unary_rpc_method_handler(deny_wrong)
        )

    def _expected(self) -> bytes:
        if self._static is not None:
            return self._static
        assert self._reloading is not None
        return f"Bearer {self._reloading.value}".encode()

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[_Req, _Resp] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Resp] | None:
        method = handler_call_details.method
        if method.startswith(EXEMPT_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        presented: bytes | None = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTHORIZATION:
                presented = value.encode() if isinstance(value, str) else value
                break
        if presented is None:
            self._refusals.labels("missing_token").inc()
            return self._deny_missing
        if not hmac.compare_digest(presented, self._expected()):
            self._refusals.labels("wrong_token").inc()
            return self._deny_wrong
        return await continuation(handler_call_details)


@dataclass(frozen=True)
class ServerSecurity:
    """What a server needs: credentials (None: plaintext) and interceptors."""

    credentials: grpc.ServerCredentials | None
    interceptors: tuple[grpc.aio.ServerInterceptor, ...]
    tls: bool
    client_certificates: bool
    token: bool

    @property
    def authenticates(self) -> bool:
        return self.client_certificates or self.token

    @property
    def loopback_only(self) -> bool:
        """A token without TLS: ``local_server_credentials`` refuse every other peer."""
        return self.token and not self.tls

    def describe(self) -> str:
        parts = ["mTLS" if self.client_certificates else ("TLS" if self.tls else "plaintext")]
        if self.token:
            parts.append("bearer token")
        return " + ".join(parts)


def token_source(config: SecurityConfig) -> str | ReloadingFiles[str] | None:
    """The bearer token: fixed (``token``), re-read on change (``token_file``) or none."""
    if config.token_file is not None and config.token is None:
        return ReloadingFiles(
            f"security.token_file {config.token_file}", (config.token_file,),
            lambda: _token(config) or "",
        )
    return _token(config)


def _certificate_configuration(
    cert: Path, key: Path, ca: Path | None
) -> grpc.ServerCertificateConfiguration:
    pair = (_read(key, "tls_key"), _read(cert, "tls_cert"))
    try:  # a rotation caught between writing the certificate and its key is not usable
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(
            f"security.tls_cert/tls_key: {cert} and {key} do not match: {e}"
        ) from None
    roots = None
    if ca is not None:
        _check_ca(ca)  # else gRPC core fails the bind, which reads as a port in use
        roots = _read(ca, "tls_ca")
    return grpc.ssl_server_certificate_configuration([pair], root_certificates=roots)


def _check_ca(ca: Path) -> None:
    try:
        ssl.create_default_context(cafile=str(ca))
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"security.tls_ca: {ca} holds no usable certificate: {e}") from None


def server_security(
    config: SecurityConfig | None, registry: CollectorRegistry
) -> ServerSecurity:
    """Server credentials and interceptors for ``config`` (None or empty: plaintext)."""
    config = config or SecurityConfig()
    token = token_source(config)
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
    if token is not None:
        interceptors = (BearerTokenInterceptor(token, auth_refusals(registry)),)
    if config.tls_cert is not None and config.tls_key is not None:
        cert, key, ca = config.tls_cert, config.tls_key, config.tls_ca
        files = (cert, key) if ca is None else (cert, key, ca)
        certificates = ReloadingFiles(
            "security.tls_cert/tls_key/tls_ca", files,
            lambda: _certificate_configuration(cert, key, ca),
        )

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            # Called by gRPC core before each handshake; None keeps the current one.
            configuration, changed = certificates.current()
            return configuration if changed else None

        creds = grpc.dynamic_ssl_server_credentials(
            certificates.value,
            # grpc documents None as "unchanged"; the stubs do not allow for it.
            cast(Callable[[], grpc.ServerCertificateConfiguration], fetch),
            require_client_authentication=ca is not None,
        )
        return ServerSecurity(creds, interceptors, True, ca is not None, token is not None)
    if config.tls_ca is not None:
        raise ConfigError("security.tls_ca on a server needs tls_cert and tls_key as well")
    if token is not None:
        # Loopback-only transport that still lets the client attach its token.
        creds = grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        return ServerSecurity(creds, interceptors, False, False, True)
    return ServerSecurity(None, (), False, False, False)


def channel_credentials(config: SecurityConfig | None) -> grpc.ChannelCredentials | None:
    """Client credentials for ``config``; None means a plaintext channel."""
    config = config or SecurityConfig()
    token = token_source(config)
    base: grpc.ChannelCredentials | None = None
    if config.uses_tls():  # the same test as the config's token-without-TLS check
        base = grpc.ssl_channel_credentials(
            root_certificates=_read(config.tls_ca, "tls_ca") if config.tls_ca else None,
            private_key=_read(config.tls_key, "tls_key") if config.tls_key else None,
            certificate_chain=_read(config.tls_cert, "tls_cert") if config.tls_cert else None,
        )
    if token is None:
        return base
    if base is None:
        base = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    if isinstance(token, str):
        call = grpc.access_token_call_credentials(token)
    else:
        call = grpc.metadata_call_credentials(_TokenFilePlugin(token), name="token_file")
    return grpc.composite_channel_credentials(base, call)


def _checked_channel_credentials(config: SecurityConfig) -> grpc.ChannelCredentials | None:
    """:func:`channel_credentials`, refusing material caught half-way through a rotation."""
    cert, key, ca = config.tls_cert, config.tls_key, config.tls_ca
    if cert is not None and key is not None:
        try:
            ssl.create_default_context(ssl.Purpose.SERVER_AUTH).load_cert_chain(cert, key)
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(
                f"security.tls_cert/tls_key: {cert} and {key} do not match: {e}"
            ) from None
    if ca is not None:
        _check_ca(ca)
    return channel_credentials(config)


def check_files(config: SecurityConfig) -> list[str]:
    """Every problem with the files ``config`` names (token, certificates, CA), as the daemon
    and the router agent would find them at start: for ``pdctl config check``."""
    problems: list[str] = []
    for check in (lambda: _token(config), lambda: _checked_channel_credentials(config)):
        try:
            check()
        except ConfigError as e:
            if str(e) not in problems:
                problems.append(str(e))
    return problems


def reloading_channel_credentials(
    config: SecurityConfig | None,
) -> ReloadingFiles[grpc.ChannelCredentials | None] | None:
    """Client credentials rebuilt when ``tls_cert``, ``tls_key`` or ``tls_ca`` changes; None
    without TLS files (a ``token_file`` alone is re-read per call already)."""
    checked = config or SecurityConfig()
    files = tuple(p for p in (checked.tls_cert, checked.tls_key, checked.tls_ca)
                  if p is not None)
    if not files:
        return None
    return ReloadingFiles("security.tls_cert/tls_key/tls_ca (client)", files,
                          lambda: _checked_channel_credentials(checked))


class _TokenFilePlugin(grpc.AuthMetadataPlugin):
    """Sends the token file's current content (re-read when the file changes)."""

    def __init__(self, token: ReloadingFiles[str]) -> None:
        self._token = token

    def __call__(
        self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback
    ) -> None:
        callback(((AUTHORIZATION, f"Bearer {self._token.value}"),), None)


def channel_options(config: SecurityConfig | None) -> list[tuple[str, Any]]:
    if config is not None and config.server_name:
        return [("grpc.ssl_target_name_override", config.server_name)]
    return []


def split_host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port); raises ConfigError when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def check_listen(listen: str, security: ServerSecurity, *, allow_unauthenticated: bool) -> None:
    """Refuse to serve policy updates to the network without any authentication."""
    host, _ = split_host_port(listen)
    if security.loopback_only and not is_loopback(host):
        raise ConfigError(
            f"refusing to listen on {listen} with a bearer token and no TLS: gRPC accepts "
            "the token from loopback peers only, so no other host (nor a kubelet probe) "
            "could reach it. Configure [security] tls_cert/tls_key (tls_ca for mutual TLS), "
            "or listen on 127.0.0.1."
        )
    if security.authenticates or is_loopback(host) or allow_unauthenticated:
        return
    raise ConfigError(
        f"refusing to listen on {listen} without authentication: anyone who can reach it "
        "could replace the routing policy. Configure [security] token/token_file or tls_ca "
        "(mutual TLS), listen on 127.0.0.1, or pass --insecure to accept the risk."
    )
