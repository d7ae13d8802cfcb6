"""The package's version, in one place: `bridge.__version__`, the `bridge_version`
that checkpoints record (also when bridge runs from a source tree that pip did not
install) and the wheel's version (pyproject.toml reads it from here)."""

__version__ = "0.4.0"  # hatch reads this line (its default pattern)
VERSION = __version__
