"""An orbax checkpoint directory: item `state` holds the arrays (a nested dict, with
orbax's own sharding metadata), item `bridge` the string metadata (JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._atomic import atomic_dir


# orbax.checkpoint is imported by the functions that use it: importing it costs about
# 0.35 s, which `import bridge` should not pay when no orbax checkpoint is touched.


ARRAYS, METADATA = "state", "bridge"


def is_checkpoint(path: Path) -> bool:
    """Whether the directory looks like an orbax checkpoint written by bridge."""
    return (path / METADATA).is_dir() and (path / ARRAYS).is_dir()


def write(path: Path, arrays: dict[str, Any], metadata: dict[str, str]) -> None:
    """Write the nested dict `arrays` and `metadata` atomically as directory `path`."""
    import orbax.checkpoint as ocp

    with atomic_dir(path, is_checkpoint) as tmp:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            checkpointer.save(
                tmp.absolute(),
                ocp.args.Composite(
                    **{
                        ARRAYS: ocp.args.StandardSave(arrays),
                        METADATA: ocp.args.JsonSave(metadata),
                    }
                ),
            )


def header(path: Path) -> dict[str, str]:
    """The metadata written with the checkpoint, without reading any array."""
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        restored = checkpointer.restore(
            path.absolute(), ocp.args.Composite(**{METADATA: ocp.args.JsonRestore()})
        )
    return restored[METADATA]


def read(path: Path, abstract: dict[str, Any] | None) -> dict[str, Any]:
    """The arrays, restored into the shapes, dtypes and shardings of `abstract` (a
    nested dict of `jax.ShapeDtypeStruct` with the checkpoint's structure), or with
    their saved shardings when `abstract` is None."""
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        restored = checkpointer.restore(
            path.absolute(),
            ocp.args.Composite(**{ARRAYS: ocp.args.StandardRestore(abstract)}),
        )
    return restored[ARRAYS]
