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


def output_weights(
    model: nn.Module,
    spec: ModelSpec,
    seq: Tensor,
    valid: Tensor,
    prompt_end: int,
    generator: torch.Generator,
) -> dict[int, Tensor]:
    """γ of every token of every recurrent head: ``{layer: [B, T, H] float64}`` (0 on invalid tokens).

    Args:
        seq: [B, T] token ids; valid: [B, T] bool (padding and tokens after end-of-sequence False).
        prompt_end: positions before it are the prompt: their next-token distributions are not
            decoded, so they add nothing to the objective.
        generator: draws the targets (on ``seq``'s device).
    """
    emb = model.get_input_embeddings()
    # the embeddings become a leaf that needs a gradient: every later activation is in the graph,
    # without touching the parameters' requires_grad
    hook = emb.register_forward_hook(lambda _m, _a, out: out.detach().requires_grad_(True))
    try:
        with torch.enable_grad(), OutputCapture(model, spec) as cap:
            logits = model(input_ids=seq, attention_mask=valid.long(), use_cache=False).logits
            logp = torch.log_softmax(logits[:, prompt_end:].float(), dim=-1)
            with torch.no_grad():
                probs = logp.exp().flatten(0, 1)
                # a row with NaN or Inf (a broken model) is drawn from uniformly: its γ comes out
                # non-finite too, and the statistics' finiteness check names the layer
                probs = torch.where(torch.isfinite(probs).all(-1, keepdim=True), probs, 1.0)
                y = torch.multinomial(probs, 1, generator=generator).view(logp.shape[:-1])
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
