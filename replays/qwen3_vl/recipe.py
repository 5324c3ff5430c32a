"""Qwen3-VL (transformers' ``Qwen3VLForConditionalGeneration``): build, load, prepare, order."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from oracle.bundle.weights import SafetensorsDir
from oracle.capture.packing import pack
from oracle.capture.samples import read_sample
from oracle.errors import RecipeError
from oracle.recipe import ModelSource, Recipe
from oracle.replay.attention import keep_sdpa_fused
from oracle.replay.loss import causal_lm_loss, lm_head_loss, masked_token_loss

from ..qwen3.recipe import MEGATRON_NAMES, megatron_modules, text_layer_key
from . import flavors
from .inputs import build_inputs

_BLOCK = re.compile(r"^model\.visual\.blocks\.(\d+)\.")
_DEEP = re.compile(r"^model\.visual\.deepstack_merger_list\.(\d+)\.")
SAMPLE = Path(__file__).with_name("sample.jsonl")


def _vl_megatron_names() -> dict[str, str]:
    """ms-swift's mcore Qwen3-VL: the language model under ``language_model.``, the HF vision
    tower kept whole under ``visual.visual.`` (not TP-split in ms-swift 3.12)."""
    names = {f"language_model.{mc}": hf.replace("model.", "model.language_model.", 1) if hf.startswith("model.") else hf
             for mc, hf in MEGATRON_NAMES.items()}  # fmt: skip
    names["visual.visual.{rest}"] = "model.visual.{rest}"
    return names


class Qwen3VLRecipe(Recipe):
    name = "qwen3-vl"
    embedded = tuple(flavors.FLAVORS)
    megatron_names = _vl_megatron_names()
    # the decoder layers and their sub-modules; the vision blocks, HF modules ms-swift runs whole on every TP
    # rank (oracle/integrations/megatron/boundaries.py ``_replica``; capture preset ``vit``)
    megatron_modules = {**megatron_modules("language_model.decoder.layers.{i}", "model.language_model.layers.{i}"),
                        "visual.visual.blocks.{i}": "model.visual.blocks.{i}"}  # fmt: skip
    residual_branches = r"^(self_attn|attn|mlp)$"  # decoder layers (self_attn, mlp) and vision blocks (attn, mlp)
    fusable = {"Qwen3VLTextRMSNorm": "rms_norm", "Qwen3VLTextMLP": "swiglu_mlp",  # oracle/replay/fused.py (text decoder)
               "transformers.models.qwen3_vl.modeling_qwen3_vl.apply_rotary_pos_emb": "rotary"}  # fmt: skip
    # transformers 5 ships only the embedding in Qwen3VLTextConfig.base_model_tp_plan; the decoder
    # layers are Qwen3's, so Qwen3's layer plan (Qwen3Config.base_model_tp_plan) applies as it is
    tp_plan = {f"model.language_model.layers.*.{m}": s for m, s in (
        ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"), ("self_attn.v_proj", "colwise"),
        ("self_attn.q_norm", "replicated_with_grad_allreduce"), ("self_attn.k_norm", "replicated_with_grad_allreduce"),
        ("self_attn.o_proj", "rowwise"), ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"), ("mlp.down_proj", "rowwise"))}  # fmt: skip

    def accepts(self, hf_config: dict[str, Any]) -> bool:
        return hf_config.get("model_type") == "qwen3_vl"

    def build(self, config: dict[str, Any]) -> nn.Module:
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        cfg = Qwen3VLConfig(**{k: v for k, v in config.items() if k != "model_type"})
        cfg._attn_implementation = "sdpa"
        keep_sdpa_fused()  # torch 2.8: grouped-query sdpa the one fused CPU op too (oracle/replay/attention.py)
        cfg.text_config.use_cache = False  # a training step: no KV cache
        return Qwen3VLForConditionalGeneration(cfg)

    def load(self, spec: str) -> ModelSource:
        if spec in flavors.FLAVORS:
            config = json.loads(json.dumps(flavors.FLAVORS[spec]))
            weights = flavors.tiny_weights(self.build, config)
            return ModelSource(self, config, weights, origin=f"embedded:{spec}", extra={
                "tokenizer": flavors.tiny_tokenizer(), "image_processor": flavors.tiny_image_processor(),
                "special_ids": flavors.SPECIAL_IDS})  # fmt: skip
        return self._load_dir(Path(spec))

    def _load_dir(self, path: Path) -> ModelSource:
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        config = json.loads((path / "config.json").read_text())
        weights = SafetensorsDir(path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            # The PIL image processor needs no torchvision; it computes what the fast one does.
            image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise RecipeError(f"{path}: cannot load the tokenizer / image processor ({e})") from e
        specials = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in flavors.SPECIALS}
        missing = [t for t, i in specials.items() if i is None or i == tokenizer.unk_token_id]
        if missing:
            raise RecipeError(f"{path}: the tokenizer lacks Qwen's special tokens {missing}")
        return ModelSource(self, config, weights, origin=str(path), extra={
            "tokenizer": tokenizer, "image_processor": image_processor, "special_ids": specials})  # fmt: skip

    def default_sample(self) -> dict[str, Any]:
        return read_sample(str(SAMPLE))

    def prepare_inputs(self, source: ModelSource, model: nn.Module, sample: dict[str, Any]) -> dict[str, torch.Tensor]:
        x = source.extra
        return build_inputs(sample, x["tokenizer"], x["image_processor"], model, x["special_ids"])

    def pack_inputs(self, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Positions of 4 rows, as transformers' Qwen3-VL reads them: a text row restarting at 0 per
        sample (what marks the samples for attention), then each sample's own 3 mRoPE rows."""
        parts = [dict(p, position_ids=torch.cat([torch.arange(p["input_ids"].shape[-1]).view(1, 1, -1), p["position_ids"]]))
                 for p in parts]  # fmt: skip
        return pack(parts, seq_keys=("input_ids", "labels", "position_ids"), row_keys=("pixel_values", "image_grid_thw"))

    def forward_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor], reduction: str) -> tuple[torch.Tensor, int]:
        model_inputs = {k: inputs[k] for k in ("input_ids", "pixel_values", "image_grid_thw", "position_ids") if k in inputs}
        hidden = model.model(**model_inputs).last_hidden_state  # (1, T, H)
        # with a loss_mask the labels are pre-rolled (Megatron / ms-swift: label t is token t+1): no second shift
        return lm_head_loss(model.lm_head, hidden, inputs["labels"], reduction, inputs.get("loss_mask"))

    def loss_from_logits(self, logits: torch.Tensor, inputs: dict[str, torch.Tensor], reduction: str) -> tuple[torch.Tensor, int]:
        if "loss_mask" in inputs:  # Megatron / ms-swift batch: labels pre-rolled, float mask
            return masked_token_loss(logits, inputs["labels"], inputs["loss_mask"], reduction)
        return causal_lm_loss(logits, inputs["labels"], reduction)

    def megatron_layer_call(self, hidden_states, position_embeddings, inputs, attention_mask):
        """As ``Qwen3VLTextModel.forward`` calls each layer: the rotary tables shared by all layers,
        the mask (None: causal; packed: per sample), and the text position row, which the model
        passes only when the positions have 4 rows (packed: the restarting text row in front,
        recipe.pack_inputs / megatron/packing.py)."""
        pos = inputs.get("position_ids")
        text = pos[0] if pos is not None and pos.dim() == 3 and pos.shape[0] == 4 else None
        return (hidden_states,), {
            "attention_mask": attention_mask,
            "position_ids": text,
            "position_embeddings": position_embeddings,
        }

    def entry_sources(self, config: dict[str, Any], inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The image (video) tokens' rows come from the vision tower's merger (``get_placeholder_mask``), the
        others from the token embedding."""
        ids = inputs.get("input_ids")
        if ids is None:
            return {}
        visual = torch.zeros_like(ids, dtype=torch.bool)
        for key in ("image_token_id", "video_token_id"):
            if config.get(key) is not None:
                visual |= ids == int(config[key])
        if not bool(visual.any()):
            return {}
        return {"model.visual.merger": visual, "model.language_model.embed_tokens": ~visual}

    def restrict_injected(self, model: nn.Module, keep: torch.Tensor) -> bool:
        """The deepstack features enter the hidden states at the visual positions of layers 0..k-1
        (``_deepstack_process``); row i of ``visual_embeds`` is the i-th visual position of the
        flattened (B, T) batch. Rows whose position is not kept pass their value but no gradient
        (``where(keep, x, x.detach())``): the backward of one SP rank that held only its chunk."""
        text = model.model.language_model
        original = text._deepstack_process

        def restricted(hidden_states, visual_pos_masks, visual_embeds):
            rows = keep.to(visual_pos_masks.device)[visual_pos_masks]  # (n_visual,) kept visual rows
            visual_embeds = torch.where(rows[:, None], visual_embeds, visual_embeds.detach())  # (n_visual, H)
            return original(hidden_states, visual_pos_masks, visual_embeds)

        text._deepstack_process = restricted  # on this replay's instance only
        return True

    def boundaries(self) -> dict[str, str]:
        return {
            "layers": r"^model\.language_model\.layers\.\d+$",
            "sublayers": r"^model\.language_model\.layers\.\d+\.(self_attn|mlp|input_layernorm|post_attention_layernorm)$",
            "vit": r"^model\.visual\.blocks\.\d+$",
            "mergers": r"^model\.visual\.(merger|deepstack_merger_list\.\d+)$",
            "embeddings": r"^model\.(language_model\.embed_tokens|visual\.patch_embed)$",
            "head": r"^lm_head$",
            "all": "|".join([
                r"^model\.language_model\.layers\.\d+(\.(self_attn|mlp|input_layernorm|post_attention_layernorm))?$",
                r"^model\.visual\.blocks\.\d+$", r"^model\.visual\.(merger|deepstack_merger_list\.\d+)$",
                r"^model\.(language_model\.embed_tokens|visual\.patch_embed)$", r"^lm_head$",
            ]),
        }  # fmt: skip

    def check_inputs(self, config: dict[str, Any], shapes: dict[str, tuple[int, ...]], load) -> list[str]:
        """Images against their tokens (oracle/replay/inputs.py calls it after the ids' checks):
        ``image_grid_thw`` (n_images, 3) of positive (t, h, w) with h, w multiples of the merge size;
        ``pixel_values`` one row per patch, sum(t*h*w) rows of C*tp*p*p values; the ids hold one
        image token per merged patch, sum(t*h*w) / merge**2 (the model scatters exactly that many
        vision features into the image tokens' places); positions, where given, of the 3 rotary sections."""
        vision = config.get("vision_config") or {}
        merge = int(vision.get("spatial_merge_size", 2))
        ids_name = "input_ids" if "input_ids" in shapes else "tokens"
        image_id = config.get("image_token_id")
        n_tokens = int((load(ids_name) == image_id).sum()) if image_id is not None and ids_name in shapes else 0
        if "image_grid_thw" not in shapes and "pixel_values" not in shapes:
            return [] if not n_tokens else [
                f"inputs/{ids_name} holds {n_tokens} image token(s) (id {image_id}) but the capture has no pixel_values "
                "and image_grid_thw: capture the step's images with its ids"]  # fmt: skip
        if "image_grid_thw" not in shapes or "pixel_values" not in shapes:
            have, lack = ("pixel_values", "image_grid_thw") if "pixel_values" in shapes else ("image_grid_thw", "pixel_values")
            return [f"inputs/{lack} is missing while inputs/{have} is there: a Qwen3-VL image is its pixels and their grid"]
        grid = load("image_grid_thw")
        if grid.dim() != 2 or grid.shape[-1] != 3 or grid.is_floating_point():
            return [f"inputs/image_grid_thw has shape {list(grid.shape)} ({grid.dtype}): one integer (t, h, w) row per image"]
        if bool((grid <= 0).any()) or bool((grid[:, 1:] % merge != 0).any()):
            return [f"inputs/image_grid_thw {grid.tolist()}: t, h, w are positive and h, w multiples of the merge size {merge}"]
        patches = int(grid.prod(-1).sum())
        problems = []
        pv = shapes["pixel_values"]
        width = int(vision.get("in_channels", 3)) * int(vision.get("temporal_patch_size", 2)) * int(vision.get("patch_size", 16)) ** 2
        if len(pv) != 2 or pv[0] != patches:
            problems.append(f"inputs/pixel_values has {pv[0] if pv else 0} patch row(s) (shape {list(pv)}) but "
                            f"inputs/image_grid_thw {grid.tolist()} makes {patches}: the grid and the pixels are of "
                            "different images, or pixels were lost; capture them together")  # fmt: skip
        elif pv[1] != width:
            problems.append(f"inputs/pixel_values rows hold {pv[1]} values; this vision config's patches hold {width} "
                            "(channels x temporal patch x patch x patch)")  # fmt: skip
        want = patches // merge**2
        pos = shapes.get("position_ids")
        if pos is not None and len(pos) == 2 and "cu_seqlens" not in shapes:  # packed Megatron steps derive theirs
            problems.append(f"inputs/position_ids has shape {list(pos)}: with images a Qwen3-VL step's rotary positions "
                            "are (3, B, T), one row per section (t, h, w); a 2-D copy gives the image tokens text "
                            "positions (capture the positions the model computed, or leave them out)")  # fmt: skip
        if n_tokens != want:
            problems.append(f"inputs/{ids_name} holds {n_tokens} image token(s) (id {image_id}) but inputs/image_grid_thw "
                            f"{grid.tolist()} makes {want} merged patches (t*h*w / {merge}x{merge}): one image token per "
                            "vision feature; the ids and the images are of different samples")  # fmt: skip
        return problems

    def stream_token_modules(self) -> str:
        return r"^model\.language_model\.layers\.\d+\.mlp$|^model\.visual\.blocks\.\d+\.mlp$"

    def stream_units(self) -> str:
        return (r"^model\.language_model\.(layers\.\d+|embed_tokens)$|^model\.visual\.(blocks\.\d+|merger"
                r"|deepstack_merger_list\.\d+|patch_embed)$")  # fmt: skip

    def layer_key(self, name: str) -> tuple[tuple[int, int], str] | None:
        """Backward order: the language model (lm_head, final norm, layers last to first,
        embeddings), then the vision tower from its merger back to the patch embedding
        (deepstack mergers before the blocks they read from)."""
        if k := text_layer_key(name, "model.language_model."):
            return k
        if name.startswith("model.visual.merger."):
            return (4, 0), "visual.merger"
        if m := _DEEP.match(name):
            return (5, -int(m[1])), f"visual.deepstack_merger_list.{m[1]}"
        if m := _BLOCK.match(name):
            return (6, -int(m[1])), f"visual.blocks.{m[1]}"
        if name.startswith("model.visual.pos_embed."):
            return (7, 0), "visual.pos_embed"
        if name.startswith("model.visual.patch_embed."):
            return (8, 0), "visual.patch_embed"
        return None
