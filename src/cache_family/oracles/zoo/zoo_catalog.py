"""The zoo's catalog: the packaged presets, re-shaped to the tiny models actually written.

Each preset keeps its key, family, payload, paths and policies, so a plan against the zoo runs
the same 14 rows. ``ctx`` stays the benchmark's run context, not the model's trained one
(``architecture_note`` says both); a preset whose model could not be built keeps its entry with
the reason, its path absent.
"""

from __future__ import annotations

import msgspec

from cache_family.errors import Refused
from cache_family.oracles.zoo.base import BuiltModel
from cache_family.schemas.catalog import NOT_BUILT_NOTE_PREFIX as NOT_BUILT_PREFIX
from cache_family.schemas.catalog import Catalog, Preset, check_catalog


def tiny_preset(reference: Preset, built: BuiltModel) -> Preset:
    """The reference preset with the tiny model's true shape."""
    n_layer = built.shape.n_layer
    whole_model = reference.state_layer_start == 0 and (
        reference.state_layer_end == reference.layer_end
    )
    if whole_model:
        state_start, state_end = 0, n_layer
    elif reference.state_layer_end <= n_layer:
        state_start, state_end = reference.state_layer_start, reference.state_layer_end
    else:
        raise ValueError(
            f"{reference.key}: the tiny model has {n_layer} layers, fewer than the state range "
            f"{reference.state_layer_start}..{reference.state_layer_end} needs"
        )
    ctx = min(reference.ctx, built.shape.n_ctx_train)
    note = reference.architecture_note
    if built.architecture != reference.architecture:
        note = (
            f"zoo: written as {built.architecture!r} because the reference architecture "
            f"{reference.architecture!r} could not be made to load. {note}"
        ).strip()
    note = f"{note} {context_note(ctx, built.shape.n_ctx_train)}".strip()
    return msgspec.structs.replace(
        reference,
        architecture=built.architecture,
        layer_end=n_layer,
        activation_width=built.shape.n_embd,
        ctx=ctx,
        state_layer_start=state_start,
        state_layer_end=state_end,
        kv_bytes_per_token=built.kv_bytes_per_token if reference.payload == "resident-kv" else None,
        synthetic=True,
        architecture_note=note,
    )


def context_note(run_ctx: int, n_ctx_train: int) -> str:
    """Why a zoo preset's ``ctx`` is not the tiny model's trained context."""
    return (
        f"zoo: ctx {run_ctx} is the benchmark's run context, not the model's; the tiny GGUF "
        f"declares context_length {n_ctx_train} (its n_ctx_train)."
    )


def missing_preset(reference: Preset, reason: str) -> Preset:
    """The reference preset, marked synthetic, saying why the zoo has no model for it."""
    note = f"{NOT_BUILT_PREFIX}{reason}"
    if reference.architecture_note:
        note = f"{note} {reference.architecture_note}"
    return msgspec.structs.replace(reference, synthetic=True, architecture_note=note)


def zoo_catalog(reference: Catalog, presets: dict[str, Preset]) -> Catalog:
    """The synthetic catalog in the reference's preset order; refuses if it is inconsistent."""
    ordered = tuple(presets[p.key] for p in reference.presets)
    catalog = Catalog(
        schema_version=reference.schema_version,
        family_order=reference.family_order,
        use_case_order=reference.use_case_order,
        presets=ordered,
        synthetic=True,
    )
    refusals = check_catalog(catalog)
    if refusals:
        raise Refused(tuple(refusals))
    return catalog


def encode_catalog(catalog: Catalog) -> bytes:
    """Indented JSON with a final newline, like the packaged catalog."""
    return msgspec.json.format(msgspec.json.encode(catalog), indent=2) + b"\n"
