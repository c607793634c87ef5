"""A torch tensor with its conjugate or negative bit set (``.conj()`` of a complex tensor,
``torch._neg_view``) holds other numbers in its memory than it shows. Storing or filling one was
refused in the name of its dtype ("torch tensor of dtype torch.complex64 has no numpy form ...
supported: ... complex tensors"), which contradicted itself, and for get_into relayed torch's
advice to call resolve_conj().numpy(), a copy that get_into would fill instead of the tensor. The
refusal now names the view, and the store or fill of a resolved tensor works."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch  # a test requirement (pyproject test extra): its absence is a failure, not a skip

from mooncake_store import Client, InvalidValue

VIEWS: dict[str, Callable[[], Any]] = {
    "conjugate": lambda: torch.complex(torch.arange(8.0), torch.ones(8)).conj(),
    "negative": lambda: torch._neg_view(torch.arange(8, dtype=torch.float32)),
}


@pytest.mark.parametrize("bit", list(VIEWS))
def test_a_lazy_view_is_refused_in_its_own_name_and_its_resolved_tensor_round_trips(
    shared_client: Client, bit: str
) -> None:
    view = VIEWS[bit]()
    key = f"lazy-view-{bit}"
    with pytest.raises(InvalidValue, match=rf"is a lazy {bit} view") as refused:
        shared_client.put(key, view)
    assert "no numpy form" not in str(refused.value)
    assert not shared_client.exists(key)

    resolved = view.resolve_conj().resolve_neg()
    shared_client.put(key, resolved)
    try:
        into = VIEWS[bit]()
        before = into.clone()
        with pytest.raises(InvalidValue, match=rf"is a lazy {bit} view") as refused:
            shared_client.get_into(key, into)
        assert ".numpy() instead" not in str(refused.value)
        assert torch.equal(into, before)  # nothing written into it
        plain = torch.zeros_like(resolved)
        shared_client.get_into(key, plain)
        assert torch.equal(plain, resolved)
        assert np.array_equal(shared_client.get(key), resolved.numpy())
    finally:
        shared_client.remove(key)
