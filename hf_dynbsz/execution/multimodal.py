"""Image inputs of vision-language samples, split per sample and joined per micro-batch (torch layer).

TRL hands the trainer a batch's image inputs flattened in one of a few ways, and its own
``_get_per_token_logps_and_entropies`` slices them for a contiguous chunk of samples by the same rules. This
module applies those rules to one sample at a time, so that each sample's inputs travel with it into whatever
micro-batch the schedule puts it in (:func:`split_media`), and concatenates them back for a micro-batch
(:func:`join_media`):

* ``image_grid_thw`` + ``pixel_values`` (Qwen2-VL family): ``pixel_values`` is flattened patches, the rows of
  image ``k`` being ``prod(image_grid_thw[k])``; ``image_grid_thw`` is per image.
* ``image_position_ids`` + ``pixel_values``: both per image.
* ``spatial_shapes`` (LFM2-VL): ``pixel_values``, ``pixel_attention_mask`` and ``spatial_shapes`` per tile
  (``num_tiles`` per sample).
* ``num_tiles`` (InternVL): ``pixel_values`` per tile.
* ``pixel_values`` with one entry per image (LLaVA family): per image.
* otherwise ``pixel_values`` per sample (e.g. Idefics3: ``(samples, images, C, H, W)``, images zero-padded to
  the batch's most), and ``pixel_attention_mask`` per sample when there is no ``spatial_shapes``.
* ``image_sizes``: per image.

Token-aligned fields (``token_type_ids``, ``mm_token_type_ids``: one value per prompt + completion position) are
not media: :class:`~hf_dynbsz.execution.packing.SequenceTable` strips and re-pads them like the token ids
(:data:`TOKEN_FIELDS`).

Cross-rank balancing moves a sample's image inputs and token fields with it as one self-describing float64 record
(:func:`media_record`, :func:`read_media_record`): exact for every dtype these inputs come in.

For padding-free rows: :func:`media_digest` tells two samples' images apart (prompt sharing compares prompts by it as
well as by their tokens), and :func:`rope_positions` computes each sample's M-RoPE positions with the model's own
``get_rope_index``, as stock's forward computes them over the padded batch (one sample's are independent of the
others').
"""

from __future__ import annotations

import hashlib

import torch

from hf_dynbsz.parallel.distributed import parameter_gathering

__all__ = [
    "MEDIA_KEYS",
    "TOKEN_FIELDS",
    "join_media",
    "media_digest",
    "media_record",
    "read_media_record",
    "rope_positions",
    "split_media",
]

#: The image inputs TRL passes to the model besides the tokens (``num_images``/``num_tiles`` only slice them).
MEDIA_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "image_position_ids",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
)
#: Per-token fields of TRL's generation output aligned with ``prompt_ids + completion_ids``.
TOKEN_FIELDS = ("token_type_ids", "mm_token_type_ids")


def _split(tensor: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """``tensor`` cut along dim 0 into consecutive pieces of ``counts`` rows."""
    return list(torch.split(tensor, counts))


def split_media(inputs: dict, samples: int) -> list[dict[str, torch.Tensor]] | None:
    """Per sample of a batch, its image inputs (a dict of tensors, empty-row tensors for a sample without images).

    ``inputs`` holds TRL's flattened fields (:data:`MEDIA_KEYS`, ``num_images``, ``num_tiles``) for ``samples``
    samples; None when it has no ``pixel_values``.
    """
    pixel_values = inputs.get("pixel_values")
    if pixel_values is None:
        return None
    num_images = list(inputs.get("num_images") or [])
    per_image, pieces = {}, [dict() for _ in range(samples)]
    grid, position_ids, spatial_shapes = (
        inputs.get(key) for key in ("image_grid_thw", "image_position_ids", "spatial_shapes")
    )
    num_tiles = inputs.get("num_tiles")
    if grid is not None:
        rows = [int(rows.sum()) for rows in grid.prod(dim=-1).split(num_images)]
        per_image["image_grid_thw"] = grid
        by_sample = {"pixel_values": _split(pixel_values, rows)}
    elif position_ids is not None:
        per_image.update(pixel_values=pixel_values, image_position_ids=position_ids)
        by_sample = {}
    elif spatial_shapes is not None:
        by_sample = {
            key: _split(inputs[key], list(num_tiles))
            for key in ("pixel_values", "pixel_attention_mask", "spatial_shapes")
        }
    elif num_tiles is not None:
        by_sample = {"pixel_values": _split(pixel_values, list(num_tiles))}
    elif num_images and pixel_values.size(0) == sum(num_images):
        per_image["pixel_values"] = pixel_values
        by_sample = {}
    else:
        by_sample = {"pixel_values": _split(pixel_values, [1] * samples)}
    if inputs.get("pixel_attention_mask") is not None and spatial_shapes is None:
        by_sample["pixel_attention_mask"] = _split(inputs["pixel_attention_mask"], [1] * samples)
    if inputs.get("image_sizes") is not None:
        per_image["image_sizes"] = inputs["image_sizes"]
    for key, tensor in per_image.items():
        by_sample[key] = _split(tensor, num_images)
    for key, values in by_sample.items():
        for piece, value in zip(pieces, values, strict=True):
            piece[key] = value
    return pieces


def join_media(pieces: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The model inputs of the samples ``pieces`` (in micro-batch row order): each field concatenated along dim 0,
    per-sample fields zero-padded to the largest piece (as the processor pads a batch). Empty when none of the
    samples has an image (the model then runs as on text, like stock's chunk without images). A sample of a text-only
    slice (no fields at all, ``{}``) adds nothing."""
    joined = {}
    for key in dict.fromkeys(key for piece in pieces for key in piece):
        values = [piece[key] for piece in pieces if key in piece]
        shape = [max(sizes) for sizes in zip(*(value.shape[1:] for value in values))]
        padded = []
        for value in values:
            if list(value.shape[1:]) != shape:
                grown = value.new_zeros((value.size(0), *shape))
                grown[tuple(slice(0, size) for size in value.shape)] = value
                value = grown
            padded.append(value)
        joined[key] = torch.cat(padded)
    if joined.get("pixel_values") is None or joined["pixel_values"].numel() == 0:
        return {}
    return joined


def media_digest(piece: dict[str, torch.Tensor]) -> str:
    """A digest of one sample's image inputs (every field's dtype, shape and bytes): equal for equal images."""
    digest = hashlib.sha1()
    for key in sorted(piece):
        value = piece[key].detach().cpu().contiguous()
        digest.update(f"{key}:{value.dtype}:{tuple(value.shape)}".encode())
        digest.update(value.view(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def rope_positions(
    model,
    tokens: list[torch.Tensor],
    token_fields: dict[str, list[torch.Tensor]] | None,
    media: list[dict[str, torch.Tensor]] | None,
) -> list[torch.Tensor]:
    """Per sample, its M-RoPE positions ``(3, len(tokens[i]))`` (CPU): ``get_rope_index`` of ``model`` (unwrapped;
    the function is on the model or its ``.model``) over the sample alone, its ``mm_token_type_ids`` and its images'
    ``image_grid_thw``. A sample without images gets text positions (what the model gives a text-only batch)."""
    owner = model if callable(getattr(model, "get_rope_index", None)) else getattr(model, "model", None)
    if not callable(getattr(owner, "get_rope_index", None)):
        raise TypeError(f"{type(model).__name__} has no get_rope_index: its M-RoPE positions cannot be computed")
    types = (token_fields or {}).get("mm_token_type_ids")
    positions = []
    with torch.no_grad():
        for i, ids in enumerate(tokens):
            grid = (media[i] if media is not None else {}).get("image_grid_thw")
            if grid is None or grid.numel() == 0:
                positions.append(torch.arange(ids.numel()).expand(3, -1))
                continue
            if types is None:
                raise ValueError(
                    "image inputs come without mm_token_type_ids: the model cannot position them (stock "
                    "GRPOTrainer's forward raises on this batch too)"
                )
            position_ids, _ = owner.get_rope_index(
                ids.unsqueeze(0), types[i].unsqueeze(0).to(ids.device), image_grid_thw=grid.to(ids.device)
            )
            positions.append(position_ids[:, 0].cpu())
    return positions


#: What a media record may hold (its index is the record's name code) and the dtypes it restores.
_RECORD_NAMES = MEDIA_KEYS + TOKEN_FIELDS
_RECORD_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
)


def media_record(piece: dict[str, torch.Tensor] | None, fields: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """One sample's image inputs ``piece`` and token fields ``fields`` as one float64 record (CPU):
    ``[entries, (name code, dtype code, ndim, *shape, *values) per entry]``. Exact: float64 holds every value of
    these dtypes (ids and grid sizes are far below 2**53)."""
    parts = [torch.zeros(1, dtype=torch.float64)]
    for name, value in [*(piece or {}).items(), *(fields or {}).items()]:
        value = value.detach().cpu()
        header = [_RECORD_NAMES.index(name), _RECORD_DTYPES.index(value.dtype), value.dim(), *value.shape]
        parts += [torch.tensor(header, dtype=torch.float64), value.reshape(-1).to(torch.float64)]
        parts[0] += 1
    return torch.cat(parts)


def read_media_record(record: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The ``(image inputs, token fields)`` of one :func:`media_record` (CPU tensors of their own dtypes)."""
    values = record.cpu().tolist()
    media, fields, offset = {}, {}, 1
    for _ in range(int(values[0])):
        name, dtype, ndim = (int(v) for v in values[offset : offset + 3])
        shape = [int(v) for v in values[offset + 3 : offset + 3 + ndim]]
        offset += 3 + ndim
        count = 1
        for size in shape:
            count *= size
        value = record[offset : offset + count].cpu().to(_RECORD_DTYPES[dtype]).reshape(shape)
        offset += count
        (fields if _RECORD_NAMES[name] in TOKEN_FIELDS else media)[_RECORD_NAMES[name]] = value
    return media, fields


class MediaPolicy:
    """The vision-language decisions of a run, made once at start and read by the executor and the trainer's hooks.

    * ``moves_media``: samples moved between processes carry their image inputs (a repacked vision-language family;
      the same answer on every process);
    * ``images_run_stock``: a step with images runs stock's micro-batches: for a family not repacked, and for a
      repacked one where an engine gathers parameters at module calls (``gathering``: DeepSpeed ZeRO-3 or FSDP on
      several processes, :func:`~hf_dynbsz.parallel.distributed.parameter_gathering`): it gathers the vision tower
      in every forward that runs it (ZeRO-3 each of its modules, FSDP its blocks, which accelerate's wrap shards on
      their own: the model's ``_no_split_modules``), so every process must run it equally often, and repacked
      passes differ between processes in that: a lockstep pass has no image;
    * :meth:`stock`: whether a step's (or a no-grad call's) inputs take stock's path, agreed by every process.
    """

    def __init__(self, vision_language: str | None, *, gathering: str | None, world) -> None:
        self.vision_language = vision_language
        self.moves_media = vision_language == "repacked"
        self.images_run_stock = vision_language == "stock" or gathering is not None
        self.world = world  # every process: the stock-or-not answer must be the same on all of them
        self.note = None
        if vision_language == "repacked" and gathering is not None:
            self.note = (
                f"image steps run stock TRL micro-batches under {gathering} on several processes: it "
                "gathers the vision tower's parameters in every forward that runs it, and repacked passes differ "
                "between processes in how many run it. Text-only steps are repacked"
            )

    @classmethod
    def of(cls, vision_language: str | None, accelerator, world) -> MediaPolicy:
        return cls(vision_language, gathering=parameter_gathering(accelerator), world=world)

    def stock(self, *inputs: dict) -> bool:
        """Whether ``inputs`` (a step's slices, or one no-grad call's fields) carry image inputs (or, for a model not
        known as vision-language, token-type fields) that this run does not repack. For a vision-language model the
        answer is agreed by every process (one all-reduce): a process taking stock's path while another repacks
        would split their collectives."""
        images = any(fields.get("pixel_values") is not None for fields in inputs)
        if self.vision_language is None:
            return images or any(fields.get(name) is not None for fields in inputs for name in TOKEN_FIELDS)
        return bool(self.world.all_reduce_max([int(images and self.images_run_stock)])[0])
