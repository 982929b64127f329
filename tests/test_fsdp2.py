"""FSDP2: paged optimizers update DTensor shards and save and load through torch.distributed.checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "scripts"))

from fsdp2_train import OPTIMIZERS, batches, build_model, make_optimizer

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

STEPS, SAVE_AT = 5, 3


@pytest.fixture(scope="module")
def two_ranks_folder(tmp_path_factory):
    """The folder of one two-process run of ``fsdp2_train.py`` for every optimizer: ``result.pt`` and the
    checkpoints (one per optimizer under ``checkpoints``)."""
    folder = tmp_path_factory.mktemp("fsdp2")
    output = folder / "result.pt"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        os.path.join(REPO, "tests", "scripts", "fsdp2_train.py"),
        "--optimizers", *sorted(OPTIMIZERS), "--steps", str(STEPS), "--save-at", str(SAVE_AT),
        "--checkpoint", str(folder / "checkpoints"), "--output", str(output),
    ]
    environment = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, check=False, capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return folder


@pytest.fixture(scope="module")
def two_ranks(two_ranks_folder) -> dict:
    """The results of ``fsdp2_train.py`` for every optimizer."""
    return torch.load(two_ranks_folder / "result.pt", weights_only=True)


def unsharded(optimizer_name: str, steps: int) -> dict[str, torch.Tensor]:
    model = build_model()
    optimizer = make_optimizer(optimizer_name, model.parameters())
    for inputs, targets in batches(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return {name: param.detach() for name, param in model.named_parameters()}


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_fsdp2_checkpoint_round_trip_with_uneven_shards_is_exact(two_ranks, optimizer_name):
    sharded = two_ranks[optimizer_name]
    # Every state entry (8-bit state as fp32 values) and every page (codes and scales) loads bitwise as
    # saved, and the resumed run equals the uninterrupted one bitwise.
    assert sharded["mismatches"] == []
    assert sharded["state_like_params"]
    assert sharded["paging"]["page_outs"] > 0


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_fsdp2_two_ranks_match_unsharded_run(two_ranks, optimizer_name):
    # The 8-bit blocks fall on the same elements sharded and unsharded, and both ranks choose 8-bit state
    # for the uneven weight from its global size, so only the gradients' summation order differs.
    reference = unsharded(optimizer_name, steps=STEPS)
    for name, expected in reference.items():
        actual = two_ranks[optimizer_name]["params"][name]
        assert ((actual - expected).norm() / expected.norm()).item() < 1e-6, name


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_two_rank_checkpoint_reshards_into_one_unsharded_optimizer(two_ranks_folder, optimizer_name):
    """The saved fp32 shards join into whole tensors that load into an unsharded optimizer (8-bit: encoded)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import set_state_dict

    whole = two_ranks_folder / f"{optimizer_name}.pt"
    dcp_to_torch_save(two_ranks_folder / "checkpoints" / optimizer_name, whole)
    saved = torch.load(whole, weights_only=True)
    model = build_model()
    optimizer = make_optimizer(optimizer_name, model.parameters())
    set_state_dict(model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"])
    reference_model = build_model()
    reference = make_optimizer(optimizer_name, reference_model.parameters())
    for inputs, targets in batches(SAVE_AT):
        reference.zero_grad()
        torch.nn.functional.mse_loss(reference_model(inputs), targets).backward()
        reference.step()
    loaded, expected = optimizer.state_dict()["state"], reference.state_dict()["state"]
    assert loaded.keys() == expected.keys()
    for index, entry in expected.items():
        assert loaded[index].keys() == entry.keys()
        for key, value in entry.items():
            # Only the gradients' summation order differs from the unsharded run: codes within one step.
            if value.is_floating_point():
                torch.testing.assert_close(loaded[index][key], value, rtol=1e-4, atol=1e-8)
            else:
                assert (loaded[index][key].int() - value.int()).abs().max() <= 1, (index, key)


@pytest.mark.parametrize("signed", [True, False])
def test_decoded_8bit_state_encodes_back_to_the_same_codes_and_scales(signed):
    """What makes exporting sharded 8-bit state as fp32 values bitwise: decode, then encode, is the identity."""
    from hf_paged.codecs import Blockwise8bitCodec

    codec = Blockwise8bitCodec(64, signed)
    generator = torch.Generator().manual_seed(0)
    # Blocks from 1e-30 to 1e33 (the encoding itself needs scales in fp32's normal range).
    values = torch.randn(64, 64, generator=generator) * 10.0 ** torch.arange(-30, 34).unsqueeze(1)
    values = values if signed else values.abs()
    values[0] = 0.0  # an all-zero block has scale zero
    codes, scales = torch.empty(64, 64, dtype=codec.code_dtype), torch.empty(64)
    codec.encode(values, (codes, scales))
    again_codes, again_scales = torch.empty_like(codes), torch.empty_like(scales)
    codec.encode(codec.decode((codes, scales)), (again_codes, again_scales))
    assert torch.equal(again_codes, codes) and torch.equal(again_scales, scales)


@pytest.fixture
def cuda_mesh():
    """A one-rank device mesh of device type cuda (no CUDA needed: it only names the device type)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cuda", [0])
    finally:
        dist.destroy_process_group()


def offloaded(mesh, local: torch.Tensor) -> torch.Tensor:
    """``local`` as FSDP2's CPU offload holds a sharded tensor: a DTensor on a cuda mesh with a CPU shard."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=TensorMeta(local.shape, local.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)


@pytest.mark.parametrize("optimizer_name", ["PagedAdamW", "PagedAdamW8bit"])
def test_state_dict_of_offloaded_shards_stays_on_the_cpu(cuda_mesh, optimizer_name):
    """Defect: ``state_dict()`` built its DTensors with ``from_local``, which copies to the mesh's device."""
    generator = torch.Generator().manual_seed(0)
    # 300 elements: a partial last block of 8-bit state
    weight, grads = torch.randn(5, 60, generator=generator), torch.randn(2, 5, 60, generator=generator)

    def trained():
        param = torch.nn.Parameter(offloaded(cuda_mesh, weight.clone()))
        optimizer = make_optimizer(optimizer_name, [param])
        for grad in grads:
            param.grad = offloaded(cuda_mesh, grad.clone())
            optimizer.step()
        return param, optimizer

    param, optimizer = trained()
    saved = optimizer.state_dict()
    names = optimizer.state_names
    assert sorted(saved["state"][0]) == sorted(["step", *names])
    for name in names:
        state = saved["state"][0][name]
        assert state.device_mesh == param.device_mesh and state.placements == param.placements
        assert state.shape == param.shape
        assert state.to_local().device.type == "cpu" and state.dtype == torch.float32
    if optimizer_name == "PagedAdamW":
        reference_param = torch.nn.Parameter(weight.clone())
        reference = torch.optim.AdamW([reference_param], lr=1e-2, weight_decay=0.1, foreach=False)
        for grad in grads:
            reference_param.grad = grad.clone()
            reference.step()
        for name in names:
            torch.testing.assert_close(saved["state"][0][name].to_local(), reference.state[reference_param][name])
    # The CPU shards load back as saved (8-bit state: into the same codes and scales).
    _, resumed = trained()
    resumed.load_state_dict(saved)
    again = resumed.state_dict()["state"][0]
    for name in names:
        assert torch.equal(again[name].to_local(), saved["state"][0][name].to_local())
    for page, resumed_page in zip(optimizer._store.pages, resumed._store.pages, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(optimizer._store.read(page), resumed._store.read(resumed_page)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("optimizer_name", ["PagedAdamW", "PagedAdamW8bit"])
def test_fsdp2_on_cuda_exports_and_loads_state_on_the_cpu(tmp_path, optimizer_name):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    def sharded_on_cuda():
        model = build_model().cuda()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        return model, make_optimizer(optimizer_name, model.parameters(), budget=512)

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, optimizer = sharded_on_cuda()
        for inputs, targets in batches(3):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs.cuda()), targets.cuda()).backward()
            optimizer.step()
        saved = optimizer.state_dict()["state"]
        for index, param in enumerate(model.parameters()):
            assert param.to_local().is_cuda
            for name in optimizer.state_names:
                assert saved[index][name].to_local().device.type == "cpu", name
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(tmp_path))
        model, optimizer = sharded_on_cuda()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(tmp_path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        loaded = optimizer.state_dict()["state"]
        for index in saved:
            for name in optimizer.state_names:
                assert loaded[index][name].to_local().device.type == "cpu"
                assert torch.equal(loaded[index][name].to_local(), saved[index][name].to_local()), name
    finally:
        dist.destroy_process_group()
