"""Mutual TLS on the picker's ext_proc port (issue 44 item 2): only a client holding a
certificate from the configured CA (the gateway) completes the handshake; every other
pod that reaches :9002 picks nothing and its forged ``served`` metadata takes no worker
out. Certificates are made here with the ``openssl`` CLI (pdserve/testing/tls_certs.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from pdserve.router.picker.service import ExtProcTLS
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.testing.loopback import free_port
from pdserve.testing.picker import Envoy, completion, start_picker
from pdserve.testing.tls_certs import ScratchCA

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("pki")
    ca, other = ScratchCA.make(root, "ca"), ScratchCA.make(root, "other")
    server = ca.issue("picker", server=True)
    return {
        "ca": ca,
        "server": server,
        "gateway": ca.issue("gateway"),
        "stranger": other.issue("gateway"),  # the right name, the wrong authority
    }


def _client(pki: dict[str, object], who: str | None) -> grpc.ChannelCredentials:
    ca = pki["ca"]
    assert isinstance(ca, ScratchCA)
    root = ca.cert.read_bytes()
    if who is None:  # trusts the picker, shows no certificate
        return grpc.ssl_channel_credentials(root_certificates=root)
    key, cert = pki[who].pem()  # type: ignore[attr-defined]
    return grpc.ssl_channel_credentials(root, key, cert)


def _forged_served(envoy: Envoy, served: str) -> None:
    """A stream that only claims the primary failed: a request, then a response whose
    ``served`` names the fallback."""
    from pdserve.testing.picker import forged_served_messages

    for msg in forged_served_messages(completion("hello"), served):
        envoy.queue.put_nowait(msg)
    envoy.close()


async def test_only_the_gateways_certificate_reaches_ext_proc(
    pki: dict[str, object], router_tokenizer: PromptTokenizer, tiny_model_dir: Path
) -> None:
    """A plaintext client, a TLS client without a certificate and one with a certificate
    from another CA all fail before ext_proc, and their forged ``served`` metadata leaves
    every decode worker in rotation; the gateway's certificate is served. The control at
    the end shows the forgery does take the primary out when the channel is accepted."""
    server = pki["server"]
    ca = pki["ca"]
    assert isinstance(ca, ScratchCA)
    key, cert = server.pem()  # type: ignore[attr-defined]
    tls = ExtProcTLS(cert, key, ca.cert.read_bytes())
    gateway = _client(pki, "gateway")
    admin = free_port()
    opts = {"tls": tls, "client_tls": gateway, "metrics_port": admin}
    async with start_picker(
        router_tokenizer, tiny_model_dir, busy=[1], health_interval_s=30.0, **opts
    ) as pc:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin}") as h:
            # the kubelet's probes (its gRPC probe speaks no TLS): the admin port's HTTP
            assert (await h.get("/livez")).status_code == 200
            assert (await h.get("/health")).status_code == 200  # a decode worker is ready
        address = f"127.0.0.1:{pc.service.port}"
        rogues = [
            grpc.aio.insecure_channel(address),
            grpc.aio.secure_channel(address, _client(pki, None)),
            grpc.aio.secure_channel(address, _client(pki, "stranger")),
        ]
        for channel in rogues:
            env = Envoy(ep_grpc.ExternalProcessorStub(channel))
            _forged_served(env, pc.endpoint(1))
            assert await env.call.code() == grpc.StatusCode.UNAVAILABLE
            await channel.close()
        assert not pc.service.rt.discovery.failed_check(pc.decode_urls[0])
        env = pc.envoy()  # the gateway itself
        routed = await env.request("/v1/completions", completion("hello"))
        assert routed.endpoints == [pc.endpoint(0), pc.endpoint(1)]
        await env.response(pc.endpoint(0), [b"data: [DONE]\n\n"])
        env.close()
        env = pc.envoy()  # control: the same forgery over an accepted channel counts
        routed = await env.request("/v1/completions", completion("hello"))
        await env.response(pc.endpoint(1), [b"data: [DONE]\n\n"])
        env.close()
        assert pc.service.rt.discovery.failed_check(pc.decode_urls[0])
        pc.decode[1].active.pop("busy")
        await pc.settle()


def test_tls_flags_come_together_and_only_for_the_picker(
    pki: dict[str, object], tmp_path: Path
) -> None:
    server = pki["server"]
    ca = pki["ca"]
    assert isinstance(ca, ScratchCA)
    cert, key = str(server.cert), str(server.key)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="--ext-proc-client-ca missing"):
        ExtProcTLS.from_files(cert, key, "")
    (tmp_path / "empty.pem").write_text("")
    with pytest.raises(ValueError, match=r"--ext-proc-client-ca: .* no PEM"):
        ExtProcTLS.from_files(cert, key, str(tmp_path / "empty.pem"))
    assert ExtProcTLS.from_files(cert, key, str(ca.cert)).client_ca_pem.startswith(b"-----")
    from pdserve.router.picker.cli import refuse_picker_flags

    args = argparse.Namespace(ext_proc_tls_cert=cert, gateway_token_file="")
    with pytest.raises(SystemExit, match="--ext-proc-tls-cert only with --mode endpoint-picker"):
        refuse_picker_flags(args)
