"""What the ``*_async`` calls of a Client do in the caller's thread before a worker takes over."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mooncake_store.errors import MooncakeError
from mooncake_store.tiers.gpu_arrays import describe_device_array, is_device_array, is_torch_tensor


def snapshot(values: Any) -> Any:
    """A list or tuple as a list as it is now, a mapping as a dict; anything else as given (for
    the call to judge)."""
    if isinstance(values, Mapping):
        return dict(values)
    return list(values) if isinstance(values, list | tuple) else values


def wait_for_callers_stream(value: object) -> None:
    """A device array handed to a worker thread: wait here, in the caller's thread, for the stream
    the array names. The CUDA Array Interface names the asking thread's current stream (and torch,
    its current stream), so asked from a worker it would name the worker's, and a caller's side
    stream still writing the source, or reading the destination, would go unwaited for. A bad array
    is left for the worker to refuse, through the future, as before."""
    if is_device_array(value):
        try:
            describe_device_array(value)
        except MooncakeError:
            pass


def outs_as_now(outs: Any) -> Any:
    """Output buffers handed to a worker: the list of them as it is now (a caller refilling its
    list for the next request had this request's chunks written into the next one's buffers),
    each device array's stream waited for here (:func:`wait_for_callers_stream`). A callable
    ``outs(n)`` is the worker's to call."""
    if callable(outs):
        return outs
    outs = snapshot(outs)
    for out in outs if isinstance(outs, list) else [outs]:
        wait_for_callers_stream(out)
    return outs


def tokens_as_now(token_ids: Any) -> Any:
    """Token ids as they are now: an array or a tensor copied, else as :func:`snapshot` takes them.
    A CUDA tensor is copied to the host here, on the caller's stream: a clone would be queued
    there and read by the worker on its own stream, perhaps before the caller's side stream had
    written the ids (another prompt matched, or none)."""
    if isinstance(token_ids, np.ndarray):
        return token_ids.copy()
    if is_torch_tensor(token_ids):
        ids = token_ids.detach()
        return ids.clone() if ids.device.type == "cpu" else ids.cpu()
    return snapshot(token_ids)
