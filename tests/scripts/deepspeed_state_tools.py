"""DeepSpeed's optimizer state tools on hf-paged client optimizers under ZeRO 3, 2 and 1, in one ``torchrun`` launch.

For each ZeRO stage of ``--stages`` (``1_bf16``: ZeRO-1 with bf16 parameters and fp32 gradient accumulation, which
DeepSpeed runs with its ``BF16_Optimizer``) and each configuration of :data:`CLIENTS` (``torch.optim.AdamW`` as the
control, and paged AdamW with 32-bit, 8-bit and 4-bit state), a small MLP is handed to ``deepspeed.initialize``
with the client optimizer, trained :data:`STEPS` steps, and then each rank checks, for every parameter and for
``exp_avg`` and ``exp_avg_sq``:

- ``safe_get_full_optimizer_state``: the piece of this rank's partition equals that partition of the state that
  the client's ``state_dict()`` saves, decoded by the client's codec (8-bit and 4-bit codes and scales); under
  ZeRO-3 ``safe_get_local_optimizer_state`` too;
- ``safe_set_full_optimizer_state`` of new values (under ZeRO-3 every other parameter through
  ``safe_set_local_optimizer_state``), parameter after parameter: afterwards the states read equal the rank's
  partition with each parameter's values written in turn, re-encoded by the codec after each write (the codec's
  blocks span parameters), and so does the saved state;
- one more training step, which uses the written state, runs.

Rank 0 writes ``--output`` (``torch.save``, loadable with ``weights_only=True``): per rank and ``zero<stage>/<name>``
the number of parameters answered, the largest differences of each check (0.0 where equal), the keys left in
``optimizer.state`` and in the ZeRO-1/2 fragment mappings, the full states read after training and the full
weights after the step that follows the writes, for comparing configurations.

Example: ``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/scripts/deepspeed_state_tools.py
--output /tmp/state_tools.pt``
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from deepspeed_train import full_weights, prepare_process, skip_shm_op_build

import hf_paged  # noqa: F401  (enables the state tools for paged clients once DeepSpeed loads)
from hf_paged.codecs import Float32Codec, to_blocks
from hf_paged.optim import PagedAdamW, PagedAdamW4bit, PagedAdamW8bit, PagedOptimizer
from hf_paged.process_exit import end_distributed_run

STEPS = 3
KEYS = ("exp_avg", "exp_avg_sq")
PAGED = {"page_size": "4KiB", "block_size": 64}
CLIENTS = {
    "adamw_torch": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "adamw_32bit": lambda params: PagedAdamW(params, lr=1e-2, page_size="4KiB"),
    "adamw_8bit": lambda params: PagedAdamW8bit(params, lr=1e-2, min_8bit_size=256, **PAGED),
    "adamw_4bit": lambda params: PagedAdamW4bit(params, lr=1e-2, min_4bit_size=256, **PAGED),
}
"""Configuration name: the client optimizer for the model's parameters (pages of 4 KiB: a partition spans
several; blocks of 64 elements, which straddle parameters)."""


def model() -> torch.nn.Module:
    """An MLP of six parameters, each with an even number of elements (two ranks split each evenly)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 96), torch.nn.GELU(), torch.nn.Linear(96, 48), torch.nn.GELU(), torch.nn.Linear(48, 8)
    )


def requantized(codec, values: torch.Tensor) -> torch.Tensor:
    """Flat fp32 ``values`` encoded by ``codec`` and decoded again."""
    padded = -(-values.numel() // codec.alignment) * codec.alignment
    fields = tuple(
        torch.zeros(length, dtype=dtype) for length, dtype in zip(codec.field_lengths(padded), codec.field_dtypes())
    )
    encoded = codec.select(fields, 0, padded)
    codec.encode(to_blocks(values.clone(), codec.alignment), encoded)
    return codec.decode(encoded).reshape(-1)[: values.numel()].clone()


def saved_partition(engine, client, key: str) -> tuple[torch.Tensor, object]:
    """This rank's flat partition of state ``key`` as the client's ``state_dict()`` saves it (under ZeRO-3, within
    the engine's, which lists the partitions for it and holds a paged client's states as fp32 values), decoded by
    the client's codec, and that codec (a :class:`Float32Codec` for ``torch.optim.AdamW``)."""
    zero = engine.optimizer
    if engine.zero_optimization_stage() == 3:
        saved, partition = zero.state_dict()["optimizer_state_dict"]["state"][0], zero.fp32_partitioned_groups_flat[0]
    else:
        saved, partition = client.state_dict()["state"][0], flat_partitions(zero)[0]
    if key in saved:  # fp32 values: torch.optim.AdamW's, or a paged client's decoded in DeepSpeed's state dict
        codec = Float32Codec()
        if isinstance(client, PagedOptimizer):
            codec = client._formats[client._layout[partition].kind].codecs[client.state_names.index(key)]
        return saved[key].reshape(-1).float().clone(), codec
    kind = "8bit" if f"{key}_codes" in saved else "4bit"
    codec = client._formats[kind].codecs[client.state_names.index(key)]
    fields = tuple(saved[f"{key}_{field}"].reshape(-1) for field in codec.fields)
    return saved_values(codec, fields, partition.numel()), codec


def flat_partitions(zero) -> list[torch.Tensor]:
    """This rank's flat fp32 partition of each param group of a ZeRO-1/2 optimizer (``DeepSpeedZeroOptimizer`` or
    ``BF16_Optimizer``)."""
    if hasattr(zero, "fp32_groups_flat_partition"):
        return zero.fp32_groups_flat_partition
    return zero.single_partition_of_fp32_groups


def saved_values(codec, fields: tuple[torch.Tensor, ...], elements: int) -> torch.Tensor:
    """The ``elements`` fp32 values of saved ``fields`` (codes and scales), decoded by ``codec``."""
    padded = -(-elements // codec.alignment) * codec.alignment
    lengths = codec.field_lengths(padded)
    fields = tuple(torch.cat([f, f.new_zeros(n - f.numel())]) if n > f.numel() else f for f, n in zip(fields, lengths))
    return codec.decode(codec.select(fields, 0, padded)).reshape(-1)[:elements].clone()


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference of ``a`` and ``b`` (``inf`` for a shape mismatch, 0.0 where equal)."""
    a, b = a.reshape(-1).float(), b.reshape(-1).float()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max()) if a.numel() else 0.0


def check(setup: str, name: str, rank: int) -> dict:
    """Train configuration ``name`` under ZeRO ``setup`` (a stage, or ``1_bf16``) and run every check on this rank;
    what it found."""
    import deepspeed
    from deepspeed.utils import (
        safe_get_full_optimizer_state,
        safe_get_local_optimizer_state,
        safe_set_full_optimizer_state,
        safe_set_local_optimizer_state,
    )

    stage = int(setup[0])
    net = model()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    dtype = torch.float32
    if setup == "1_bf16":
        config.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
        dtype = torch.bfloat16
    engine, *_ = deepspeed.initialize(model=net, optimizer=CLIENTS[name](net.parameters()), config=config)
    client = engine.optimizer.optimizer
    generator = torch.Generator().manual_seed(rank)
    inputs, targets = torch.randn(4, 16, generator=generator).to(dtype), torch.randn(4, 8, generator=generator)
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(engine(inputs).float(), targets)
        engine.backward(loss)
        engine.step()
    zero = engine.optimizer
    params = list(engine.module.parameters())
    record: dict = {"answered": 0, "parameters": len(params), "full": {}, "differences": {}}

    def note(check_name: str, difference: float) -> None:
        record["differences"][check_name] = max(record["differences"].get(check_name, 0.0), difference)

    def position(param) -> tuple[int, int, int] | None:
        """Where this rank's piece of ``param`` is: its offset in the flat partition, its elements and its offset
        in the whole parameter (``None``: not in this rank's partition)."""
        if stage == 3:
            _, offset, elements = zero.grad_position[zero.get_param_id(param)]
            return offset, elements, rank * elements
        mapping = param._hp_mapping
        if mapping is None:
            return None
        return mapping.hp_fragment_address.start, mapping.hp_fragment_address.numel, mapping.lp_fragment_address.start

    def piece(tensor: torch.Tensor, where: tuple[int, int, int]) -> torch.Tensor:
        return tensor.reshape(-1)[where[2] : where[2] + where[1]]

    expected = {}
    for key in KEYS:
        partition, codec = saved_partition(engine, client, key)
        expected[key] = (partition, codec)
        record["full"][key] = []
        for param in params:
            try:
                full = safe_get_full_optimizer_state(param, key)
                local = safe_get_local_optimizer_state(param, key) if stage == 3 else None
            except (KeyError, ValueError) as error:
                record.setdefault("errors", []).append(f"{key}: {type(error).__name__}: {error}")
                continue
            record["answered"] += key == KEYS[0]
            record["full"][key].append(full.reshape(-1).clone())
            where = position(param)
            if where is None:
                continue
            offset, elements, _ = where
            note("full_vs_saved", largest_difference(piece(full, where), partition[offset : offset + elements]))
            if stage == 3:
                note("local_vs_saved", largest_difference(local, partition[offset : offset + elements]))
    if "errors" in record:
        return record

    for key in KEYS:
        partition, codec = expected[key]
        written = partition.clone()
        for index, param in enumerate(params):
            new_full = safe_get_full_optimizer_state(param, key) * 1.5 + 1e-4
            where = position(param)
            if stage == 3 and index % 2:
                safe_set_local_optimizer_state(param, piece(new_full, where).clone(), key)
            else:
                safe_set_full_optimizer_state(param, new_full, key)
            if where is not None:
                offset, elements, _ = where
                written[offset : offset + elements] = piece(new_full, where)
                written = requantized(codec, written)
        for param in params:
            full = safe_get_full_optimizer_state(param, key)
            where = position(param)
            if where is None:
                continue
            offset, elements, _ = where
            note("full_after_set", largest_difference(piece(full, where), written[offset : offset + elements]))
            if stage == 3:
                local = safe_get_local_optimizer_state(param, key)
                note("local_after_set", largest_difference(local, written[offset : offset + elements]))
        resaved, _ = saved_partition(engine, client, key)
        note("saved_after_set", largest_difference(resaved, written))
    record["state_keys"] = sorted(str(key) for entry in client.state.values() for key in entry)
    record["fragment_keys"] = sorted(
        {key for param in params if getattr(param, "_hp_mapping", None) for key in param._hp_mapping.optim_fragment}
    )
    loss = torch.nn.functional.mse_loss(engine(inputs).float(), targets)
    engine.backward(loss)
    engine.step()
    record["weights_after_set"] = full_weights(engine)
    engine.destroy()
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--stages", nargs="+", default=["3", "2", "1", "1_bf16"], choices=["1", "2", "3", "1_bf16"])
    parser.add_argument("--configs", nargs="+", default=list(CLIENTS), choices=list(CLIENTS))
    options = parser.parse_args()
    prepare_process()
    skip_shm_op_build()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = {f"zero{stage}/{name}": check(stage, name, rank) for stage in options.stages for name in options.configs}
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        torch.save({"world_size": world_size, "ranks": gathered}, options.output)
    end_distributed_run()  # ends the process: see hf_paged/process_exit.py


if __name__ == "__main__":
    main()
