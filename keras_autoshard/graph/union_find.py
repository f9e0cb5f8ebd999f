"""Union-find over tensor dimensions, for the axis graph's classes."""

from __future__ import annotations

from keras_autoshard.errors import DimSizeMismatchError


class UnionFind:
    """Union-find over tensor dimensions that remembers each set's dim size.

    Every element is one tensor dimension with a size. `union` merges two sets
    only when their sizes agree and raises `DimSizeMismatchError` otherwise, so
    a wrong rule never silently glues different axes together. A set can be
    marked unshardable with a reason; merged sets keep the first reason.

    Example:

    ```python
    uf = UnionFind()
    a, b = uf.add(256), uf.add(256)
    uf.union(a, b)
    assert uf.find(a) == uf.find(b)
    uf.mark_unshardable(a, "spatial dim of conv")
    assert uf.reason(b) == "spatial dim of conv"
    ```
    """

    def __init__(self) -> None:
        self._parent: list[int] = []
        self._set_size: list[int] = []
        self._dim_size: list[int] = []
        self._reason: list[str | None] = []

    def __len__(self) -> int:
        return len(self._parent)

    def add(self, dim_size: int, reason: str | None = None) -> int:
        """Add a new singleton element.

        Args:
            dim_size: Size of the dimension the element stands for.
            reason: Why the element may not be sharded, or `None`.

        Returns:
            The new element's id.
        """
        element = len(self._parent)
        self._parent.append(element)
        self._set_size.append(1)
        self._dim_size.append(int(dim_size))
        self._reason.append(reason)
        return element

    def find(self, element: int) -> int:
        """Return the representative of `element`'s set (with path compression).

        Args:
            element: An element id.

        Returns:
            The id of the set's root.
        """
        root = element
        while self._parent[root] != root:
            root = self._parent[root]
        while self._parent[element] != root:
            self._parent[element], element = root, self._parent[element]
        return root

    def union(self, a: int, b: int) -> int:
        """Merge the sets of `a` and `b` (union by set size).

        Args:
            a: An element id.
            b: An element id.

        Returns:
            The root of the merged set.

        Raises:
            DimSizeMismatchError: If the two sets have different dim sizes.
        """
        root_a, root_b = self.find(a), self.find(b)
        if root_a == root_b:
            return root_a
        if self._dim_size[root_a] != self._dim_size[root_b]:
            raise DimSizeMismatchError(
                f"Cannot unify a dim of size {self._dim_size[root_a]} with a dim "
                f"of size {self._dim_size[root_b]}."
            )
        if self._set_size[root_a] < self._set_size[root_b]:
            root_a, root_b = root_b, root_a
        self._parent[root_b] = root_a
        self._set_size[root_a] += self._set_size[root_b]
        if self._reason[root_a] is None:
            self._reason[root_a] = self._reason[root_b]
        return root_a

    def same(self, a: int, b: int) -> bool:
        """Whether `a` and `b` are in the same set."""
        return self.find(a) == self.find(b)

    def dim_size(self, element: int) -> int:
        """The dim size shared by every element of `element`'s set."""
        return self._dim_size[self.find(element)]

    def mark_unshardable(self, element: int, reason: str) -> None:
        """Forbid sharding `element`'s set (keeps an earlier reason if any).

        Args:
            element: An element id.
            reason: Human-readable reason, e.g. `"spatial dim of conv"`.
        """
        root = self.find(element)
        if self._reason[root] is None:
            self._reason[root] = reason

    def reason(self, element: int) -> str | None:
        """Why `element`'s set may not be sharded, or `None` if it may."""
        return self._reason[self.find(element)]
