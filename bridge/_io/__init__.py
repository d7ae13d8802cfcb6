"""Checkpoints: save/load, one file per format, atomic writes, relayout for the CLI."""
