"""Which layer calls return several tensors.

Keras lays out a layer's output through one hook,
`Distribution.get_tensor_layout("<layer path>/output")`, and hands the
layout with the whole returned structure to `distribute_tensor`: a layer
that returns a tuple gets one layout for every tensor in it, and while a
functional model is built its tuple of `KerasTensor`s goes to
`jax.device_put`, which rejects them. So the planner pins only layers whose
calls return one tensor, and this module finds the others from the trace.

A call returns the tensors made in it that an equation after it reads or
the model returns, and its last tensor (what `AxisGraph.scope_outputs`
takes for the layer's output): a returned tensor that nothing reads is
last only if the call makes it last (XLNet's attention mask layer returns
the content mask, read by every encoder layer, and the query mask, read by
none, made last). A call that returns another tensor unread and not last,
or one it passes through unchanged, is taken for a one-tensor call. A
layer called twice in a row (Bart's token embedding, for the encoder and
the decoder) leaves one run of its name scope in the trace, as one call
would, and is taken for a call returning two tensors: it loses its pin
rather than risk one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# (layer path, index of the call).
Call = tuple[str, int]


class CallReturns:
    """Records, per layer call, the tensors made in it and read after it.

    Example:

    ```python
    calls = CallReturns()
    calls.record("split_layer", ins=[0], outs=[1, 2])
    calls.record("", ins=[1, 2], outs=[3])
    calls.several_outputs(model_outputs=[3])  # ("split_layer",)
    ```
    """

    def __init__(self) -> None:
        self._call_index: dict[str, int] = {}
        self._open: frozenset[str] = frozenset()
        self._made_in: dict[int, tuple[Call, ...]] = {}
        self._returned: dict[Call, set[int]] = {}
        self._last: dict[Call, int] = {}

    def record(self, name_stack: str, ins: Sequence[int], outs: Sequence[int]) -> None:
        """Note a top-level equation of `name_stack` that reads `ins` and
        makes `outs`. A scope left and entered again starts a new call, as
        in `GraphBuilder.record_scope`.

        Args:
            name_stack: The equation's JAX name stack (a Keras layer path).
            ins: Tensor ids it reads.
            outs: Tensor ids it makes.
        """
        parts = [p for p in name_stack.split("/") if p]
        scopes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        for scope in scopes:
            if scope not in self._open:
                self._call_index[scope] = self._call_index.get(scope, -1) + 1
        self._open = frozenset(scopes)
        current = tuple((scope, self._call_index[scope]) for scope in scopes)
        self._read(ins, frozenset(current))
        for tid in outs:
            self._made_in.setdefault(tid, current)
        if outs:
            self._last.update((call, outs[-1]) for call in current)

    def several_outputs(self, model_outputs: Iterable[int]) -> tuple[str, ...]:
        """Layer paths some call of which returns more than one tensor.

        Args:
            model_outputs: Tensor ids the traced function returns.

        Returns:
            The paths, sorted.
        """
        self._read(model_outputs, frozenset())
        returned = {call: {tid} for call, tid in self._last.items()}
        for call, tids in self._returned.items():
            returned.setdefault(call, set()).update(tids)
        return tuple(
            sorted({scope for (scope, _), tids in returned.items() if len(tids) > 1})
        )

    def _read(self, tids: Iterable[int], current: frozenset[Call]) -> None:
        for tid in tids:
            for call in self._made_in.get(tid, ()):
                if call not in current:
                    self._returned.setdefault(call, set()).add(tid)
