"""Cases shared by the Triton kernel tests, on the CPU under the interpreter (``tests/test_triton_kernels.py``) and on
CUDA (``tests/test_gpu_triton.py``): the rules, state formats and scalars, the optimizers run whole, and a batch of
rank-1 normalized state with its references (also for ``tests/test_rank1_triton.py``). Imports no Triton, so that
either test module controls how Triton is imported (random pages and the reference update are
:func:`hf_paged.codecs.random_page_buffers` and :func:`hf_paged.kernels.pytorch.update_in_buffers`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_paged.codecs import (
    Blockwise4bitCodec,
    Blockwise8bitCodec,
    Float32Codec,
    PageFormat,
    Rank1Normalized4bitCodec,
    Rank1Statistics,
    random_page_buffers,
)
from hf_paged.kernels import SegmentKernel
from hf_paged.kernels.batch import PageBatch
from hf_paged.kernels.pytorch import gather_in_buffers, update_in_buffers
from hf_paged.kernels.rules import (
    adamw_moments_,
    adamw_scalars,
    adamw_update_,
    ademamix_scalars,
    ademamix_update_,
    lion_update_,
)
from hf_paged.stochastic_rounding import ElementRounding, step_keys

BLOCK = 64
"""Elements per block of the 8-bit and 4-bit codecs."""
RULES = {
    "adamw": (adamw_update_, (True, False)),
    "lion": (lion_update_, (True,)),
    "ademamix": (ademamix_update_, (True, True, False)),
}
"""Each rule with the signedness of its states."""
FORMATS = ("8bit", "4bit", "fp32")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ADAMW_GROUP = {"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.1, "eps": 1e-8}
LION_SCALARS = {"lr": 1e-3, "decay": 0.9999, "direction_weight": 0.1, "avg_weight": 0.01}
ADEMAMIX_GROUP = {
    "lr": 1e-2, "betas": (0.9, 0.999, 0.9999), "alpha": 5.0, "t_alpha": 10, "t_beta3": 10, "eps": 1e-8,
    "weight_decay": 0.1,
}  # fmt: skip


def codecs_of(rule_name: str, state_format: str) -> tuple:
    """The codecs of the rule's states in ``state_format``."""
    _, signedness = RULES[rule_name]
    if state_format == "fp32":
        return tuple(Float32Codec() for _ in signedness)
    codec = Blockwise8bitCodec if state_format == "8bit" else Blockwise4bitCodec
    return tuple(codec(BLOCK, signed) for signed in signedness)


def scalars_of(rule_name: str, step: int = 3) -> dict[str, float]:
    """The rule's scalars at optimizer step ``step``."""
    if rule_name == "adamw":
        return adamw_scalars(ADAMW_GROUP, step)
    if rule_name == "ademamix":
        return ademamix_scalars(ADEMAMIX_GROUP, step)
    return dict(LION_SCALARS)


CASES = {
    "PagedAdamW8bit": {},
    "PagedAdamW4bit": {"dtype": torch.bfloat16},
    "PagedLion8bit": {},
    "PagedAdamW": {"dtype": torch.bfloat16, "bf16_stochastic_round": True, "stochastic_round_seed": 5},
    "PagedLion": {"dtype": torch.bfloat16},
}
"""Per optimizer: the parameters' dtype and extra arguments (PagedAdamW on fp32 parameters takes torch's fused AdamW,
so it runs on bf16 parameters, where its fp32 state takes the Triton kernel)."""


RANK1_BLOCK = 32
"""Elements per block (half-blocks of packed codes) of the rank-1 cases."""
RANK1_CODECS = (Rank1Normalized4bitCodec(RANK1_BLOCK, True), Rank1Normalized4bitCodec(RANK1_BLOCK, False))
RANK1_SCALAR_NAMES = ("decay", "avg_weight", "beta2", "sq_weight", "eps", "step_size", "inv_bias_correction2_sqrt")
"""AdamW's scalars in the kernels' column order."""
RANK1_SHAPES = ((6, 40), (3, 50), (16, 7))
RANK1_DTYPES = ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16))
"""Each tensor's parameter and gradient dtypes."""
RANK1_SEGMENTS = (
    # (tensor, start, length, page, offset, scalar row), pages of 16 blocks
    (0, 0, 96, 0, 0, 0),  # rows 0 to 2, ending inside row 2
    (0, 96, 144, 1, 2 * RANK1_BLOCK, 0),  # from inside row 2: a partial last block at the tensor's end
    (1, 0, 150, 0, 4 * RANK1_BLOCK, 1),  # a tensor in one segment, a partial last block
    (2, 0, 45, 1, 8 * RANK1_BLOCK, 1),  # a partial last block inside the tensor
    (2, 45, 67, 1, 10 * RANK1_BLOCK, 1),  # from inside row 6 to the end, a partial last block
)
RANK1_CAPACITY = 16 * RANK1_BLOCK


@dataclass
class Rank1Case:
    """CPU inputs of a page batch of rank-1 normalized AdamW state: parameters shaped :data:`RANK1_SHAPES`, two
    pages, :data:`RANK1_SEGMENTS`, two rows of scalars (rounded to fp32), each tensor's statistics as a batch takes
    them, and the stochastic rounding keys of tensor 1 (the bf16 parameter) or ``None``."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    pages: list[list[torch.Tensor]]
    statistics: list[tuple[torch.Tensor, ...]]
    scalars: list[dict[str, float]]
    keys: tuple[int, int] | None

    def batch(self, device: torch.device | str = "cpu") -> PageBatch:
        """A page batch of copies of the inputs on ``device`` (segments of tensor 1 round where :attr:`keys`)."""
        rounding = None
        if self.keys is not None:
            rounding = torch.tensor([list(self.keys) if row[0] == 1 else [-1, -1] for row in RANK1_SEGMENTS])
        scalars = torch.tensor([[row[name] for name in RANK1_SCALAR_NAMES] for row in self.scalars])
        return PageBatch(
            [p.to(device, copy=True) for p in self.params],
            [g.to(device, copy=True) for g in self.grads],
            [tuple(b.to(device, copy=True) for b in page) for page in self.pages],
            torch.tensor(RANK1_SEGMENTS, dtype=torch.int64).to(device),
            scalars.to(device),
            None if rounding is None else rounding.to(device),
            [tuple(t.to(device, copy=True) for t in entry) for entry in self.statistics],
        )

    def tracked(self, tensor: int) -> Rank1Statistics:
        """Tensor ``tensor``'s statistics as a :class:`Rank1Statistics` of copies (what the references take)."""
        statistics = Rank1Statistics(RANK1_SHAPES[tensor], 2)
        entry = [t.clone() for t in self.statistics[tensor]]
        statistics.rows, statistics.cols = entry[0:4:2], entry[1:4:2]
        statistics.next_rows, statistics.next_cols = entry[4:8:2], entry[5:8:2]
        return statistics

    def updated(self) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """The parameters and pages after ``update_in_buffers`` of every segment (the per-segment path)."""
        params = [p.clone() for p in self.params]
        pages = [[b.clone() for b in page] for page in self.pages]
        for tensor, start, length, page, offset, row in RANK1_SEGMENTS:
            rounding = None if self.keys is None or tensor != 1 else ElementRounding(*self.keys, start)
            update_in_buffers(
                adamw_update_, RANK1_CODECS, params[tensor].view(-1)[start : start + length],
                self.grads[tensor].view(-1)[start : start + length], pages[page], offset, self.scalars[row], rounding,
                statistics=self.tracked(tensor), first=start,
            )  # fmt: skip
        return params, pages

    def gathered(self) -> list[tuple[torch.Tensor, ...]]:
        """Each tensor's statistics after ``gather_in_buffers`` of every segment: its next maxima raised."""
        tracked = [self.tracked(tensor) for tensor in range(len(RANK1_SHAPES))]
        for tensor, start, length, page, offset, row in RANK1_SEGMENTS:
            gather_in_buffers(
                adamw_moments_, RANK1_CODECS, self.grads[tensor].view(-1)[start : start + length], self.pages[page],
                offset, self.scalars[row], tracked[tensor], start,
            )  # fmt: skip
        return [statistics.batch_entry() for statistics in tracked]


def _maxima(count: int, generator: torch.Generator, low: int = -4) -> torch.Tensor:
    """``count`` positive fp32 maxima over magnitudes ``10**low`` to 1."""
    return torch.rand(count, generator=generator) * 10.0 ** torch.randint(low, 1, (count,), generator=generator)


def rank1_case(seed: int, rounds: bool = False, gathering: bool = False) -> Rank1Case:
    """A :class:`Rank1Case`: random codes and maxima (a zero row and column maximum, so zero normalizers), and for an
    update random next maxima (a zero one, and small ones that saturate codes), for gathering next maxima partly
    raised already (the kernel raises, never lowers them) and gradients with an infinity and a NaN."""
    generator = torch.Generator().manual_seed(seed)
    params = [
        torch.randn(shape, generator=generator).to(dtype) for shape, (dtype, _) in zip(RANK1_SHAPES, RANK1_DTYPES)
    ]
    grads = [
        (torch.randn(shape, generator=generator) * 10.0 ** torch.randint(-3, 1, shape, generator=generator)).to(dtype)
        for shape, (_, dtype) in zip(RANK1_SHAPES, RANK1_DTYPES)
    ]
    pages = [random_page_buffers(PageFormat(RANK1_CODECS), RANK1_CAPACITY, generator) for _ in range(2)]
    statistics = []
    for rows, cols in RANK1_SHAPES:
        entry = [_maxima(n, generator) for _ in range(2) for n in (rows, cols)]
        if gathering:
            entry += [_maxima(n, generator, low=-8) * (torch.rand(n, generator=generator) < 0.3) for n in (rows, cols)]
            entry += [_maxima(n, generator, low=-8) * (torch.rand(n, generator=generator) < 0.3) for n in (rows, cols)]
        else:
            entry += [_maxima(n, generator, low=-2) * 2 for _ in range(2) for n in (rows, cols)]
        statistics.append(entry)
    statistics[0][0][1] = 0.0  # row 1 of tensor 0's first moment: normalizers 0, decoded to 0
    statistics[1][3][4] = 0.0  # column 4 of tensor 1's second moment
    statistics[2][5][2] = 0.0  # next column 2 of tensor 2's first moment: encoded as 0 (or raised by gathering)
    if gathering:
        grads[0][1, 3], grads[2][8, 1] = float("inf"), float("nan")
        grads[1][2, 7] = -float("inf")
    rows = [adamw_scalars(ADAMW_GROUP, 3), adamw_scalars({**ADAMW_GROUP, "lr": 3e-2}, 1)]
    scalars = [{name: float(torch.tensor(value, dtype=torch.float32)) for name, value in row.items()} for row in rows]
    keys = step_keys(seed=77, step=3) if rounds else None
    return Rank1Case(params, grads, pages, [tuple(entry) for entry in statistics], scalars, keys)


def squared_gradient_state(triton_kernels, state_format: str, grad: torch.Tensor, device) -> list[torch.Tensor]:
    """AdamW's state with beta2 = 0 (its second moment: the squares of ``grad``, blocks of :data:`BLOCK`) written
    from zero state by the Triton kernel of ``triton_kernels`` on ``device``, asserted to have run (not its fallback)
    and to give the codes and scales of the eager kernel on the CPU bit for bit: the CPU's arrays (the first moment's
    codes and scales, then the second's)."""
    codecs = codecs_of("adamw", state_format)
    scalars = adamw_scalars({**ADAMW_GROUP, "betas": (0.9, 0.0)}, 1)
    fallback = SegmentKernel(adamw_update_, codecs, False)
    results = []
    for where, kernel in (("cpu", fallback), (device, triton_kernels.TritonKernel(adamw_update_, codecs, fallback))):
        zeros = [tuple(torch.zeros(n, dtype=t, device=where) for n, t in c.buffer_specs(grad.numel())) for c in codecs]
        encoded = [codec.select(arrays, 0, grad.numel()) for codec, arrays in zip(codecs, zeros)]
        kernel(torch.zeros(grad.shape, device=where), grad.to(where), encoded, scalars)
        results.append([array.cpu() for segment in encoded for array in segment])
    assert kernel.takes_batch(torch.device(device), torch.float32, torch.float32)  # passed its first-use check
    on_cpu, on_device = results
    assert all(torch.equal(actual, expected) for actual, expected in zip(on_device, on_cpu))
    return on_cpu
