"""A session's early open: the cloud prefills the prompt while the edge drafts, and may bring the first token.

The edge opens the session as soon as a generation starts (`CloudSession.open_ahead`), so the cloud
prefills the prompt while the edge prefills its draft and drafts the first block; time to first
token pays the longer of the two, not their sum. Asked for it, the open also brings the target's
token after the prompt, which the lossless modes release at once (edge/decoding/decoder.py).
If the open fails, its failure waits here for the first verify, whose retry loop handles it as its
own first attempt's (a busy cloud's hint honoured, a broken stream reset, a refusal final).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from common.sampling.logprobs import TokenLogprob


class EarlyOpen:
    """The open in flight, its failure, and the first token it brought."""

    def __init__(self) -> None:
        self._task: asyncio.Task | None = None  # until the first verify takes it over
        self._failure: Exception | None = None
        self.first_token: int | None = None  # the target's token after the prompt, from an open that asked for it
        self.first_logprob: TokenLogprob | None = None  # its logprob, when the sampling asked for logprobs

    def start(self, opening: Awaitable[None], failure_of: Callable[[Exception], Exception | None]) -> None:
        """Run `opening` now; `failure_of` says which of its exceptions the first verify is to meet (None: raise)."""

        async def run() -> None:
            try:
                await opening
            except Exception as err:  # noqa: BLE001 -- sorted by failure_of: kept, or raised
                kept = failure_of(err)
                if kept is None:
                    raise
                self._failure = kept

        self._task = asyncio.get_running_loop().create_task(run())

    @property
    def started(self) -> bool:
        return self._task is not None

    @property
    def in_flight(self) -> bool:
        """Still waiting for the cloud's answer (the next verify waits for it)."""
        return self._task is not None and not self._task.done()

    async def token(self) -> tuple[int, TokenLogprob | None] | None:
        """The target's token after the prompt and its logprob, once the open has answered; None if it failed
        or brought none (its failure stays for the first verify). Taken once."""
        if self._task is not None:
            await asyncio.shield(self._task)
        token, self.first_token = self.first_token, None
        return None if token is None else (token, self.first_logprob)

    async def take_over(self) -> None:
        """The first verify's turn: wait for the open, and meet its failure as that verify's own."""
        if self._task is None:
            return
        task, self._task = self._task, None
        await task
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    async def cancel(self) -> None:
        """Cancelled mid-open (the generation ended): the stream is closed by the session, its answer unread."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
