"""``pdserve router``'s flags beyond the first ones: its limits at the edge and the
endpoint-picker mode (pdserve/config_cli.py; ``router/args.py`` lists them all)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config_cli import flag_group
from pdserve.router.config import CACHE_ISOLATION

flag_limits = flag_group("limits at the edge (docs/router.md)")
MODES = ("router", "endpoint-picker")  # --mode (endpoint-picker: router/picker/cli.py)
DEFAULT_GRPC_PORT = 9002  # the extension's usual port for the picker's ext_proc service


@dataclass(frozen=True)
class EdgeLimits:
    """What one request, one key and the queue may take."""

    max_queue: int = flag_limits(256, "requests in flight; beyond them they wait (--max-waiting)")
    max_waiting: int = flag_limits(
        256,
        "requests that wait for a slot beyond --max-queue, fairly "
        "across keys (0: a full queue is a 429 at once)",
    )
    queue_timeout: float = flag_limits(30.0, "seconds a request waits for a slot before its 429")
    max_body_bytes: int = flag_limits(
        8 << 20, "largest request body; larger is a 413 (default 8 MiB)"
    )
    max_prompt_chars: int = flag_limits(
        1 << 20, "longest prompt text (all messages together) to tokenize"
    )
    max_schema_bytes: int = flag_limits(
        64 << 10,
        "largest structured-output spec (JSON schema, regex, "
        "grammar, the tools of tool_choice required); larger is a 400",
    )
    tokenizer_threads: int = flag_limits(
        2, "threads that parse and tokenize requests off the event loop"
    )
    rate_limit_rpm: int = flag_limits(
        0, "requests per minute per API key (0: no limit); beyond it 429"
    )
    rate_limit_tpm: int = flag_limits(0, "prompt + max_tokens per minute per API key (0: no limit)")
    body_timeout: float = flag_limits(
        30.0,
        "seconds a request body may take to arrive; then 408 (no slot is held meanwhile)",
    )
    router_replicas: int = flag_limits(
        1,
        "router replicas that split the per-key budgets (rate "
        "limits, --max-concurrency-per-key): each enforces 1/N",
    )
    router_service: str | None = flag_limits(
        None,
        "kubernetes: the router's own Service, its ready "
        "endpoints the replica count (default: the LLMService's; "
        "'none': use --router-replicas)",
    )
    budget_peers: str = flag_limits(
        "",
        "exact per-key budgets across router replicas: every replica's "
        "base URL, comma-separated (this one's too), '@FILE' (a file of them, re-read "
        "when it changes), or 'kubernetes' (the router "
        "Service's ready endpoints at --admin-port); each key's counters live on one "
        "replica, the others ask it (router/peer_budgets.py); replaces --router-replicas",
    )
    budget_self: str = flag_limits(
        "",
        "this replica's URL among --budget-peers (default with 'kubernetes': "
        "http://$POD_IP:<admin port>)",
    )
    max_concurrency_per_key: int = flag_limits(
        0, "requests one API key may have in flight or waiting (0: off)"
    )
    stream_write_timeout: float = flag_limits(
        30.0,
        "seconds a stream may wait for its client to read; "
        "then it is aborted and its KV freed (a slow reader)",
    )
    cache_isolation: str = flag_limits(
        "api-key",
        "api-key: each API key has its own prefix cache "
        "(cached_tokens reveal nothing across keys); none: one cache "
        "shared by all",
        choices=CACHE_ISOLATION,
    )


flag_picker = flag_group("endpoint picker (Gateway API Inference Extension, docs/router.md)")


@dataclass(frozen=True)
class PickerArgs:
    """``--mode endpoint-picker``: the router as a gateway's ext_proc service."""

    mode: str = flag_picker(
        "router",
        "router: the OpenAI router; endpoint-picker: an Envoy ext_proc "
        "service picking the decode pod (and prefill worker) for a gateway",
        choices=MODES,
    )
    grpc_port: int = flag_picker(DEFAULT_GRPC_PORT, "the picker's ext_proc and gRPC health port")
    fallbacks: int = flag_picker(
        2,
        "endpoints named after the primary, which the gateway's retries walk in order",
    )
    target_port: int = flag_picker(
        0,
        "the port the gateway dials on a picked decode pod (the "
        "InferencePool's targetPort: its front); 0: the decode worker's own "
        "port",
    )
    gateway_token_file: str = flag_picker(
        "",
        "a file holding the gateway's credential: every ext_proc stream must carry it as "
        "gRPC metadata x-pdserve-gateway-token, else UNAUTHENTICATED (docs/security.md)",
        metavar="PATH",
    )
    ext_proc_tls_cert: str = flag_picker(
        "",
        "serve ext_proc over mutual TLS with this certificate (PEM; with "
        "--ext-proc-tls-key and --ext-proc-client-ca; docs/security.md)",
        metavar="PATH",
    )
    ext_proc_tls_key: str = flag_picker(
        "", "the private key of --ext-proc-tls-cert (PEM)", metavar="PATH"
    )
    ext_proc_client_ca: str = flag_picker(
        "",
        "the CA (PEM) that signs the gateway's client certificate: a client without one "
        "fails the TLS handshake before it reaches ext_proc",
        metavar="PATH",
    )
    prefill_from_header: bool = flag_picker(
        False,
        "a decode pod's front: prefill on the worker the "
        "picker named in its signed x-prefiller-host-port header, "
        "else locally",
    )
