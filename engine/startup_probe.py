"""The start-up probe: the serving path, run once before a worker says it is ready.

Loading a model proves little: a model can load, answer the one-token check of its
attention options (model_runner.ModelRunner._probe), and still raise in its MLP at the
second decode step. So before the core answers "ready" it runs, on the forward it will
serve with and through the engine's own step (scheduler, pool, sampler):

- one short prefill (a prompt of ``PREFILL_LEN`` tokens, one token sampled), held for a
  KV hand-off where the role hands off (prefill: the blocks go to the KV holder);
- the role's KV hand-off, given as ``transfer`` (worker/core/handoff_probe.py): a prefill
  worker's KV server serves a read of the held blocks to an in-process reader, a decode
  worker's connector reads seeded blocks from a loopback peer; the bytes are checked;
- ``DECODE_STEPS`` decode steps at batch ``len(BATCH_LENS)`` (prompts of unequal lengths,
  greedy).

A step that raises, or a request that fails, refuses the start: ``ProbeFailed`` names the
model and the exception's class and message; the core answers "failed" with it and the
worker exits non-zero. The compile job runs the same probe on the compiled forward
before swapping it in (compile_job.py). The probe leaves nothing behind: counters, prefix
cache and KV events are reset, every block is free (``LLMEngine.forget_warm_up``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pdserve.protocol.outputs import HANDOFF
from pdserve.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.engine_view import EngineView

PREFILL_LEN = 12
BATCH_LENS = (5, 19, 9)  # decode rows of unequal contexts
DECODE_STEPS = 4


# The role's KV hand-off (worker/core/handoff_probe.py), given the prefill's held handles
# (none on a decode worker): raises if the transfer fails or moves the wrong bytes.
Transfer = Callable[[list[Any]], None]


class ProbeFailed(RuntimeError):
    """The model raised (or a request failed) on the serving path at start-up."""


def _prompt(engine: EngineView, length: int, salt: int) -> list[int]:
    vocab = max(2, min(engine.vocab_size, 1000))
    return [(salt * 31 + 7 * i + 3) % vocab for i in range(length)]


def _run(
    engine: EngineView,
    prompts: list[list[int]],
    params: SamplingParams,
    handles: list[Any] | None = None,
    **kwargs: Any,
) -> list[list[int]]:
    ids = [f"pdserve-probe-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params, **kwargs)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    try:
        while engine.has_work:
            for o in engine.step():
                if o.error:
                    raise ProbeFailed(f"request failed: {o.error}")
                out[o.request_id] += o.token_ids
                if handles is not None and o.finish_reason == HANDOFF:
                    handles.append(o.kv_handle)  # the holder's (None: engine-local)
    except BaseException:
        for rid in ids:
            engine.abort(rid)
        raise
    return [out[rid] for rid in ids]


def run(
    engine: EngineView, hand_off: bool = False, transfer: Transfer | None = None
) -> list[list[int]]:
    """The probe's greedy tokens (prefill's first token, then each decode row's); raises
    what the model (or ``transfer``, the role's KV hand-off) raised."""
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    handles: list[Any] = []
    prompt = [_prompt(engine, PREFILL_LEN, 0)]
    if hand_off:  # handed off after its first token (a request of one token is not)
        held = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        first = _run(engine, prompt, held, handles, hold_kv=True)
        if not handles:
            raise ProbeFailed("the probe's prefill was not handed off")
    else:
        first = _run(engine, prompt, greedy)
    try:
        if transfer is not None:
            transfer(handles)
    finally:
        for rid in list(engine.held):  # what a read's done did not end already
            engine.release_held(rid)
        engine.free_released()
    decode = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0.0, ignore_eos=True)
    rows = _run(engine, [_prompt(engine, n, i + 1) for i, n in enumerate(BATCH_LENS)], decode)
    engine.free_released()
    engine.forget_warm_up()
    return first + rows


def check(
    engine: EngineView, hand_off: bool = False, transfer: Transfer | None = None
) -> list[list[int]]:
    """``run``, with any exception turned into a ``ProbeFailed`` naming the model."""
    try:
        return run(engine, hand_off, transfer)
    except Exception as exc:
        cause = exc.__cause__ if isinstance(exc, ProbeFailed) and exc.__cause__ else exc
        raise ProbeFailed(
            f"model {engine.served_model_name!r} refused at start: its start-up probe "
            f"raised {type(cause).__name__}: {cause}"
        ) from exc
