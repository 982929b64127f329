"""Out-of-memory recovery: injected errors in forward and mid-backward, replayed exactly (Trainer, TRL, plain loops)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import Trainer, TrainerCallback

import hf_paged
from hf_paged.callbacks import MemorySpikeCallback
from hf_paged.integrations.oom import disable_oom_recovery, enable_oom_recovery, oom_recovery_of

from trainer_utils import tiny_llama, token_dataset, training_args

PAGE_SIZE = "16KiB"
DROPOUT = 0.2
RECOVERY_LOG = "out of memory in forward/backward"


class Injector:
    """Raises ``torch.OutOfMemoryError`` at chosen calls (counted from 1) of a forward pre-hook on the first
    decoder layer's MLP and of a gradient hook on its attention's query weight (reached mid-backward, after
    the gradients of the layers above are accumulated). Both hooks are installed in clean runs too."""

    def __init__(self, model, forward_at=(), backward_at=()):
        self.forward_at, self.backward_at = set(forward_at), set(backward_at)
        self.forward_calls = self.backward_calls = 0
        layer = model.model.layers[0]
        layer.mlp.register_forward_pre_hook(self._forward)
        layer.self_attn.q_proj.weight.register_hook(self._backward)

    def _forward(self, module, args):
        self.forward_calls += 1
        if self.forward_calls in self.forward_at:
            raise torch.OutOfMemoryError("injected in forward")

    def _backward(self, grad):
        self.backward_calls += 1
        if self.backward_calls in self.backward_at:
            raise torch.OutOfMemoryError("injected in backward")


class StepInjector(TrainerCallback):
    """Makes the first page allocation of the optimizer step of the chosen Trainer steps (from 1) raise
    ``torch.OutOfMemoryError`` (the optimizer needs a budget, so that its pages stream in at every step)."""

    def __init__(self, steps):
        self.steps = set(steps)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step + 1 not in self.steps:
            return
        (store,) = hf_paged.recovery.paged_optimizer_of(optimizer)._store.stores.values()
        allocate = store.backend.empty_device

        def failing(specs):
            store.backend.empty_device = allocate
            raise torch.OutOfMemoryError("injected in the optimizer step")

        store.backend.empty_device = failing


def llama_with_dropout(vocab_size=None):
    model = tiny_llama()
    if vocab_size is not None:
        model.resize_token_embeddings(vocab_size)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = DROPOUT
    model.config.attention_dropout = DROPOUT
    return model


# Micro-batch forwards of the first decoder layer, 2 per step: the 4th is step 2's second micro-batch; its
# replay adds 2 (step 3 then runs calls 7 and 8). Gradient hook calls: step 2's first micro-batch is call 3,
# its replay adds 2 (4, 5), so step 3's are 6 and 7: the 7th fails mid-backward of step 3's second micro-batch.
INJECTED = {"forward_at": [4], "backward_at": [7]}


def run_trainer(output_dir, budget=None, injected=None, oom_retries=2, trainer_cls=Trainer, step_at=(), **overrides):
    optim_args = f"page_size={PAGE_SIZE}" + (f",device_budget={budget}" if budget else "")
    callback = MemorySpikeCallback(oom_retries=oom_retries, plot=False)
    if trainer_cls is Trainer:
        model = llama_with_dropout()
        args = training_args(
            output_dir,
            optim="hf_paged_adamw_32bit",
            optim_args=optim_args,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=4,
            **overrides,
        )
        trainer = Trainer(model=model, args=args, train_dataset=token_dataset(16), callbacks=[callback])
    else:
        trainer = sft_trainer(output_dir, optim_args, callback)
        model = trainer.model
    Injector(model, **(injected or {}))
    if step_at:
        trainer.add_callback(StepInjector(step_at))
    trainer.train()
    return trainer, callback


def sft_trainer(output_dir, optim_args, callback):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_paged.cli.tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer(model_max_length=32)
    texts = [f"Count from {n}: " + " ".join(str(n + i) for i in range(6)) for n in range(16)]
    config = SFTConfig(
        output_dir=str(output_dir),
        optim="hf_paged_adamw_32bit",
        optim_args=optim_args,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        max_length=32,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return SFTTrainer(
        model=llama_with_dropout(len(tokenizer)),
        args=config,
        train_dataset=Dataset.from_list([{"text": text} for text in texts]),
        processing_class=tokenizer,
        callbacks=[callback],
    )


def paged(trainer):
    return trainer.optimizer.optimizer


def assert_same_run(trainer, reference):
    for (name, mine), theirs in zip(trainer.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(mine, theirs), name
    assert [e.get("loss") for e in trainer.state.log_history] == [e.get("loss") for e in reference.state.log_history]
    mine, theirs = paged(trainer).state_dict(), paged(reference).state_dict()
    assert mine["state"].keys() == theirs["state"].keys()
    for index, entry in mine["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, theirs["state"][index][key]), (index, key)


@pytest.fixture(scope="module")
def clean_trainer(tmp_path_factory):
    return run_trainer(tmp_path_factory.mktemp("clean"))[0]


@pytest.mark.parametrize("budget", ["64KiB", "auto"])
def test_trainer_recovers_bitwise_from_errors_in_forward_and_mid_backward(tmp_path, clean_trainer, budget, caplog):
    with caplog.at_level(logging.WARNING):
        trainer, callback = run_trainer(tmp_path, budget=budget, injected=INJECTED)
    assert_same_run(trainer, clean_trainer)
    assert [e["memory/oom_recoveries"] for e in trainer.state.log_history if "loss" in e] == [0, 1, 2, 2]
    assert callback.summary()["oom_recoveries"] == 2
    assert [row["oom_recoveries"] for row in callback.rows] == [0, 1, 1, 0]
    warnings = [record.message for record in caplog.records if RECOVERY_LOG in record.message]
    assert len(warnings) == 2 and "step 2 (micro-batch 2)" in warnings[0] and "step 3 (micro-batch 2)" in warnings[1]
    stats, clean = paged(trainer).paging_stats(), paged(clean_trainer).paging_stats()
    assert stats["pages_total"] == clean["pages_total"] > 1
    # every page is on the device or on the host, none lost and none counted twice
    assert stats["device_bytes"] + stats["host_bytes"] == clean["device_bytes"] + clean["host_bytes"]
    assert stats["page_outs"] > clean["page_outs"]  # the recoveries evicted the state
    if budget == "auto":
        auto = paged(trainer).auto_budget
        total = clean["device_bytes"] + clean["host_bytes"]
        assert auto.predicted_peak >= auto.capacity - total  # the failed step's need entered the prediction
        assert callback.rows[3]["state_bytes_forward"] == 0 < callback.rows[1]["state_bytes_forward"]
    else:
        assert stats["device_bytes"] <= stats["device_budget"]
    assert "training_step" not in vars(trainer)  # the wrapper is gone after training


def test_trainer_recovers_bitwise_from_an_error_in_the_optimizer_step(tmp_path, clean_trainer, caplog):
    with caplog.at_level(logging.WARNING):
        trainer, callback = run_trainer(tmp_path, budget="64KiB", step_at=[2])
    assert_same_run(trainer, clean_trainer)
    assert [e["memory/oom_recoveries"] for e in trainer.state.log_history if "loss" in e] == [0, 1, 1, 1]
    assert [row["oom_recoveries"] for row in callback.rows] == [0, 1, 0, 0]
    warnings = [record.message for record in caplog.records if "out of memory in the optimizer step" in record.message]
    assert len(warnings) == 1 and "(retry 1 of 2)" in warnings[0]
    assert paged(trainer).paging_stats()["device_budget"] == 64 * 2**10  # the budget is back after the step


def test_sft_trainer_recovers_bitwise_with_its_own_metrics(tmp_path):
    pytest.importorskip("trl")
    from trl import SFTTrainer

    reference, _ = run_trainer(tmp_path / "clean", trainer_cls=SFTTrainer)
    trainer, callback = run_trainer(tmp_path / "injected", budget="64KiB", injected=INJECTED, trainer_cls=SFTTrainer)
    assert_same_run(trainer, reference)
    assert callback.oom_recoveries == 2
    for key in ("num_tokens", "entropy", "mean_token_accuracy"):  # replayed micro-batches are not counted twice
        assert [e[key] for e in trainer.state.log_history if key in e] == [
            e[key] for e in reference.state.log_history if key in e
        ], key


def test_no_retries_lets_the_error_through_unchanged(tmp_path):
    with pytest.raises(torch.OutOfMemoryError) as raised:
        run_trainer(tmp_path, injected={"forward_at": [2]}, oom_retries=0)
    assert raised.value.args == ("injected in forward",) and not getattr(raised.value, "__notes__", None)


def test_a_step_failing_more_than_the_retries_raises_the_explained_error(tmp_path):
    # step 1: its second micro-batch fails (call 2), the replay of its first fails too (call 3)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        run_trainer(tmp_path, budget="64KiB", injected={"forward_at": [2, 3]}, oom_retries=1)
    assert raised.value.args == ("injected in forward",)
    (note,) = raised.value.__notes__
    assert "step 1 2 times in a row" in note and "moved all optimizer state to host memory" in note
    assert "optimizer state held" in note and "the rest of training" in note
    for advice in ("batch size", "max_length", "gradient checkpointing", "device_budget"):
        assert advice in note


def test_callback_rejects_bad_retries():
    with pytest.raises(ValueError, match="oom_retries must be an integer >= 0"):
        MemorySpikeCallback(oom_retries=-1)
    with pytest.raises(ValueError, match="retries must be an integer >= 0"):
        hf_paged.OOMRecovery(hf_paged.PagedAdamW(torch.nn.Linear(2, 2).parameters()), retries=1.5)
    with pytest.raises(TypeError, match="must be an hf-paged optimizer or wrap one, got AdamW"):
        hf_paged.OOMRecovery(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))
    recovery = hf_paged.OOMRecovery(hf_paged.PagedAdamW(torch.nn.Linear(2, 2).parameters()))
    with pytest.raises(RuntimeError, match="call start_window"):
        recovery.run(print)  # a micro-batch outside any step would be kept, and replayed, forever


def test_callback_state_round_trips_the_recovery_count():
    callback = MemorySpikeCallback(oom_retries=3)
    callback.oom_recoveries = 2
    saved = json.loads(json.dumps(callback.state()))
    restored = MemorySpikeCallback(**saved["args"])
    for name, value in saved["attributes"].items():
        setattr(restored, name, value)
    assert restored.oom_retries == 3 and restored.oom_recoveries == 2


def _plain_loop(
    recovery_retries,
    fail_at_backward=(),
    budget=None,
    set_to_none=True,
    device="cpu",
    error=None,
    batch_norm=False,
):
    """Two steps of two micro-batches on an MLP with dropout (or, with ``batch_norm``, a BatchNorm1d whose running
    statistics forward updates, its model given to the recovery), through hf_paged.recover_oom; the injected
    failures raise ``error`` (by default ``torch.OutOfMemoryError``)."""
    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.manual_seed_all(0)
    middle = torch.nn.BatchNorm1d(32) if batch_norm else torch.nn.Dropout(0.5)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), middle, torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model.to(device)
    optimizer = hf_paged.PagedAdamW(model.parameters(), lr=1e-2, page_size=512, device_budget=budget)
    calls = [0]

    def hook(grad):
        calls[0] += 1
        if calls[0] in fail_at_backward:
            raise torch.OutOfMemoryError("injected in backward") if error is None else error

    model[0].weight.register_hook(hook)
    data = torch.randn(2, 2, 4, 8, generator=torch.Generator().manual_seed(1)).to(device)

    def forward_backward(micro_batch):
        loss = model(micro_batch).square().mean() / 2
        loss.backward()
        return loss.detach()

    losses = []
    for step in data:
        replayed = model if batch_norm else None
        losses += hf_paged.recover_oom(forward_backward, step, optimizer, retries=recovery_retries, model=replayed)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    return model, optimizer, losses


def test_recover_oom_in_a_plain_loop_replays_the_window_exactly():
    reference, _, reference_losses = _plain_loop(2)
    # the second step's second micro-batch fails in backward (hook call 4), then its first replayed one (call 5)
    model, optimizer, losses = _plain_loop(2, fail_at_backward=(4, 5), budget=1024)
    assert losses == reference_losses
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)
    assert optimizer.paging_stats()["page_outs"] > 0
    with pytest.raises(torch.OutOfMemoryError, match="injected in backward"):
        _plain_loop(1, fail_at_backward=(4, 5))


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "CUDA error: out of memory",
        "MPS backend out of memory (MPS allocated: 1.00 GB, other allocations: 0 bytes, max allowed: 1.00 GB)",
    ],
)
def test_allocation_failures_that_libraries_raise_as_runtime_errors_are_recovered(message):
    reference, _, reference_losses = _plain_loop(2)
    model, _, losses = _plain_loop(2, fail_at_backward=(4,), budget=1024, error=RuntimeError(message))
    assert losses == reference_losses
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)


def test_other_runtime_errors_are_not_taken_for_out_of_memory():
    with pytest.raises(RuntimeError, match="CUBLAS_STATUS_EXECUTION_FAILED"):
        _plain_loop(2, fail_at_backward=(4,), error=RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED"))


def test_gradients_left_before_a_step_are_not_silently_lost():
    # zero_grad(set_to_none=False) leaves gradient tensors that a replay could only restore from a copy
    with pytest.raises(torch.OutOfMemoryError) as raised:
        _plain_loop(2, fail_at_backward=(4,), set_to_none=False)
    assert "gradients were present before the step's first micro-batch" in raised.value.__notes__[0]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_a_model_sharded_by_fsdp2_is_not_replayed_in_one_process():
    """FSDP2 gathers its parameters in hooks of forward and backward; an error part way left them gathered, and a
    replay in one process (accelerate wraps one process in FSDP2 on accelerators) then trained the gathered copies
    while the optimizer updated the shards: the losses and weights drifted from a run without the error, silently.
    The error is now raised with a note saying why, as under several processes."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        optimizer = hf_paged.PagedAdamW(model.parameters(), lr=1e-2, page_size=512)

        def fail(grad: torch.Tensor) -> torch.Tensor:
            raise torch.OutOfMemoryError("injected in backward")

        def forward_backward(micro_batch: torch.Tensor) -> torch.Tensor:
            hidden = model[1](model[0](micro_batch))
            hidden.register_hook(fail)  # reached once the last layer's gradients are reduced
            loss = model[2](hidden).square().mean()
            loss.backward()
            return loss.detach()

        with pytest.raises(torch.OutOfMemoryError) as raised:
            hf_paged.recover_oom(forward_backward, torch.randn(2, 4, 8), optimizer, retries=2, model=model)
    finally:
        dist.destroy_process_group()
    assert "the model's parameters are DTensors (FSDP2 or tensor parallelism)" in raised.value.__notes__[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_recover_oom_on_cuda_restores_the_device_generator():
    reference, _, reference_losses = _plain_loop(2, device="cuda")
    model, optimizer, losses = _plain_loop(2, fail_at_backward=(4, 5), budget=1024, device="cuda")
    assert [loss.item() for loss in losses] == [loss.item() for loss in reference_losses]
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)
    assert optimizer.paging_stats()["device_bytes"] <= 1024


def test_replay_restores_the_buffers_forward_changed():
    """BatchNorm's running statistics count each micro-batch once, as in a run without the error."""
    reference, _, reference_losses = _plain_loop(2, batch_norm=True)
    model, _, losses = _plain_loop(2, fail_at_backward=(4,), budget=1024, batch_norm=True)  # step 2, micro-batch 2
    assert losses == reference_losses
    assert model[1].num_batches_tracked.item() == 4
    for (name, mine), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(mine, theirs), name


def test_replay_restores_python_and_numpy_generators():
    """A micro-batch that draws from Python's ``random`` and NumPy's global generator replays the same draws."""
    import random

    import numpy

    def run(fail_at_backward):
        torch.manual_seed(0)
        random.seed(0)
        numpy.random.seed(0)
        model = torch.nn.Linear(8, 1)
        optimizer = hf_paged.PagedAdamW(model.parameters(), lr=1e-2, page_size=512)
        calls = [0]

        def hook(grad):
            calls[0] += 1
            if calls[0] in fail_at_backward:
                raise torch.OutOfMemoryError("injected in backward")

        model.weight.register_hook(hook)

        def forward_backward(micro_batch):
            scale = random.random() + float(numpy.random.rand())  # augmentation drawn on the host
            loss = model(micro_batch * scale).square().mean()
            loss.backward()
            return loss.detach()

        data = torch.randn(2, 2, 4, 8, generator=torch.Generator().manual_seed(1))
        losses = []
        for step in data:
            losses += hf_paged.recover_oom(forward_backward, step, optimizer)
            optimizer.step()
            optimizer.zero_grad()
        return model, losses

    reference, reference_losses = run(())
    model, losses = run((4,))
    assert losses == reference_losses
    assert torch.equal(model.weight, reference.weight)


def test_replay_drops_the_gradients_of_model_parameters_another_optimizer_holds():
    """The body under PagedAdamW, the head under SGD: a replay after an error mid-backward (the head's gradient
    already accumulated) counts each micro-batch's gradient once, the head's too."""

    def gradients(fail: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        recovery = hf_paged.OOMRecovery(hf_paged.PagedAdamW(model[0].parameters(), lr=1e-2), model=model)
        failures = [1 if fail else 0]

        def fail_once(grad: torch.Tensor) -> torch.Tensor:
            if failures[0]:
                failures[0] -= 1
                raise torch.OutOfMemoryError("injected in backward")
            return grad

        def forward_backward(micro_batch: torch.Tensor, last: bool) -> None:
            hidden = model[1](model[0](micro_batch))
            if last:
                hidden.register_hook(fail_once)  # reached after the head's gradient is accumulated
            model[2](hidden).square().mean().backward()

        data = torch.randn(2, 4, 8)
        with recovery.window(1):
            recovery.run(forward_backward, data[0], False)
            recovery.run(forward_backward, data[1], True)
        assert recovery.recoveries == int(fail)
        return [param.grad for param in model.parameters()]

    for mine, theirs in zip(gradients(fail=True), gradients(fail=False)):
        assert torch.equal(mine, theirs)


def _failing_once(model: torch.nn.Module, failures: list[int]):
    """A forward and backward of ``model`` that raises an injected out-of-memory error while ``failures[0]`` > 0."""

    def forward_backward() -> None:
        model(torch.randn(2, 8)).sum().backward()
        if failures[0]:
            failures[0] -= 1
            raise torch.OutOfMemoryError("injected")

    return forward_backward


def _assert_left_gradients_stop_the_replay(recovery, forward_backward, window: int) -> None:
    with pytest.raises(torch.OutOfMemoryError) as raised, recovery.window(window):
        recovery.run(forward_backward)
    assert "gradients were present before the step's first micro-batch" in raised.value.__notes__[0]


def test_gradients_left_on_model_parameters_another_optimizer_holds_are_not_silently_doubled():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    recovery = hf_paged.OOMRecovery(hf_paged.PagedAdamW(model[0].parameters()), model=model)
    model[1].weight.grad = torch.zeros_like(model[1].weight)  # the head's optimizer zeroed it in place
    _assert_left_gradients_stop_the_replay(recovery, _failing_once(model, [1]), 1)


def test_a_model_parameter_replaced_after_a_window_is_seen_by_the_next():
    """The model's parameters are kept from one window to the next: one replaced in between (written into
    ``_parameters`` as accelerate does, or newly unfrozen) is checked for gradients left before the step."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    recovery = hf_paged.OOMRecovery(hf_paged.PagedAdamW(model[0].parameters()), model=model)
    with recovery.window(0):
        pass
    model[1]._parameters["weight"] = torch.nn.Parameter(torch.zeros(1, 8))
    model[1].weight.grad = torch.zeros_like(model[1].weight)
    failures = [1]
    forward_backward = _failing_once(model, failures)
    _assert_left_gradients_stop_the_replay(recovery, forward_backward, 1)
    model.zero_grad(set_to_none=True)
    model[1].bias.requires_grad_(False)
    model[1].bias.grad = torch.zeros_like(model[1].bias)  # frozen: backward adds nothing to it, a replay keeps it
    failures[0] = 1
    with recovery.window(2):
        recovery.run(forward_backward)
    assert recovery.recoveries == 1


def test_enable_oom_recovery_refuses_bad_arguments_before_changing_anything(tmp_path):
    """A call with bad arguments leaves the recovery enabled before, the optimizer's settings and the wrapped
    training step as they were."""
    trainer = Trainer(
        model=tiny_llama(), args=training_args(tmp_path, optim="hf_paged_adamw_32bit"), train_dataset=token_dataset()
    )
    trainer.create_optimizer()
    recovery = enable_oom_recovery(trainer)
    optimizer = hf_paged.recovery.paged_optimizer_of(trainer.optimizer)
    installed = (optimizer.oom_retries, optimizer.on_oom_recovery, vars(trainer)["training_step"])
    for arguments, error, message in (
        ({"retries": -1}, ValueError, "retries must be an integer >= 0, got -1"),
        ({"on_recovery": "print"}, TypeError, "on_recovery must be callable or None, got str"),
    ):
        with pytest.raises(error, match=message):
            enable_oom_recovery(trainer, **arguments)
        assert oom_recovery_of(trainer) is recovery
        assert (optimizer.oom_retries, optimizer.on_oom_recovery, vars(trainer)["training_step"]) == installed


def test_a_training_step_set_on_the_trainer_survives_enabling_recovery_again(tmp_path):
    """As MemorySpikeCallback does at each trainer.train(): enabling twice, then disabling, keeps the user's own
    training_step (set on the instance) under the recovery and gives it back."""
    trainer = Trainer(
        model=tiny_llama(), args=training_args(tmp_path, optim="hf_paged_adamw_32bit"), train_dataset=token_dataset()
    )
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1
    calls = []
    class_step = trainer.training_step

    def own_step(model, inputs, *args, **kwargs):
        calls.append(trainer.state.global_step)
        return class_step(model, inputs, *args, **kwargs)

    trainer.training_step = own_step
    batch = {key: torch.stack([row[key] for row in token_dataset()[:2]]) for key in ("input_ids", "labels")}
    trainer.model.train()
    for _ in range(2):
        enable_oom_recovery(trainer)
        calls.clear()
        trainer.training_step(trainer.model, dict(batch))
        assert calls == [0]
    disable_oom_recovery(trainer)
    assert vars(trainer)["training_step"] is own_step


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("on_recovery", "print", "on_recovery must be callable or None, got str"),
        ("replay_obstacle", "never", "replay_obstacle must be callable or None, got str"),
        ("model", "my_model", r"model must be a torch.nn.Module or None, got str"),
    ],
)
def test_oom_recovery_refuses_arguments_of_the_wrong_kind_before_changing_the_optimizer(name, value, message):
    optimizer = hf_paged.PagedAdamW(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(TypeError, match=message):
        hf_paged.OOMRecovery(optimizer, retries=3, **{name: value})
    assert optimizer.oom_retries != 3 and optimizer.on_oom_recovery is None


@pytest.mark.parametrize("retries", [0, 2])
def test_only_recovery_that_is_on_warns_that_deepspeed_is_not_replayed(tmp_path, caplog, retries):
    """In one process an engine that keeps a step from being replayed (DeepSpeed: its flag set on the trainer, as
    accelerate's Trainer sets it) is worth a warning only where recovery is on (``retries`` > 0)."""
    trainer = Trainer(
        model=tiny_llama(), args=training_args(tmp_path, optim="hf_paged_adamw_32bit"), train_dataset=token_dataset()
    )
    trainer.create_optimizer()
    trainer.is_deepspeed_enabled = True
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        enable_oom_recovery(trainer, retries=retries)
    warned = [record for record in caplog.records if "is not replayed" in record.getMessage()]
    assert len(warned) == (1 if retries else 0)
