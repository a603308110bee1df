"""The fused delta-rule input kernel against the adapters' torch form of the same math (float64)."""

import pytest
import torch

from sketchcal.kernels.common.prepare import delta_rule_inputs
from sketchcal.models.gdn import GdnAdapter
from sketchcal.models.kda import KdaAdapter
from sketchcal.runtime.kernel_state import kernel_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ADAPTERS = {"gdn": GdnAdapter(), "kda": KdaAdapter()}
# B, T, H, G, K, V: grouped heads, a head per group, dims that are not powers of two
SHAPES = [(2, 1, 4, 2, 16, 32), (3, 2, 3, 3, 24, 16), (1, 3, 8, 2, 16, 20)]


def call_args(family: str, shape, dtype: torch.dtype, l2norm: bool, seed: int) -> dict:
    """A decode call's arguments as transformers passes them (query/key per group)."""
    b, t, h, g, k, v = shape
    g = h if family == "kda" else g  # KDA: every head is its own group
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=gen)).to(DEVICE, dtype)

    log_decay = -torch.rand(b, t, h, *((k,) if family == "kda" else ()), generator=gen)
    return {
        "query": rnd(b, t, g, k, scale=3.0),
        "key": rnd(b, t, g, k, scale=3.0),
        "value": rnd(b, t, h, v),
        "g": log_decay.to(DEVICE, dtype),
        "beta": torch.rand(b, t, h, generator=gen).to(DEVICE, dtype),
        "use_qk_l2norm_in_kernel": l2norm,
    }


def reference(family: str, args: dict) -> dict[str, torch.Tensor]:
    """The adapter's float64 inputs, per head, taken to the kernels' per-group layout."""
    x, _ = ADAPTERS[family].inputs("decode", args, torch.float64)
    rep = x.num_heads // args["key"].shape[-2]  # the adapter repeats k, q over a group's heads
    return {"k": x.k[:, :, ::rep], "q": x.q[:, :, ::rep], "w": x.w, "decay": x.decay, "beta": x.beta}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", ["gdn", "kda"])
@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize(
    ("in_dtype", "out_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]
)
def test_fused_inputs_match_the_adapter(shape, family, l2norm, in_dtype, out_dtype):
    args = call_args(family, shape, in_dtype, l2norm, seed=sum(shape))
    want = reference(family, args)
    got = ADAPTERS[family].fused_inputs(args, out_dtype)
    for name, ref in want.items():
        out = getattr(got, name)
        assert out.is_contiguous() and tuple(out.shape) == tuple(ref.shape), name
        assert out.dtype == (out_dtype if name in ("k", "q", "w") else torch.float32), name
        if out.dtype == torch.bfloat16:  # the fp32 result rounded once: equal to the rounded reference
            torch.testing.assert_close(out, ref.to(torch.bfloat16), rtol=2**-7, atol=1e-6, msg=name)
        else:
            torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=1e-7, msg=name)


def test_kernel_layout_inputs_pass_through_without_a_copy():
    args = call_args("gdn", SHAPES[0], torch.bfloat16, True, seed=1)
    x = ADAPTERS["gdn"].fused_inputs(args, torch.bfloat16)
    xk = kernel_inputs(x, SHAPES[0][3], torch.bfloat16)
    for name in ("k", "q", "w", "decay", "beta"):
        assert getattr(xk, name).data_ptr() == getattr(x, name).data_ptr(), name


def test_bad_shapes_are_refused():
    args = call_args("gdn", SHAPES[0], torch.float32, True, seed=2)
    with pytest.raises(ValueError, match="G dividing H"):
        delta_rule_inputs(args["query"], args["key"], args["value"][:, :, :3], args["g"], args["beta"],
                          l2norm=True, dtype=torch.float32)  # fmt: skip
    with pytest.raises(ValueError, match="g must be"):
        delta_rule_inputs(args["query"], args["key"], args["value"], args["g"][..., :1], args["beta"],
                          l2norm=True, dtype=torch.float32)  # fmt: skip


# B, T, H, G, P, N: grouped heads, one group, dims that are not powers of two
MAMBA2_SHAPES = [(2, 1, 4, 2, 16, 32), (3, 1, 6, 1, 12, 16), (2, 3, 4, 4, 16, 20)]


def mamba2_args(shape, dtype: torch.dtype, seed: int, *, softplus: bool, skip: bool, bias: bool) -> dict:
    """A Mamba-2 call's arguments as transformers passes them: ``selective_state_update``'s for one
    token (T = 1), else ``mamba2_chunk_scan``'s continuing a state."""
    b, t, h, g, p, n = shape
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=gen)).to(DEVICE, dtype)

    a_log = torch.rand(h, generator=gen) * 2
    raw = dict(
        dt=rnd(b, t, h, scale=2.0) - (4.0 if softplus else -0.5),  # softplus: dt from ~1e-4 to ~1
        A=(-torch.exp(a_log)).to(DEVICE, torch.float32),
        D=rnd(h) if skip else None,
        dt_bias=rnd(h, scale=0.5) if bias else None,
    )
    x, bm, cm = rnd(b, t, h, p), rnd(b, t, g, n), rnd(b, t, g, n)
    if t > 1:
        return dict(hidden_states=x, B=bm, C=cm, dt_softplus=softplus, initial_states=rnd(b, h, p, n), **raw)
    wide = {"D": (h, p), "dt_bias": (h, p)}
    args = {k: None if v is None else v[:, None].expand(wide[k]) for k, v in raw.items() if k in wide}
    args.update(
        state=rnd(b, h, p, n), hidden_states=x[:, 0], B=bm[:, 0], C=cm[:, 0], dt_softplus=softplus,
        dt=raw["dt"][:, 0, :, None].expand(b, h, p), A=raw["A"][:, None, None].expand(h, p, n),
    )  # fmt: skip
    return args


@pytest.mark.parametrize("shape", MAMBA2_SHAPES)
@pytest.mark.parametrize(
    ("softplus", "skip", "bias"), [(True, True, True), (False, True, False), (True, False, False)]
)
@pytest.mark.parametrize(
    ("in_dtype", "out_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]
)
def test_fused_mamba2_inputs_match_the_adapter(shape, softplus, skip, bias, in_dtype, out_dtype):
    """The kernel against the adapter's float64 form of a decode step (transformers' one-token
    dynamics: dt rounded to the model's dtype after the bias and after the softplus, no limit)."""
    from sketchcal.models.mamba2 import Mamba2Adapter

    adapter = Mamba2Adapter()
    args = mamba2_args(shape, in_dtype, sum(shape), softplus=softplus, skip=skip, bias=bias)
    kind = "decode" if "state" in args else "prefill"
    want, _ = adapter.inputs(kind, args, torch.float64, step_dynamics=True)
    rep = want.num_heads // shape[3]
    got = adapter.fused_inputs(args, out_dtype)
    assert got.beta is None and (got.skip is None) == (not skip)
    refs = {"k": want.k[:, :, ::rep], "q": want.q[:, :, ::rep], "w": want.w, "decay": want.decay}
    if skip:
        refs["skip"] = want.skip
    for name, ref in refs.items():
        out = getattr(got, name)
        assert out.is_contiguous() and tuple(out.shape) == tuple(ref.shape), name
        assert out.dtype == (torch.float32 if name == "decay" else out_dtype), name
        if out.dtype == torch.bfloat16:
            torch.testing.assert_close(out, ref.to(torch.bfloat16), rtol=2**-7, atol=1e-6, msg=name)
        else:
            torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=1e-7, msg=name)


def test_fused_mamba2_inputs_refuse_bad_groups():
    from sketchcal.models.mamba2 import Mamba2Adapter

    args = mamba2_args(MAMBA2_SHAPES[0], torch.float32, 3, softplus=True, skip=True, bias=True)
    args["B"] = args["B"][:, :1].expand(-1, 3, -1)  # 3 groups do not divide 4 heads
    with pytest.raises(ValueError, match="G dividing H"):
        Mamba2Adapter.fused_inputs(args, torch.float32)
