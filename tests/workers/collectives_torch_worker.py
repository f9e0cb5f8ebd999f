"""One gloo rank of tests/runtime/test_collectives_torch.py.

Every rank builds the same seeded global tensors, runs each collective on its
own part in float32 (forward and `.backward()`), and compares the values and
gradients with the single-process computation on the whole tensors (float64).
Writes `rank<r>.json` into the output directory:
`{"rank": r, "world_size": n, "failures": {check: message}, "checks": [...]}`.

Usage: python tests/workers/collectives_torch_worker.py RANK WORLD_SIZE INIT_FILE
    OUT_DIR
"""

import datetime
import json
import os
import sys
import traceback

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from keras_autoshard.runtime.collectives import (  # noqa: E402
    CollectiveError,
    all_gather,
    all_reduce,
    broadcast,
    copy_to_parallel,
    reduce_from_parallel,
    reduce_scatter,
    scatter,
)

RTOL = 1e-5
COLLECTIVE_TIMEOUT_S = 60


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = max(expected.abs().max().item(), 1e-30)
    return (actual - expected).abs().max().item() / scale


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(
            f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
        )
    error = relative_error(actual, expected)
    if not error <= RTOL:
        raise AssertionError(f"{what}: relative error {error:.3g} > {RTOL}")


def seeded(seed: int, *shape: int, ties: bool = False) -> torch.Tensor:
    """The same float64 tensor on every rank; `ties` draws from {0, 1, 2}."""
    generator = torch.Generator().manual_seed(seed)
    if ties:
        return torch.randint(0, 3, shape, generator=generator).double()
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def leaf(tensor: torch.Tensor) -> torch.Tensor:
    """A float32 leaf that takes gradients, for the sharded computation."""
    return tensor.float().clone().requires_grad_()


def reference_leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone().requires_grad_()


def loss_of(y: torch.Tensor) -> torch.Tensor:
    return (torch.sin(y) * y).sum()


class Checks:
    """Each method is one check; it raises AssertionError when it fails."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def _rows(self, block: int) -> slice:
        return slice(self.rank * block, (self.rank + 1) * block)

    def _all_reduce(self, op: str, reduce, ties: bool = False) -> None:
        X = seeded(1, self.world_size, 3, 4, ties=ties)
        x = leaf(X[self.rank])
        y = all_reduce(x, op)
        loss_of(y).backward()
        Xr = reference_leaf(X)
        Y = reduce(Xr)
        loss_of(Y).backward()
        assert_close(y, Y, f"all_reduce {op} forward")
        assert_close(x.grad, Xr.grad[self.rank], f"all_reduce {op} gradient")

    def all_reduce_sum(self):
        self._all_reduce("sum", lambda X: X.sum(0))

    def all_reduce_mean(self):
        self._all_reduce("mean", lambda X: X.mean(0))

    def all_reduce_max_shares_ties_evenly(self):
        X = seeded(1, self.world_size, 3, 4, ties=True)
        tied = (X == X.amax(0)).sum(0) > 1
        if not tied.any():
            raise AssertionError("the seeded input has no ties to test")
        self._all_reduce("max", lambda X: X.amax(0), ties=True)

    def all_reduce_of_non_contiguous_input(self):
        X = seeded(2, self.world_size, 3, 4)
        x = leaf(X[self.rank]).t()
        assert_close(all_reduce(x), X.sum(0).t(), "all_reduce of x.t()")

    def inputs_are_not_modified(self):
        X = seeded(3, self.world_size, 4, 2 * self.world_size)
        x = X[self.rank].float()
        before = x.clone()
        all_reduce(x)
        all_reduce(x, "max")
        broadcast(x, src=self.world_size - 1)
        reduce_scatter(x, axis=1)
        if not torch.equal(x, before):
            raise AssertionError("a collective changed its input in place")

    def all_gather_axis_1(self):
        X = seeded(4, 3, self.world_size * 2, 4)
        x = leaf(X[:, self._rows(2)])
        y = all_gather(x, axis=1)
        loss_of(y).backward()
        Xr = reference_leaf(X)
        loss_of(Xr).backward()
        assert_close(y, X, "all_gather forward")
        assert_close(x.grad, Xr.grad[:, self._rows(2)], "all_gather gradient")

    def _reduce_scatter(self, op: str, reduce, ties: bool = False) -> None:
        X = seeded(5, self.world_size, 3, self.world_size * 2, ties=ties)
        x = leaf(X[self.rank])
        y = reduce_scatter(x, axis=-1, op=op)
        loss = all_reduce(loss_of(y))
        loss.backward()
        Xr = reference_leaf(X)
        Y = reduce(Xr)
        loss_reference = loss_of(Y)
        loss_reference.backward()
        assert_close(y, Y[:, self._rows(2)], f"reduce_scatter {op} forward")
        assert_close(loss, loss_reference, f"reduce_scatter {op} loss")
        assert_close(x.grad, Xr.grad[self.rank], f"reduce_scatter {op} gradient")

    def reduce_scatter_sum(self):
        self._reduce_scatter("sum", lambda X: X.sum(0))

    def reduce_scatter_mean(self):
        self._reduce_scatter("mean", lambda X: X.mean(0))

    def reduce_scatter_max(self):
        self._reduce_scatter("max", lambda X: X.amax(0), ties=True)

    def scatter_last_axis(self):
        X = seeded(6, 3, self.world_size * 2)
        x = leaf(X)
        y = scatter(x, axis=-1)
        all_reduce(loss_of(y)).backward()
        Xr = reference_leaf(X)
        loss_of(Xr).backward()
        assert_close(y, X[:, self._rows(2)], "scatter forward")
        assert_close(x.grad, Xr.grad, "scatter gradient (whole, on every rank)")

    def _broadcast(self, src: int) -> None:
        X = seeded(7, self.world_size, 5)
        x = leaf(X[self.rank])
        y = broadcast(x, src=src)
        loss_of(y).backward()
        Xr = reference_leaf(X)
        loss_of(Xr[src]).backward()
        assert_close(y, X[src], f"broadcast from {src} forward")
        assert_close(x.grad, Xr.grad[self.rank], f"broadcast from {src} gradient")

    def broadcast_from_first_rank(self):
        self._broadcast(0)

    def broadcast_from_last_rank(self):
        self._broadcast(self.world_size - 1)

    def _mlp_weights(self):
        hidden = 4 * self.world_size
        return (
            seeded(10, 4, 8),
            seeded(11, 8, hidden),
            seeded(12, hidden),
            seeded(13, hidden, 8),
            seeded(14, 8),
        )

    def megatron_mlp_with_f_and_g(self):
        X, W1, B1, W2, B2 = self._mlp_weights()
        cols = self._rows(4)
        x, w1, b1 = leaf(X), leaf(W1[:, cols]), leaf(B1[cols])
        w2, b2 = leaf(W2[cols]), leaf(B2)
        h = F.gelu(copy_to_parallel(x) @ w1 + b1)
        y = reduce_from_parallel(h @ w2) + b2
        loss_of(y).backward()
        reference = [reference_leaf(t) for t in (X, W1, B1, W2, B2)]
        Xr, W1r, B1r, W2r, B2r = reference
        loss_of(F.gelu(Xr @ W1r + B1r) @ W2r + B2r).backward()
        assert_close(y, F.gelu(X @ W1 + B1) @ W2 + B2, "MLP forward")
        assert_close(x.grad, Xr.grad, "MLP gradient of x")
        assert_close(w1.grad, W1r.grad[:, cols], "MLP gradient of w1 (columns)")
        assert_close(b1.grad, B1r.grad[cols], "MLP gradient of b1 (columns)")
        assert_close(w2.grad, W2r.grad[cols], "MLP gradient of w2 (rows)")
        assert_close(b2.grad, B2r.grad, "MLP gradient of b2")

    def megatron_mlp_without_f_gives_each_rank_a_partial_input_gradient(self):
        X, W1, B1, W2, B2 = self._mlp_weights()
        cols = self._rows(4)
        x = leaf(X)
        h = F.gelu(x @ W1[:, cols].float() + B1[cols].float())
        loss_of(reduce_from_parallel(h @ W2[cols].float()) + B2.float()).backward()
        Xr = reference_leaf(X)
        loss_of(F.gelu(Xr @ W1 + B1) @ W2 + B2).backward()
        if relative_error(x.grad, Xr.grad) < 1e-3:
            raise AssertionError("without copy_to_parallel x.grad is already whole")
        summed = all_reduce(x.grad)
        assert_close(summed, Xr.grad, "sum over ranks of the partial gradients")

    def sequence_parallel_mlp_with_gather_scatter_broadcast(self):
        n, src = self.world_size, self.world_size - 1
        X, W1, W2 = seeded(20, 2 * n, 8), seeded(21, 8, 4 * n), seeded(22, 4 * n, 8)
        BIAS = seeded(23, n, 8)
        cols = self._rows(4)
        x, w1, w2 = leaf(X), leaf(W1[:, cols]), leaf(W2[cols])
        bias_here = leaf(BIAS[self.rank])
        x_rows = scatter(x, axis=0)
        h = F.gelu(copy_to_parallel(all_gather(x_rows, axis=0)) @ w1)
        bias = copy_to_parallel(broadcast(bias_here, src=src))
        y_rows = reduce_scatter(h @ w2, axis=0) + x_rows + bias
        loss = all_reduce(loss_of(y_rows))
        loss.backward()
        Xr, W1r, W2r, BIASr = (reference_leaf(t) for t in (X, W1, W2, BIAS))
        Y = F.gelu(Xr @ W1r) @ W2r + Xr + BIASr[src]
        loss_reference = loss_of(Y)
        loss_reference.backward()
        assert_close(y_rows, Y[self._rows(2)], "forward (this rank's rows)")
        assert_close(loss, loss_reference, "loss")
        assert_close(x.grad, Xr.grad, "gradient of x")
        assert_close(w1.grad, W1r.grad[:, cols], "gradient of w1 (columns)")
        assert_close(w2.grad, W2r.grad[cols], "gradient of w2 (rows)")
        assert_close(bias_here.grad, BIASr.grad[self.rank], "gradient of the bias")

    def collectives_within_pairs_of_ranks_use_group_ranks(self):
        pairs = [
            dist.new_group([first, first + 1]) for first in range(0, self.world_size, 2)
        ]
        pair, first = pairs[self.rank // 2], self.rank - self.rank % 2
        X = seeded(30, self.world_size, 3)
        x = leaf(X[self.rank])
        gathered = all_gather(x, group=pair)
        from_second = broadcast(x, src=1, group=pair)
        loss_of(all_reduce(x, group=pair) + gathered[:3] + from_second).backward()
        Xr = reference_leaf(X[first : first + 2])
        loss_of(Xr.sum(0) + Xr[0] + Xr[1]).backward()
        assert_close(gathered, X[first : first + 2].reshape(-1), "all_gather in pair")
        assert_close(from_second, X[first + 1], "broadcast from group rank 1")
        assert_close(x.grad, Xr.grad[self.rank % 2], "gradient within the pair")

    def bad_arguments_raise_collective_error(self):
        n = self.world_size
        uneven = torch.zeros(n + 1, 2)
        calls = {
            "reduce_scatter uneven": (
                lambda: reduce_scatter(uneven),
                [f"size {n + 1}", f"{n} ranks", "dimension 0", "multiple of"],
            ),
            "scatter uneven": (
                lambda: scatter(uneven, axis=0),
                [f"size {n + 1}", f"{n} ranks", "dimension 0"],
            ),
            "broadcast src=n": (lambda: broadcast(uneven, src=n), [f"src={n}"]),
            "broadcast src=-1": (lambda: broadcast(uneven, src=-1), ["src=-1"]),
            "all_reduce op": (lambda: all_reduce(uneven, "min"), ["'min'"]),
            "reduce_scatter op": (
                lambda: reduce_scatter(torch.zeros(n, 2), op="prod"),
                ["'prod'"],
            ),
            "all_gather axis": (lambda: all_gather(uneven, axis=2), ["axis=2"]),
            "axis_name": (
                lambda: copy_to_parallel(uneven, axis_name="model"),
                ["group="],
            ),
        }
        for name, (call, wanted) in calls.items():
            try:
                call()
            except CollectiveError as error:
                missing = [part for part in wanted if part not in str(error)]
                if missing:
                    raise AssertionError(f"{name}: {missing} not in {error}") from None
            else:
                raise AssertionError(f"{name}: no CollectiveError")


CHECKS = [name for name in vars(Checks) if not name.startswith("_")]


def main() -> int:
    rank, world_size = int(sys.argv[1]), int(sys.argv[2])
    init_file, out_dir = sys.argv[3], sys.argv[4]
    torch.manual_seed(0)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    checks = Checks(rank, world_size)
    failures = {}
    for name in CHECKS:
        try:
            getattr(checks, name)()
        except Exception as error:  # noqa: BLE001 - reported to the test
            frames = traceback.extract_tb(error.__traceback__)[1:]
            where = " <- ".join(
                f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
                for frame in reversed(frames)
            )
            failures[name] = f"{type(error).__name__}: {error} (at {where})"
    dist.destroy_process_group()
    report = {
        "rank": rank,
        "world_size": world_size,
        "checks": CHECKS,
        "failures": failures,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
