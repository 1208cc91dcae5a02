"""``pdserve router``'s flags beyond the first ones: its limits at the edge and the
endpoint-picker mode (pdserve/config_cli.py; ``router/args.py`` lists them all)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config_cli import flag
from pdserve.router.config import CACHE_ISOLATION

LIMITS = "limits at the edge (docs/router.md)"
MODES = ("router", "endpoint-picker")  # --mode (endpoint-picker: router/picker/cli.py)
DEFAULT_GRPC_PORT = 9002  # the extension's usual port for the picker's ext_proc service


@dataclass(frozen=True)
class EdgeLimits:
    """What one request, one key and the queue may take."""

    max_queue: int = flag(
        256, "requests in flight; beyond them they wait (--max-waiting)", group=LIMITS
    )
    max_waiting: int = flag(
        256,
        "requests that wait for a slot beyond --max-queue, fairly "
        "across keys (0: a full queue is a 429 at once)",
        group=LIMITS,
    )
    queue_timeout: float = flag(
        30.0, "seconds a request waits for a slot before its 429", group=LIMITS
    )
    max_body_bytes: int = flag(
        8 << 20, "largest request body; larger is a 413 (default 8 MiB)", group=LIMITS
    )
    max_prompt_chars: int = flag(
        1 << 20, "longest prompt text (all messages together) to tokenize", group=LIMITS
    )
    max_schema_bytes: int = flag(
        64 << 10,
        "largest structured-output spec (JSON schema, regex, "
        "grammar, the tools of tool_choice required); larger is a 400",
        group=LIMITS,
    )
    tokenizer_threads: int = flag(
        2, "threads that parse and tokenize requests off the event loop", group=LIMITS
    )
    rate_limit_rpm: int = flag(
        0, "requests per minute per API key (0: no limit); beyond it 429", group=LIMITS
    )
    rate_limit_tpm: int = flag(
        0, "prompt + max_tokens per minute per API key (0: no limit)", group=LIMITS
    )
    body_timeout: float = flag(
        30.0,
        "seconds a request body may take to arrive; then 408 (no slot is held meanwhile)",
        group=LIMITS,
    )
    router_replicas: int = flag(
        1,
        "router replicas that split the per-key budgets (rate "
        "limits, --max-concurrency-per-key): each enforces 1/N",
        group=LIMITS,
    )
    router_service: str | None = flag(
        None,
        "kubernetes: the router's own Service, its ready "
        "endpoints the replica count (default: the LLMService's; "
        "'none': use --router-replicas)",
        group=LIMITS,
    )
    budget_peers: str = flag(
        "",
        "exact per-key budgets across router replicas: every replica's "
        "base URL, comma-separated (this one's too), '@FILE' (a file of them, re-read "
        "when it changes), or 'kubernetes' (the router "
        "Service's ready endpoints at --admin-port); each key's counters live on one "
        "replica, the others ask it (router/peer_budgets.py); replaces --router-replicas",
        group=LIMITS,
    )
    budget_self: str = flag(
        "",
        "this replica's URL among --budget-peers (default with 'kubernetes': "
        "http://$POD_IP:<admin port>)",
        group=LIMITS,
    )
    max_concurrency_per_key: int = flag(
        0, "requests one API key may have in flight or waiting (0: off)", group=LIMITS
    )
    stream_write_timeout: float = flag(
        30.0,
        "seconds a stream may wait for its client to read; "
        "then it is aborted and its KV freed (a slow reader)",
        group=LIMITS,
    )
    cache_isolation: str = flag(
        "api-key",
        "api-key: each API key has its own prefix cache "
        "(cached_tokens reveal nothing across keys); none: one cache "
        "shared by all",
        group=LIMITS,
        choices=CACHE_ISOLATION,
    )


PICKER = "endpoint picker (Gateway API Inference Extension, docs/router.md)"


@dataclass(frozen=True)
class PickerArgs:
    """``--mode endpoint-picker``: the router as a gateway's ext_proc service."""

    mode: str = flag(
        "router",
        "router: the OpenAI router; endpoint-picker: an Envoy ext_proc "
        "service picking the decode pod (and prefill worker) for a gateway",
        group=PICKER,
        choices=MODES,
    )
    grpc_port: int = flag(
        DEFAULT_GRPC_PORT, "the picker's ext_proc and gRPC health port", group=PICKER
    )
    fallbacks: int = flag(
        2,
        "endpoints named after the primary, which the gateway's retries walk in order",
        group=PICKER,
    )
    target_port: int = flag(
        0,
        "the port the gateway dials on a picked decode pod (the "
        "InferencePool's targetPort: its front); 0: the decode worker's own "
        "port",
        group=PICKER,
    )
    gateway_token_file: str = flag(
        "",
        "a file holding the gateway's credential: every ext_proc stream must carry it as "
        "gRPC metadata x-pdserve-gateway-token, else UNAUTHENTICATED (docs/security.md)",
        group=PICKER,
        metavar="PATH",
    )
    ext_proc_tls_cert: str = flag(
        "",
        "serve ext_proc over mutual TLS with this certificate (PEM; with "
        "--ext-proc-tls-key and --ext-proc-client-ca; docs/security.md)",
        group=PICKER,
        metavar="PATH",
    )
    ext_proc_tls_key: str = flag(
        "", "the private key of --ext-proc-tls-cert (PEM)", group=PICKER, metavar="PATH"
    )
    ext_proc_client_ca: str = flag(
        "",
        "the CA (PEM) that signs the gateway's client certificate: a client without one "
        "fails the TLS handshake before it reaches ext_proc",
        group=PICKER,
        metavar="PATH",
    )
    prefill_from_header: bool = flag(
        False,
        "a decode pod's front: prefill on the worker the "
        "picker named in its signed x-prefiller-host-port header, "
        "else locally",
        group=PICKER,
    )
