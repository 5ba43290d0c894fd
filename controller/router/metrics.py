"""The router's own Prometheus metrics, beside the agent's ``pdrouter_*`` families.

Every request gets an answer counted in ``pdrouter_http_responses_total{endpoint,code}`` or
a hang-up counted in ``pdrouter_client_disconnects_total{stage}``; every route change the
router makes on its own is counted with its reason (:class:`FallbackReason`).
"""

from __future__ import annotations

import enum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

OVERHEAD_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


class FallbackReason(enum.StrEnum):
    """Why a prefill leg failed (a retry on another P, then decode-local)."""

    CONNECT = "prefill_connect"  # connection refused / reset / closed mid-answer
    STATUS_5XX = "prefill_5xx"
    TIMEOUT = "prefill_timeout"
    NO_HANDLE = "prefill_no_handle"  # P answered without kv_transfer_params (first token EOS)
    BAD_ANSWER = "prefill_bad_answer"  # not JSON
    NO_INSTANCE = "no_prefill_instance"  # no healthy P at all


class RejectReason(enum.StrEnum):
    """Why a request was refused before it reached a route (a ``reason`` label)."""

    HEADER_TOO_LARGE = "header_too_large"  # a header line over the limit, or too many
    REQUEST_LINE_TOO_LONG = "request_line_too_long"
    INVALID_HEADER = "invalid_header"  # control characters, bad names, bad line endings
    INVALID_CONTENT_LENGTH = "invalid_content_length"
    INVALID_FRAMING = "invalid_framing"  # chunked encoding, Content-Length with chunked
    BAD_REQUEST_LINE = "bad_request_line"  # method, version, or not HTTP at all
    MALFORMED = "malformed"  # any other parser error
    BODY_TOO_LARGE = "body_too_large"  # over [http] max_body_bytes
    BODY_NOT_UTF8 = "body_not_utf8"
    BODY_NOT_JSON = "body_not_json"
    BODY_INVALID = "body_invalid"  # JSON the router cannot route (protocol.body_problem)


class DecodeFailure(enum.StrEnum):
    CONNECT = "connect"
    TIMEOUT_FIRST_BYTE = "timeout_first_byte"
    TIMEOUT_BETWEEN_TOKENS = "timeout_between_tokens"
    STATUS = "status"  # D answered an error status
    BROKEN_STREAM = "broken_stream"  # the stream ended without [DONE]
    NO_INSTANCE = "no_decode_instance"


class Stage(enum.StrEnum):
    """Where a request is; a hang-up before ``DONE`` is counted under the stage it cut."""

    READ = "read"  # the client's body
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"  # the answer is complete and counted: a hang-up now cuts nothing


class RouterHttpMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.tokenizer_loaded = Gauge(
            "pdrouter_tokenizer_loaded",
            "1 when token counts come from the model's tokenizer, 0 when they are estimated.",
            registry=registry)
        self.responses = Counter(
            "pdrouter_http_responses", "Answers to clients by endpoint and HTTP status.",
            ["endpoint", "code"], registry=registry)
        self.rejected = Counter(
            "pdrouter_http_rejected",
            "Requests refused before routing (each also in pdrouter_http_responses_total), "
            "by reason: the HTTP parser's (headers, request line, framing) and the body's.",
            ["reason"], registry=registry)
        self.routes = Counter(
            "pdrouter_routes_executed",
            "Requests by the route actually executed (after any fallback).",
            ["route"], registry=registry)
        self.fallbacks = Counter(
            "pdrouter_fallbacks",
            "Requests decided PREFILL_NODE that ran decode-local, by the last prefill failure.",
            ["reason"], registry=registry)
        self.prefill_retries = Counter(
            "pdrouter_prefill_retries", "Prefill legs retried on another P, by failure.",
            ["reason"], registry=registry)
        self.decode_failures = Counter(
            "pdrouter_decode_failures",
            "Decode legs that failed; after_prefill=true left P's blocks pinned until vLLM's "
            "abort timeout (VLLM_NIXL_ABORT_REQUEST_TIMEOUT).",
            ["reason", "after_prefill"], registry=registry)
        self.client_disconnects = Counter(
            "pdrouter_client_disconnects",
            "Clients that hung up before their answer was complete; the legs in flight were "
            "cancelled. stage=read|prefill|decode.",
            ["stage"], registry=registry)
        self.overhead = Histogram(
            "pdrouter_overhead_seconds",
            "The router's own time per request from its arrival to its first upstream leg "
            "(body read, parse, tokenize, decide, pick): what it adds to TTFT besides the "
            "network.",
            buckets=OVERHEAD_BUCKETS_S, registry=registry)
        self.prompt_tokens = Counter(
            "pdrouter_prompt_tokens", "Prompt tokens of completed requests (engines' usage).",
            ["route"], registry=registry)
        self.completion_tokens = Counter(
            "pdrouter_completion_tokens",
            "Generated tokens of completed requests (engines' usage).",
            ["route"], registry=registry)
        self.instance_healthy = Gauge(
            "pdrouter_instance_healthy", "1 while an engine instance is in rotation.",
            ["role", "instance"], registry=registry)
        for r in FallbackReason:
            self.fallbacks.labels(r.value)
        for reason in RejectReason:
            self.rejected.labels(reason.value)
        for route in ("PREFILL_NODE", "DECODE_LOCAL"):
            self.routes.labels(route)
