"""The patch embedding as one matrix product (the varlen path's) computes what transformers'
convolution computes, to rounding, for every family; the reference path keeps the convolution."""

import pytest
import torch

from epdserve.vision.families import FAMILIES, PATCH_GRID_FAMILIES
from epdserve.vision.patch_embedding import as_matmul, matmul_forward
from epdserve.vision.small_checkpoints import vision_config
from epdserve.vision.tower import VisionTower


@pytest.mark.parametrize("family", PATCH_GRID_FAMILIES)  # the towers of packed patches
def test_the_matrix_product_equals_the_convolution_to_rounding(family):
    spec = FAMILIES[family]
    torch.manual_seed(0)
    embed = spec.tower(spec.vision_config(**vision_config(family, width=64))).patch_embed.eval()
    pixels = torch.randn(300, embed.proj.weight[0].numel())
    with torch.inference_mode():
        convolved = embed(pixels)
        as_matmul(embed)
        multiplied = embed(pixels)
    assert multiplied.shape == convolved.shape == (300, 64)
    torch.testing.assert_close(multiplied, convolved, rtol=1e-5, atol=1e-5)


def test_a_convolution_that_is_no_patch_embedding_is_refused():
    embed = torch.nn.Module()
    embed.proj = torch.nn.Conv3d(3, 8, kernel_size=(2, 14, 14), stride=(1, 14, 14))
    with pytest.raises(ValueError, match="not a patch embedding"):
        as_matmul(embed)


def test_the_varlen_path_multiplies_and_the_reference_convolves(checkpoints):
    directory = checkpoints["qwen2_5_vl"]
    varlen = VisionTower.load(directory, vision_attention="varlen")
    reference = VisionTower.load(directory, vision_attention="reference")
    assert varlen.model.patch_embed.forward.__func__ is matmul_forward
    assert "forward" not in vars(reference.model.patch_embed)  # the class's own convolution
