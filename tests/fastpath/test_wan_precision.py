"""``with_decoder_precision`` (the Wan VAE Decode Precision node's work), tier 1.

On diffusers ``AutoencoderKLWan`` and on a stand-in for ``comfy.sd.VAE`` (same attributes the
function reads and replaces): decoder in the chosen dtype, encoder fp32, the VAE given untouched,
fp16 overflow caught. Tier 2 (``test_wan_comfy.py``) repeats the wrapper checks on ComfyUI's own.
"""
from __future__ import annotations

import logging

import pytest
import torch

from fast_vae_decode.fastpath.families.wan.precision import PRECISIONS, with_decoder_precision
from fast_vae_decode.fastpath.gate import gate_for
from fast_vae_decode.fastpath.install import install_fast_path
from fast_vae_decode.fastpath.swap import is_swapped
from support.wan_models import latent, psnr, tiny_wan

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DECODER_SIDE = ("decoder.", "post_quant_conv.")


class FakePatcher:
    """What ``with_decoder_precision`` needs of a ``ModelPatcher``: its class and devices."""

    def __init__(self, model, load_device, offload_device):
        self.model, self.load_device, self.offload_device = model, load_device, offload_device


class FakeVAE:
    """The ``comfy.sd.VAE`` attributes the precision copy reads or replaces."""

    def __init__(self, model):
        self.first_stage_model = model
        self.patcher = FakePatcher(model, torch.device("cpu"), torch.device("cpu"))
        self.vae_dtype = torch.float32
        self.device = torch.device("cpu")
        self.output_device = torch.device("cpu")
        self.working_dtypes = [torch.bfloat16, torch.float16, torch.float32]
        self.memory_used_decode = lambda shape, dtype: 1000 * dtype.itemsize
        self.latent_channels = 4

    def decode(self, samples):  # comfy.sd.VAE.decode's model call, diffusers-style output
        return self.first_stage_model.decode(samples.to(self.vae_dtype)).sample.float()


def snapshot(model):
    return {k: (v.clone(), v.dtype) for k, v in model.state_dict().items()}, [type(m) for m in model.modules()]


def assert_unchanged(model, snap):
    state, classes = snap
    now = model.state_dict()
    assert list(now) == list(state)
    assert all(now[k].dtype == dt and torch.equal(now[k], v) for k, (v, dt) in state.items())
    assert [type(m) for m in model.modules()] == classes


@pytest.mark.parametrize("precision", PRECISIONS)
def test_module_copy_has_decoder_in_precision_and_encoder_fp32(precision):
    model = tiny_wan("wan21")
    snap = snapshot(model)
    new = with_decoder_precision(model, precision)
    assert new is not model and type(new).__mro__[2] is type(model)
    for name, p in new.named_parameters():
        want = DTYPES[precision] if name.startswith(DECODER_SIDE) else torch.float32
        assert p.dtype == want, name
    assert list(new.state_dict()) == list(model.state_dict())
    shared = {id(p) for p in model.parameters()} & {id(p) for p in new.parameters()}
    assert not shared  # an independent copy: neither model's patcher can move the other's weights
    assert_unchanged(model, snap)


def test_fp32_copy_decodes_exactly_like_the_original():
    model = tiny_wan("wan22")
    z = latent((1, 8, 2, 4, 6))
    new = with_decoder_precision(model, "fp32")
    with torch.no_grad():
        assert torch.equal(new.decode(z).sample, model.decode(z).sample)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_decode_is_close_and_finite(precision):
    model = tiny_wan("wan21")
    z = latent((1, 4, 2, 4, 6))
    new = with_decoder_precision(model, precision)
    with torch.no_grad():
        expected = model.decode(z).sample
        got = new.decode(z).sample  # a float32 latent: the copy casts it to its decoder's dtype
    assert got.dtype == DTYPES[precision] and torch.isfinite(got).all()
    # bf16 keeps 8 mantissa bits (fp16 11): ~0.4% per rounding, ~20 layers deep, partly
    # cancelling; 30 dB on the [-1, 1] range is an error of ~3% of full scale at worst.
    assert psnr(got.float(), expected) >= 30.0


def test_encoder_stays_fp32_and_takes_any_input_dtype():
    model = tiny_wan("wan21")
    new = with_decoder_precision(model, "bf16")
    x = torch.rand(1, 3, 5, 16, 16).mul(2).sub(1).to(torch.bfloat16)  # images in the decoder's dtype
    with torch.no_grad():
        mean = new.encode(x).latent_dist.mean
        expected = model.encode(x.float()).latent_dist.mean
    assert mean.dtype == torch.float32
    assert torch.equal(mean, expected)  # the same fp32 encoder on the same (cast) pixels


def test_wrapper_copy_leaves_the_given_vae_untouched():
    model = tiny_wan("wan21")
    vae = FakeVAE(model)
    before = dict(vars(vae))
    snap = snapshot(model)
    new = with_decoder_precision(vae, "bf16")

    assert new is not vae and type(new) is FakeVAE
    assert vars(vae) == before  # same objects under the same names: nothing replaced
    assert_unchanged(model, snap)
    assert new.first_stage_model is not model
    assert type(new.patcher) is FakePatcher and new.patcher is not vae.patcher
    assert new.patcher.model is new.first_stage_model
    assert (new.patcher.load_device, new.patcher.offload_device) == (vae.patcher.load_device,
                                                                    vae.patcher.offload_device)
    assert new.vae_dtype == torch.float32  # images reach the fp32 encoder unrounded
    assert new.memory_used_decode((1, 4, 2, 4, 6), torch.float32) == 1000 * 2  # asked at bf16
    assert new.latent_channels == 4 and new.output_device == vae.output_device

    z = latent((1, 4, 2, 4, 6))
    with torch.no_grad():
        expected = vae.decode(z)
        got = new.decode(z)
        assert torch.equal(vae.decode(z), expected)  # the original still decodes as before
    assert psnr(got, expected) >= 30.0  # bf16 decoder; see the tolerance note above


def test_precision_copy_takes_the_fast_path():
    model = tiny_wan("wan21")
    install_fast_path(model)  # the original is installed: the copy must start stock, then install
    new = with_decoder_precision(model, "bf16")
    assert not any(is_swapped(m) for m in new.decoder.modules())
    report = install_fast_path(new)
    assert report.fused > 1 and report.reason is None
    z = latent((1, 4, 2, 4, 6))
    with torch.no_grad():
        with gate_for(new).opened(False):
            lossless = new.decode(z).sample
        with gate_for(new).opened(True) as stats:
            high = new.decode(z).sample
    assert stats.fallbacks == {} and stats.fused_calls > 0
    assert high.dtype == lossless.dtype == torch.bfloat16
    # bf16 activations: the fused norm rounds once (stock rounds after each of its passes).
    assert psnr(high.float(), lossless.float()) >= 30.0


def _overflowing(kind="wan21"):
    """A model whose first upsample conv overflows fp16 (65504; bf16 reaches 3e38).

    The next RMS norm then divides inf by inf: NaN all the way to the output, which diffusers'
    final clamp keeps (an overflow only in the last conv would be clamped to +-1 instead).
    """
    model = tiny_wan(kind)
    with torch.no_grad():
        model.decoder.up_blocks[0].upsamplers[0].resample[1].weight.mul_(1e6)
    return model


def test_fp16_overflow_is_decoded_again_in_bf16(caplog):
    model = _overflowing()
    new = with_decoder_precision(model, "fp16")
    z = latent((1, 4, 2, 4, 6))
    with caplog.at_level(logging.WARNING, logger="fast_vae_decode"), torch.no_grad():
        got = new.decode(z).sample
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert "fp16 overflowed" in caplog.text
    assert all(p.dtype == torch.float16 for p in new.decoder.parameters())  # the copy is unchanged


def test_fp16_overflow_is_said_once_per_model_even_at_a_reused_address(monkeypatch, caplog):
    """Once per model, and a later model at a freed one's address (id() repeats; made
    deterministic here) still gets its own warning."""
    from fast_vae_decode.fastpath import log
    from fast_vae_decode.fastpath.families.wan import decode

    monkeypatch.setattr(log, "_SAID", set())
    monkeypatch.setattr(decode, "id", lambda obj: 7, raising=False)
    z = latent((1, 4, 2, 4, 6))
    with caplog.at_level(logging.WARNING, logger="fast_vae_decode"), torch.no_grad():
        for _ in range(2):
            new = with_decoder_precision(_overflowing(), "fp16")
            new.decode(z)
            new.decode(z)
    assert sum("fp16 overflowed" in r.getMessage() for r in caplog.records) == 2


def test_non_finite_in_bf16_too_raises_a_clear_error():
    model = tiny_wan("wan21")
    with torch.no_grad():
        model.decoder.conv_out.bias.fill_(float("nan"))
    new = with_decoder_precision(model, "fp16")
    with pytest.raises(RuntimeError, match="non-finite values in fp16 and again in bf16"):
        with torch.no_grad():
            new.decode(latent((1, 4, 1, 4, 6)))


def test_rejects_other_vaes_and_precisions():
    with pytest.raises(ValueError, match="needs a Wan VAE"):
        with_decoder_precision(torch.nn.Conv2d(1, 1, 1), "bf16")
    with pytest.raises(ValueError, match="precision must be one of"):
        with_decoder_precision(tiny_wan("wan21"), "fp8")
