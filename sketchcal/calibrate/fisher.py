"""Output weights of the reads: how much an error in each head's output at each token moves the logits.

For a teacher-forced sequence, let ``o_{h,t}`` [V] be the pre-gate output of recurrent head h at
token t (the mixer kernel function's output, where a read error lands) and draw targets
``y_s ~ p(· | x_{≤s})`` from the model's own next-token distributions. With
``g_{h,t} = ∂ Σ_s log p(y_s | x_{≤s}) / ∂ o_{h,t}``, ``E_y[g gᵀ]`` is the Fisher information of the
decoded distributions with respect to that output, and to second order an output error δ raises the
summed KL(standard ‖ perturbed) by ``½ δᵀ E[g gᵀ] δ``. Taking that Fisher block as isotropic in V,
a read error of squared norm ``‖δ‖²`` costs ``½ γ ‖δ‖² / V`` with the read's *output weight*

    γ_{h,t} = ‖g_{h,t}‖²     (one sampled target per position: an unbiased estimate of tr F).

The gradient runs through the whole model, later recurrent layers included (errors carried forward
in their states count), from the decoded positions on (``prompt_end`` onward). Calibration
weights each read's statistics by γ (:mod:`sketchcal.calibrate.stats`), which the allocation turns
into predicted KL (:mod:`sketchcal.fit.allocate`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from sketchcal.models import ModelSpec
from sketchcal.models.capture import OutputCapture

# Packages of GPU kernels that transformers calls when they are installed; a failure raised inside
# one of them during the backward is answered by taking the torch references instead.
KERNEL_PACKAGES = ("fla", "mamba_ssm", "causal_conv1d")

# float64 elements of one slice of the CDF that draw_targets builds at a time
_CDF_ELEMENTS = 1 << 25


def draw_targets(logp: Tensor, generator: torch.Generator) -> Tensor:
    """One draw from each row of ``exp(logp)`` [..., vocab]: ids [...] int64 on ``logp``'s device.

    The CDF (float64) is inverted at uniforms drawn from ``generator``, a CPU generator, so a seed
    gives the same targets on every device. A row with NaN or Inf (a broken model) is drawn from
    uniformly: its γ comes out non-finite too, and the statistics' finiteness check names the layer.
    """
    rows = logp.reshape(-1, logp.shape[-1])
    n, vocab = rows.shape
    u = torch.rand(n, generator=generator, dtype=torch.float64).to(rows.device)
    out = torch.empty(n, dtype=torch.long, device=rows.device)
    step = max(1, _CDF_ELEMENTS // vocab)
    for i in range(0, n, step):
        p = rows[i : i + step].double().exp()
        p = torch.where(torch.isfinite(p).all(-1, keepdim=True), p, 1.0)
        cdf = p.cumsum(-1)
        # the first id whose CDF exceeds u · total (zero-probability ids have empty intervals)
        picked = torch.searchsorted(cdf, (u[i : i + step] * cdf[:, -1])[:, None], right=True)
        out[i : i + step] = picked.squeeze(-1).clamp_max(vocab - 1)
    return out.view(logp.shape[:-1])


def raised_in_kernel_package(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc``'s traceback lies in one of :data:`KERNEL_PACKAGES`."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    return module.split(".")[0] in KERNEL_PACKAGES


class OutputWeights:
    """:func:`output_weights` of ``model``, on its installed kernels while their backward works.

    Some kernel releases refuse a backward on some GPUs (flash-linear-attention's gated chunked
    backward on Hopper under Triton 3.4–3.7.0 raises rather than give wrong gradients). The first
    such failure switches this object to the torch references for good; the batch is redrawn from
    the same generator state, so the targets do not depend on the switch.
    """

    def __init__(self, model: nn.Module, spec: ModelSpec):
        self.model, self.spec = model, spec
        self.reference = False

    def __call__(
        self, seq: Tensor, valid: Tensor, prompt_end: int, generator: torch.Generator
    ) -> dict[int, Tensor]:
        state = generator.get_state()
        try:
            return output_weights(self.model, self.spec, seq, valid, prompt_end, generator, self.reference)
        except RuntimeError as exc:
            if self.reference or not raised_in_kernel_package(exc):
                raise
            from sketchcal.ui import console

            text = str(exc).strip()
            first = text.splitlines()[0] if text else type(exc).__name__
            console.print(
                f"[yellow]output weights: a kernel's backward failed ({first}); "
                "using the torch references for the gradients (slower, same result)[/]"
            )
            self.reference = True
            generator.set_state(state)
            return output_weights(self.model, self.spec, seq, valid, prompt_end, generator, True)


def output_weights(
    model: nn.Module,
    spec: ModelSpec,
    seq: Tensor,
    valid: Tensor,
    prompt_end: int,
    generator: torch.Generator,
    reference: bool = False,
) -> dict[int, Tensor]:
    """γ of every token of every recurrent head: ``{layer: [B, T, H] float64}`` (0 on invalid tokens).

    Args:
        seq: [B, T] token ids; valid: [B, T] bool (padding and tokens after end-of-sequence False).
        prompt_end: positions before it are the prompt: their next-token distributions are not
            decoded, so they add nothing to the objective.
        generator: a CPU generator; draws the targets (:func:`draw_targets`).
        reference: run the mixers' torch references on a GPU too (:class:`OutputCapture`).
    """
    emb = model.get_input_embeddings()
    # the embeddings become a leaf that needs a gradient: every later activation is in the graph,
    # without touching the parameters' requires_grad
    hook = emb.register_forward_hook(lambda _m, _a, out: out.detach().requires_grad_(True))
    try:
        with torch.enable_grad(), OutputCapture(model, spec, reference=reference) as cap:
            logits = model(input_ids=seq, attention_mask=valid.long(), use_cache=False).logits
            logp = torch.log_softmax(logits[:, prompt_end:].float(), dim=-1)
            with torch.no_grad():
                y = draw_targets(logp, generator)
            picked = logp.gather(-1, y[..., None]).squeeze(-1)
            objective = (picked * valid[:, prompt_end:].to(picked.dtype)).sum()
            layers = [s.layer for s in spec.layers]
            outputs = [o for layer in layers for o in cap.outputs[layer]]  # one call per layer here
            grads = torch.autograd.grad(objective, outputs, allow_unused=True)
    finally:
        hook.remove()
    weight = valid.to(torch.float64)[..., None]
    out, i = {}, 0
    for layer in layers:
        parts = []
        for o in cap.outputs[layer]:
            g = grads[i]
            i += 1
            parts.append(
                o.new_zeros(o.shape[:3], dtype=torch.float64) if g is None else g.double().square().sum(-1)
            )
        out[layer] = torch.cat(parts, dim=1) * weight.to(parts[0].device)
    return out
