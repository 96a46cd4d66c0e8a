"""One request's choices (prompts x n) run concurrently in the kernel's shared batch; what they produced by
each time the consumer reads leaves as one item: a ChoiceDelta, or a DeltaBatch of one delta per choice (every
Ray message costs CPU in this process, the ingress and the proxy alike, so a step's new tokens of all choices
travel together, and a lagging consumer catches up in one item)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from app.protocol import ChoiceDelta, DeltaBatch, ReplicaRequest, TokenLogprob
from app.replica.kernel import LLMKernel
from app.replica.logprobs import SampleLogprobs
from app.sampling_params import SEED_MAX, SEED_MIN, SamplingParams


@dataclasses.dataclass(frozen=True)
class PreparedPrompt:
    """A request's prompt, checked against the model: its token ids, and its text for echo."""

    ids: list[int]
    text: str | None  # None: given as token ids (decoded only when echo asks for it)


def choice_params(params: SamplingParams, n: int, j: int) -> SamplingParams:
    """Sample j of n: the same seed for every choice would repeat one answer n times, so choice j draws from
    seed + j, wrapped within signed 64 bits (a valid seed near the top stays valid)."""
    if n == 1 or params.seed is None:
        return params
    span = SEED_MAX - SEED_MIN + 1
    return dataclasses.replace(params, seed=(params.seed + j - SEED_MIN) % span + SEED_MIN)


async def fan_in(
    kernel: LLMKernel,
    request: ReplicaRequest,
    prompts: Sequence[PreparedPrompt],
    logprob_text: Callable[[list[SampleLogprobs]], list[TokenLogprob]],
) -> AsyncIterator[ChoiceDelta | DeltaBatch]:
    """The request's reply items. A failed sequence raises out of its kernel stream, and so out of this one
    (the other choices are then cancelled: their sequences abort in the kernel). With `echo`, each choice's
    first delta carries its prompt's text."""
    n = request.n
    queue: asyncio.Queue = asyncio.Queue()
    first: set[int] = set()  # choices whose first delta went out

    async def pump(index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for d in stream:
                await queue.put((index, d, None))
        except Exception as e:
            await queue.put((index, None, e))

    tasks = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            params = choice_params(request.sampling, n, j)
            stream = kernel.generate(prompt.ids, request.spec, tenant=request.tenant, params=params)
            tasks.append(asyncio.ensure_future(pump(i * n + j, stream)))
    remaining = len(tasks)
    try:
        while remaining:
            got = [await queue.get()]
            while not queue.empty():
                got.append(queue.get_nowait())
            items: dict[int, ChoiceDelta] = {}
            for index, d, exc in got:
                if exc is not None:
                    raise exc
                if d.finish_reason is not None:
                    remaining -= 1
                delta = ChoiceDelta(
                    index,
                    d.text,
                    d.finish_reason,
                    d.prompt_tokens,
                    d.completion_tokens,
                    None if d.logprobs is None else logprob_text(d.logprobs),
                    alora_activated=d.alora_activated,
                )
                if index not in first:
                    first.add(index)
                    if request.echo:
                        p = prompts[index // n]
                        delta.prompt_text = p.text if p.text is not None else kernel.tokenizer.decode(p.ids)
                    if d.prompt_logprobs is not None:
                        delta.prompt_logprobs = logprob_text(d.prompt_logprobs)
                if index in items:
                    items[index].merge(delta)
                else:
                    items[index] = delta
            batch = tuple(items.values())
            yield batch[0] if len(batch) == 1 else DeltaBatch(batch)
    finally:
        for t in tasks:  # a client that went away aborts its sequences in the kernel
            t.cancel()
