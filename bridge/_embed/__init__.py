"""Run one framework's model inside another's: `as_nnx`, `as_linen`, `as_equinox`."""
