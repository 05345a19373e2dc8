"""bf16 matrix products as fp32 kernels on bf16 values (nemo_anchor.cpu_bf16) against torch's native
bf16 kernels and a float64 oracle."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from nemo_anchor import cpu_bf16
from nemo_anchor.cpu_bf16 import Bf16MatmulsInFp32, bf16_matmuls_in_fp32


def bf16_ulp(reference: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at each element of ``reference`` (8 significand bits)."""
    exponent = torch.frexp(reference.abs().clamp_min(1e-30).float())[1]
    return torch.ldexp(torch.ones_like(reference, dtype=torch.float64), (exponent - 8).to(torch.int64))


PRODUCTS = {
    "mm": lambda a, b, c: a @ b,
    "addmm": lambda a, b, c: torch.addmm(c, a, b),
    "bmm": lambda a, b, c: torch.bmm(a[None].expand(2, -1, -1), b[None].expand(2, -1, -1)),
    "baddbmm": lambda a, b, c: torch.baddbmm(c[None].expand(2, -1, -1), a[None].expand(2, -1, -1),
                                             b[None].expand(2, -1, -1), beta=0.5, alpha=2.0),
}


@pytest.mark.parametrize("name", sorted(PRODUCTS))
def test_products_round_once_like_the_native_kernel(name):
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(shape, generator=g).bfloat16() for shape in ((96, 640), (640, 80), (96, 80)))
    product = PRODUCTS[name]
    native = product(a, b, c)
    with Bf16MatmulsInFp32():
        emulated = product(a, b, c)
    assert emulated.dtype == native.dtype == torch.bfloat16
    exact = product(a.double(), b.double(), c.double())
    # a rounding of an fp32 accumulation (two for baddbmm's scaled sum): near the exact product, like the native kernel
    assert ((emulated.double() - exact).abs() <= 1.5 * bf16_ulp(exact)).all()
    assert ((native.double() - exact).abs() <= 1.5 * bf16_ulp(exact)).all()
    # and the same number as the native kernel except where the accumulation order tips a rounding
    assert (emulated != native).float().mean() < 1e-3


@pytest.mark.parametrize("product", ["linear", "matmul"])
def test_inference_mode_products_are_emulated_too(product):
    """Under torch.inference_mode linear and matmul reach the mode whole, not as mm."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 96, 640, generator=g).bfloat16(), torch.randn(80, 640, generator=g).bfloat16()
    run = (lambda: F.linear(x, w)) if product == "linear" else (lambda: torch.matmul(x, w.T))
    with torch.no_grad(), Bf16MatmulsInFp32():
        emulated = run()
    with torch.inference_mode(), Bf16MatmulsInFp32():
        inference = run()
    assert not torch.equal(emulated, run())  # the native kernel rounds some elements differently here
    assert torch.equal(inference, emulated)


def test_linear_gradients_equal_the_native_kernels():
    g = torch.Generator().manual_seed(1)
    leaves = [torch.randn(shape, generator=g).bfloat16().requires_grad_() for shape in ((64, 96), (128, 96), (128,))]

    def grads(context):
        for leaf in leaves:
            leaf.grad = None
        with context:
            F.linear(*leaves).float().square().sum().backward()
        return [leaf.grad.clone() for leaf in leaves]

    native, emulated = grads(contextlib.nullcontext()), grads(Bf16MatmulsInFp32())
    for n, e in zip(native, emulated):
        assert e.dtype == torch.bfloat16
        torch.testing.assert_close(e, n, rtol=2 ** -7, atol=0)


def test_flash_attention_backward_rounds_once():
    """The CPU flash-attention backward runs in fp32 and rounds its gradients once: at least as close to the
    float64 gradient as the native bf16 kernel, which rounds its intermediate probabilities to bf16."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 256, 32, generator=g).bfloat16() for _ in range(3))
    upstream = torch.randn(1, 2, 256, 32, generator=g)

    def gradients(dtype, context):
        leaves = [t.to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
        with context:
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
            (out.to(dtype) * upstream.to(dtype)).sum().backward()
        return [leaf.grad for leaf in leaves]

    exact = gradients(torch.float64, contextlib.nullcontext())
    native = gradients(torch.bfloat16, contextlib.nullcontext())
    emulated = gradients(torch.bfloat16, Bf16MatmulsInFp32())
    for e, n, x in zip(emulated, native, exact):
        assert e.dtype == torch.bfloat16
        emulated_error, native_error = (e.double() - x).abs().max(), (n.double() - x).abs().max()
        assert emulated_error <= native_error
        assert emulated_error <= 2 ** -7 * x.abs().max()


def test_the_context_only_acts_on_bf16_on_cpus_without_native_bf16(monkeypatch):
    monkeypatch.setattr(cpu_bf16, "cpu_has_native_bf16", lambda: False)
    assert isinstance(bf16_matmuls_in_fp32(torch.bfloat16, "cpu"), Bf16MatmulsInFp32)
    assert isinstance(bf16_matmuls_in_fp32("bf16", torch.device("cpu")), Bf16MatmulsInFp32)
    assert isinstance(bf16_matmuls_in_fp32(torch.float32, "cpu"), contextlib.nullcontext)
    assert isinstance(bf16_matmuls_in_fp32("fp32", "cpu"), contextlib.nullcontext)
    assert isinstance(bf16_matmuls_in_fp32(torch.bfloat16, "cuda"), contextlib.nullcontext)
    monkeypatch.setattr(cpu_bf16, "cpu_has_native_bf16", lambda: True)
    assert isinstance(bf16_matmuls_in_fp32(torch.bfloat16, "cpu"), contextlib.nullcontext)


def test_fp32_products_are_untouched():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(32, 48, generator=g), torch.randn(48, 16, generator=g)
    with Bf16MatmulsInFp32():
        inside = a @ b
    assert torch.equal(inside, a @ b)


def test_the_bf16_rope_probe_measures_the_same_drift(tmp_path, tiny_byte_llama):
    """The paper's probe on a bf16 model: D from fp32 kernels on bf16 values matches the native bf16 kernels'."""
    import transformers

    from nemo_anchor.analysis.shift_metrics import shift_differences

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    tokens = torch.randint(3, 259, (128,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        native = shift_differences(model, tokens, [0, 8, 64]).attention.sum(-1)
        with Bf16MatmulsInFp32():
            emulated = shift_differences(model, tokens, [0, 8, 64]).attention.sum(-1)
    assert (native > 0).all()
    torch.testing.assert_close(emulated, native, rtol=0.15, atol=0)
