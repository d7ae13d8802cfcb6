"""Sizes in bytes for people, in binary units (as `bridge inspect` and a Tree's repr
write them)."""

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human(nbytes: int) -> str:
    """A size in bytes, for people.

    ```python
    >>> human(20), human(1536), human(2**30)
    ('20 B', '1.5 KiB', '1.0 GiB')

    ```
    """
    size, unit = float(nbytes), 0
    while size >= 1024 and unit < len(_UNITS) - 1:
        size, unit = size / 1024, unit + 1
    return f"{nbytes} B" if unit == 0 else f"{size:.1f} {_UNITS[unit]}"
