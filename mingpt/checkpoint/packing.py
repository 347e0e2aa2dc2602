"""A state (nested dicts, lists and tuples of tensors and plain values) as a JSON tree and a list of tensors, and back,
for the memory tier (mingpt.checkpoint.memory) and healing (mingpt.training.healing): a pickle would run whatever its
bytes say. Dict keys keep their type; a sharded tensor is its shard and where it lies, so shards reassemble."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mingpt.torch_internals import shard_offsets


@dataclass
class Chunk:
    """What a shard holds of a sharded tensor: `local`, at `offsets` in a whole of `shape`."""

    shape: list[int]
    offsets: list[int]
    local: torch.Tensor


def pack(obj: Any, tensors: list[torch.Tensor], shared: dict[tuple, int] | None = None) -> Any:
    """A JSON tree of `obj`, each tensor (a sharded one: its shard, and where it lies) replaced by its index in
    `tensors`. With `shared`, tied weights are packed once: safetensors refuses two tensors on one storage."""
    if (shard := shard_offsets(obj)) is not None:
        return {**pack(obj.to_local(), tensors, shared), "shape": list(obj.shape), "offsets": shard[0]}
    if isinstance(obj, torch.Tensor):
        key = (obj.data_ptr(), obj.dtype, tuple(obj.shape), tuple(obj.stride()))
        if shared is None or key not in shared:
            tensors.append(obj)
            if shared is not None:
                shared[key] = len(tensors) - 1
        return {"tensor": shared[key] if shared is not None else len(tensors) - 1}
    if isinstance(obj, dict):
        return {"dict": [[key, pack(value, tensors, shared)] for key, value in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"list": [pack(value, tensors, shared) for value in obj], "tuple": isinstance(obj, tuple)}
    return {"value": obj}


def unpack(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """The state `pack` described, its tensors taken from `tensors` (a Chunk for a shard)."""
    if "tensor" in tree:
        tensor = tensors[tree["tensor"]]
        return Chunk(tree["shape"], tree["offsets"], tensor) if "offsets" in tree else tensor
    if "dict" in tree:
        return {key: unpack(value, tensors) for key, value in tree["dict"]}
    if "list" in tree:
        values = [unpack(value, tensors) for value in tree["list"]]
        return tuple(values) if tree["tuple"] else values
    return tree["value"]


def assemble(trees: list[Any]) -> Any:
    """One state from every process's unpacked shards: sharded tensors whole from their Chunks, the rest as is."""
    first = trees[0]
    if isinstance(first, Chunk):
        whole = torch.empty(first.shape, dtype=first.local.dtype)
        if sum(chunk.local.numel() for chunk in trees) != whole.numel():
            raise ValueError(f"the shards of a tensor of shape {first.shape} do not fill it")
        for chunk in trees:
            whole[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.local.shape))] = chunk.local
        return whole
    if isinstance(first, dict):
        return {key: assemble([tree[key] for tree in trees]) for key in first}
    if isinstance(first, (list, tuple)):
        return type(first)(assemble([tree[i] for tree in trees]) for i in range(len(first)))
    return first


def placed_like(tree: Any, template: Any) -> Any:
    """The unpacked `tree` (sent by a process holding the same shards: hsdp's peer on another node), each Chunk made
    the DTensor that `template`, this process's state, holds there; ValueError where a shard is not this process's."""
    mine = shard_offsets(template)
    if isinstance(tree, Chunk):
        if mine is None or tree.shape != list(template.shape) or tree.offsets != mine[0] or \
                list(tree.local.shape) != mine[1]:
            held = f"{mine[0]} of {list(template.shape)}" if mine is not None else "a whole tensor"
            raise ValueError(f"a shard at {tree.offsets} of {tree.shape} where this process holds {held}")
        local = tree.local.to(template.to_local().device)
        return type(template).from_local(local, template.device_mesh, template.placements, run_check=False,
                                         shape=template.shape, stride=template.stride())
    if mine is not None:
        raise ValueError(f"a whole tensor where this process holds a shard of {list(template.shape)}")
    if isinstance(tree, dict) and isinstance(template, dict):
        return {key: placed_like(value, template.get(key)) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)) and isinstance(template, (list, tuple)) and len(tree) == len(template):
        return type(tree)(placed_like(value, mine) for value, mine in zip(tree, template))
    return tree
