"""SpinQuant's learned rotations (Liu et al. 2024, arXiv:2405.16406): R1 (the residual stream) and one R2 per block
(each head's values) trained by Cayley SGD (`compress.quantizers.cayley`) against the quantized model's loss.

The loss is the next-token cross entropy, averaged over the tokens of a step's calibration windows, of the rotated
model (`compress.engine.rotation.Rotator`'s weights, differentiable in R1 and R2) where every linear layer of the
blocks computes with its rotated weight fake-quantized by round-to-nearest (or in float: SpinQuant's setting before
GPTQ) and, if asked, with its input fake-quantized per token; both straight-through (the forward sees the grid's values, the gradient passes as if
unrounded). Online rotations (R4, inputs) are applied to the layers' inputs as at run time, before their grid. The
embeddings and the output layer stay in float, as SpinQuant's: the window's embeddings ``E[ids] R1``, and the
output layer applied as ``(h R1ᵀ) diag(offset + γ) Wᵀ``, the rotated output layer's function without rotating the
vocabulary's matrix at every step.

Each step the rotated weights are computed once (float64 products, float32 values) and taken as leaves; the
step's windows run through the model in batches of ``batch_size``, their gradients accumulating on those leaves,
then one backward pass carries them to R1 and R2.

Memory: the whole model in float32, the rotated weights and their gradients (three more copies), the float64
products autograd keeps for the backward pass to R1 and R2 (about two copies in float64), and one batch's
activations and logits.

Ranks (torchrun): each rank runs its contiguous share of every step's windows (`Ranks.local_share`); the loss's
sums and the gradients of R1 and R2 are summed over the ranks in float64 (every rank receives the same bits), so
every rank takes the same step. Each step is one process's up to float rounding (the windows' gradients are summed
in another order), a difference that the quantized loss's rounding can amplify over later steps. The `rotate`
method runs it in one process (a launcher is refused: every rank would write the output).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch.func import functional_call

from compress.checkpoints.model_io import ModelHandle, quantizable_layers
from compress.checkpoints.rotation_layouts import RotationLayout
from compress.engine.rotation import Rotator
from compress.engine.structured import stored_parameters
from compress.errors import CompressError
from compress.quantizers.activations import ActivationScheme, quantize_activations
from compress.quantizers.cayley import cayley_sgd
from compress.quantizers.grid import QuantScheme, fake_quantize
from compress.quantizers.rotation import rotate_reader

if TYPE_CHECKING:
    from compress.engine.ranks import Ranks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Training:
    steps: int
    lr: float
    momentum: float
    windows: int  # calibration windows per step
    batch_size: int  # windows per forward pass
    weights: QuantScheme | None  # the weights' fake-quantization grid, or None: float
    activations: ActivationScheme | None  # the layers' inputs' grid (per token), or None


@dataclass
class Learned:
    q: torch.Tensor | None  # R1 [hidden, hidden] float64
    r: torch.Tensor | None  # R2 by block [blocks, head_dim, head_dim] float64
    losses: list[float]  # each step's loss, before its update


class _Loaded(Rotator):
    """The Rotator on the model's loaded parameters: its products differentiable in ``q`` and ``r``."""

    def __init__(self, handle, layout, q, r, online, parameters: dict[str, torch.Tensor]):
        super().__init__(handle, layout, q, r, online)
        self.parameters = parameters

    def stored(self, name: str) -> torch.Tensor:
        return self.parameters[name]


def _ste(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """``rounded``'s value, ``x``'s gradient (the straight-through estimator)."""
    return x + (rounded - x).detach()


def _grad(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


class _Model:
    """The float32 model of ``handle`` loaded whole, run with given block weights (``torch.func.functional_call``)."""

    def __init__(self, handle: ModelHandle, layout: RotationLayout, online: dict[str, torch.Tensor], training: Training):
        self.handle, self.layout = handle, layout
        model = handle.load_remaining("cpu", torch.float32)
        self.base, prefix = handle.base_model, handle.base_prefix
        self.strip = len(prefix) + 1 if prefix else 0
        self.parameters = {n: p.detach() for n, p in model.named_parameters()}
        names = stored_parameters(handle)
        blocks = handle.blocks_name + "."
        self.block_tensors = [n for n in names if n.startswith(blocks)]
        self.linear = {f"{n}.weight": m for n, m in quantizable_layers(model, [handle.block_name(i) for i in range(len(handle.blocks))]).items()}
        scheme = training.weights
        for name, module in self.linear.items():
            if scheme is not None and scheme.group_size != -1 and module.in_features % scheme.group_size:
                raise CompressError(f"rotate learned: group_size {scheme.group_size} does not divide the {module.in_features} "
                                    f"inputs of {name.removesuffix('.weight')}: choose a group size dividing every layer's inputs, or -1")
        self.head = self.parameters[layout.head if layout.head in names else layout.embeddings]
        self.online_weights = online  # block weight name -> M [b, b]: fused into the weight (the Rotator's)
        self.online = {}  # module -> M [b, b] float32: the rotation its input takes at run time
        for rel, m in online.items():
            for i in range(len(handle.blocks)):
                self.online[self.linear[f"{handle.block_name(i)}.{rel}"]] = m.to(torch.float32)
        self.activations = training.activations
        self.training = training

    def _input(self, module, args):
        x = args[0]
        m = self.online.get(module)
        if m is not None:
            x = (x.unflatten(-1, (-1, m.shape[0])) @ m).flatten(-2)
        if self.activations is not None:
            x = _ste(x, quantize_activations(x.detach(), self.activations))
        return (x, *args[1:])

    def weights(self, q: torch.Tensor | None, r: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The block tensors rotated by ``q`` and ``r`` (graphs to them) and the leaves the model runs on: each
        linear weight fake-quantized, every tensor detached, requiring grad where it depends on ``q`` or ``r``."""
        rotator = _Loaded(self.handle, self.layout, q, r, self.online_weights, self.parameters)
        rotated, leaves = {}, {}
        for name in self.block_tensors:
            value = rotator.tensor(name)
            quantized = name in self.linear and self.training.weights is not None
            rounded = fake_quantize(value.detach(), self.training.weights) if quantized else value.detach()
            if value.requires_grad:
                rotated[name] = value
            leaves[name] = rounded.requires_grad_(value.requires_grad)
        return rotated, leaves

    def loss_sum(self, leaves: dict[str, torch.Tensor], q: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
        """The summed next-token cross entropy of ``ids [windows, seq_len]``."""
        embeddings = self.parameters[self.layout.embeddings][ids]
        inputs = embeddings if q is None else rotate_reader(embeddings, q)
        params = {name[self.strip:]: value for name, value in leaves.items()}
        if q is not None:  # the final norm's scale folds into the output layer: the norm scales by one
            params[self.layout.final_norm[self.strip:]] = torch.full_like(self.parameters[self.layout.final_norm], 1.0 - self.layout.norm_offset)
        h = functional_call(self.base, params, args=(), kwargs={"inputs_embeds": inputs, "use_cache": False}).last_hidden_state
        if q is not None:
            gamma = self.parameters[self.layout.final_norm].double() + self.layout.norm_offset
            h = ((h.double() @ q.T) * gamma).to(h.dtype)
        logits = h @ self.head.T
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


def learn_rotations(handle: ModelHandle, layout: RotationLayout, q: torch.Tensor | None, r: torch.Tensor | None,
                    online: dict[str, torch.Tensor], calibration: torch.Tensor, training: Training, ranks: Ranks | None = None,
                    progress: Callable[[str, int, int], None] | None = None) -> Learned:
    """R1 ``q [hidden, hidden]`` and R2 ``r [blocks, d, d]`` (each None: not learned) trained from their values
    given, on ``calibration [samples, seq_len]`` (the windows of step ``s``: ``s·windows …`` cyclically)."""
    if ranks is None:
        from compress.engine.ranks import Ranks  # here: ranks imports the methods, whose rotate imports this module

        ranks = Ranks()
    model = _Model(handle, layout, online, training)
    q = None if q is None else q.to(torch.float64)
    r = None if r is None else r.to(torch.float64)
    states: dict[str, torch.Tensor | None] = {"q": None, "r": None}
    losses = []
    hooks = [m.register_forward_pre_hook(model._input) for m in model.linear.values()]
    try:
        for step in range(training.steps):
            index = torch.arange(step * training.windows, (step + 1) * training.windows) % calibration.shape[0]
            ids, total = ranks.local_share(calibration[index]), training.windows * (calibration.shape[1] - 1)
            q_, r_ = (None if t is None else t.clone().requires_grad_() for t in (q, r))
            rotated, leaves = model.weights(q_, r_)
            loss = torch.zeros((), dtype=torch.float64)
            for batch in ids.split(training.batch_size):
                part = model.loss_sum(leaves, q_, batch) / total
                part.backward()
                loss += part.detach().double()
            names = [n for n in rotated if leaves[n].grad is not None]
            if names:  # a rank with no window of this step has no gradient of its own
                torch.autograd.backward([rotated[n] for n in names], [leaves[n].grad for n in names])
            losses.append(float(ranks.sum_(loss)))
            if q is not None:
                q, states["q"] = cayley_sgd(q, ranks.sum_(_grad(q_)), training.lr, training.momentum, states["q"])
            if r is not None:
                r, states["r"] = cayley_sgd(r, ranks.sum_(_grad(r_)), training.lr, training.momentum, states["r"])
            log.info("learned rotation: step %d/%d, loss %.5f", step + 1, training.steps, losses[-1])
            if progress is not None:
                progress("learned rotation", step + 1, training.steps)
    finally:
        for hook in hooks:
            hook.remove()
    return Learned(q, r, losses)
