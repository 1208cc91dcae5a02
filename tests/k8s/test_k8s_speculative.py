"""``spec.decode.speculative``: in the CRD's schema, rendered into the decode pods' args,
refused by name when it is malformed or set on the prefill pool."""

from __future__ import annotations

from typing import Any

import pytest
from k8s_helpers import minimal_llmservice, schema_errors

from pdserve.operator.render import render
from pdserve.operator.spec import SpecError
from pdserve.operator.spec_parse import parse_llmservice


def _args(manifests: list[dict[str, Any]], role: str) -> list[str]:
    (dep,) = [
        m
        for m in manifests
        if m["kind"] == "Deployment" and m["metadata"]["name"].endswith(f"-{role}")
    ]
    args: list[str] = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    return args


def test_rendered_into_decode_pods_only() -> None:
    obj = minimal_llmservice(decode={"speculative": "ngram:k=4"})
    assert schema_errors(obj) == []
    manifests = render(obj)
    decode = _args(manifests, "decode")
    assert decode[decode.index("--speculative") + 1] == "ngram:k=4"
    assert "--speculative" not in _args(manifests, "prefill")
    assert "--speculative" not in _args(render(minimal_llmservice()), "decode")


@pytest.mark.parametrize(
    ("pools", "words"),
    [
        ({"decode": {"speculative": "draft:k=4"}}, "needs model"),
        ({"decode": {"speculative": "draft:model=/m,k=4,n=2"}}, "unknown key"),
        ({"decode": {"speculative": "ngram:k=99"}}, "k must be"),
        ({"prefill": {"speculative": "ngram:k=4"}}, "decode workers"),
    ],
)
def test_bad_values_refused_by_name(pools: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_llmservice(minimal_llmservice(**pools))
    assert "speculative" in str(err.value) and words in str(err.value)
    assert schema_errors(minimal_llmservice(decode={"speculative": 4})) != []
