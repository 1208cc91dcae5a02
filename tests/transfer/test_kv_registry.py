"""One list of KV transports: the registry's. Every ``--kv-transport`` flag, the operator's
spec and the CRD's enum take their choices from it, and it imports without torch."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdserve.transfer.registry import TRANSPORT_NAMES, TRANSPORTS, transport_class

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _choices(add_arguments) -> tuple[str, ...]:  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    (action,) = [a for a in parser._actions if "--kv-transport" in a.option_strings]
    return tuple(action.choices)


def test_every_flag_offers_the_registry() -> None:
    from pdserve.decode_worker.server import add_arguments as decode_args
    from pdserve.local.up import add_arguments as up_args
    from pdserve.prefill_worker.server import add_arguments as prefill_args

    for add in (prefill_args, decode_args, up_args):
        assert _choices(add) == TRANSPORT_NAMES, add.__module__
    assert "choices=TRANSPORT_NAMES" in (ROOT / "bench" / "routing.py").read_text()


def test_the_crd_enum_equals_the_registry() -> None:
    from pdserve.operator.spec import TRANSPORTS as spec_transports

    crd = yaml.safe_load((ROOT / "charts/pdserve/crds/llmservices.pdserve.io.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    kv = schema["properties"]["spec"]["properties"]["kvTransfer"]["properties"]
    assert tuple(sorted(kv["transport"]["enum"])) == TRANSPORT_NAMES == tuple(spec_transports)
    assert sorted(TRANSPORTS) == list(TRANSPORT_NAMES)


def test_registry_is_torch_free_and_names_the_valid_keys() -> None:
    code = "import sys, pdserve.transfer.registry; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    with pytest.raises(ValueError, match=r"unknown kv transport 'ucx'; valid: \['nixl', 'tcp'\]"):
        transport_class("ucx")
