"""What XLA:GPU holds at a zoo plan's compiled peak, buffer by buffer.

The memory-truth zoo (`benchmarks/memory_truth_gpu.py`) gives one number per
plan, the compiled peak, against the estimate. Finding what the estimate
misses needs the buffers behind that number: this compiles one zoo row's
train step for `TARGET`'s GPUs (deviceless, as the zoo does) with XLA's
dump on, reads the buffer live ranges XLA:GPU writes for its schedule (the
`*train_step*gpu_after_optimizations-live-range.txt` file: the buffers live
at the program's peak position and each buffer's first and last position)
and names each buffer's part of the step from the HLO's `op_name`
metadata: parameters, optimizer state, data, a layer's forward or backward
pass, or other (the optimizer's updates, combined collectives, the loss).

Run:

```
python -m benchmarks.peak_buffers mlp 1x8 float32
python -m benchmarks.peak_buffers gemma 2x4 float32 --top 40
```

The model, mesh and policy are those of the zoo table's rows
(`memory_truth_gpu.selected_settings`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import pathlib
import re
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

# Imported first: it sets the environment for planning on the host (JAX,
# the CPU platform) before anything imports Keras.
from benchmarks.memory_truth_gpu import TARGET, selected_settings

_PEAK_HEAD = re.compile(r"^\s*Live ranges at (\d+) \(peak\):\s*$")
_PEAK_LINE = re.compile(r"^\s*(\S+?)(\{[0-9,]*\}): (\d+) bytes")
_RANGE_LINE = re.compile(r"^\s*(\S+?)(\{[0-9,]*\}):(\d+)-(\d+)\s*$")
_LAYER = re.compile(r"jvp\(([A-Za-z0-9_.\-]+)\)")
_STATE = re.compile(r"^state\[(\d+)\]")
# Keras's train step state: trainable, non-trainable, optimizer, metrics.
_STATE_PARTS = ("parameters", "non-trainable", "optimizer state", "metrics")


@dataclasses.dataclass(frozen=True)
class PeakBuffer:
    """One buffer live at a compiled program's peak.

    Attributes:
        name: The instruction that defines it, with its tuple index
            (`"gemm_fusion_dot.21{}"`).
        size_bytes: Its bytes per device.
        first: First position in the schedule where it is live.
        last: Last position where it is live.
        shape: The defining instruction's shape text ("" when not found).
        op_name: The instruction's `op_name` metadata ("" when it has none).
        opcode: The instruction's opcode ("" when not found).
    """

    name: str
    size_bytes: int
    first: int
    last: int
    shape: str = ""
    op_name: str = ""
    opcode: str = ""

    @property
    def part(self) -> str:
        """The part of the train step that made it (see the module doc)."""
        state = _STATE.match(self.op_name)
        if state:
            index = int(state.group(1))
            return _STATE_PARTS[index] if index < len(_STATE_PARTS) else "state"
        if self.op_name.startswith("data["):
            return "data"
        if "transpose(jvp(" in self.op_name:
            return "backward"
        if "jvp(" in self.op_name:
            return "forward"
        return "other"

    @property
    def layer(self) -> str:
        """The outermost layer call its `op_name` names ("" when none)."""
        match = _LAYER.search(self.op_name)
        return match.group(1) if match else ""


@dataclasses.dataclass(frozen=True)
class PeakBuffers:
    """The buffers live at a compiled program's peak.

    Attributes:
        position: The peak's position in the schedule.
        length: Positions in the schedule.
        buffers: The buffers live there, largest first.
    """

    position: int
    length: int
    buffers: tuple[PeakBuffer, ...]

    @property
    def total_bytes(self) -> int:
        return sum(buffer.size_bytes for buffer in self.buffers)

    def by_part(self) -> dict[str, int]:
        """Bytes per part of the step (`PeakBuffer.part`), largest first."""
        totals: collections.Counter = collections.Counter()
        for buffer in self.buffers:
            totals[buffer.part] += buffer.size_bytes
        return dict(totals.most_common())


def dump_options(directory: str | pathlib.Path) -> dict[str, Any]:
    """XLA compiler options that dump a program's optimized HLO and its
    buffer live ranges into `directory` (`read_dump` reads them back)."""
    return {"xla_dump_to": str(directory), "xla_dump_hlo_as_text": True}


def read_dump(directory: str | pathlib.Path) -> tuple[str, str]:
    """The train step's live-range dump and optimized HLO text that XLA:GPU
    wrote into `directory` under `dump_options`."""
    dump = pathlib.Path(directory)
    (live,) = dump.glob("*train_step*gpu_after_optimizations-live-range.txt")
    (hlo,) = dump.glob("*train_step*gpu_after_optimizations.txt")
    return live.read_text(), hlo.read_text()


def _entry_instructions(hlo_text: str) -> list:
    """The instructions of a program's entry computation, in order."""
    from keras_autoshard.report.hlo.text import parse_computations

    return [
        instruction
        for computation in parse_computations(hlo_text)
        if computation.is_entry
        for instruction in computation.instructions
    ]


def read_by_the_update(hlo_text: str, instruction_name: str) -> bool:
    """Whether the optimizer's update alone reads the buffer
    `instruction_name` (`reader_op_names`: the `adam` name scope, numbered
    where a process made several optimizers)."""
    readers = reader_op_names(hlo_text, instruction_name)
    return bool(readers) and all(re.match(r"adam(_\d+)?/", r) for r in readers)


def _op_name(instruction) -> str:
    found = re.search(r'op_name="([^"]*)"', instruction.attributes)
    return found.group(1).removeprefix("jit(train_step)/") if found else ""


def shapes_made_by(hlo_text: str, op_name_part: str, opcode: str = "") -> set[str]:
    """Array shapes (without layouts) of the entry computation's
    instructions whose `op_name` contains `op_name_part`, of `opcode` only
    where given: what a program makes for one op of the model.

    Example:

    ```python
    shapes_made_by(hlo, "rematted_computation/dense", "all-gather-done")
    ```
    """
    return {
        instruction.shape_text.split("{")[0]
        for instruction in _entry_instructions(hlo_text)
        if op_name_part in _op_name(instruction)
        and (not opcode or instruction.opcode == opcode)
    }


def reader_op_names(hlo_text: str, instruction_name: str) -> list[str]:
    """The `op_name`s of the entry computation's instructions that read
    `instruction_name` (a `PeakBuffer.name` with or without its tuple
    index): which part of the step consumes a buffer.

    Example:

    ```python
    reader_op_names(hlo, "gemm_fusion_dot.22{}")  # ["adam/sub"]
    ```
    """
    from keras_autoshard.report.hlo.text import operand_names_and_shapes

    name = instruction_name.split("{")[0]
    return [
        _op_name(instruction)
        for instruction in _entry_instructions(hlo_text)
        if any(
            operand == name
            for operand, _ in operand_names_and_shapes(instruction.operands_text)
        )
    ]


def read_peak_buffers(live_range_text: str, hlo_text: str = "") -> PeakBuffers:
    """Parse XLA's buffer live ranges (its `-live-range.txt` dump).

    Args:
        live_range_text: The live-range dump of one module.
        hlo_text: The same module's optimized HLO text (its
            `gpu_after_optimizations.txt` dump), to name each buffer's shape
            and `op_name`; without it those are empty.

    Returns:
        The buffers live at the peak.

    Raises:
        ValueError: the text has no peak section.

    Example:

    ```python
    peak = read_peak_buffers(pathlib.Path(live).read_text(), hlo)
    peak.by_part()  # {"backward": ..., "parameters": ..., ...}
    ```
    """
    lines = live_range_text.splitlines()
    length = re.search(r"HloLiveRange \(max (\d+)\)", live_range_text)
    ranges: dict[str, tuple[int, int]] = {}
    position = None
    sizes: list[tuple[str, int]] = []
    for line in lines:
        head = _PEAK_HEAD.match(line)
        if head:
            position = int(head.group(1))
            continue
        if position is None:
            found = _RANGE_LINE.match(line)
            if found:
                key = found.group(1) + found.group(2)
                ranges[key] = (int(found.group(3)), int(found.group(4)))
            continue
        found = _PEAK_LINE.match(line)
        if found is None:
            break  # the peak section ends where its buffer lines do
        sizes.append((found.group(1) + found.group(2), int(found.group(3))))
    if position is None:
        raise ValueError("The live-range text has no 'Live ranges at N (peak)'.")
    instructions = {
        instruction.name: instruction for instruction in _entry_instructions(hlo_text)
    }
    buffers = []
    for key, size in sizes:
        instruction = instructions.get(key.split("{")[0])
        op_name = _op_name(instruction) if instruction is not None else ""
        first, last = ranges.get(key, (-1, -1))
        buffers.append(
            PeakBuffer(
                name=key,
                size_bytes=size,
                first=first,
                last=last,
                shape=instruction.shape_text if instruction is not None else "",
                op_name=op_name,
                opcode=instruction.opcode if instruction is not None else "",
            )
        )
    buffers.sort(key=lambda buffer: -buffer.size_bytes)
    return PeakBuffers(
        position=position,
        length=int(length.group(1)) if length else 0,
        buffers=tuple(buffers),
    )


def compiled_with_dump(
    model_builder: Callable[[], Any],
    sharding_plan: Any,
    sample_batch: Any,
    target: str = TARGET,
) -> tuple[Any, PeakBuffers, str]:
    """Compile the plan's train step for `target`'s GPUs (deviceless) with
    XLA's dump on, and read the buffers at its compiled peak.

    Args:
        model_builder: The function building the model (as for `plan`).
        sharding_plan: The plan to compile.
        sample_batch: `(x, y)` with the global batch (arrays or
            `jax.ShapeDtypeStruct`s).
        target: A GPU hardware profile's name.

    Returns:
        `(TargetCompile, PeakBuffers, the optimized HLO text)`.
    """
    from keras_autoshard import compile_for_target

    with tempfile.TemporaryDirectory() as directory:
        result = compile_for_target(
            model_builder,
            sharding_plan,
            sample_batch,
            target,
            compiler_options=dump_options(directory),
        )
        live_text, hlo_text = read_dump(directory)
    return result, read_peak_buffers(live_text, hlo_text), hlo_text


def _setting(model: str, mesh: str, policy: str):
    for setting in selected_settings():
        shape = "x".join(map(str, setting.mesh_shape))
        if (setting.model, shape, setting.policy) == (model, mesh, policy):
            return setting
    raise SystemExit(
        f"No zoo row {model!r} {mesh!r} {policy!r}; rows: "
        + "; ".join(
            f"{s.model} {'x'.join(map(str, s.mesh_shape))} {s.policy}"
            for s in selected_settings()
        )
    )


def zoo_peak_buffers(model: str, mesh: str, policy: str) -> dict[str, Any]:
    """Plan one zoo row for `TARGET`, compile its train step with XLA's dump
    on, and read the buffers at its compiled peak.

    Args:
        model: The row's model (`"mlp"`, `"gemma + LoRA r4"`).
        mesh: The row's mesh (`"1x8"`).
        policy: The row's policy (`"float32"`, `"float32, remat all"`).

    Returns:
        `{"plan": ..., "compiled_peak": bytes, "peak": PeakBuffers,
        "hlo_text": the optimized program}`.
    """
    from keras_autoshard.testing import zoo

    setting = _setting(model, mesh, policy)
    with setting.scope():
        sharding_plan = setting.plan(hardware=TARGET)
        targets = zoo.random_targets(setting.build, setting.x)
        result, peak, hlo_text = compiled_with_dump(
            setting.build, sharding_plan, (setting.x, targets)
        )
    return {
        "plan": sharding_plan,
        "compiled_peak": result.compiled_peak_bytes,
        "peak": peak,
        "hlo_text": hlo_text,
    }


def _mib(size: float) -> str:
    return f"{size / 2**20:.3f} MiB"


def render(result: dict[str, Any], top: int) -> str:
    """The estimate's terms, the peak's bytes by part, its largest buffers."""
    estimate = result["plan"].estimate
    peak: PeakBuffers = result["peak"]
    lines = [
        f"estimated peak {_mib(estimate.peak_bytes)}, compiled peak "
        f"{_mib(result['compiled_peak'])} "
        f"({estimate.peak_bytes / result['compiled_peak']:.3f})",
        "estimate terms: "
        + ", ".join(
            f"{name} {_mib(getattr(estimate, name + '_bytes'))}"
            for name in (
                "parameter",
                "gradient",
                "optimizer",
                "activation",
                "data",
                "transient",
            )
        ),
        f"peak at {peak.position} of {peak.length}: {_mib(peak.total_bytes)} in "
        f"{len(peak.buffers)} buffers",
    ]
    lines += [f"  {part}: {_mib(size)}" for part, size in peak.by_part().items()]
    lines.append(f"largest {min(top, len(peak.buffers))}:")
    for buffer in peak.buffers[:top]:
        lines.append(
            f"  {buffer.size_bytes:>10} {buffer.first:>5}-{buffer.last:<5} "
            f"{buffer.part:<15} {buffer.layer:<24} {buffer.shape:<28} "
            f"{(buffer.op_name or buffer.opcode)[-90:]}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a zoo row's model, e.g. mlp")
    parser.add_argument("mesh", help="a zoo row's mesh, e.g. 1x8")
    parser.add_argument("policy", help="a zoo row's policy, e.g. float32")
    parser.add_argument("--top", type=int, default=25, help="buffers to list")
    args = parser.parse_args(argv)
    print(render(zoo_peak_buffers(args.model, args.mesh, args.policy), args.top))


if __name__ == "__main__":
    main()
