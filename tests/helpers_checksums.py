"""Tamperings of a checkpoint's metadata, shared by test_checksums (restore refuses each,
naming the file) and test_cli (``verify`` names each): ``TAMPERING[case](item)`` damages the
checkpoint item directory ``item`` in place and returns the path the error must name."""

from __future__ import annotations

import json
import os


def edit_json(path: str, edit) -> None:
    with open(path) as f:
        obj = json.load(f)
    edit(obj)
    with open(path, "w") as f:
        json.dump(obj, f)


def _plain_commit(item: str) -> None:
    """``commit_success.txt`` as Orbax (and funcshard before format 3) writes it."""
    with open(os.path.join(item, "commit_success.txt"), "w") as f:
        f.write(f"Checkpoint commit was successful to {os.path.basename(item)}")


def _record(item: str) -> dict:
    return json.load(open(os.path.join(item, "_CHECKPOINT_METADATA")))["custom_metadata"][
        "funcshard"
    ]


def as_format(item: str, version: int) -> None:
    """Rewrites the records of a checkpoint ``fs.save`` wrote at ``item`` as funcshard wrote
    them at format ``version`` (1: no checksums, 2: chunk checksums only)."""
    if version == 1:
        os.remove(os.path.join(item, "_CHECKSUMS"))
    else:
        edit_json(
            os.path.join(item, "_CHECKSUMS"),
            lambda r: [r.pop(k, None) for k in ("version", "metadata", "info")],
        )

    def record(r: dict) -> None:
        info = r["custom_metadata"]["funcshard"]
        info["version"] = version
        if version == 1:
            del info["checksums"]

    edit_json(os.path.join(item, "_CHECKPOINT_METADATA"), record)
    edit_json(os.path.join(item, "_METADATA"), lambda m: m.update(custom_metadata=None))
    _plain_commit(item)


def _array_leaf(item: str) -> str:
    """The first params leaf with two dims and two chunks (at least two rows per chunk)."""
    for leaf in sorted(os.listdir(item)):
        zarray = os.path.join(item, leaf, ".zarray")
        if leaf.startswith("params.") and os.path.exists(zarray):
            md = json.load(open(zarray))
            if len(md["shape"]) == 2 and md["shape"][0] > md["chunks"][0] > 1:
                return leaf
    raise AssertionError(f"{item}: no two-chunk params leaf")


def _zarray(item: str) -> str:
    return os.path.join(item, _array_leaf(item), ".zarray")


def _swap_same_shape_leaves(item: str) -> None:
    """Swaps the names of two params leaves of one shape in ``_METADATA``: each would read the
    other's bytes, every chunk checksum intact."""
    by_shape: dict = {}
    for leaf in sorted(os.listdir(item)):
        zarray = os.path.join(item, leaf, ".zarray")
        if leaf.startswith("params.") and os.path.exists(zarray):
            by_shape.setdefault(tuple(json.load(open(zarray))["shape"]), []).append(leaf)
    a, b = next(v for v in by_shape.values() if len(v) > 1)[:2]

    def swap(meta: dict) -> None:
        tree = meta["tree_metadata"]
        ka = next(k for k, e in tree.items() if ".".join(x["key"] for x in e["key_metadata"]) == a)
        kb = next(k for k, e in tree.items() if ".".join(x["key"] for x in e["key_metadata"]) == b)
        tree[ka]["key_metadata"], tree[kb]["key_metadata"] = (
            tree[kb]["key_metadata"],
            tree[ka]["key_metadata"],
        )

    edit_json(os.path.join(item, "_METADATA"), swap)


def _lose_checksums_and_flag(item: str) -> str:
    os.remove(os.path.join(item, "_CHECKSUMS"))

    def forget(r: dict) -> None:  # as a checkpoint saved before checksums existed says
        del r["custom_metadata"]["funcshard"]["checksums"]
        r["custom_metadata"]["funcshard"]["version"] = 1

    edit_json(os.path.join(item, "_CHECKPOINT_METADATA"), forget)
    return os.path.join(item, "_CHECKSUMS")


def _only_the_commit_mark_left(item: str) -> str:
    path = _lose_checksums_and_flag(item)
    edit_json(os.path.join(item, "_METADATA"), lambda m: m.update(custom_metadata=None))
    return path


def _not_plain_zarr(item: str) -> str:  # Fortran order: tensorstore would read it transposed
    edit_json(_zarray(item), lambda md: md.update(order="F"))
    return _zarray(item)


def _format2_not_plain_zarr(item: str) -> str:  # no metadata checksums to catch it
    as_format(item, 2)
    return _not_plain_zarr(item)


def _shape_changed(item: str) -> str:
    edit_json(_zarray(item), lambda md: md["shape"].__setitem__(1, md["shape"][1] + 1))
    return _zarray(item)


def _chunks_changed(item: str) -> str:  # rows would be read from the wrong offsets, silently
    edit_json(_zarray(item), lambda md: md["chunks"].__setitem__(0, md["chunks"][0] - 1))
    return _zarray(item)


def _leaves_swapped(item: str) -> str:
    _swap_same_shape_leaves(item)
    return os.path.join(item, "_METADATA")


def _record_edited(item: str) -> str:
    edit_json(
        os.path.join(item, "_CHECKPOINT_METADATA"),
        lambda r: r["custom_metadata"]["funcshard"].update(step=12345),
    )
    return os.path.join(item, "_CHECKPOINT_METADATA")


# name -> damage(item) returning the file every rank's error must name
TAMPERING = {
    "checksums_and_flag_removed": _lose_checksums_and_flag,
    "only_the_commit_mark_left": _only_the_commit_mark_left,
    "zarray_not_plain_zarr": _not_plain_zarr,
    "format2_zarray_not_plain_zarr": _format2_not_plain_zarr,
    "zarray_shape_changed": _shape_changed,
    "zarray_chunks_changed": _chunks_changed,
    "metadata_leaves_swapped": _leaves_swapped,
    "record_edited": _record_edited,
}
