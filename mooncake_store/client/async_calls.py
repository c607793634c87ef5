"""The ``*_async`` calls of a :class:`~mooncake_store.Client`: each runs its blocking twin on the
client's worker threads (``io_threads``) and returns a ``concurrent.futures.Future`` with what
that call returns or raises (``asyncio.wrap_future`` makes it awaitable). What they are given is
taken as it is at the call: lists, tuples and mappings are copied (the caller may reuse them at
once), device arrays' streams are waited for in the caller's thread; buffers are not copied, so a
value must not change, nor an ``out`` be read, until the future is done."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from mooncake_store.client.async_args import outs_as_now, snapshot, wait_for_callers_stream

T = TypeVar("T")


class AsyncCalls:
    """Mixed into Client, which provides ``_submit`` and the blocking calls."""

    if TYPE_CHECKING:
        get: Callable[..., Any]
        get_into: Callable[..., int]
        put: Callable[..., None]
        get_many: Callable[..., list[Any]]
        get_many_into: Callable[..., list[int]]
        put_many: Callable[..., None]

        def _submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]: ...

    def get_async(self, key: str, *, device: str | int | None = None) -> Future[Any]:
        """:meth:`get` on a worker thread."""
        return self._submit(self.get, key, device=device)

    def get_into_async(self, key: str, out: object) -> Future[int]:
        """:meth:`get_into` on a worker thread: ``out`` is being written (partly, until then)
        until the future is done, and holds the object once it is done without an error."""
        wait_for_callers_stream(out)
        return self._submit(self.get_into, key, out)

    def put_async(
        self, key: str, value: object, *, replicas: int = 1, preferred_node: str | None = None
    ) -> Future[None]:
        """:meth:`put` on a worker thread. The value must not change until the future is done
        (what happens if it does: :meth:`put`)."""
        wait_for_callers_stream(value)
        return self._submit(self.put, key, value, replicas=replicas, preferred_node=preferred_node)

    def get_many_async(self, keys: Sequence[str]) -> Future[list[Any]]:
        """:meth:`get_many` on a worker thread (``keys`` taken as they are now)."""
        return self._submit(self.get_many, snapshot(keys))

    def get_many_into_async(self, keys: Sequence[str], outs: Sequence[object]) -> Future[list[int]]:
        """:meth:`get_many_into` on a worker thread (``keys`` and the list of ``outs`` taken as
        they are now; the buffers themselves are written until the future is done)."""
        return self._submit(self.get_many_into, snapshot(keys), outs_as_now(outs))

    def put_many_async(
        self,
        items: Mapping[str, object],
        *,
        replicas: int = 1,
        preferred_node: str | None = None,
        chain_pos: Mapping[str, int] | None = None,
        chain_parent: Mapping[str, str] | None = None,
    ) -> Future[None]:
        """:meth:`put_many` on a worker thread; the values must not change until it is done. The
        mappings are taken as they are now (``chain_pos`` and ``chain_parent`` were read by the
        worker: a key added to one after the call made the put fail)."""
        items = snapshot(items)
        for value in items.values() if isinstance(items, dict) else []:
            wait_for_callers_stream(value)
        return self._submit(
            self.put_many,
            items,
            replicas=replicas,
            preferred_node=preferred_node,
            chain_pos=snapshot(chain_pos),
            chain_parent=snapshot(chain_parent),
        )
