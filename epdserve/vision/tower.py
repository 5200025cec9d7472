"""The vision tower: transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL towers, or Gemma 3's SigLIP
and projector or InternVL's InternViT, pixel shuffle and projector (``vision.projected_tower``),
loaded alone.

``VisionTower.load(dir)`` reads a full VLM checkpoint (weights under ``visual.`` or
``model.visual.``; Gemma 3's under ``vision_tower.`` and ``multi_modal_projector.``:
``TowerFamily.tower_prefixes``) or a vision-only one, and refuses to start when any tower weight
is missing (transformers would only warn and random-initialise it). The image and video
processors come from the same directory, so the encode worker and the prefill side agree on rows
per item. A video goes through the same tower (its frames as temporal patches,
``video_grid_thw``), so images and videos share a batch. A Qwen-VL tower takes a batch as packed
patches with their grids; Gemma 3's and InternVL's as fixed-size images or tiles
(``TowerFamily.packed_patches``), each image with the grid its sizing gives it
(``sizing.FIXED_SIZE``, ``sizing.TILED``: one entry per row, tiles first), so the worker batches
and counts all alike.

Wire layout: one ``[rows, width]`` tensor per item. For Qwen3-VL the DeepStack levels travel in
the same rows, concatenated on the hidden dimension (as vLLM does):
``[rows, out_width * (1 + levels)]``; the receiver cuts it back into ``encoded`` and
``encoded_deepstack`` (``ReceiverConfig.deepstack_width``).

Batching changes no bit: on CPUs where oneMKL's small-M GEMM kernels round differently from its
large-M ones (some AVX-512/AMX Xeons), the sums would depend on the batch. Importing this module
therefore defaults ``MKL_CBWR`` to ``AUTO,STRICT`` (oneMKL's strict reproducibility mode, read at
its first call): GEMM results do not depend on M or the thread count, for a few percent of
GEMM speed (docs/performance.md). Set ``MKL_CBWR`` yourself to choose otherwise. GPU kernels are
not covered: see docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # before torch runs its first GEMM (see above)

import torch  # noqa: E402
from transformers.utils import logging as hf_logging

from epdserve.data_plane.dtypes import dtype_from_wire
from epdserve.multimodal.rows import split_rows
from epdserve.process_settings import TowerCompile, VisionAttention
from epdserve.vision import attention, compilation, patch_embedding
from epdserve.vision.families import FAMILIES, TowerLoadError, detect_family
from epdserve.vision.grid_inputs import GridInputs
from epdserve.vision.image_processor import load_image_processor
from epdserve.vision.images import image_from_bytes, image_from_pixels
from epdserve.vision.video import load_video_processor
from epdserve.wire.ec_params import row_shape

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _quiet_transformers():
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


@dataclass(frozen=True)
class TowerInfo:
    family: str
    out_width: int  # main embedding width (the LLM's hidden size)
    deepstack_levels: int  # 0 except Qwen3-VL
    merge: int  # 1 where the grid is the rows already (Gemma 3)
    patch_size: int

    @property
    def wire_width(self) -> int:
        return self.out_width * (1 + self.deepstack_levels)


class VisionTower:
    def __init__(
        self,
        model: torch.nn.Module,
        info: TowerInfo,
        processor,
        dtype: torch.dtype,
        device: str,
        model_id: str,
        video_processor=None,
        attention_path: attention.AttentionPath = "reference",
        compile: TowerCompile = "off",
        compile_cache_dir: str | None = None,
    ):
        self.model = model
        self.info = info
        self.processor = processor
        self.video_processor = video_processor  # None: video items are refused
        self.dtype = dtype
        self.device = device
        self.model_id = model_id
        family = FAMILIES[info.family]
        self.packed_patches = family.packed_patches
        if not self.packed_patches:  # fixed-size images: transformers' attention, eager
            if compile == "on":
                raise compilation.CompileUnavailable(
                    f"{info.family}'s tower (fixed-size images) is not compiled"
                )
            attention_path, compile = "reference", "off"
        self.attention_path = attention_path
        self.attention_kernel = (
            attention.kernel(device, dtype, attention_path)
            if self.packed_patches
            else "sdpa over the batch of images (transformers' own attention)"
        )
        self._grid_inputs = (
            GridInputs(model, family.windows, family.position_table)
            if self.packed_patches
            else None
        )
        self.sizing = family.sizing  # an item's grid from its sizes, its rows
        self._on_gpu = torch.device(device).type == "cuda"
        if self.packed_patches:
            attention.use(model, attention_path)
        if attention_path == "varlen":  # the fast path; the reference stays transformers' own
            patch_embedding.as_matmul(model.patch_embed)
        # --compile: whether its blocks and mergers are compiled, and why or why not
        self.compile_choice = compile
        self.compiled, self.compile_reason = compilation.resolve(compile, device, attention_path)
        if not self.packed_patches:
            self.compile_reason = "a tower of fixed-size images runs eagerly"
        if self.compiled:
            compilation.compile_regions(model, compile_cache_dir)
        elif compile != "off":
            compilation.say_once(self.compile_reason)

    @classmethod
    def load(
        cls,
        directory: str,
        dtype: str = "float32",
        device: str = "cpu",
        processor_kwargs: dict | None = None,
        vision_attention: VisionAttention = "auto",
        compile: TowerCompile = "off",
        compile_cache_dir: str | None = None,
    ) -> VisionTower:
        """The tower of ``directory``'s checkpoint with its image and video processors, each
        with ``processor_kwargs`` (``--mm-processor-kwargs``) over its config (the image
        processor as its model's processor applies it: ``vision.image_processor``); its attention
        as ``vision_attention`` says (``vision.attention``), compiled as ``compile`` says
        (``vision.compilation``; ``CompileUnavailable`` for ``on`` where it cannot be)."""
        family = detect_family(directory)
        config_class, tower_class = FAMILIES[family].vision_config, FAMILIES[family].tower
        prefixes = FAMILIES[family].tower_prefixes
        torch_dtype = dtype_from_wire(dtype)
        config = config_class.from_pretrained(directory)
        with _quiet_transformers():  # the LLM's weights are "unexpected" here, by design
            model, info = tower_class.from_pretrained(
                directory,
                config=config,
                dtype=torch_dtype,
                key_mapping=prefixes,
                output_loading_info=True,
                local_files_only=True,
            )
        if info["missing_keys"]:
            missing = sorted(info["missing_keys"])
            raise TowerLoadError(
                f"{len(missing)} tower weights missing from {directory} (e.g. {missing[:3]}); "
                "refusing to run a randomly initialised tower"
            )
        model = model.to(device).eval()
        kwargs = processor_kwargs or {}
        processor = load_image_processor(directory, kwargs)
        video_processor = load_video_processor(directory, kwargs)
        out_width, levels = row_shape(config)
        vision = getattr(config, "vision_config", config)  # Gemma 3's: the full model's config
        patch = vision.patch_size  # InternVL's is (height, width), of square patches
        tower_info = TowerInfo(
            family,
            out_width,
            levels,
            getattr(vision, "spatial_merge_size", 1),
            patch[0] if isinstance(patch, (list, tuple)) else patch,
        )
        return cls(
            model,
            tower_info,
            processor,
            torch_dtype,
            device,
            model_id=os.path.abspath(directory),
            video_processor=video_processor,
            attention_path=attention.resolve(vision_attention, device, torch_dtype),
            compile=compile,
            compile_cache_dir=compile_cache_dir,
        )

    def rows_per_item(self, grid_thw: torch.Tensor) -> list[int]:
        return [self.sizing.rows(grid, self.processor) for grid in grid_thw.tolist()]

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Packed wire rows ``[sum rows, wire_width]`` for a batch of items, in item order, on the
        tower's device. What the forward derives from the grid is assembled here on the CPU
        (``vision.grid_inputs``), so on a GPU the call only queues kernels: it returns before
        they have run. A tower of fixed-size images takes ``[n, 3, H, W]`` and reads no grid."""
        if not self.packed_patches:
            return self.model(pixel_values.to(self.device, self.dtype))
        grid = grid_thw.cpu()
        derived = {
            name: self._to_device(value) if torch.is_tensor(value) else value
            for name, value in self._grid_inputs(grid).items()
        }
        out = self.model(pixel_values.to(self.device, self.dtype), grid_thw=grid, **derived)
        if isinstance(out, torch.Tensor):
            return out
        merged = out.pooler_output
        if self.info.deepstack_levels:
            merged = torch.cat([merged, *out.deepstack_features], dim=1)
        return merged

    def warm_up(self, batch_items: int, batch_patches: int) -> dict | None:
        """Compile every graph a worker of this batch budget needs before it serves: one batch
        of each shape ``compilation.warm_up_grids`` names, waited for. What it ran and compiled,
        or None for a tower that is not compiled (nothing to warm up). Under ``auto``, a
        compile that fails leaves the tower eager (the reason logged); under ``on`` it raises."""
        if not self.compiled:
            return None
        try:
            return self._warm_up(batch_items, batch_patches)
        except Exception as exc:
            if self.compile_choice != "auto":
                raise
            log.exception("compiling the vision tower failed: running it eagerly")
            compilation.uncompile_regions(self.model)
            self.compiled = False
            self.compile_reason = f"compiling failed: {type(exc).__name__}: {exc}"[:500]
            return None

    def _warm_up(self, batch_items: int, batch_patches: int) -> dict:
        def grid(width: int, height: int) -> tuple[int, int, int]:
            return self.sizing.image_grid(self.processor, height, width)

        batches = compilation.warm_up_grids(
            grid(224, 224), grid(200, 300), grid(448, 448), self.info.merge, batch_items,
            batch_patches,
        )  # fmt: skip
        patch_width = self.model.patch_embed.proj.weight[0].numel()
        started, graphs = time.monotonic(), compilation.graphs_compiled()
        for batch in batches:
            grid_thw = torch.tensor(batch)
            pixels = torch.zeros(int(grid_thw.prod(dim=1).sum()), patch_width)
            self.encode(pixels, grid_thw).cpu()
        return {
            "seconds": round(time.monotonic() - started, 2),
            "graphs_compiled": compilation.graphs_compiled() - graphs,
            "batches": [compilation.describe(batch) for batch in batches],
        }

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A CPU tensor on the tower's device. To a GPU through pinned memory: a copy from
        pageable memory would wait for the work already queued on the stream."""
        if self._on_gpu:
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def image_inputs(self, image: bytes | bytearray | torch.Tensor):
        """The image processor's inputs (``pixel_values``, ``image_grid_thw``) for one image: an
        encoded file, or raw uint8 ``[H, W, 3]`` pixels (``BadItem`` for one that is neither)."""
        picture = (
            image_from_bytes(image)
            if isinstance(image, (bytes, bytearray))
            else image_from_pixels(image)
        )
        return self.preprocess([picture])

    def preprocess(self, images: list, **kwargs):
        """The image processor's output for ``images`` (PIL images or uint8 ``[3, H, W]``
        tensors; ``kwargs`` to it), with each image's grid (``image_grid_thw``): the processor's
        own, or for a processor that makes none (fixed-size images, tiles) the family's sizing of
        the image's size, whose first entry is the images (tiles) the processor made of it
        (``ValueError`` where it made another count)."""
        out = self.processor(images=images, return_tensors="pt", **kwargs)
        if "image_grid_thw" not in out:
            grids = [self.sizing.image_grid(self.processor, *_height_width(i)) for i in images]
            made = len(out["pixel_values"])
            if sum(grid[0] for grid in grids) != made:
                raise ValueError(
                    f"the image processor made {made} images of {len(images)}, its sizing "
                    f"counts {[grid[0] for grid in grids]}"
                )
            out["image_grid_thw"] = torch.tensor(grids)
        return out

    def encode_items(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> list[torch.Tensor]:
        """One ``[rows_i, wire_width]`` tensor per item (views of one packed output)."""
        return split_rows(self.encode(pixel_values, grid_thw), self.rows_per_item(grid_thw))


def _height_width(image) -> tuple[int, int]:
    """A PIL image's or a ``[..., H, W]`` tensor's height and width."""
    if torch.is_tensor(image):
        return int(image.shape[-2]), int(image.shape[-1])
    return image.height, image.width
