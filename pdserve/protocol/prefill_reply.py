"""The prefill worker's reply as the router reads it, once per P/D request: an exact fast
form of ``codec.decode(raw, PrefillReply)``.

The general codec walks the reply's fields and then its KV handle's, checking every
annotation (about a twentieth of the router's CPU on the P/D path,
``bench/router_throughput.py --profile``). A reply has one common shape: this module
checks that shape's types in a handful of comparisons and builds the same messages,
the handle validated by its own ``validate``. Anything off that shape (a LoRA handle,
logprobs of another form, a bad body) goes through the codec itself, so its messages and
errors stay the codec's (tests/workers/test_prefill_reply.py compares both on random
replies).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pdserve.protocol.codec import all_ints
from pdserve.protocol.contract import KVHandle, PrefillReply
from pdserve.protocol.fast_dumps import JsonList
from pdserve.protocol.token_lines import fast_decode, usage_of

_REPLY_KEYS = frozenset({*(f.name for f in dataclasses.fields(PrefillReply)), "type"})
_HANDLE_KEYS = frozenset({*(f.name for f in dataclasses.fields(KVHandle)), "type"})
# _handle builds a KVHandle from its fields in this order: a new field must be added there.
assert tuple(f.name for f in dataclasses.fields(KVHandle)) == (
    "request_id",
    "agent_name",
    "side_channel",
    "block_ids",
    "num_tokens",
    "block_hashes",
    "block_size",
    "nonce",
    "lease_ttl_s",
    "transport",
    "version",
    "lora",
), "update prefill_reply"


def decode_prefill_reply(raw: bytes) -> PrefillReply:
    """``codec.decode(raw, PrefillReply)``: the same message, or the same CodecError."""
    return fast_decode(raw, PrefillReply, _REPLY_KEYS, "prefill_reply", _reply_of)


def _reply_of(body: dict[str, Any]) -> PrefillReply | None:
    rid, first, text = body["request_id"], body["first_token_id"], body["text"]
    finish, cached = body["finish_reason"], body["num_cached_tokens"]
    prompt = body["prompt_tokens"]
    lps, plps = body["logprobs"], body["prompt_logprobs"]
    usage = usage_of(body["usage"])
    handle = _handle(body["kv_handle"])
    if (
        type(rid) is str
        and type(first) is int
        and type(text) is str
        and (finish is None or type(finish) is str)
        and type(cached) is int
        and type(prompt) is int
        and (lps is None or type(lps) is list)
        and (plps is None or type(plps) is list)
        and usage is not False
        and handle is not False
    ):
        return PrefillReply(rid, first, text, finish, handle, cached, prompt, usage, lps, plps)
    return None


def _handle(body: Any) -> KVHandle | Literal[False] | None:
    """The reply's KV handle, validated; False: not the common shape, or not valid (the
    codec decides, and says why)."""
    if body is None:
        return None
    if type(body) is not dict or body.keys() != _HANDLE_KEYS or body["type"] != "kv_handle":
        return False
    ids, hashes, ttl = body["block_ids"], body["block_hashes"], body["lease_ttl_s"]
    strs = (
        body["request_id"],
        body["agent_name"],
        body["side_channel"],
        body["nonce"],
        body["transport"],
    )
    ints = (body["num_tokens"], body["block_size"], body["version"])
    if not (
        body["lora"] is None
        and all(type(s) is str for s in strs)
        and all(type(i) is int for i in ints)
        and type(ids) is list
        and (not ids or all_ints(ids))
        and type(hashes) is list
        and (not hashes or all_ints(hashes))
        and type(ttl) in (int, float)
    ):
        return False
    handle = KVHandle(
        *strs[:3], ids, ints[0], hashes, ints[1], strs[3], float(ttl), strs[4], ints[2]
    )
    try:
        handle.validate()
    except (TypeError, ValueError):
        return False
    body["lease_ttl_s"] = handle.lease_ttl_s  # a float, as to_dict writes it
    body["block_hashes"] = JsonList(hashes)  # 128-bit: json writes them (fast_dumps)
    handle.__dict__["wire"] = body  # its codec form, where ``wire`` keeps it (protocol/once.py)
    return handle
